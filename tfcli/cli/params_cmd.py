"""`tfcli params`: where the parameters are and what memory they take."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

import typer

from tfcli.cli._common import (ConfigOpt, DimOpt, HfClassOpt, InputOpt, JsonOpt, ModelArgOpt,
                               ModelOpt, PresetOpt, SetOpt, print_json, resolve_subject, sizes,
                               stdout)


class DType(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    int8 = "int8"


class Optimizer(str, Enum):
    adam = "adam"
    adamw = "adamw"
    sgd_momentum = "sgd-momentum"
    sgd = "sgd"


class Mixed(str, Enum):
    none = "none"
    bf16 = "bf16"
    fp16 = "fp16"


class BuildDevice(str, Enum):
    meta = "meta"
    cpu = "cpu"


def params(
    preset: PresetOpt = None, config: ConfigOpt = None, set_: SetOpt = None,
    model_ref: ModelOpt = None, model_arg: ModelArgOpt = None, hf_class: HfClassOpt = None,
    input_: InputOpt = None, dim: DimOpt = None,
    depth: Annotated[int, typer.Option(
        min=0, help="Table depth: 0 totals only, 1 components, 2 layers, 3 sublayers, "
                    "4 projections.")] = 3,
    expand: Annotated[bool, typer.Option(
        "--expand", help="Show every repeated layer instead of collapsing them (×N).")] = False,
    freeze: Annotated[Optional[list[str]], typer.Option(
        "--freeze", metavar="PATTERN", show_default=False,
        help="Mark parameters frozen by glob on module paths, e.g. 'encoder.*' (repeatable).")
    ] = None,
    dtype: Annotated[DType, typer.Option(help="Parameter dtype for the memory lines.")] = DType.fp32,
    optimizer: Annotated[Optimizer, typer.Option(help="Optimizer whose state is counted.")
                         ] = Optimizer.adam,
    mixed_precision: Annotated[Mixed, typer.Option(
        help="torch.autocast dtype: fp32 weights, grads and optimizer state; half activations."
    )] = Mixed.none,
    batch_size: Annotated[int, typer.Option(min=1, help="Batch size for activations.")] = 8,
    seq_len: Annotated[Optional[int], typer.Option(
        min=1, show_default=False,
        help="Sequence length (source and target; every length letter of --input) for the "
             "activation lines; without it activations are not estimated.")] = None,
    device: Annotated[BuildDevice, typer.Option(
        help="Where to build the model for counting: meta allocates nothing; cpu for a --model "
             "that cannot be built on meta.")] = BuildDevice.meta,
    json_out: JsonOpt = False,
) -> None:
    """Parameters per layer (tied weights counted once), buffers, and training memory."""
    from tfcli.errors import TfcliError
    from tfcli.inspection.memory import estimate_activations, training_memory
    from tfcli.inspection.params import freeze as apply_freeze
    from tfcli.inspection.params import param_report
    from tfcli.render.params import display_rows, render

    subject = resolve_subject(preset, config, set_, model_ref, model_arg, hf_class, input_)
    mixed = None if mixed_precision is Mixed.none else mixed_precision.value
    cfg = getattr(subject, "cfg", None)
    if cfg is not None and seq_len is not None and seq_len > cfg.max_seq_len \
            and cfg.positional != "none":
        raise TfcliError(f"--seq-len {seq_len} exceeds max_seq_len={cfg.max_seq_len}; "
                         f"raise it with --set max_seq_len={seq_len}")
    if seq_len is not None and dtype is DType.int8 and not mixed:
        raise TfcliError("--seq-len with --dtype int8: activations need a floating dtype "
                         "(int8 is counted for weights only)")
    model = subject.build(device.value)
    apply_freeze(model, freeze or [])
    report = param_report(model)

    activations, how = None, ""
    if seq_len is not None:
        dims = sizes(subject, batch_size, seq_len, seq_len, dim, seq_len)
        activations, how = estimate_activations(subject, dims, dtype.value, mixed)
    memory = training_memory(report.total_params, report.trainable_params, report.buffer_numel,
                             dtype.value, optimizer.value, mixed, activations)
    if json_out:
        data = report.to_dict()
        data["buffers"] = [dict(b) for b in data["buffers"]]
        data.update(buffer_elements=report.buffer_numel,
                    bytes={m.name: m.bytes for m in memory},
                    memory=[{"name": m.name, "bytes": m.bytes, "how": m.how} for m in memory],
                    activations_method=how or None,
                    dtype=dtype.value, optimizer=optimizer.value, mixed_precision=mixed,
                    subject=subject.describe())
        if cfg is not None:
            data["config"] = cfg.to_dict()
        print_json(data)
        return
    rows = display_rows(report, depth, expand)
    render(report, rows, memory, how, stdout(),
           title=f"parameters: {cfg.kind}, d_model {cfg.d_model}" if cfg is not None
           else f"parameters: {subject.label}")

"""`tfcli params`: where the parameters are and what memory they take."""

from __future__ import annotations

import os
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from tfcli.cli.options import (SUBJECT_RULES, AttnImplementation, MAX_SIZE, ConfigOpt, DimOpt, AttnImplOpt, HfClassOpt, InputOpt, JsonOpt,
                               MaxMemoryOpt, ModelArgOpt, ModelOpt, PresetOpt, SetOpt, given,
                               max_seq_len_hint, refuse_unused_sizes, resolve_subject, sizes)
from tfcli.cli.process import print_json, stdout
from tfcli.cli.rules import Needs, Rule, Rules, any_model
from tfcli.guard import guard_build, require


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


class OptimizerImpl(str, Enum):
    auto = "auto"
    for_loop = "for-loop"
    foreach = "foreach"
    fused = "fused"


class Mixed(str, Enum):
    none = "none"
    bf16 = "bf16"
    fp16 = "fp16"


class Precision(str, Enum):
    autocast = "autocast"
    fsdp_mixed = "fsdp-mixed"
    zero_paper = "zero-paper"
    deepspeed = "deepspeed"
    megatron = "megatron"


class BuildDevice(str, Enum):
    meta = "meta"
    cpu = "cpu"


class TrainDevice(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class Loop(str, Enum):
    loss_only = "loss-only"
    keep_output = "keep-output"


class Checkpointing(str, Enum):
    none = "none"
    selective = "selective"
    full = "full"


class Fit(str, Enum):
    batch = "batch"
    seq_len = "seq-len"


class Kernel(str, Enum):
    auto = "auto"
    math = "math"
    flash = "flash"
    efficient = "efficient"


def _sized_without_length(v) -> bool:
    """--batch-size or --dim, without a length, for a --model: the sizes of a model whose
    inputs have no sequence (an image's sides, features alone), which the step is replayed
    at; whether its inputs have one is known once it is resolved (params checks again)."""
    return (v.model_ref is not None and v.seq_len is None and v.fit_ is not Fit.seq_len
            and (v.typed("batch_size") or v.typed("dim") or v.fit_ is Fit.batch))


def _per_rank(v) -> str | None:
    """The first option that asks for the per-rank plan (None: one device; with --inference,
    --device-memory and --fit ask whether serving fits one device)."""
    serving = () if v.inference else (("--fit", v.fit_), ("--device-memory", v.device_memory))
    return next((o for o, value in (("--parallel", v.parallel), ("--checkpointing", v.checkpointing),
                                    ("--micro-batches", v.micro_batches), *serving,
                                    ("--precision", v.precision if v.precision not in
                                     (None, Precision.autocast) else None),
                                    ("--param-count", v.param_count))
                 if value is not None), None)


JSON_BYTES_PER_ROW = 5 * 1024  # a module or buffer in --json, at the peak of making it
STEP = Needs(lambda v: v.seq_len is not None or (v.inference and v.fit_ is Fit.seq_len)
             or v.sized_without_length,
             "only with --seq-len (or --inference --fit seq-len), or a sequence-free --model's "
             "--batch-size",
             "applies to the memory of a step: add --seq-len L (and --batch-size B; a --model "
             "whose inputs have no sequence: --batch-size B alone; one whose factory returns "
             "example inputs, which keep their sizes: --seq-len, which then sizes nothing)")
# what a step's replay follows; --fit seq-len replays steps too, at the lengths it tries
# (a --model whose inputs have no sequence, a ViT's, is sized by --batch-size and --dim)
ONLY_SIZED = "only with --seq-len or --fit seq-len, or a --model whose inputs have no sequence"
STEP_OR_SEARCH = Needs(lambda v: v.sized, ONLY_SIZED,
                       "applies to the memory of a step: add --seq-len L (and --batch-size B), "
                       "or --fit seq-len (a --model whose inputs have no sequence: --batch-size "
                       "B)")
FITS_INTO = Needs(lambda v: v.device_memory is not None, "only with --device-memory",
                  "{option} needs --device-memory to fit into: add --device-memory SIZE|GPU "
                  "(e.g. 80GiB or H100)")


def _floating(v) -> bool:
    """Whether the model runs in a floating dtype: int8 is counted for weights alone."""
    return v.dtype is not DType.int8 or v.mixed_precision is not Mixed.none


FLOATING = Needs(_floating, "not with --dtype int8",
                 "{option} with --dtype int8: activations need a floating dtype (int8 is "
                 "counted for weights only)")


def _dim_set_elsewhere(v) -> str | None:
    """Why the first --dim for a letter that --fit searches or that the per-rank plan divides
    over ranks (B over dp) cannot be given: it would silently win over the search's or the
    plan's value. (A length is --seq-len's: the table refuses it as --dim.)"""
    for text in v.dim or []:
        letter = text.partition("=")[0].strip()
        if v.fit_ is Fit.batch and letter == "B" \
                or v.fit_ is Fit.seq_len and letter in ("S", "T", "L"):
            return f"{text} with --fit {v.fit_.value}: the search sets {letter}; drop the --dim"
        if v.per_rank is not None and letter == "B":
            return (f"{text} with {v.per_rank}: the plan divides B over the ranks from "
                    f"--batch-size; give it as --batch-size (--dim sets the model's other "
                    f"dimensions)")
    return None
SIZED = Needs(lambda v: v.sized, ONLY_SIZED,
              "sizes the activation lines, which need a length: add --seq-len L")
CHANGES_ACTIVATIONS = Needs(lambda v: v.sized, ONLY_SIZED,
                            "changes the activations, which need a length: add --seq-len L "
                            "(a --model whose inputs have no sequence: --batch-size B; model "
                            "states are the same with or without it)")
TABLE_ONLY = Needs(lambda v: not v.json_out, "not with --json",
                   "{option}: shape the table; --json holds every module whole (drop {it}, or "
                   "drop --json)")
PER_RANK_SHOWN = "not with a per-rank plan: --parallel, --device-memory, --fit, ..."
ONE_DEVICE = Needs(lambda v: v.per_rank is None, PER_RANK_SHOWN,
                   "does nothing with {v.per_rank}: the per-rank plan is a table of memory "
                   "lines, not of the model's modules")
TRAINING = Needs(lambda v: not v.inference, "not with --inference",
                 "applies to training memory; --inference counts weights, KV cache and working "
                 "memory only")

def _model_split(v, keys: tuple[str, ...] = ("tp", "pp", "cp")) -> str | None:
    """The first split of the model itself (of ``keys``) that --parallel asks for."""
    from tfcli.parallel.layout import parse_parallel

    if v.parallel is None:
        return None
    par = parse_parallel(v.parallel)
    return next((f"{key}={getattr(par, key)}" for key in keys if getattr(par, key) > 1), None)


def _units_chosen(v) -> bool:
    """Whether the per-rank plan has units --wrap would choose: FSDP's (zero=3), the
    pipeline's blocks, or those --checkpointing checkpoints (DDP and ZeRO-1/2 have none)."""
    from tfcli.parallel.layout import parse_parallel

    if v.parallel is None:
        return v.checkpointing is not None
    par = parse_parallel(v.parallel)
    return par.zero == 3 or par.pp > 1 or v.checkpointing is not None


def _layout(v):
    """--parallel parsed (tfcli.parallel.layout.Parallel), or one device's layout without it."""
    from tfcli.parallel.layout import Parallel, parse_parallel

    return parse_parallel(v.parallel) if v.parallel is not None else Parallel()


def _rank_timeline(v) -> str | None:
    """Why --timeline cannot draw the rank that the per-rank options ask for (None: it can,
    or they ask for none): one rank of FSDP data parallelism, one micro-batch, no
    checkpointing or autocast, is drawn."""
    from tfcli.parallel.layout import parse_parallel

    if v.per_rank is None:
        return None
    wanted = "a rank's timeline is drawn for FSDP data parallelism (--parallel dp=N,zero=3)"
    if v.parallel is None:
        return f"{wanted}; add --parallel dp=N,zero=3, or drop {v.per_rank}"
    par = parse_parallel(v.parallel)
    if par.zero != 3 or par.tp > 1 or par.pp > 1 or par.cp > 1 or par.ep > 1:
        return f"{wanted}; DDP, ZeRO-1/2, tp, pp, cp and ep are not drawn yet"
    for option, value in (("--fit", v.fit_), ("--micro-batches", v.micro_batches),
                          ("--checkpointing", v.checkpointing)):
        if value is not None:
            return (f"{wanted} at the given batch and length, one micro-batch, without "
                    f"checkpointing; drop {option}")
    if v.mixed_precision is not Mixed.none:
        return (f"{wanted} in one dtype; FSDP's mixed precision is not drawn yet: drop "
                f"--mixed-precision")
    if v.loop is not Loop.loss_only:
        return f"{wanted} with a loss-only loop; drop --loop {v.loop.value}"
    return None


RULES = Rules(
    SUBJECT_RULES,
    Rule(("depth", "expand"), TABLE_ONLY),
    Rule("mixed_precision", Needs(
        lambda v: v.mixed_precision is Mixed.none or v.dtype is DType.fp32,
        "only with --dtype fp32",
        "{option} {value} keeps fp32 weights and casts activations (torch.autocast); --dtype "
        "{v.dtype.value} makes the weights {v.dtype.value}: give one of the two")),
    Rule("tp_plan", any_model("{option} applies to --model; tfcli's own model splits its "
                              "attention and FFN matrices as Megatron-LM does"),
         Needs(lambda v: v.tensor_ranks > 1, "only with --parallel tp=T",
               "splits the model over tensor-parallel ranks: add tp=T (T > 1) to --parallel")),
    Rule("micro_batches", Needs(
        lambda v: v.pipelined, "only with pp=P in --parallel",
        "{option} {value}: micro-batches in flight matter to pipeline stages; add pp=P to "
        "--parallel (with pp=1 one is in flight)")),
    Rule("wrap", any_model("{option} applies to --model; tfcli's own model wraps each of its "
                           "layers"),
         Needs(lambda v: v.per_rank is not None, "only with --parallel",
               "chooses the FSDP units of the per-rank plan: add --parallel dp=N,zero=3"),
         Needs(_units_chosen, "with zero=3, pp=P or --checkpointing",
               "{option} {value} with {v.plan_asked}: it chooses FSDP's units (zero=3), the "
               "pipeline's blocks (pp) and the checkpointed units (--checkpointing); none of "
               "them is in this plan: drop it")),
    Rule("device", STEP_OR_SEARCH),
    Rule("attention_kernel", STEP_OR_SEARCH),
    Rule("keep_grads", STEP),
    Rule("inference", STEP),
    Rule("kv_dtype", Needs(lambda v: v.inference, "only with --inference",
                           "applies to --inference")),
    Rule("freeze", Needs(lambda v: v.per_rank is None, PER_RANK_SHOWN,
                         "is not modelled with {v.per_rank}: the per-rank plan gives every "
                         "parameter gradients and optimizer state; drop --freeze, or drop "
                         "{v.per_rank} to size one device with frozen parameters")),
    Rule("build_on", ONE_DEVICE),
    Rule("max_memory", ONE_DEVICE,
         Needs(lambda v: v.build_on is BuildDevice.cpu, "only with --build-on cpu",
               "bounds --build-on cpu; meta allocates nothing")),
    Rule("keep_grads", Needs(lambda v: v.per_rank is None, PER_RANK_SHOWN,
                             "{option} is not modelled with {v.per_rank}: the per-rank "
                             "plan's moments follow zero_grad(set_to_none=True), PyTorch's "
                             "default, gradients made in backward; drop {it}")),
    Rule("dim", Needs(lambda v: v.seq_len is not None or v.fit_ is Fit.seq_len or not any(
        t.partition("=")[0].strip() in ("S", "T", "L") for t in v.dim or []),
                      "not for S, T or L",
                      "{option} {value}: a length is given as --seq-len (it sets S, T and L); "
                      "--dim sets the inputs' other letters")),
    Rule("dim", Needs(lambda v: v.per_rank is None or v.model_ref is not None,
                      "with --parallel: only with --model",
                      "{option} {value} with {v.per_rank}: tfcli's own plan takes its sizes "
                      "from --batch-size and --seq-len; --dim sets other dimensions of a "
                      "--model's inputs")),
    Rule("depth", ONE_DEVICE),
    Rule("expand", ONE_DEVICE),
    Rule("batch_size", SIZED),
    Rule("dim", SIZED),
    # under autocast the 16-bit dtype changes the activations alone; the other policies keep
    # weights, gradients or states in it too (a plan without activations, --param-count)
    Rule("mixed_precision", Needs(
        lambda v: v.sized or v.precision not in (None, Precision.autocast),
        ONLY_SIZED + ", or a --precision but autocast", CHANGES_ACTIVATIONS.refusal)),
    Rule("checkpointing", CHANGES_ACTIVATIONS),
    Rule("micro_batches", CHANGES_ACTIVATIONS),
    Rule("optimizer", TRAINING),
    Rule("loop", CHANGES_ACTIVATIONS, TRAINING),
    Rule("reserve", Needs(lambda v: v.device_memory is not None, "only with --device-memory",
                          "is kept back from --device-memory: add --device-memory SIZE|GPU")),
    Rule("optimizer_impl", STEP_OR_SEARCH, TRAINING,
         Needs(lambda v: v.per_rank is None or v.data_parallel_only,
               "not with tp/pp/ep",
               "{option} with {v.parallel}: the per-rank plan has an optimizer-step moment "
               "with data and context parallelism alone (dp, zero, cp), not with tp, pp or "
               "ep; drop {option}")),
    Rule("mixed_precision", TRAINING),
    Rule("precision", TRAINING, Needs(
        lambda v: v.precision in (None, Precision.autocast) or v.dtype is DType.fp32,
        "but autocast: only with --dtype fp32",
        "{option} {value} keeps fp32 master weights and takes its 16-bit dtype from "
        "--mixed-precision (default bf16); --dtype {v.dtype.value} is autocast's: drop it")),
    Rule("param_count", Needs(
        lambda v: not any((v.preset, v.config, v.set_, v.model_ref)), "not with a model",
        "{option} states the model's size instead of a model: drop --preset/--config/--set/"
        "--model, or drop {option}"), Needs(
        lambda v: v.seq_len is None and v.fit_ is None and v.checkpointing is None
        and v.micro_batches is None and v.model_split is None,
        "not with --seq-len, --fit, --checkpointing, --micro-batches or tp/pp/cp",
        "{option} sizes model states only (no layout, no activations): drop --seq-len, --fit, "
        "--checkpointing, --micro-batches and tp/pp/cp, or give a model instead")),
    Rule("keep_grads", TRAINING),
    Rule(("parallel", "checkpointing", "micro_batches"), Needs(
        lambda v: not v.inference, "not with --inference",
        "{option}: the per-rank plan sizes a training step; --inference sizes one device's "
        "weights, KV cache and working sets; drop {it} or --inference")),
    Rule("fit_", FITS_INTO, Needs(
        lambda v: v.fit_ is not Fit.batch or v.seq_len is not None or v.sized_without_length,
        "batch: only with --seq-len (or a sequence-free --model)",
        "{option} {value} needs --seq-len, the length whose batch is searched: add --seq-len "
        "L")),
    # the search sets what it searches: a value given for it would be silently replaced
    Rule("seq_len", Needs(lambda v: v.fit_ is not Fit.seq_len, "not with --fit seq-len",
                          "{option} {value}: --fit seq-len searches the length; drop {it} (or "
                          "--fit)")),
    Rule("batch_size", Needs(lambda v: v.fit_ is not Fit.batch, "not with --fit batch",
                             "{option} {value}: --fit batch searches the batch; drop {it} (or "
                             "--fit)")),
    Rule("timeline", STEP,
         Needs(lambda v: v.rank_timeline is None, "with --parallel: dp=N,zero=3 only",
               "with {v.per_rank}: {v.rank_timeline}"),
         Needs(lambda v: not v.inference or v.model_ref is None,
               "with --inference: not with --model",
               "{option} with --inference draws tfcli's own model (--preset/--config/--set) "
               "for now; for --model drop {option}")),
    Rule("decode_steps", Needs(lambda v: v.inference and v.timeline is not None,
                               "only with --inference --timeline",
                               "sets the decode steps that --inference --timeline FILE draws: add "
                               "both, or drop it")),
    # --dim sets a letter over every other option: one that the search or the plan sets
    # would silently win over the search's or the plan's value
    Rule("dim", Needs(lambda v: v.dim_set_elsewhere is None,
                      "not for B with --fit batch or a per-rank plan",
                      "{option} {v.dim_set_elsewhere}")),
    Rule("seq_len", FLOATING),
    Rule(("batch_size", "dim"), Needs(
        lambda v: not v.sized_without_length or _floating(v), "not with --dtype int8",
        FLOATING.refusal)),
    Rule("fit_", Needs(_floating, "not with --dtype int8",
                       "{option} {value} with --dtype int8: the search replays steps, whose "
                       "activations need a floating dtype (int8 is counted for weights only)")),
    Rule(("parallel", "checkpointing", "micro_batches", "device_memory", "param_count"), Needs(
        lambda v: v.per_rank is None or _floating(v), "not with --dtype int8",
        "{option} with --dtype int8: the per-rank plan sizes a training step, which needs a "
        "floating dtype (int8 is counted for weights only)")),
    Rule("precision", Needs(
        lambda v: v.precision is not Precision.fsdp_mixed or v.zero_stage == 3,
        "fsdp-mixed: only with zero=3",
        "{option} fsdp-mixed: FSDP's MixedPrecisionPolicy gathers sharded parameters; add "
        "zero=3 to --parallel (now zero={v.zero_stage}), or use --precision autocast")),
    Rule("param_count", Needs(
        lambda v: v.expert_ranks == 1, "not with ep",
        "{option} with --parallel ep={v.expert_ranks}: a stated size has no experts to split; "
        "give the model (--model) instead")),
    derived={"per_rank": _per_rank, "model_split": _model_split, "layout": _layout,
             "expert_ranks": lambda v: v.layout.ep, "zero_stage": lambda v: v.layout.zero,
             "plan_asked": lambda v: v.parallel or v.per_rank,  # dp=2, or the option
             "dim_set_elsewhere": _dim_set_elsewhere,
             "pipelined": lambda v: _model_split(v, ("pp",)) is not None,
             "tensor_ranks": lambda v: v.layout.tp,
             # context-parallel ranks step the same shards as data-parallel ones
             "data_parallel_only": lambda v: _model_split(v, ("tp", "pp", "ep")) is None,
             "rank_timeline": lambda v: _rank_timeline(v),
             "sized_without_length": _sized_without_length,
             "sized": lambda v: (v.seq_len is not None or v.fit_ is Fit.seq_len
                                 or v.sized_without_length)},
)


def params(
    preset: PresetOpt = None, config: ConfigOpt = None, set_: SetOpt = None,
    model_ref: ModelOpt = None, model_arg: ModelArgOpt = None, hf_class: HfClassOpt = None,
    attn_implementation: AttnImplOpt = AttnImplementation.auto,
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
    optimizer_impl: Annotated[OptimizerImpl, typer.Option(
        help="How optimizer.step() runs, for the peak line: for-loop (one parameter at a "
             "time), foreach (every parameter at once: about sizeof(parameters) of "
             "temporaries), fused (none); auto is what PyTorch picks on --device (CUDA: "
             "foreach, CPU: for-loop).")] = OptimizerImpl.auto,
    mixed_precision: Annotated[Mixed, typer.Option(
        help="The 16-bit dtype of a mixed-precision run. How weights, gradients and optimizer "
             "state are kept is --precision's (its default, autocast: fp32 states, the "
             "matrix products in this dtype, the residual stream between layers fp32)."
    )] = Mixed.none,
    batch_size: Annotated[int, typer.Option(min=1, help="Batch size for activations.")] = 8,
    seq_len: Annotated[Optional[int], typer.Option(
        min=1, show_default=False,
        help="Sequence length (source and target; every length letter of --input) for the "
             "activation lines; without it activations are not estimated.")] = None,
    device: Annotated[TrainDevice, typer.Option(
        help="The device you will run on, for the activation lines: it decides which SDPA "
             "kernel --attention-kernel auto means.")] = TrainDevice.cpu,
    attention_kernel: Annotated[Kernel, typer.Option(
        help="SDPA kernel assumed for activations: math keeps [B, h, T, S] scores and weights; "
             "flash/efficient keep only a [B, h, T] log-sum-exp; auto is what SDPA picks on "
             "--device.")] = Kernel.auto,
    loop: Annotated[Loop, typer.Option(
        help="The training loop the step is replayed as: loss-only frees the model's output "
             "once the loss is computed (loss_fn(model(x)).backward()); keep-output holds it "
             "until the step ends, as nanoGPT's `logits, loss = model(x, y)` does (its logits "
             "stay alive through backward).")] = Loop.loss_only,
    keep_grads: Annotated[bool, typer.Option(
        "--keep-grads", help="The peak line with gradients kept between steps "
                             "(zero_grad(set_to_none=False)).")] = False,
    inference: Annotated[bool, typer.Option(
        "--inference", help="Inference memory instead of training: weights, KV cache, and "
                            "the working sets of a prefill of --seq-len tokens and of one "
                            "decode step (for --model: the KV cache measured; a --model "
                            "whose inputs have no sequence: one eval forward at "
                            "--batch-size, nothing cached).")] = False,
    kv_dtype: Annotated[Optional[DType], typer.Option(
        show_default=False, help="KV cache dtype with --inference (default: --dtype).")] = None,
    build_on: Annotated[BuildDevice, typer.Option(
        help="Where to build the model for counting: meta allocates nothing; cpu for a --model "
             "that cannot be built on meta.")] = BuildDevice.meta,
    max_memory: MaxMemoryOpt = None,
    parallel: Annotated[Optional[str], typer.Option(
        metavar="dp=N,zero=0-3,tp=T,pp=P,cp=C,ep=E", show_default=False,
        help="Memory per rank under data (ZeRO/FSDP), tensor (+sequence), pipeline, context "
             "and expert parallelism (ep: experts split over E of the dp ranks, --model with "
             "experts; sp=0|1, for --model off unless sp=1), e.g. dp=8,zero=3,tp=2.")] = None,
    checkpointing: Annotated[Optional[Checkpointing], typer.Option(
        show_default=False, help="Activation recomputation for the per-rank plan (default "
                                 "none).")] = None,
    micro_batches: Annotated[Optional[int], typer.Option(
        min=1, show_default=False,
        help="Micro-batches per step with pipeline parallelism (default: pp).")] = None,
    device_memory: Annotated[Optional[str], typer.Option(
        metavar="SIZE|GPU", show_default=False,
        help="Per-rank device memory, e.g. 80GiB or H100: prints the headroom (with "
             "--inference: of serving on one device).")] = None,
    reserve: Annotated[Optional[str], typer.Option(
        metavar="SIZE", show_default=False,
        help="Memory kept back from --device-memory for what a real GPU also holds (CUDA "
             "context, NCCL and cuBLAS workspaces, allocator rounding); default 2GiB, 0 for "
             "none.")] = None,
    fit_: Annotated[Optional[Fit], typer.Option(
        "--fit", show_default=False,
        help="Search the largest --batch-size or --seq-len that fits --device-memory (a "
             "training step per rank, or serving with --inference).")] = None,
    wrap: Annotated[Optional[str], typer.Option(
        "--wrap", metavar="CLASS", show_default=False,
        help="FSDP wrap units for a --model's per-rank plan: every outermost module of this "
             "class (default: the blocks of the model's largest ModuleList).")] = None,
    tp_plan: Annotated[Optional[str], typer.Option(
        "--tp-plan", metavar="GLOB=colwise|rowwise,...", show_default=False,
        help="Tensor-parallel plan for a --model with --parallel tp=T: fnmatch globs on module "
             "paths and how torch splits each nn.Linear/nn.Embedding (colwise: output "
             "features, rowwise: input features), e.g. 'blocks.*.fc1=colwise,"
             "blocks.*.fc2=rowwise'; default: a Transformers model's own plan "
             "(base_model_tp_plan).")] = None,
    decode_steps: Annotated[Optional[int], typer.Option(
        min=1, max=4096, show_default=False,
        help="Decode steps after the prefill in a --inference --timeline (default 8).")] = None,
    timeline: Annotated[Optional[Path], typer.Option(
        "--timeline", metavar="FILE", show_default=False,
        help="Draw the replayed training step's memory over time, by category, with its "
             "phases and what is alive at the peak: FILE.png (the 'plot' extra), .html "
             "(self-contained) or .json (torch.cuda.memory._snapshot() format); with "
             "--inference, tfcli's own model's prefill and decode steps.")] = None,
    precision: Annotated[Optional[Precision], typer.Option(
        show_default=False,
        help="How weights, gradients, master weights and optimizer moments are kept, and the "
             "dtype the model runs in (default autocast): autocast = torch.autocast (fp32 "
             "weights, grads, moments: 16 B/param with Adam; fp32 residual stream); fsdp-mixed "
             "= FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), zero=3 only; "
             "zero-paper = Rajbhandari et al. 2020 (2 + 2 + 12 B); deepspeed = DeepSpeed ZeRO "
             "as its estimators count it (+ an fp32 gradient partition); megatron = bf16 "
             "weights, fp32 main grads (18 B). Not autocast: the per-rank plan (dp=1 without "
             "--parallel); the 16-bit dtype is --mixed-precision's (default bf16).")] = None,
    param_count: Annotated[Optional[str], typer.Option(
        metavar="N", show_default=False,
        help="No model: the per-rank model states of N parameters (e.g. 7.5e9), as "
             "--precision keeps them, at every ZeRO stage.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Parameters per layer (tied weights counted once), buffers, and training memory."""
    values = dict(locals())  # the parameters, for a second pass of the table below
    v = RULES.apply(values)
    prec = (precision or Precision.autocast).value
    if param_count is not None:
        from tfcli.parallel.report import params_parallel, parse_param_count

        return params_parallel(None, parallel, batch_size, None, None, None, dtype.value,
                               None if mixed_precision is Mixed.none else mixed_precision.value,
                               optimizer.value, "auto", device_memory, None, inference,
                               json_out, reserve=reserve, precision=prec,
                               param_count=parse_param_count(param_count))
    timeline_file = _check_timeline(timeline)  # absolute: the model may change directory
    subject = resolve_subject(preset, config, set_, model_ref, model_arg, hf_class, input_,
                              attn_implementation)  # first: it may speak before torch loads
    from tfcli.errors import TfcliError

    if kv_dtype is not None and not subject.has_sequence():
        raise TfcliError(f"--kv-dtype {kv_dtype.value}: the model's inputs have no sequence "
                         f"({subject.why_no_sequence()}), so nothing is decoded and no KV "
                         f"cache kept; drop it")
    # a --seq-len given to a model whose inputs have no sequence still asks for the step (a
    # module with example inputs has no other size to ask it by), and sizes nothing: said so
    unused_length = None
    if seq_len is not None and not subject.has_sequence() and given("seq_len"):
        unused_length = (f"--seq-len {seq_len} sizes nothing: the model's inputs have no "
                         f"sequence ({subject.why_no_sequence()})")
    if v.sized_without_length:
        if subject.has_sequence():
            RULES.apply(values, sized_without_length=lambda v: False)  # refused as for text
        else:  # no letter of it is a length: the step at --batch-size and --dim
            seq_len = subject.default_sizes.get("L", 1)  # (set for the letters it lacks)
    from tfcli.inspection import memory as mem
    from tfcli.inspection.params import freeze as apply_freeze
    from tfcli.inspection.params import param_report
    from tfcli.render.params import display_rows, render

    mixed = None if mixed_precision is Mixed.none else mixed_precision.value
    cfg = getattr(subject, "cfg", None)
    if seq_len is not None and seq_len > MAX_SIZE:  # so a --set max_seq_len hint is allowed
        raise TfcliError(f"--seq-len {seq_len}: at most {MAX_SIZE:,}")
    if cfg is not None and seq_len is not None and seq_len > cfg.max_seq_len \
            and cfg.positional not in ("none", "rope"):
        raise TfcliError(f"--seq-len {seq_len} exceeds max_seq_len={cfg.max_seq_len}; "
                         f"{max_seq_len_hint(seq_len)}")
    impl, impl_why = optimizer_impl.value, ""
    if impl == "auto":
        impl = mem.default_optimizer_impl(device.value)
        impl_why = f" (what PyTorch picks on {device.value})"
    mem.check_optimizer_impl(optimizer.value, impl, device.value)
    kernel = attention_kernel.value
    if kernel == "auto" and device is TrainDevice.cuda:
        kernel = "flash"  # flash or efficient: both keep only the log-sum-exp
    if kernel in ("flash", "efficient") and device is TrainDevice.cpu and cfg is not None \
            and cfg.dropout > 0:
        where = "--device cpu" if given("device") else "the CPU (--device cpu, the default)"
        raise TfcliError(f"--attention-kernel {kernel} on {where} with dropout="
                         f"{cfg.dropout}: the CPU flash kernel takes no dropout (SDPA falls "
                         f"back to math); size a GPU run with --device cuda")
    if seq_len is not None and given("batch_size"):
        refuse_unused_sizes(subject, {"--batch-size": batch_size}, dim)
    _refuse_lengths_twice(subject, seq_len, dim)
    if v.per_rank is not None:
        from tfcli.parallel.report import params_parallel  # issue 14: memory per rank

        rank = None
        if timeline is not None:
            rank = _rank_drawing(timeline_file, subject, parallel,
                                 sizes(subject, batch_size, seq_len, seq_len, dim, seq_len),
                                 dtype.value, optimizer.value, kernel, wrap,
                                 mem.assumed_kernel(attention_kernel.value, device.value,
                                                    dtype.value, mixed, cfg.dropout
                                                    if cfg is not None else None), device.value)
        return params_parallel(cfg, parallel, batch_size, seq_len, micro_batches,
                               checkpointing.value if checkpointing else None, dtype.value, mixed,
                               optimizer.value, kernel, device_memory,
                               fit_.value if fit_ else None, inference, json_out, subject,
                               lambda b, s: sizes(subject, b, s, s, dim, s), wrap, reserve, rank,
                               loop.value, prec, device=device.value, tp_plan=tp_plan,
                               optimizer_impl=impl, unused_length=unused_length)
    if build_on is BuildDevice.cpu:  # real weights: estimated on meta first
        guard_build(subject, "params --build-on cpu", max_memory)
    model = subject.build(build_on.value)
    apply_freeze(model, freeze or [])
    report = param_report(model, subject.experts_per_token())
    if json_out:  # refused before the memory estimates, not after
        # Every module and buffer whole, then JSON text: 3.2-3.9 KB per row at the peak
        # (tracemalloc, a 100-layer Llama and 2,000 Linear modules), which 130,000 modules
        # (10,000 Llama layers) make half a gigabyte.
        rows = len(report.layers) + len(report.buffers)
        require(JSON_BYTES_PER_ROW * rows, "params --json", None, "cpu",
                f"{rows:,} modules and buffers, about {JSON_BYTES_PER_ROW // 1024} KiB apiece "
                f"while the JSON is made", hint="; without --json the table folds repeated "
                "layers (--depth 0 gives the totals alone)")

    served = None
    if inference and device_memory is not None:  # serving: does it fit, what fits
        from tfcli.inspection.serving import serve
        from tfcli.inspection.fit import device_budget

        static = mem.training_memory(report.total_params, 0, report.buffer_numel, dtype.value,
                                     optimizer.value, None, None)[:2]
        served = serve(subject, sum(m.bytes for m in static), device_budget(device_memory, reserve),
                       fit_.value if fit_ else None, batch_size, seq_len,
                       lambda b, n: sizes(subject, b, n, n, dim, n), dtype.value,
                       (kv_dtype or dtype).value, kernel)
        batch_size, seq_len = served.point.batch, served.point.length

    activations, how, memory, step, recorder = None, "", [], None, None
    if seq_len is not None:
        dims = sizes(subject, batch_size, seq_len, seq_len, dim, seq_len)
        assumed = mem.assumed_kernel(attention_kernel.value, device.value, dtype.value, mixed,
                                     cfg.dropout if cfg is not None else None)
        if cfg is not None and cfg.attention == "naive":
            assumed = "naive path (matmul + softmax, no SDPA): math"
        if inference:
            memory = mem.training_memory(report.total_params, 0, report.buffer_numel,
                                         dtype.value, optimizer.value, None, None)[:2]
            if served is None:  # the same lines and peak as serving on a device, without one
                from tfcli.inspection.serving import measure, peak_line

                static = sum(line.bytes for line in memory)
                point = measure(subject, static, dims, dtype.value, (kv_dtype or dtype).value,
                                kernel, batch_size, seq_len)
                memory += [*point.lines, peak_line(point, static)]
            else:
                memory += served.memory
            how = "; ".join([*subject.assumptions(dims),
                             f"attention kernel: {assumed}, on {device.value}"])
            if timeline is not None:
                from tfcli.inspection.timeline import DECODE_STEPS, inference_timeline

                steps = decode_steps or DECODE_STEPS
                kv = (kv_dtype or dtype).value
                written = _write_timeline(timeline_file, inference_timeline(
                    subject, dims, dtype.value, kv, kernel, steps), None, {
                    "what": f"inference: a prefill of {seq_len} tokens, then {steps} decode "
                            f"steps (eval, no grad)",
                    "model": subject.label, "sizes": mem._sizes_text(subject, dims),
                    "precision": f"{dtype.value}, KV cache {kv}", "kernel": assumed,
                    "method": f"fake-tensor replay of each forward on {device.value} kernels: "
                              f"nothing allocated; the KV cache modelled per layer as a "
                              f"DynamicCache grows (a rolling buffer with a sliding window)"})
        else:
            # one replay of the step answers the activation lines and the step's own
            if timeline is not None:
                from tfcli.inspection.timeline import TimelineRecorder

                recorder = TimelineRecorder()
            step = mem.estimate_step(subject, dims, dtype.value, mixed, optimizer.value, kernel,
                                     keep_grads, recorder, impl, tuple(freeze or ()),
                                     loop.value, device.value, activations=True)
            activations = step.activations
            how = (mem.activations_how(subject, dims, mixed, tuple(freeze or ()), loop.value)
                   + f"; attention kernel: {assumed}, on {device.value}")
        if unused_length:
            how += f"; {unused_length}"
        report.reused_calls = _reused_calls(subject, dims)
    if not inference:
        memory = mem.training_memory(report.total_params, report.trainable_params,
                                     report.buffer_numel, dtype.value, optimizer.value, mixed,
                                     activations)
        if step is not None:
            by = {m.name: m.bytes for m in memory}
            memory += mem.training_step_lines(
                step, optimizer.value, keep_grads,
                by["weights"] + by["buffers"] + by["optimizer state"], by["gradients"], impl,
                impl_why, loop.value)
            if recorder is not None:
                precision = f"fp32 weights, autocast {mixed}" if mixed else dtype.value
                written = _write_timeline(timeline_file, recorder.timeline, memory[-1].bytes, {
                    "what": f"one training step (forward, loss, backward, "
                            f"{optimizer.value}.step() {impl}, zero_grad(set_to_none="
                            f"{not keep_grads})); {mem.LOOP_WORDS[loop.value]}",
                    "model": subject.label, "sizes": mem._sizes_text(subject, dims),
                    "precision": precision, "kernel": assumed,
                    "method": f"fake-tensor replay of the step on {device.value} kernels, "
                              f"{subject.loss_name()}: nothing allocated; bytes are storage "
                              f"sizes, without a caching allocator's rounding"})
    if json_out:
        data = report.to_dict()
        data["buffers"] = [dict(b) for b in data["buffers"]]
        data.update(buffer_elements=report.buffer_numel,
                    bytes={m.name: m.bytes for m in memory},
                    memory=[m.record() for m in memory],
                    total_bytes=mem.lines_total(memory),  # as a per-rank plan's
                    activations_method=how or None,
                    dtype=dtype.value,  # no optimizer and no training precision to serve
                    optimizer=None if inference else optimizer.value, mixed_precision=mixed,
                    precision=None if inference else prec,  # one device: autocast's
                    optimizer_impl=impl if activations is not None else None,
                    loop=loop.value if activations is not None else None,
                    subject=subject.describe())
        if cfg is not None:
            data["config"] = cfg.to_dict()
        if timeline is not None:
            data["timeline"] = written
        if served is not None:
            data["serving"] = served.record
        print_json(data)
        return
    rows = display_rows(report, depth, expand)
    console = stdout()
    render(report, rows, memory, how, console,
           title=f"parameters: {cfg.kind}, d_model {cfg.d_model}" if cfg is not None
           else f"parameters: {subject.label}")
    for note in served.notes if served else ():
        console.print(note, highlight=False)
    if timeline is not None:
        console.print(f"wrote timeline: {timeline} (peak {written['peak_bytes']:,} B at event "
                      f"{written['peak_event']:,} of {written['events']:,}, "
                      f"{written['phase_at_peak']}; {written['peak_line']})", highlight=False)


params.rules = RULES

TIMELINE_SUFFIXES = (".json", ".html", ".png")


def _check_timeline(path: Path | None) -> Path | None:
    """Before any work (and before the user's model is imported, which may change the
    working directory): the suffix, a writable place, matplotlib for a PNG; the absolute
    path to write."""
    from tfcli.cli.outputs import Output, check_outputs
    from tfcli.errors import TfcliError

    if path is None:
        return None
    if path.suffix.lower() not in TIMELINE_SUFFIXES:
        raise TfcliError(f"--timeline {str(path)!r}: the file name must end in .json, .html or "
                         f".png")
    check_outputs(Output(path, "--timeline"))
    if path.suffix.lower() == ".png":
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise TfcliError("--timeline FILE.png needs matplotlib: pip install "
                             "'matplotlib>=3.7' (the 'plot' extra; from tfcli's clone: pip "
                             "install '.[plot]'), or write .html or .json") from None
    return Path(os.path.abspath(path))


def _write_timeline(path: Path, timeline, peak_line: int, about: dict) -> dict:
    """Write the timeline atomically (an existing file survives a failure); what was written,
    for the closing line or --json."""
    from tfcli.cli.outputs import AtomicFile
    from tfcli.errors import TfcliError
    from tfcli.render import timeline as draw

    info = draw.summary(timeline)
    agrees = info["peak_bytes"] == peak_line
    line = about.pop("compared_with", "the peak line")
    about["peak_line"] = ("no peak line to compare (inference)" if peak_line is None else
                          f"equal to {line}" if agrees else
                          f"{line} is {peak_line:,} B: "
                          f"{peak_line - info['peak_bytes']:+,} B")
    out = AtomicFile(path)
    try:
        suffix = path.suffix.lower()
        if suffix == ".png":
            draw.save_png(timeline, about, out.temp)
        elif suffix == ".html":
            draw.write_html(timeline, about, out.text())
        else:
            draw.write_json(timeline, about, out.text())
        out.commit()
    except OSError as error:
        out.discard()
        raise TfcliError(f"--timeline {str(path)!r}: {error.strerror or error}",
                         exit_code=1) from None
    except BaseException:
        out.discard()
        raise
    return {"path": str(path), "peak_bytes": info["peak_bytes"], "peak_event": info["peak_event"],
            "events": info["events"], "phase_at_peak": info["phase_at_peak"],
            "peak_line": about["peak_line"], "by_category_at_peak": info["by_category_at_peak"]}


def _rank_drawing(path: Path, subject, parallel: str, dims: dict[str, int], dtype: str,
                  optimizer: str, kernel: str, wrap: str | None, assumed: str, device: str):
    """What params_parallel calls with the plan: rank 0's step of FSDP on a fake world,
    drawn and compared with the plan's peak; what was written."""
    from tfcli.inspection.memory import _sizes_text
    from tfcli.parallel.layout import parse_parallel
    from tfcli.parallel.rank_timeline import fsdp_rank_timeline

    par = parse_parallel(parallel)

    def draw(plan: dict) -> dict:
        tl, _ = fsdp_rank_timeline(subject, par.dp, dims, dtype, optimizer, kernel, wrap)
        return _write_timeline(path, tl, plan["peak"]["bytes"], {
            "what": f"one training step of rank 0 of {par.dp}, FSDP (fully_shard per layer "
                    f"unit and the root; ZeRO-3), {optimizer}.step(), zero_grad("
                    f"set_to_none=True)",
            "model": subject.label, "sizes": _sizes_text(subject, dims) + " per rank",
            "precision": dtype, "kernel": assumed, "compared_with": "the per-rank plan's peak",
            "method": f"FSDP2 on torch.distributed's fake process group of {par.dp} ranks "
                      f"(collectives move no data), fake-tensor replay of the rank's second "
                      f"step on {device} kernels, {subject.loss_name()}: nothing allocated; "
                      f"bytes are storage sizes, without a caching allocator's rounding"})
    return draw


def _refuse_lengths_twice(subject, seq_len: int | None, dims: list[str] | None) -> None:
    """--seq-len sets every length letter (S, T, L): a --dim for one the inputs use would
    silently win over it (one they do not use is refused by the sizes, as any such --dim)."""
    from tfcli.errors import TfcliError
    from tfcli.subjects.base import parse_dim

    if seq_len is None:
        return
    for text in dims or []:
        letter = parse_dim(text)[0]
        if letter in ("S", "T", "L") and letter in subject.dims_used():
            raise TfcliError(f"--seq-len {seq_len} and --dim {text}: both set {letter}; give "
                             f"one")


def _reused_calls(subject, dims: dict[str, int]) -> list[dict]:
    """Modules called in several roles by one forward at ``dims`` (a trace on meta or fake
    tensors, as the replay ran it); nothing when the trace cannot run."""
    from tfcli.inspection.shapes import ForwardFailed, reused_calls, trace

    device, abstract = subject.abstract_run("meta")
    try:
        with abstract:
            model = subject.build(device)
            events = trace(model, subject.make_inputs(model, dims, device))
    except ForwardFailed:
        return []
    return [r.to_dict() for r in reused_calls(events, model)]

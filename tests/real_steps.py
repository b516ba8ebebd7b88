"""A real CPU training step of a subject, run the way tfcli's step replay models it, for the
tests that hold the replay to torch's profiler: forward (under autocast when asked), loss,
backward, AdamW's step, zero_grad(set_to_none=True), after one warm-up step so that the
optimizer's state exists before the step measured. The loop is written either way people write
it (tfcli.inspection.memory.LOOPS): the model's output dropped once the loss is computed, or
held until the step ends (nanoGPT's ``logits, loss = model(x, y)``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from tfcli.inspection.memory import DTYPES, profile_peak_bytes
from tfcli.inspection.params import freeze as apply_freeze


@dataclass
class RealStep:
    peak: int  # the CPU profiler's peak of the measured step, above what existed before it
    model: torch.nn.Module
    inputs: Any
    optimizer: torch.optim.Optimizer
    forward_backward: Callable[[], None]


def real_adamw_step(subject, sizes: dict[str, int], mixed: str | None = None,
                    freeze: tuple[str, ...] = (), keep_output: bool = False,
                    **adamw) -> RealStep:
    """``subject`` built on the CPU (seed 0, ``freeze``'s parameters frozen), AdamW over its
    trainable parameters with ``adamw``'s options (foreach=..., fused=...), one step to warm
    up, then the profiled step; ``keep_output``: the loop holds the model's output until the
    step ends."""
    torch.manual_seed(0)
    model = subject.build("cpu").train()
    apply_freeze(model, list(freeze))
    optimizer = torch.optim.AdamW((p for p in model.parameters() if p.requires_grad), **adamw)
    inputs = subject.step_inputs(model, sizes, "cpu")

    def forward_backward() -> list:
        """The model's output, in a list the caller holds (empty: dropped before backward)."""
        with torch.autocast("cpu", dtype=DTYPES[mixed or "bf16"], enabled=mixed is not None):
            held = [inputs(model)]
            loss = subject.loss(held[0])
        if not keep_output:
            held.clear()
        loss.backward()
        return held

    def step() -> None:
        held = forward_backward()  # noqa: F841 (alive until the step returns)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    return RealStep(profile_peak_bytes(step), model, inputs, optimizer, forward_backward)

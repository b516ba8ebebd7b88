"""A real CPU training step of a subject, run the way tfcli's step replay models it, for the
tests that hold the replay to torch's profiler: forward (under autocast when asked), loss,
backward, AdamW's step, zero_grad(set_to_none=True), after one warm-up step so that the
optimizer's state exists before the step measured."""

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
                    freeze: tuple[str, ...] = (), **adamw) -> RealStep:
    """``subject`` built on the CPU (seed 0, ``freeze``'s parameters frozen), AdamW over its
    trainable parameters with ``adamw``'s options (foreach=..., fused=...), one step to warm
    up, then the profiled step."""
    torch.manual_seed(0)
    model = subject.build("cpu").train()
    apply_freeze(model, list(freeze))
    optimizer = torch.optim.AdamW((p for p in model.parameters() if p.requires_grad), **adamw)
    inputs = subject.make_inputs(model, sizes, "cpu")

    def forward_backward() -> None:
        with torch.autocast("cpu", dtype=DTYPES[mixed or "bf16"], enabled=mixed is not None):
            out = subject.loss(inputs(model))
        out.backward()

    def step() -> None:
        forward_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    return RealStep(profile_peak_bytes(step), model, inputs, optimizer, forward_backward)

"""Precision policies: how a training stack keeps weights, gradients, master weights and
optimizer moments, what a gathered FSDP/ZeRO-3 unit and the communication buffers hold, and in
which dtype the model runs (so what its activations and checkpointed layer inputs weigh).

One policy is chosen per plan (``--precision``) and every line of the plan follows it:

============  =======  =====  ===========  ======  =======  ========  =======  ============
policy        weights  grads  fp32 grads   master  moments  gathered  reduced  model runs
============  =======  =====  ===========  ======  =======  ========  =======  ============
autocast      4        4      —            —       4 each   4         4        fp32, autocast
fsdp-mixed    4        4      —            —       4 each   2         4        16-bit
zero-paper    2        2      —            4       4 each   2         2        16-bit
deepspeed     2        2 (*)  4            4       4 each   2         2        16-bit
megatron      2        4      —            4       4 each   2         4        16-bit
============  =======  =====  ===========  ======  =======  ========  =======  ============

- autocast: PyTorch's torch.autocast: the parameters, their gradients and Adam's moments stay
  in the weights' dtype (fp32), matmuls run in bf16/fp16: 16 B per parameter with Adam. The
  residual stream between layers stays fp32 (a half matmul output added to an fp32 residual
  is fp32), so a checkpointed layer input is 4 B per element.
- fsdp-mixed: FSDP2 ``fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32))``: sharded parameters, gradients and moments in fp32, each unit
  all-gathered into bf16, its gradients computed in bf16 and reduce-scattered in fp32. The
  model runs in bf16 (FSDP casts the inputs too), activations and layer inputs are 2 B.
- zero-paper: Rajbhandari et al. 2020 (ZeRO), Section 3.1: 16-bit parameters and gradients
  (2Ψ + 2Ψ) and K = 12 bytes of optimizer state per parameter (fp32 master weights, momentum,
  variance): (2 + 2 + K)Ψ; P_os shards K, P_os+g also the gradients, P_os+g+p everything.
- deepspeed: DeepSpeed's ZeRO as its memory estimators count it
  (``deepspeed/runtime/zero/stage_1_and_2.py`` ``estimate_zero2_model_states_mem_needs``:
  "2 = params_16bit, 18 = 2_grads_16bit + 4_grads_32bit + 4_params_32bit +
  8_optimizer_states_32bit"; ``stage3.py`` ``estimate_zero3_model_states_mem_needs``:
  4 × the largest layer + 18Ψ/N): the paper's lines plus the fp32 gradient partition the
  optimizer steps on. (*) Under ZeRO-3 gradients are reduce-scattered straight into that fp32
  partition (``grad_partitions_flat_buffer``): no 16-bit gradient shard is kept. ZeRO-3
  gathers module by module (each module's own parameters), so its unit is the largest module.
- megatron: Megatron-LM's mixed-precision optimizer with bf16 parameters and fp32 main
  gradients (``--accumulate-allreduce-grads-in-fp32``): 18 B per parameter, 6 + 12/d with the
  distributed optimizer (Megatron Core developer guide, "Distributed Optimizer"); its
  Megatron-FSDP sharding strategies optim / optim_grads / optim_grads_params are ZeRO-1/2/3.

No torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tfcli.errors import TfcliError

PRECISIONS = ("autocast", "fsdp-mixed", "zero-paper", "deepspeed", "megatron")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}


@dataclass(frozen=True)
class Policy:
    """Bytes per parameter (or element) of everything a policy keeps; see the module's table."""
    name: str
    weights: int
    grads: int  # the model's gradients (0: none kept sharded, ZeRO-3 under deepspeed)
    fp32_grads: int  # a separate fp32 gradient copy the optimizer steps on (deepspeed)
    master: int  # fp32 master weights beside 16-bit weights
    moment: int  # bytes of each optimizer state
    states: int  # optimizer states per parameter (Adam: 2)
    gathered: int  # a gathered (unsharded) unit's parameters, and its all-gather buffer
    unit_grads: int  # a gathered unit's gradients as backward makes them
    reduced: int  # a unit's gradients in the reduce-scatter buffer
    run_dtype: str  # the dtype the model's weights have when it runs (for the replay)
    autocast: str | None  # torch.autocast dtype of the replay
    residual: int  # bytes per element of the residual stream (a checkpointed layer input)
    half: str | None  # the 16-bit dtype (None: no mixed precision)
    how: str
    grads_sharded_at: int = 2  # ZeRO stage from which the model's gradients are sharded

    @property
    def optimizer(self) -> int:
        """K: the optimizer's own bytes per parameter (master copy included, as the paper)."""
        return self.master + self.states * self.moment

    @property
    def per_param(self) -> int:
        return self.weights + self.grads + self.fp32_grads + self.optimizer

    def tag(self) -> str:
        return f"[{self.name}{' ' + self.half if self.half else ''}]"


def policy(precision: str = "autocast", dtype: str = "fp32", mixed: str | None = None,
           optimizer_states: int = 2) -> Policy:
    """The policy ``precision`` names, with ``mixed`` (bf16/fp16) as its 16-bit dtype: for
    autocast the autocast dtype (None: no autocast, everything in ``dtype``); for the others
    bf16 unless fp16 is asked for, with ``dtype`` fp32 (their master precision)."""
    if precision not in PRECISIONS:
        raise TfcliError(f"--precision {precision!r}: allowed: {', '.join(PRECISIONS)}")
    k = optimizer_states
    if precision == "autocast":
        b = 4 if mixed else DTYPE_BYTES[dtype]
        what = (f"fp32 weights, gradients and {k} optimizer state(s); matmuls in {mixed} under "
                f"torch.autocast; the residual stream stays fp32" if mixed else
                f"{dtype} weights, gradients, {k} optimizer state(s) and activations")
        return Policy("autocast", b, b, 0, 0, b, k, b, b, b, dtype, mixed, b, mixed,
                      f"autocast: {what}")
    if dtype != "fp32":
        raise TfcliError(f"--precision {precision} with --dtype {dtype}: its master weights "
                         f"and optimizer states are fp32; give the 16-bit dtype with "
                         f"--mixed-precision bf16|fp16 and leave --dtype fp32")
    half = mixed or "bf16"
    if precision == "fsdp-mixed":
        return Policy(precision, 4, 4, 0, 0, 4, k, 2, 2, 4, half, None, 2, half,
                      f"fsdp-mixed: FSDP2 MixedPrecisionPolicy(param_dtype={half}, "
                      f"reduce_dtype=fp32): fp32 sharded weights, gradients and {k} optimizer "
                      f"state(s); units gathered in {half}, their gradients reduce-scattered "
                      f"in fp32; the model runs in {half}")
    if precision == "zero-paper":
        return Policy(precision, 2, 2, 0, 4, 4, k, 2, 2, 2, half, None, 2, half,
                      f"zero-paper: Rajbhandari et al. 2020: {half} weights and gradients, "
                      f"fp32 master weights + {k} fp32 optimizer state(s) (K = "
                      f"{4 + 4 * k} B); the model runs in {half}")
    if precision == "deepspeed":
        return Policy(precision, 2, 2, 4, 4, 4, k, 2, 2, 2, half, None, 2, half,
                      f"deepspeed: DeepSpeed ZeRO as its estimators count it: {half} weights "
                      f"and gradients, an fp32 gradient partition, fp32 master weights + {k} "
                      f"fp32 optimizer state(s); the model runs in {half}", grads_sharded_at=2)
    return Policy(precision, 2, 4, 0, 4, 4, k, 2, 4, 4, half, None, 2, half,
                  f"megatron: Megatron-LM mixed precision: {half} weights, fp32 main gradients, "
                  f"fp32 master weights + {k} fp32 optimizer state(s); the model runs in "
                  f"{half}")


def check_stage(pol: Policy, zero: int) -> None:
    """fsdp-mixed is FSDP: it has no meaning without parameter sharding."""
    if pol.name == "fsdp-mixed" and zero != 3:
        raise TfcliError(f"--precision fsdp-mixed: FSDP's MixedPrecisionPolicy gathers "
                         f"sharded parameters; add zero=3 to --parallel (now zero={zero}), or "
                         f"use --precision autocast")


@dataclass(frozen=True)
class StateLine:
    name: str
    per_param: int
    sharded_from: int  # the ZeRO stage from which it is sharded over the N ranks
    what: str


def state_parts(pol: Policy, zero: int) -> list[StateLine]:
    """The model-state lines of ``pol`` at ``zero`` (lines of 0 B per parameter left out,
    except the three every plan has)."""
    dt = "fp32" if pol.weights == 4 else pol.half or pol.run_dtype
    grad_dt = "fp32" if pol.grads == 4 else pol.half or pol.run_dtype
    out = [StateLine("weights", pol.weights, 3, f"{dt} weights"),
           StateLine("gradients", pol.grads, pol.grads_sharded_at, f"{grad_dt} gradients")]
    if pol.name == "megatron":  # a contiguous buffer, zeroed between steps, never freed
        out[1] = StateLine("main gradients", pol.grads, pol.grads_sharded_at,
                           "fp32 main gradients (a contiguous buffer kept between steps)")
    if pol.name == "deepspeed" and zero == 3:
        out[1] = StateLine("gradients", 0, 3, "no 16-bit gradient shard: ZeRO-3 reduce-"
                           "scatters each module's gradients straight into the fp32 partition")
    if pol.fp32_grads:
        out.append(StateLine("fp32 gradients", pol.fp32_grads, 1,
                             "the fp32 gradient partition the optimizer steps on"))
    if pol.master:
        out.append(StateLine("master weights", pol.master, 1, "fp32 master weights"))
    out.append(StateLine("optimizer state", pol.states * pol.moment, 1,
                         f"{pol.states} fp32 optimizer state(s)" if pol.moment == 4 else
                         f"{pol.states} optimizer state(s) of {pol.moment} B"))
    return out


def stage_totals(psi: int, n: int, pol: Policy) -> dict[int, int]:
    """Model states per rank at ZeRO-0..3 over ``n`` ranks (each line rounded up, as a rank
    holds whole elements)."""
    out = {}
    for zero in range(4):
        out[zero] = sum(math.ceil(psi * part.per_param / n) if zero >= part.sharded_from and n > 1
                        else psi * part.per_param for part in state_parts(pol, zero))
    return out

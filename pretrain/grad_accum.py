"""The dtype a step's micro-batch gradients are summed in, under bf16 or fp16 DeepSpeed.

DeepSpeed sums them in the model's own dtype unless its config's ``data_types.grad_accum_dtype``
says otherwise (it warns about bf16 only for pipeline parallelism). In bf16 every addition
rounds the sum to 8 significant bits. Measured on the CPU (``tests/test_grad_accum.py``: the demo's
ViT, two ranks of 16 micro-batches of 4 images, one SGD update against the exact sum of the same
bf16 micro-batch gradients), the update's relative error was 6.1e-3 to 7.3e-3 at ZeRO-1, -2 and -3
with bf16 accumulation and 2.3e-3 to 2.7e-3 with fp32, what is left being the bf16 in which
DeepSpeed reduces the gradients across the ranks (with one rank, fp32 summed exactly at ZeRO-2
and -3). The ImageNet-21k recipes' batch of 4096 makes 4 micro-batches per step on 8 GPUs and
32 on one, so ``deepspeed.grad_accum_dtype`` defaults to fp32. Its price is memory and one
addition per micro-batch: at ZeRO-1 an fp32 copy of all the gradients beside the bf16 ones
(about 1.2 GiB for ViT-L/16, 2.5 GiB for ViT-H/14), from ZeRO-2 on an fp32 gradient partition
instead of a bf16 one.

What DeepSpeed does with fp32 accumulation depends on the stage:

- ZeRO-2 and ZeRO-3 add each micro-batch's gradient into their fp32 gradient partition.
- ZeRO-1: DeepSpeed's ZeRO optimizer would add it into an fp32 ``grad_accum`` beside each
  parameter (its path under CPU offload), but for bf16 without offload DeepSpeed's engine swaps
  that optimizer for its ``BF16_Optimizer``, whose checkpoints have another layout (a run could
  not resume a ZeRO-1 checkpoint written with one micro-batch per step) and which
  ``pretrain.grad_checks`` does not cover. :func:`keep_zero1_optimizer` keeps the ZeRO
  optimizer.
- ZeRO-0 has no fp32 accumulation in DeepSpeed: refused, naming the alternatives.

With one micro-batch per step there is nothing to sum and DeepSpeed's config is left as it was.
The gradients still cross the ranks in DeepSpeed's ``communication_data_type`` (the model's
dtype unless a ``deepspeed.config`` file sets it; fp32 doubles the traffic): ZeRO-1 reduces the
step's sum once, ZeRO-2 and -3 each micro-batch's gradient as it is made; those roundings do not
compound in the sum.
"""
from __future__ import annotations

import contextlib
from typing import Optional

from pretrain.config import ConfigError

HALF = ("bf16", "fp16")


PRETRAIN_KEYS = ("deepspeed.grad_accum_dtype", "deepspeed.zero_stage")


def accumulation_dtype(wanted: str, precision: str, accum: int, zero_stage: int,
                       keys: tuple[str, str] = PRETRAIN_KEYS, where: str = "") -> Optional[str]:
    """DeepSpeed's ``data_types.grad_accum_dtype`` for this run, or None to leave it unset (the
    model's dtype, which is then the wanted one or the only one). ``keys``: the settings of the
    dtype and the ZeRO stage that the refusal at ZeRO-0 names, ``where`` where they are."""
    if precision not in HALF or accum == 1 or wanted == precision:
        return None
    if zero_stage == 0:
        dtype_key, stage_key = keys
        raise ConfigError(
            f"{where}{dtype_key}={wanted} needs ZeRO stage 1-3: at ZeRO-0 DeepSpeed sums a step's "
            f"{accum} micro-batch gradients in {precision} only; set {stage_key}=1, or "
            f"{dtype_key}={precision} to accept that")
    return wanted


def summed_in(ds_config: dict, precision: str) -> str:
    """The dtype a DeepSpeed config has the micro-batches' gradients summed in."""
    return ds_config.get("data_types", {}).get("grad_accum_dtype", precision)


@contextlib.contextmanager
def keep_zero1_optimizer():
    """While ``deepspeed.initialize`` runs: a ZeRO-1 engine under bf16 with fp32 accumulation
    keeps DeepSpeed's ZeRO optimizer (its fp32 ``grad_accum`` path) instead of being given
    DeepSpeed's ``BF16_Optimizer``. Nothing else about DeepSpeed's choice changes."""
    from deepspeed.runtime import engine as ds_engine

    own = ds_engine.DeepSpeedEngine._do_optimizer_sanity_check

    def check(self, basic_optimizer):
        wrapper = own(self, basic_optimizer)
        if wrapper == ds_engine.BFLOAT16 and self.zero_optimization_stage() == 1:
            return ds_engine.ZERO_OPTIMIZATION
        return wrapper

    ds_engine.DeepSpeedEngine._do_optimizer_sanity_check = check
    try:
        yield
    finally:
        ds_engine.DeepSpeedEngine._do_optimizer_sanity_check = own

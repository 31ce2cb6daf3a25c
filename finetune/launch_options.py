"""What the launcher asks of a fine-tune's Accelerator, checked against the run's config before
anything starts.

``accelerate launch`` passes its choices (flags, or the file of ``accelerate config``) to every
rank in ``ACCELERATE_*`` variables, which a torchrun job may set itself; the Accelerator reads
them where the program does not say otherwise. Four of them would not do here what they say,
so a run they reach stops at its start, in one line that names the way out:

* ``mixed_precision``: the run's ``train.precision`` decides (the backend passes it to the
  Accelerator, which then ignores the variable). A launcher asking for another precision would
  be ignored silently, so it is refused; ``no`` (also what ``accelerate launch`` writes when
  given nothing) leaves it to ``train.precision``.
* ``dynamo_backend``: Accelerate would wrap the model in ``torch.compile``'s module, whose state
  dict names every tensor ``_orig_mod.*``: the checkpoints would hold those names and the
  exports at the end of the run would fail. ``train.compile`` compiles the same model in place.
* ``gradient_accumulation_steps`` (without DeepSpeed, whose config is checked against the run's
  in :mod:`finetune.accelerate_deepspeed`): the backend accumulates ``train.grad_accum_steps``
  micro-batches itself and divides each loss by their count; Accelerate would divide it again,
  and the updates would shrink by its count without a word.
* FSDP on a machine without GPUs: Accelerate shards only on GPUs and would train under DDP,
  unsharded, without a word. DeepSpeed ZeRO-3 shards on CPU ranks too
  (:mod:`finetune.accelerate_deepspeed`).
"""
from __future__ import annotations

import os

from pretrain.config import ConfigError

# Accelerate's names for the precisions the pipeline trains in (train.precision)
PRECISIONS = {"no": "fp32", "fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


def check(precision: str, on_gpu: bool) -> None:
    """Raise ConfigError where the launcher asks for what this fine-tune would not do."""
    asked = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if asked != "no" and PRECISIONS.get(asked) != precision:
        way = (f"set train.precision={PRECISIONS[asked]}, or launch with --mixed_precision no"
               if asked in PRECISIONS else "launch with --mixed_precision no and choose "
               "train.precision (bf16, fp16 or fp32)")
        raise ConfigError(f"the launcher asks for mixed precision {asked} (accelerate launch "
                          f"--mixed_precision or its config file), but the run's precision "
                          f"comes from train.precision, which is {precision}; {way}")
    dynamo = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower()
    if dynamo != "no":
        raise ConfigError(f"the launcher asks Accelerate to compile the model (dynamo_backend="
                          f"{dynamo}), which would rename its tensors _orig_mod.* in checkpoints "
                          f"and exports; set train.compile=true instead (the same compile, in "
                          f"place) and launch with --dynamo_backend no")
    accum = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1").strip() or "1"
    if accum != "1" and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        raise ConfigError(f"the launcher asks Accelerate to accumulate gradients over {accum} "
                          f"micro-batches (its ACCELERATE_GRADIENT_ACCUMULATION_STEPS), which "
                          f"would scale every update down by {accum}: "
                          f"the run accumulates train.grad_accum_steps itself; set "
                          f"train.grad_accum_steps={accum} and launch without it")
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not on_gpu:
        raise ConfigError("the launcher asks for FSDP, which Accelerate runs on GPUs only (here it "
                          "would train under DDP, unsharded); launch without it on this machine, "
                          "or shard on CPU ranks under DeepSpeed ZeRO-3: accelerate launch "
                          "--config_file configs/accelerate/deepspeed_zero2.yaml --zero_stage 3")

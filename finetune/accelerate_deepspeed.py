"""Fine-tuning under an Accelerate DeepSpeed config (``accelerate launch --config_file X`` where X
says ``distributed_type: DEEPSPEED``, or ``--use_deepspeed``; under torchrun, Accelerate's
``ACCELERATE_USE_DEEPSPEED=true`` and ``ACCELERATE_DEEPSPEED_*`` variables), on GPUs and CPUs.

Three things that Accelerate alone gets wrong or leaves to its user:

* Its DeepSpeed plugin hands the DeepSpeed config to ``transformers`` (a weak reference that
  transformers' ``from_pretrained`` reads to build models under ZeRO-3), importing transformers
  to do so whether or not it is installed: without it every such launch ended at start with
  ``PackageNotFoundError: No package metadata was found for transformers`` (Accelerate 1.15;
  under ZeRO-3, whose ``zero3_init_flag`` is on by default, with "it requires Transformers").
  The models here are timm's, built by this project, and nothing reads that reference, so
  where transformers is not installed the hand-over is skipped (:func:`accelerator`).
* On a machine without GPUs, Accelerate told to use the CPU drops the DeepSpeed config and runs
  DDP, silently; not told, it starts DeepSpeed's process group but counts a world of one. Naming
  the process group's backend (gloo) gives DeepSpeed on CPU ranks, as pretraining has.
* The run's batch layout, clipping and precision go into the DeepSpeed config, and its micro-batch
  gradients are summed in fp32 under bf16/fp16 as in pretraining (:mod:`pretrain.grad_accum`):
  :func:`fill_deepspeed_values`. Under ZeRO-3 the shards are gathered for the exports.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
from typing import Optional

from pretrain.config import ConfigError
from pretrain.deepspeed_json import refuse_gc_setting, without_throughput_timer, zero_stage
from pretrain.distributed import world_of_one_unless_launched
from pretrain.grad_accum import HALF, accumulation_dtype

WHERE = "Accelerate's DeepSpeed config"


def requested() -> bool:
    """Whether the run is to use DeepSpeed: ``accelerate launch`` given a DeepSpeed config says
    so to its ranks in this variable, which a torchrun job may also set itself."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def accelerator(on_gpu: bool, mixed_precision: str):
    """The run's ``accelerate.Accelerator``. On CPUs several processes (gloo) are ranks of one
    run only when Accelerate is told to use the CPU (DDP) or, under a DeepSpeed config, given
    gloo; otherwise each ``torchrun`` process would train alone."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    deepspeed = requested()
    if deepspeed:
        world_of_one_unless_launched()
    options = {} if on_gpu else (
        {"kwargs_handlers": [InitProcessGroupKwargs(backend="gloo")]} if deepspeed
        else {"cpu": True})
    with _without_transformers_handover():
        return Accelerator(mixed_precision=mixed_precision, **options)


@contextlib.contextmanager
def _without_transformers_handover():
    from accelerate.utils import DeepSpeedPlugin

    own = getattr(DeepSpeedPlugin, "set_deepspeed_weakref", None)
    if own is None or importlib.util.find_spec("transformers") is not None:
        yield
        return

    DeepSpeedPlugin.set_deepspeed_weakref = lambda plugin: None
    try:
        yield
    finally:
        DeepSpeedPlugin.set_deepspeed_weakref = own


def fill_deepspeed_values(ds_config: dict, micro: int, accum: int, world: int,
                          grad_clip: Optional[float], precision: str) -> None:
    """Put this run's batch layout, clipping and precision into an Accelerate DeepSpeed config
    (in place): its "auto" values (and absent ones) become ours. A value it fixes to something
    else is refused: DeepSpeed would step, divide the loss, clip and compute by those numbers,
    not the run's. Accelerate itself puts gradient_accumulation_steps=1 where a JSON file has
    none, and bf16/fp16 from train.precision where the file says "auto" or nothing; a fixed
    bf16.enabled or fp16.enabled it keeps, silently, whatever train.precision says. The
    micro-batch gradients are summed in fp32 under bf16/fp16 unless the config's
    ``data_types.grad_accum_dtype`` says otherwise. DeepSpeed's throughput timer goes off unless
    the config sets it, as in pretraining."""
    # as in pretraining's DeepSpeed file (pretrain/deepspeed_json.py): ours, from this config
    owned = sorted(set(ds_config) & {"optimizer", "scheduler"})
    if owned:
        raise ConfigError(f"{WHERE} sets {owned}, which come from this config (optimizer.*, "
                          f"schedule.*); remove them from that config")
    refuse_gc_setting(ds_config, WHERE, "that config")
    for dtype in HALF:
        section = ds_config.setdefault(dtype, {})
        given, ours = section.get("enabled", "auto"), precision == dtype
        if given == "auto":
            section["enabled"] = ours
        elif str(given).lower() != str(ours).lower():
            raise ConfigError(f"{WHERE} has {dtype}.enabled={given}, but this run's "
                              f"train.precision is {precision}; set {dtype}.enabled to \"auto\" "
                              f"in that config")
    wanted = {"train_batch_size": (micro * accum * world, "train.global_batch_size"),
              "train_micro_batch_size_per_gpu": (micro, "train.micro_batch_size"),
              "gradient_accumulation_steps": (accum, "train.grad_accum_steps"),
              "gradient_clipping": (grad_clip or 0.0, "optimizer.grad_clip")}  # 0: no clipping
    for key, (value, ours) in wanted.items():
        given = ds_config.get(key, "auto")
        if given == "auto":
            ds_config[key] = value
        elif given != value:
            raise ConfigError(f"{WHERE} has {key}={given} (from its file or Accelerate's "
                              f"default), but this run's {ours} gives {value}; set {key} to "
                              f"\"auto\" in that config")
    types = dict(ds_config.get("data_types") or {})
    given = types.pop("grad_accum_dtype", "auto")
    if given not in ("auto", "fp32", precision):
        raise ConfigError(f"{WHERE} has data_types.grad_accum_dtype={given}, but this run's "
                          f"train.precision is {precision}; set it to \"fp32\" or \"auto\"")
    summed = accumulation_dtype("fp32" if given == "auto" else given, precision, accum,
                                zero_stage(ds_config), where=f"{WHERE}: ",
                                keys=("data_types.grad_accum_dtype", "zero_optimization.stage"))
    if summed:  # otherwise the model's dtype: the one asked for, or fp32 itself
        types["grad_accum_dtype"] = summed
    if types or "data_types" in ds_config:
        ds_config["data_types"] = types
    if zero_stage(ds_config) == 3:
        # the exports (best, final) need the whole model: Accelerate gathers ZeRO-3's shards only
        # with this on, and `accelerate config` writes it off; it costs nothing until an export
        ds_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    without_throughput_timer(ds_config)

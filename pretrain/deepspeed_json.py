"""The DeepSpeed JSON a pretraining run hands to ``deepspeed.initialize``: a file from
configs/deepspeed/ or the inline ZeRO stage, with what our config owns (batch layout, precision,
clipping, the gradients' accumulation dtype) always taken from it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from pretrain.config import ConfigError, PretrainConfig
from pretrain.grad_accum import accumulation_dtype

DEEPSPEED_CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "deepspeed"
# ZeRO-1 when neither deepspeed.zero_stage nor a deepspeed.config file says: the optimizer
# states sharded, the rest replicated; no cost on one GPU, memory saved on many.
DEFAULT_ZERO_STAGE = 1


def refuse_gc_setting(ds: dict, where: str, holder: str) -> None:
    """DeepSpeed's disable_python_gc would keep the collector off for the application to run it
    at points of its choosing; the launchers of both stages have their own way
    (pretrain/interpreter.py), which would silently turn it on again."""
    if ds.get("disable_python_gc"):
        raise ConfigError(f"{where} sets disable_python_gc, but the launchers manage Python's "
                          f"garbage collector themselves (off while a run starts, what lives "
                          f"for the whole run frozen out of it from the first step); remove the "
                          f"key from {holder}")


def json_path(name: str) -> Optional[Path]:
    """Where the file ``deepspeed.config`` names is: as given, else in configs/deepspeed/."""
    for path in (Path(name), DEEPSPEED_CONFIGS / name):
        if path.is_file():
            return path
    return None


def user_deepspeed_json(cfg: PretrainConfig) -> Optional[dict]:
    """The file ``deepspeed.config`` names (from configs/deepspeed/ when not found as given),
    or None; refused when it sets what our config owns. Read when the backend is made, so a
    bad file fails before any data or model work."""
    name = cfg.deepspeed.config
    if not name:
        return None
    path = json_path(name)
    if path is None:
        raise ConfigError(f"config key 'deepspeed.config': file '{name}' not found "
                          f"(looked in . and {DEEPSPEED_CONFIGS})")
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"config key 'deepspeed.config': '{path}' cannot be read as JSON "
                          f"({e}); fix the file") from None
    if not isinstance(out, dict):
        raise ConfigError(f"config key 'deepspeed.config': '{path}' holds no JSON object; "
                          f"write the DeepSpeed config as {{\"zero_optimization\": ...}}")
    # these come from our config in every run; left in the file they would silently win
    # over it (a scheduler section replaces schedule.*) or outlive it (a clipping value
    # with optimizer.grad_clip=null)
    owned = sorted(set(out) & {"optimizer", "scheduler", "gradient_clipping", "bf16", "fp16",
                               "train_batch_size", "train_micro_batch_size_per_gpu",
                               "gradient_accumulation_steps", "data_types"})
    if owned:
        raise ConfigError(f"config key 'deepspeed.config': '{path}' sets {owned}, which come "
                          f"from this config (optimizer.*, schedule.*, train.*, "
                          f"deepspeed.grad_accum_dtype); remove them from the file")
    refuse_gc_setting(out, f"config key 'deepspeed.config': '{path}'", "the file")
    if "steps_per_print" in out:  # DeepSpeed's INFO lines are not shown: it would do nothing
        raise ConfigError(f"config key 'deepspeed.config': '{path}' sets steps_per_print, but "
                          f"the run prints its own progress line (every log.every_steps) "
                          f"instead of DeepSpeed's; remove the key from the file")
    # the file decides the stage; one also given as deepspeed.zero_stage must agree with it,
    # and a file without one runs deepspeed.zero_stage or the default (DeepSpeed's own is 0)
    given = cfg.deepspeed.zero_stage
    zero = out.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"config key 'deepspeed.config': '{path}' has a zero_optimization "
                          f"that is no JSON object; write it as {{\"stage\": 1, ...}}")
    stage = zero.setdefault("stage", DEFAULT_ZERO_STAGE if given is None else given)
    if given is not None and given != stage:
        raise ConfigError(f"deepspeed.zero_stage={given} but deepspeed.config '{path}' runs "
                          f"ZeRO-{stage}; drop deepspeed.zero_stage, or set "
                          f"zero_optimization.stage in the file")
    return out


def deepspeed_config(cfg: PretrainConfig, micro: int, accum: int, world: int) -> dict:
    """The DeepSpeed JSON: a file from configs/deepspeed/ (``deepspeed.config``) or the inline
    ZeRO stage, with batch, precision, clipping and the gradients' accumulation dtype always
    taken from our config."""
    ds = cfg.deepspeed
    out = user_deepspeed_json(cfg)
    if out is None:
        # Overlapping the gradient reduction with backward, and copying every gradient into
        # one contiguous buffer for it, pay off only when there is someone to reduce with: in
        # a world of one they are pure per-step cost (measured on the CPU with `benchmark.py
        # overhead`: ~35 ms of a 190 ms ViT-Tiny step) and change no result.
        many = world > 1
        stage = DEFAULT_ZERO_STAGE if ds.zero_stage is None else ds.zero_stage
        out = {"zero_optimization": {"stage": stage, "overlap_comm": many,
                                     "contiguous_gradients": many}}
    out.update(
        train_batch_size=micro * accum * world,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=accum,
        steps_per_print=10 ** 9,  # our own metrics line replaces DeepSpeed's
        zero_allow_untested_optimizer=True,
    )
    if cfg.optimizer.grad_clip:
        out["gradient_clipping"] = cfg.optimizer.grad_clip
    without_throughput_timer(out)
    precision = cfg.train.precision
    out["bf16"] = {"enabled": precision == "bf16"}
    # loss_scale 0 = dynamic loss scaling
    out["fp16"] = {"enabled": precision == "fp16", "loss_scale": 0, "initial_scale_power": 16}
    summed = accumulation_dtype(ds.grad_accum_dtype, precision, accum, zero_stage(out))
    if summed:
        out["data_types"] = {"grad_accum_dtype": summed}
    return out


def without_throughput_timer(ds_config: dict) -> None:
    """Turn DeepSpeed's throughput timer off (in place) unless the config sets it. The timer
    waits for the device at every forward and after every step (``get_accelerator()
    .synchronize()``) for figures it prints only every ``steps_per_print``: the GPU runs dry at
    each micro-batch while the host starts the next. ``pretrain.throughput`` measures instead.
    Both stages' DeepSpeed configs go through here."""
    ds_config.setdefault("timers", {}).setdefault("throughput", {"enabled": False})


def zero_stage(ds_config: dict) -> int:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))

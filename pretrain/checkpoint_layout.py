"""A relaunch with another world size, ZeRO stage or precision than its checkpoint's, in either
stage: what DeepSpeed's files of the checkpoint need.

DeepSpeed names and shards its files for the ranks, ZeRO stage and precision that wrote them.
Where that layout changed, the checkpoint is read as written (ZeRO-1 <-> ZeRO-2, which write
the same files; another world size without ZeRO, whose one model file holds the whole state),
converted first through DeepSpeed's universal checkpoint (``ds_to_universal``:
:meth:`pretrain.checkpoint.CheckpointStore.prepare_universal`), or refused at the start in one
line where DeepSpeed cannot convert it (:func:`unconvertible`: measured, every case). Used by
pretraining's :class:`pretrain.engine.DeepSpeedBackend`, the fine-tune's
:class:`finetune.backend.AccelerateBackend` under an Accelerate DeepSpeed config, and the
``--dry-run`` plan.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from torch import nn

from pretrain.config import ConfigError


def saved_precision(ckpt, now: str, files: Optional[Path] = None) -> str:
    """The train.precision ``ckpt`` was saved in; for a manifest from before it was kept, what
    DeepSpeed's files (in ``files``, else the checkpoint's folder) tell: it names a bf16 run's
    optimizer states bf16_*, fp16's and fp32's alike (``now`` when that cannot tell them
    apart). Shared with the fine-tune under an Accelerate DeepSpeed config."""
    if ckpt.precision is not None:
        return ckpt.precision
    if any((files or ckpt.path).glob("bf16_*optim_states.pt")):
        return "bf16"
    return now if now != "bf16" else "fp32 or fp16"


def allow_universal(model: nn.Module) -> None:
    """Let DeepSpeed's ds_to_universal convert the checkpoints DeepSpeed writes of ``model``
    (both stages') for another world size, ZeRO stage or precision; a plain data-parallel model
    needs no tensor-parallel patterns, only the format version."""
    from deepspeed.checkpoint.constants import (UNIVERSAL_CHECKPOINT_INFO,
                                                UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                                UNIVERSAL_CHECKPOINT_VERSION_VALUE)
    setattr(model, UNIVERSAL_CHECKPOINT_INFO,
            {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE})


def load_universal(ds_config: dict) -> None:
    """Have DeepSpeed load the universal checkpoint made for a relaunch on another layout (in
    place), the config's other checkpoint settings (``tag_validation``, say) kept."""
    ds_config["checkpoint"] = {**(ds_config.get("checkpoint") or {}), "load_universal": True}


def layout_changes(ckpt, world_size: int, stage: int, precision: str,
                   files: Optional[Path] = None) -> str:
    """Why DeepSpeed's files of ``ckpt`` are read through its universal layout ("" when they
    are not): they name and shard the state for the ranks, ZeRO stage and precision that wrote
    them (an fp32 checkpoint resumed in bf16 failed on a missing file). ZeRO-1 and ZeRO-2 write
    the same files, sharded alike: between the two no conversion is needed; nor on another
    world size without ZeRO, whose one model file holds the whole state. ``files``: where they
    are, when not in the checkpoint's folder itself."""
    saved = saved_precision(ckpt, precision, files)
    return ", ".join(what for what, changed in (
        (f"world size changed ({ckpt.world_size} -> {world_size} ranks)",
         ckpt.world_size != world_size and (ckpt.zero_stage, stage) != (0, 0)),
        (f"ZeRO stage changed ({ckpt.zero_stage} -> {stage})",
         ckpt.zero_stage != stage and {ckpt.zero_stage, stage} != {1, 2}),
        (f"precision changed ({saved} -> {precision})", saved != precision),
    ) if changed)


# SGD's state: DeepSpeed's ds_to_universal extracts Adam's moments (exp_avg, exp_avg_sq) by name
# and failed on SGD's with a KeyError, but its merging of the ranks' flat partitions is the same
# for any tensor shaped as the fp32 weights, and its ZeRO-1/2 load takes every file it finds
# (``<key>.pt``) as the optimizer state of that name. So SGD's momentum goes through in Adam's
# first slot (:func:`momentum_as_adam`) and is renamed back after (:func:`momentum_back`).
MOMENTUM = "momentum_buffer"


def momentum_as_adam(src: Path, staging: Path) -> Optional[bool]:
    """When DeepSpeed's files in ``src`` hold SGD's state: a copy of them in ``staging`` that
    ds_to_universal converts (the momentum as ``exp_avg``, ``exp_avg_sq`` a placeholder), and
    whether there was a momentum (SGD with momentum 0 keeps none); None for Adam's, which
    DeepSpeed converts as they are. The files were screened by the caller."""
    import torch
    from deepspeed.checkpoint.constants import (BASE_OPTIMIZER_STATE, OPTIMIZER_STATE_DICT,
                                                SINGLE_PARTITION_OF_FP32_GROUPS)
    files = sorted(src.glob("*optim_states.pt"))
    held = None
    for f in files:
        saved = torch.load(f, map_location="cpu", weights_only=False)
        optim = saved[OPTIMIZER_STATE_DICT]
        if BASE_OPTIMIZER_STATE not in optim:  # ZeRO-3's layout: AdamW's only (unconvertible)
            return None
        groups = optim[BASE_OPTIMIZER_STATE]["state"]  # torch's: {group index: state}
        if all("exp_avg" in state for state in groups.values()):
            return None
        for g, state in groups.items():
            buffer = state.pop(MOMENTUM, None)
            held = buffer is not None
            moved = buffer if held else torch.zeros_like(optim[SINGLE_PARTITION_OF_FP32_GROUPS][g])
            state.update(exp_avg=moved, exp_avg_sq=moved)
        staging.mkdir(parents=True, exist_ok=True)
        torch.save(saved, staging / f.name)
    for f in src.iterdir():
        if f.is_file() and f not in files:
            (staging / f.name).symlink_to(f.resolve())
    return held


def momentum_back(universal: Path, held: bool) -> None:
    """Undo :func:`momentum_as_adam` in the converted checkpoint ``universal``: per parameter,
    the momentum under its own name, the placeholder gone."""
    for param in (universal / "zero").iterdir():
        if param.is_dir():
            (param / "exp_avg_sq.pt").unlink()
            if held:
                (param / "exp_avg.pt").rename(param / f"{MOMENTUM}.pt")
            else:
                (param / "exp_avg.pt").unlink()


def unconvertible(ckpt, why: str, stage: int, optimizer: str,
                  files: Optional[Path] = None) -> str:
    """Why the conversion a changed layout needs (``why``, from :func:`layout_changes`) cannot
    be done, or "". Measured with DeepSpeed 0.19 on CPU ranks, every change of world size,
    ZeRO stage and precision: its universal checkpoint is made from the optimizer-state files
    ZeRO-1..3 write, so not without ZeRO, which keeps the optimizer in the model file ("can't
    find *_optim_states.pt files"); it loads into the ZeRO stage that wrote it (after a change
    of world size or precision) or between ZeRO-1 and ZeRO-2, but a change to or from ZeRO-0 or
    ZeRO-3 fails in DeepSpeed (a bare AssertionError, "'NoneType' object has no attribute
    'copy'"); and its ZeRO-3 load takes Adam's moments only (ZeRO-1/2's takes SGD's momentum
    too: :func:`momentum_as_adam`)."""
    if not why:
        return ""
    if ckpt.zero_stage != stage and {ckpt.zero_stage, stage} != {1, 2}:
        return f"{why}; DeepSpeed converts a checkpoint between ZeRO-1 and ZeRO-2 only"
    if not any((files or ckpt.path).glob("*optim_states.pt")):
        return f"{why}; DeepSpeed cannot convert a checkpoint written without ZeRO (its " \
               f"optimizer state is in the model file)"
    if optimizer != "adamw" and 3 in (ckpt.zero_stage, stage):
        return f"{why}; DeepSpeed's ZeRO-3 loads AdamW's state from a converted checkpoint, " \
               f"not {optimizer.upper()}'s momentum"
    return ""


def conversion(ckpt, world_size: int, stage: int, precision: str, optimizer: str,
               files: Optional[Path] = None, under: str = "", marked: bool = True) -> str:
    """Why DeepSpeed's files of ``ckpt`` are converted before they are loaded ("" when they are
    read as written); raises the one-line refusal where they cannot be. Shared by both stages'
    runs and the ``--dry-run`` plan. ``files``: where they are (the fine-tune's
    ``pytorch_model/``); ``under``: the layout the refusal names; ``marked``: whether the model
    that wrote them was marked for ``ds_to_universal`` (a fine-tune's was not before its
    manifests kept the precision)."""
    why = layout_changes(ckpt, world_size, stage, precision, files)
    refused = unconvertible(ckpt, why, stage, optimizer, files) or (
        f"{why}; it was written before a fine-tune's checkpoints could be converted"
        if why and not marked else "")
    if refused:
        raise unresumable(ckpt, refused,
                          as_written(ckpt, saved_precision(ckpt, precision, files), under))
    return why


def ranks(n: int) -> str:
    return f"{n} rank{'s' if n > 1 else ''}"


def as_written(ckpt, precision: Optional[str], under: str = "", zero: bool = True) -> str:
    """The layout ``ckpt`` was written in, for the refusal's way out."""
    return ", ".join(filter(None, (under, zero and f"ZeRO-{ckpt.zero_stage}",
                                   ranks(ckpt.world_size),
                                   precision and f"train.precision={precision}")))


def unresumable(ckpt, reason: str, written: str) -> ConfigError:
    """The one-line refusal of a checkpoint this job cannot load, either stage's: every rank
    reads the same manifest and decides alike, so rank 0 alone prints it."""
    from pretrain.distributed import agreed
    return agreed(ConfigError(
        f"{ckpt.path} cannot be resumed by this job ({reason}): relaunch as it was written "
        f"({written}), or set checkpoint.resume=false to start a new run there (this one is "
        f"moved aside)"))

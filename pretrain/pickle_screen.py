"""Screening a checkpoint before anything unpickles it.

DeepSpeed unpickles checkpoints with ``weights_only=False``. Before it reads one, every file
under the checkpoint directory that could be a pickle -- at any depth, so a universal checkpoint's
``zero/<param>/*.pt`` too -- is scanned by ``torch.serialization.get_unsafe_globals_in_checkpoint``,
which executes nothing, and a reference to any Python object outside a short list of known, inert
types is refused with :class:`pretrain.checkpoint.CheckpointError`. Fine-tune checkpoints are read
with ``weights_only=True``, except the model directory Accelerate leaves to DeepSpeed, which is
screened the same way.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from pretrain.checkpoint import CheckpointError

# Python objects a DeepSpeed checkpoint of this project may reference in its pickles: numpy's
# array reconstruction (the RNG state in the client state) and inert DeepSpeed records.
_SAFE_GLOBAL_PATTERNS = (
    r"numpy\.(_core|core)\.multiarray\._reconstruct", r"numpy\.ndarray", r"numpy\.dtype",
    r"numpy\.dtypes\.\w+DType", r"numpy\.(_core|core)\.multiarray\.scalar",
    r"deepspeed\.runtime\.fp16\.loss_scaler\.(LossScaler|DynamicLossScaler)",
    r"deepspeed\.runtime\.zero\.config\.ZeroStageEnum",
    r"deepspeed\.utils\.tensor_fragment\.fragment_address",
    r"collections\.OrderedDict", r"torch\.Size",
)
_SAFE_GLOBAL_RE = re.compile("|".join(f"(?:{p})" for p in _SAFE_GLOBAL_PATTERNS) + r"\Z")

# Files screened whatever they start with: the suffixes torch, DeepSpeed and Accelerate give
# their pickles. Any other file is screened too when it starts like one (torch.save's zip, or a
# bare pickle of protocol 2 or later): a file's name is no promise of what is in it.
_PICKLE_SUFFIXES = frozenset({".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt"})
_PICKLE_MAGIC = (b"PK\x03\x04", b"\x80")


def check_pickles_are_inert(ckpt: Path) -> None:
    """Refuse a checkpoint whose pickles reference anything but known, inert types: DeepSpeed's
    loaders will unpickle them with ``weights_only=False``. Every file under ``ckpt`` that could
    be a pickle is read, at any depth: a universal checkpoint keeps its tensors in
    ``zero/<param>/*.pt``."""
    if not hasattr(torch.serialization, "get_unsafe_globals_in_checkpoint"):
        raise CheckpointError(f"cannot screen '{ckpt}' before DeepSpeed unpickles it: torch "
                              f"{torch.__version__} lacks get_unsafe_globals_in_checkpoint; "
                              f"install torch>=2.6")
    fix = f"remove '{ckpt}' or restore it from a copy you trust, then run again"
    try:
        files = _pickle_files(ckpt)
    except OSError as e:
        raise CheckpointError(f"cannot screen '{ckpt}' before DeepSpeed unpickles it: "
                              f"{type(e).__name__}: {e}") from None
    for f in files:
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(f)
        except Exception as e:  # noqa: BLE001 - whatever it is, it cannot be shown to be inert
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise CheckpointError(f"'{f}' is not a readable torch checkpoint ({first}); refusing "
                                  f"to let DeepSpeed unpickle it: {fix}") from None
        bad = sorted(n for n in names if not _SAFE_GLOBAL_RE.match(n))
        if bad:
            raise CheckpointError(
                f"'{f}' references Python objects {bad[:3]} that a DeepSpeed checkpoint of this "
                f"project never holds; refusing to unpickle it (DeepSpeed's loader would run "
                f"them): {fix}")


def _pickle_files(top: Path) -> list[Path]:
    """Every file under ``top`` that is named or starts like a pickle. Symbolic links are
    followed, as DeepSpeed's loader follows them (a directory met twice is read once)."""
    out, seen = [], set()
    for dirpath, dirnames, filenames in os.walk(top, onerror=_raise, followlinks=True):
        st = os.stat(dirpath)
        if (st.st_dev, st.st_ino) in seen:
            dirnames[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirnames.sort()
        for name in sorted(filenames):
            f = Path(dirpath, name)
            if f.suffix in _PICKLE_SUFFIXES or _starts_like_pickle(f):
                out.append(f)
    return out


def _starts_like_pickle(f: Path) -> bool:
    try:
        with open(f, "rb") as fh:
            return fh.read(4).startswith(_PICKLE_MAGIC)
    except OSError:  # a dangling link, say: DeepSpeed cannot read it either
        return False


def _raise(e: OSError) -> None:
    raise e

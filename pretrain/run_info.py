"""What a run records about itself, for MLflow and the files next to its weights: the config
as flat params, the commit the code ran from, the software environment, a picture of what the
model sees, and the tags that link a fine-tune to the pretraining it started from."""
from __future__ import annotations

import io
import math
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Optional


def flatten(tree: Mapping, prefix: str = "") -> dict[str, str]:
    """``{"optimizer": {"lr": 1e-3}}`` -> ``{"optimizer.lr": "0.001"}`` (MLflow params are text)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


def git_info(root: Path) -> dict[str, str]:
    """Commit and dirty flag of the checkout the code runs from (empty outside a checkout)."""
    def git(*args):
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=20, check=True).stdout.strip()
    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {}
    # mlflow.source.git.commit is the tag the UI shows in the run's header
    return {"git.commit": commit, "git.dirty": str(dirty).lower(),
            "mlflow.source.git.commit": commit}


def source_tags() -> dict[str, str]:
    """Who ran what, in the tags MLflow's UI shows as a run's User and Source columns: MLflow's
    own context tags (``mlflow.start_run`` sets them; runs made through the client get none)."""
    try:
        from mlflow.tracking.context.registry import resolve_tags
        return {k: str(v) for k, v in resolve_tags().items()
                if k in ("mlflow.user", "mlflow.source.name", "mlflow.source.type")}
    except Exception:  # noqa: BLE001 -- an MLflow without it: the columns stay blank
        return {}


def environment() -> dict:
    """Interpreter, platform, accelerator and every installed distribution's version."""
    from importlib import metadata

    import torch
    env = {"python": sys.version.split()[0], "platform": platform.platform(),
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    env["packages"] = dict(sorted((d.metadata["Name"] or "?", d.version)
                                  for d in metadata.distributions()))
    return env


def sample_grid_png(images, max_images: int = 64, min_tile: int = 96) -> bytes:
    """uint8 (B, 3, H, W) -> PNG bytes of a square-ish grid (small images scaled up, nearest)."""
    import numpy as np
    from PIL import Image

    arr = images[:max_images].detach().cpu().numpy() if hasattr(images, "detach") \
        else np.asarray(images[:max_images])
    n, _, h, w = arr.shape
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    scale = max(1, math.ceil(min_tile / max(h, w)))
    th, tw, pad = h * scale, w * scale, 2
    grid = Image.new("RGB", (cols * (tw + pad) + pad, rows * (th + pad) + pad), (255, 255, 255))
    for i in range(n):
        tile = Image.fromarray(np.ascontiguousarray(arr[i].transpose(1, 2, 0)).astype(np.uint8))
        tile = tile.resize((tw, th), Image.NEAREST)
        grid.paste(tile, (pad + (i % cols) * (tw + pad), pad + (i // cols) * (th + pad)))
    buf = io.BytesIO()
    grid.save(buf, format="PNG")
    return buf.getvalue()


# the MLflow store the pretraining run is in, where its output_dir tells (its tracking/run.json)
PARENT_STORE = "pretrain.tracking_uri"


def lineage_tags(pretrain_run_id: Optional[str], checkpoint: os.PathLike | str,
                 step: Optional[int], nest: bool = True,
                 store: Optional[str] = None) -> dict[str, str]:
    """Tags a fine-tune run carries about the pretraining it starts from.

    Find every fine-tune of a pretraining run with the search filter
    ``tags.`pretrain.run_id` = '<id>'`` (UI search box or ``MlflowClient.search_runs``). With
    ``nest`` (and both runs in the same experiment) the UI shows the fine-tunes nested under it,
    where ``store``, that run's MLflow store when known, is the fine-tune's too.
    """
    from pretrain.spool import redacted
    tags = {"pretrain.checkpoint": str(checkpoint)}
    if step is not None:  # unknown for weights from elsewhere (.npz, a Hugging Face download)
        tags["pretrain.step"] = str(int(step))
    if pretrain_run_id:
        tags["pretrain.run_id"] = pretrain_run_id
        if nest:
            tags["mlflow.parentRunId"] = pretrain_run_id
        if store:
            tags[PARENT_STORE] = redacted(store)
    return tags


def dataset_name(root: Optional[str]) -> str:
    """The name in the shards' _info.json, else the directory's name."""
    from pretrain.data.info import read_info
    try:
        return read_info(root).name
    except Exception:  # noqa: BLE001 -- a tag is not worth failing over
        return Path(str(root or "?").rstrip("/")).name

"""Initialising a model from pretrained weights: ``load_init(model, init)``.

``init`` is a local path (no network access, ever), one of:

* ``deepspeed`` - a pretraining output dir (its newest complete checkpoint) or one DeepSpeed
  checkpoint dir, consolidated to fp32 by ``pretrain.consolidate.consolidate`` (zero-to-fp32);
* ``export``    - a file written by ``launch/export.py`` / ``pretrain.export.export_full``;
* ``state_dict``- any other safetensors / .pth / .bin file keyed like ``ViTClassifier``;
* ``timm``      - a timm ``VisionTransformer`` state dict (safetensors, .pth, .bin, .pt), as the
  Hugging Face hub ships them or ``export_timm_backbone`` writes them;
* ``npz``       - a Google ViT checkpoint: the vision_transformer layout (``Transformer/
  posembed_input``, ``MultiHeadDotProductAttention_1`` ...; ``opt/target/`` prefix allowed) or
  the big_vision layout (``params/`` prefix, ``pos_embedding``, ``MultiHeadDotProductAttention_0``,
  scanned ``encoderblock`` stacks), ``pre_logits`` and ``head`` included; converted by
  :mod:`finetune.google_npz`.

Every format is first turned into one state dict keyed like ``ViTClassifier.state_dict()``
(``backbone.<timm name>``, ``pre_logits.fc.*``, ``head.*``); one function then checks it against the
model, resamples the position embedding in 2-D to the model's grid (``timm.layers.
resample_abs_pos_embed``, bicubic; class-token position kept as is) and copies it in.

What is copied: the backbone always; ``pre_logits`` when the model has them (a model built with
``representation_size`` wants them pretrained; if the checkpoint has none, e.g. a timm backbone,
the model's own stay and the lineage lists them under ``new``); ``head`` only with
``with_head=True``. So the
paper's transfer is: build the fine-tuning model (no pre-logits, zero-initialised head for the new
classes - ``create_model`` with the fine-tune config, or ``ViTClassifier.swap_head``) and call
``load_init(model, init)``; the checkpoint's pre-logits and head are dropped. ``with_head=True``
re-loads a pretrained model whole.

A checkpoint that does not fit raises :class:`InitError` (a ``ConfigError``: the launchers print
it as one line) listing the tensors that differ. Untrusted files never run code: safetensors,
``torch.load(weights_only=True)``, ``numpy.load(allow_pickle=False)``; DeepSpeed directories are
screened as ``pretrain.export`` describes.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

import torch

from pretrain.config import ConfigError
from pretrain.checkpoint import CheckpointError
from pretrain.consolidate import resolve_checkpoint
from pretrain.export import BACKBONE_PREFIX, FULL_FORMAT, normalize_in, read_metadata
from pretrain.model import ViTClassifier

POS_EMBED = BACKBONE_PREFIX + "pos_embed"
_SHOWN = 6  # mismatched tensors named in the error; the rest are counted


class InitError(ConfigError):
    """``init`` cannot initialise this model; one line naming the file and what differs."""


@dataclass
class InitSource:
    """Pretrained weights in ViTClassifier key layout, with what is known about their origin."""

    format: str
    path: str
    state: dict  # ViTClassifier keys -> tensors
    step: Optional[int] = None
    pretrain_run_id: Optional[str] = None
    spec: Optional[dict] = None  # ViTSpec fields, when the file says
    extra: dict = field(default_factory=dict)
    # the data.normalize it was trained with, when known: the fine-tune must feed the same
    normalize: Optional[str] = None


# --------------------------------------------------------------------------------------------
# Position embeddings
# --------------------------------------------------------------------------------------------
def _grid_of(tokens: int, prefix: int) -> Optional[int]:
    g = math.isqrt(max(tokens - prefix, 0))
    return g if g * g == tokens - prefix and g > 0 else None


def resample_pos_embed(pos_embed: torch.Tensor, grid: int, num_prefix_tokens: int = 1
                       ) -> torch.Tensor:
    """(1, prefix + g*g, D) -> (1, prefix + grid*grid, D): the patch positions interpolated in
    2-D (bicubic, antialiased when shrinking: timm's defaults), prefix (class token) rows kept."""
    from timm.layers import resample_abs_pos_embed

    old = _grid_of(pos_embed.shape[1], num_prefix_tokens)
    if old is None:
        raise ValueError(f"position embedding of {pos_embed.shape[1]} tokens is not "
                         f"{num_prefix_tokens} prefix tokens + a square grid")
    if old == grid:
        return pos_embed
    out = resample_abs_pos_embed(pos_embed.float(), new_size=[grid, grid], old_size=[old, old],
                                 num_prefix_tokens=num_prefix_tokens)
    return out.to(pos_embed.dtype)


# --------------------------------------------------------------------------------------------
# Readers: each format -> InitSource
# --------------------------------------------------------------------------------------------
def _from_deepspeed(path: Path) -> InitSource:
    from dataclasses import asdict

    from pretrain.consolidate import consolidate

    c = consolidate(path)
    return InitSource("deepspeed", c.source, c.state_dict, c.step, c.tracking_run_id,
                      asdict(c.spec), normalize=normalize_in(c.config_yaml))


def _read_tensors(path: Path) -> tuple[dict, dict]:
    """(tensors, safetensors metadata) of a safetensors or torch file, safely."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        try:
            return load_file(str(path)), read_metadata(path)
        except Exception as e:  # noqa: BLE001 - a corrupt header is a user error
            raise InitError(f"init '{path}' is not a readable safetensors file ({e})") from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - weights_only refuses anything but tensors & containers
        if str(e).startswith("Weights only load failed"):
            # torch's own text invites loading it unsafely: not our advice to give
            found = re.search(r"nsupported (?:global: )?GLOBAL ([\w.]+)", str(e))
            what = f" ({found.group(1)})" if found else ""
            raise InitError(f"init '{path}' references Python objects{what}, which are never "
                            f"unpickled here; save its state_dict of tensors (safetensors or "
                            f"torch.save) and start from that") from None
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InitError(f"init '{path}' cannot be read as a weights-only torch file: "
                        f"{first}") from None
    if isinstance(obj, Mapping):  # training checkpoints nest the weights
        for key in ("state_dict", "model", "module", "model_state_dict", "params"):
            if isinstance(obj.get(key), Mapping):
                obj = obj[key]
                break
    tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)} \
        if isinstance(obj, Mapping) else {}
    if not tensors:
        raise InitError(f"init '{path}' holds no state dict of tensors")
    return tensors, {}


def _header(meta: dict, key: str):
    """``key`` of a file's header: export.py's own field, or a fine-tune export's model card."""
    if meta.get(key):
        return meta[key]
    try:
        return json.loads(meta.get("model_card") or "{}").get(key)
    except (ValueError, AttributeError):
        return None


def _run_id(meta: dict) -> Optional[str]:
    """The run that wrote the file."""
    return _header(meta, "tracking_run_id")


def _from_file(path: Path) -> InitSource:
    tensors, meta = _read_tensors(path)
    if all(k.startswith("module.") for k in tensors):  # saved from a DDP-wrapped model
        tensors = {k[len("module."):]: v for k, v in tensors.items()}
    ours = ("backbone.", "pre_logits.", "head.")
    if all(k.startswith(ours) for k in tensors):
        fmt = "export" if meta.get("format") == FULL_FORMAT else "state_dict"
        step = _header(meta, "step")
        return InitSource(fmt, str(path), tensors, int(step) if step else None,
                          _run_id(meta),
                          json.loads(meta["spec"]) if "spec" in meta else None,
                          extra={"source": meta["source"]} if "source" in meta else {},
                          normalize=normalize_in(meta.get("config")))
    state = {}
    for k, v in tensors.items():
        if k.startswith(("head.", "pre_logits.")):  # timm's classifier / pre-0.6 representation
            state[k] = v
        else:
            state[BACKBONE_PREFIX + k] = v
    step = _header(meta, "step")
    return InitSource("timm", str(path), state, int(step) if step else None,
                      _run_id(meta),
                      json.loads(meta["spec"]) if "spec" in meta else None,
                      normalize=meta.get("normalize"))  # (export.py --timm-backbone's)


def check_init(init: str | os.PathLike) -> str:
    """What kind of init ``init`` is (``timm folder``, ``deepspeed``, ``npz``, ``file``), from
    its name and layout alone; a one-line :class:`InitError` when it cannot be one. Cheap:
    ``--dry-run`` and the run's start check it before any data or model is touched."""
    text = str(init)
    if "://" in text or text.startswith(("hf-hub:", "hf_hub:")):
        raise InitError(f"init '{text}' must be a local file or directory (no downloads here); "
                        f"fetch it first, e.g. with huggingface-cli download")
    path = Path(text).expanduser()
    if not path.exists():
        hint = ""
        if text.lower() == "none":
            hint = " (no init, from scratch, is init=null)"
        elif not path.is_absolute():
            hint = f" in {Path.cwd()}"
            if path == Path("runs/demo"):  # configs/finetune/demo.yaml's, before the pretraining
                hint += ("; the demo fine-tune starts from the demo pretraining: run "
                         "'deepspeed launch/pretrain.py' first, or add init=null (from scratch)")
        raise InitError(f"init '{text}' not found{hint}")
    if path.is_dir() and (path / "config.json").is_file() and \
            (path / "model.safetensors").is_file():
        return "timm folder"  # timm's layout (export.py --out FOLDER, a Hugging Face download)
    if path.is_dir() and (path / "final.safetensors").is_file():
        raise InitError(f"init '{text}' is a fine-tune's output folder; start from one of its "
                        f"files: init={path / 'final.safetensors'} or {path / 'best.safetensors'}")
    if path.is_dir():
        try:  # its layout only: which checkpoint it names, nothing read (nor warned twice)
            resolve_checkpoint(path, warn=False)
        except CheckpointError as e:
            raise InitError(f"init '{text}': {e}") from None
        return "deepspeed"
    if re.fullmatch(r".*_(model|optim)_states\.pt", path.name):
        raise InitError(f"init '{text}' is one file of a DeepSpeed checkpoint; give its folder: "
                        f"init={path.parent}")
    if path.suffix == ".npz":
        return "npz"
    if path.suffix in (".safetensors", ".pth", ".pt", ".bin", ".ckpt"):
        return "file"
    raise InitError(f"init '{text}': unknown file type '{path.suffix}' (expected a directory, "
                    f".safetensors, .pth/.pt/.bin or .npz)")


def read_init(init: str | os.PathLike) -> InitSource:
    """Read ``init`` (any supported format) into ViTClassifier key layout, nothing copied yet."""
    kind, path = check_init(init), Path(str(init)).expanduser()
    if kind == "timm folder":
        from pretrain.timm_folder import normalize_of
        src = _from_file(path / "model.safetensors")
        try:  # its eval transform's mean and std: ours say which normalisation they are
            config = json.loads((path / "config.json").read_text())
            src.normalize = normalize_of(config.get("pretrained_cfg") or {})
            heads = (config.get("model_args") or {}).get("num_heads")
            if isinstance(heads, int):  # the attention's split, which no shape shows
                src.spec = {**(src.spec or {}), "num_heads": heads}
        except (OSError, ValueError, AttributeError):
            pass  # timm reports an unreadable config.json where it matters
        return src
    if kind == "deepspeed":
        try:
            return _from_deepspeed(path)
        except CheckpointError as e:
            raise InitError(f"init '{init}': {e}") from None
    if kind == "npz":
        from finetune.google_npz import read_npz
        return read_npz(path)
    return _from_file(path)


# --------------------------------------------------------------------------------------------
# Copying into the model
# --------------------------------------------------------------------------------------------
def _shape(t) -> str:
    return str(list(t.shape))


def _short(key: str) -> str:
    return key[len(BACKBONE_PREFIX):] if key.startswith(BACKBONE_PREFIX) else key


def _describe(model: ViTClassifier) -> str:
    s = model.spec
    return (f"{s.name} (width {s.embed_dim}, depth {s.depth}, patch {s.patch_size}, "
            f"{s.num_heads} heads, {s.img_size}px)")


def _describe_state(state: dict) -> str:
    """Width, depth and patch of a ViTClassifier-keyed state dict, as far as it tells."""
    b = BACKBONE_PREFIX
    parts = []
    if b + "cls_token" in state:
        parts.append(f"width {state[b + 'cls_token'].shape[-1]}")
    blocks = {int(k.split(".")[2]) for k in state if k.startswith(b + "blocks.")}
    parts.append(f"depth {len(blocks)}")
    if b + "patch_embed.proj.weight" in state:
        parts.append(f"patch {state[b + 'patch_embed.proj.weight'].shape[-1]}")
    return ", ".join(parts)


def _natural(key: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


def apply_init(model: ViTClassifier, src: InitSource, with_head: bool = False) -> dict:
    """Check ``src`` against ``model``, resample the position embedding, copy; returns lineage."""
    new, parts, fresh, pos_grids = _matched(model, src, with_head)
    with torch.no_grad():
        result = model.load_state_dict(new, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys  # only model keys were passed

    patch = src.state[BACKBONE_PREFIX + "patch_embed.proj.weight"].shape[-1]
    src_grid = pos_grids[0] if pos_grids else model.spec.grid
    resolution = (src.spec or {}).get("img_size") or src_grid * patch
    dropped = [p for p in ("pre_logits", "head")
               if p not in parts and any(k.startswith(p + ".") for k in src.state)]
    return {"format": src.format, "path": str(Path(src.path).resolve()), "step": src.step,
            "pretrain_run_id": src.pretrain_run_id, "resolution": int(resolution),
            "pos_embed_grid": pos_grids, "loaded": parts, "dropped": dropped, "new": fresh,
            "source_model": (src.spec or {}).get("name"), **src.extra}


def _matched(model: ViTClassifier, src: InitSource, with_head: bool) -> tuple:
    """(the tensors of ``src`` that ``model`` takes, position embedding resampled; the parts
    loaded; the parts left as built; the position grids, source and model, when resampled).
    InitError, one line naming the mismatched tensors, where ``src`` does not fit. ``model``
    may live on the meta device: only its tensors' names and shapes are read."""
    target = model.state_dict()
    backbone = model.backbone
    prefix_tokens = 0 if getattr(backbone, "no_embed_class", False) else backbone.num_prefix_tokens
    grid = model.spec.grid
    parts = ["backbone"]
    if isinstance(model.pre_logits, torch.nn.Sequential):
        parts.append("pre_logits")
    if with_head:
        parts.append("head")

    fresh = []
    if "pre_logits" in parts and not any(k.startswith("pre_logits.") for k in src.state):
        # e.g. a timm backbone into a model that keeps a pre-logits layer: it stays as built
        parts.remove("pre_logits")
        fresh.append("pre_logits")
    wanted = {k: v for k, v in target.items() if k.split(".", 1)[0] in parts}
    problems, new, pos_grids = [], {}, None
    for key, here in wanted.items():
        there = src.state.get(key)
        if there is None:
            problems.append(f"{_short(key)} missing there (here {_shape(here)})")
            continue
        if key == POS_EMBED and there.shape != here.shape and there.ndim == 3 \
                and there.shape[-1] == here.shape[-1]:
            old = _grid_of(there.shape[1], prefix_tokens)
            if old is not None:
                pos_grids = [old, grid]
                there = resample_pos_embed(there, grid, prefix_tokens)
        if there.shape != here.shape:
            problems.append(f"{_short(key)} {_shape(src.state[key])} vs {_shape(here)}")
            continue
        new[key] = there
    unexpected = sorted((k for k in src.state if k.startswith(BACKBONE_PREFIX)
                         and k not in target), key=_natural)
    problems += [f"{_short(k)} {_shape(src.state[k])} not in the model" for k in unexpected]
    heads = (src.spec or {}).get("num_heads")
    if heads and heads != model.spec.num_heads:  # the shapes agree: qkv would be cut wrongly
        problems.insert(0, f"{heads} attention heads vs {model.spec.num_heads} (set "
                           f"model.num_heads={heads})")
    if problems:
        more = f" (+{len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
        said = _describe_state(src.state) + (f", {heads} heads" if heads else "")
        raise InitError(f"init '{src.path}' ({said}) does not match "
                        f"model {_describe(model)}: {', '.join(problems[:_SHOWN])}{more}")
    return new, parts, fresh, pos_grids


def check_init_fits(init: str | os.PathLike, model_cfg, normalize: Optional[str] = None
                    ) -> None:
    """``--dry-run``: ``init`` is read and checked against the configured model and
    normalisation as the run's start checks it (the model built on the meta device: no
    memory, no initialisation)."""
    from pretrain.model import create_model
    with torch.device("meta"):
        model = create_model(model_cfg)
    src = read_init(init)
    _check_normalize(init, src, normalize)
    _matched(model, src, with_head=False)


def _check_normalize(init, src: InitSource, normalize: Optional[str]) -> None:
    """The weights learned on inputs in one range; fed another, the fine-tune starts from
    features of inputs they never saw (and reports no error: its loss just starts higher)."""
    if normalize and src.normalize and src.normalize != normalize:
        raise InitError(f"init '{init}' was trained on inputs normalised as "
                        f"data.normalize={src.normalize}, but this fine-tune normalises them as "
                        f"{normalize}; set data.normalize={src.normalize}")


def load_init(model: ViTClassifier, init: str | os.PathLike, *, with_head: bool = False,
              normalize: Optional[str] = None) -> dict:
    """Initialise ``model`` from ``init`` (see the module docstring); returns the lineage:
    ``{format, path, step, pretrain_run_id, resolution, pos_embed_grid, loaded, dropped, ...}``.
    Raises :class:`InitError` (one line) when ``init`` is unreadable, does not fit, or was
    trained on inputs normalised otherwise than ``normalize`` says (where the init says)."""
    src = read_init(init)
    _check_normalize(init, src, normalize)
    return apply_init(model, src, with_head=with_head)

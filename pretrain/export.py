"""Pretraining checkpoints and fine-tuned models -> portable weight files.

The weights come as a :class:`~pretrain.consolidate.Consolidated`: a pretraining checkpoint read
back in fp32 by :func:`pretrain.consolidate.consolidate` (either function here also takes its
path), or an in-memory model (``from_model``). Two outputs:

* ``export_full`` - one safetensors file with everything (backbone, pre-logits, head; keys as
  ``ViTClassifier.state_dict()``) and the model config in the safetensors metadata
  (``format``, ``spec``, ``config``, ``step``, ``tracking_run_id``, ``source``).
* ``export_timm_backbone`` - the backbone alone, keys as timm's ``VisionTransformer`` names them:
  ``timm.create_model(NAME, pretrained=True, pretrained_cfg_overlay=dict(file=PATH),
  num_classes=0, **timm_kwargs(spec))`` loads it with no missing or unexpected keys
  (``timm_kwargs`` is empty for an architecture timm registers as NAME, e.g. ViT-L/16 @224;
  a name that pools the average, ``*_gap_*``, gets ``class_token`` and ``global_pool``);
  ``timm_folder.file_overlay`` adds the run's eval transform to the overlay.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Optional, Union

from pretrain.atomic_write import write_atomic
from pretrain.consolidate import Consolidated, consolidate
from pretrain.model import ViTSpec

# ``format`` in the safetensors metadata of the two kinds of file written here.
FULL_FORMAT = "vit-classifier/1"
TIMM_FORMAT = "timm-vit-backbone/1"
BACKBONE_PREFIX = "backbone."


def _as_consolidated(source) -> Consolidated:
    return source if isinstance(source, Consolidated) else consolidate(source)


def _save(tensors: dict, out: Union[str, os.PathLike], metadata: dict) -> Path:
    from safetensors.torch import save_file

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(out, lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()},
                                                  str(tmp), metadata=metadata))


def export_full(source: Union[str, os.PathLike, Consolidated], out: Union[str, os.PathLike]
                ) -> Path:
    """One safetensors file: the whole ViTClassifier (pre-logits and head included) + metadata."""
    c = _as_consolidated(source)
    return _save(c.state_dict, out, c.metadata(FULL_FORMAT))


def from_model(model, source: str = "model", **metadata) -> Consolidated:
    """An in-memory ViTClassifier (e.g. fine-tuned weights) as a ``Consolidated``, for
    ``export_full`` / ``export_timm_backbone``. ``step``, ``config_yaml`` and ``tracking_run_id``
    are recognised; any other keyword goes into the file header (JSON unless a string)."""
    known = {k: metadata.pop(k) for k in ("step", "config_yaml", "tracking_run_id")
             if k in metadata}
    sd = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}
    return Consolidated(state_dict=sd, spec=model.spec, source=source,
                        extra={k: v if isinstance(v, str) else json.dumps(v)
                               for k, v in metadata.items()}, **known)


def timm_backbone_state(state_dict: dict) -> dict:
    """ViTClassifier keys -> timm VisionTransformer keys (the backbone only)."""
    return {k[len(BACKBONE_PREFIX):]: v for k, v in state_dict.items()
            if k.startswith(BACKBONE_PREFIX)}


def timm_kwargs(spec: ViTSpec) -> dict:
    """The ``timm.create_model(spec.name, ...)`` arguments that make timm build this backbone:
    only what differs from the architecture timm registers under that name. Our backbone
    always pools the class token; a name whose default pools the average (``*_gap_*``) needs
    that said, or timm builds another model (no class token, another final norm) and loads
    the weights partly, with a log line only."""
    from pretrain.model import ARCH_FIELDS, _timm_arch, timm_stock

    base = dict(zip(ARCH_FIELDS, _timm_arch(spec.name)[:-1]))
    out = {k: getattr(spec, k) for k in ARCH_FIELDS if getattr(spec, k) != base[k]}
    if "mlp_ratio" in out and math.isclose(out["mlp_ratio"], base["mlp_ratio"]):
        del out["mlp_ratio"]
    stock = timm_stock(spec.name)
    if stock.cls_token is None:
        out["class_token"] = True
    if stock.global_pool != "token":
        out["global_pool"] = "token"
    return out


def normalize_in(config_yaml: Optional[str]) -> Optional[str]:
    """``data.normalize`` of a run's saved config (None: no config, or it does not say)."""
    import yaml
    try:
        data = (yaml.safe_load(config_yaml or "") or {}).get("data") or {}
    except (yaml.YAMLError, AttributeError):
        return None
    return data.get("normalize") if isinstance(data, dict) else None


def export_timm_backbone(source: Union[str, os.PathLike, Consolidated],
                         out: Union[str, os.PathLike]) -> Path:
    """The backbone with timm's key names, for ``timm.create_model(..., pretrained=True,
    pretrained_cfg_overlay=dict(file=out), num_classes=0, **timm_kwargs(spec))``."""
    c = _as_consolidated(source)
    meta = c.metadata(TIMM_FORMAT)
    # timm ignores the header; the spec, timm kwargs and the inputs' normalisation are enough
    # (a fine-tune from this file checks its data.normalize against it)
    normalize = normalize_in(meta.pop("config", None))
    if normalize:
        meta["normalize"] = normalize
    meta["timm_model"] = c.spec.name
    meta["timm_kwargs"] = json.dumps(timm_kwargs(c.spec))
    return _save(timm_backbone_state(c.state_dict), out, meta)


def read_metadata(path: Union[str, os.PathLike]) -> dict:
    """The safetensors header metadata of a file (empty dict if none)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})

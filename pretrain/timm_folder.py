"""A model folder in timm's own layout: ``timm.create_model("local-dir:DIR", pretrained=True)``.

The folder holds what timm's ``local-dir:`` (and ``hf-hub:``) loader reads:

* ``config.json`` - ``architecture`` (the timm name), ``num_classes``, ``model_args`` (every
  argument that makes timm build exactly these weights) and ``pretrained_cfg`` (the run's eval
  preprocessing: input size, interpolation, crop, mean/std; ``label_names`` when known), so
  ``timm.data.resolve_model_data_config(model)`` gives the run's transform, not the stock one;
* ``model.safetensors`` - timm's parameter names;
* ``README.md`` - a model card with a YAML metadata block (Hugging Face's convention).

timm's VisionTransformer has no representation (pre-logits) layer, so a model with one is
written as its backbone (``num_classes=0``); a classifier without one (every fine-tune) is
written whole.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Union

import torch

from pretrain.atomic_write import write_atomic
from pretrain.checkpoint import CheckpointError
from pretrain.consolidate import Consolidated
from pretrain.export import BACKBONE_PREFIX, _as_consolidated, timm_backbone_state
from pretrain.model import ViTSpec

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
CARD = "README.md"
# pretrain/data/eval_loader.py builds every eval loader with EvalTransform's default crop and resize
EVAL_CROP_PCT = 0.875
EVAL_INTERPOLATION = "bilinear"


def timm_model_args(spec: ViTSpec) -> dict:
    """Everything ``create_model(spec.name, **args)`` needs to match the weights; the pooling is
    stated because our backbone always pools the class token, whatever the name's default."""
    return {"img_size": spec.img_size, "patch_size": spec.patch_size,
            "embed_dim": spec.embed_dim, "depth": spec.depth, "num_heads": spec.num_heads,
            "mlp_ratio": spec.mlp_ratio, "in_chans": spec.in_chans, "class_token": True,
            "global_pool": "token"}


def data_config(img_size: int, normalize: str = "minus_one_one",
                crop_pct: float = EVAL_CROP_PCT, in_chans: int = 3) -> dict:
    """timm's data-config keys for our eval transform and ``data.normalize``."""
    if normalize == "minus_one_one":  # x / 127.5 - 1
        mean, std = (0.5,) * 3, (0.5,) * 3
    elif normalize == "imagenet":
        from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
        mean, std = IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
    else:
        raise ValueError(f"data.normalize='{normalize}' is unknown; use 'minus_one_one' or "
                         f"'imagenet'")
    return {"input_size": [in_chans, img_size, img_size], "interpolation": EVAL_INTERPOLATION,
            "crop_pct": crop_pct, "crop_mode": "center", "mean": list(mean), "std": list(std)}


def file_overlay(c: Consolidated, path: Union[str, os.PathLike]) -> dict:
    """``pretrained_cfg_overlay`` for timm to load the backbone file at ``path`` and resolve the
    run's eval transform from it: timm's config of the name alone says 224 px, bicubic, 0.9."""
    cfg = data_config(c.spec.img_size, _run_normalize(c), in_chans=c.spec.in_chans)
    return {"file": str(path), **{k: tuple(v) if isinstance(v, list) else v
                                  for k, v in cfg.items()}}


def normalize_of(pretrained_cfg: dict) -> Optional[str]:
    """The ``data.normalize`` whose :func:`data_config` has this mean/std (None: neither).
    The name, not the numbers, is what an evaluation needs: the loader's ``x / 127.5 - 1`` and
    timm's ``(x / 255 - 0.5) / 0.5`` differ in the last bits."""
    import math
    for mode in ("minus_one_one", "imagenet"):
        want = data_config(1, mode)
        if all(len(pretrained_cfg.get(k) or ()) == 3 and all(
                math.isclose(a, b, abs_tol=1e-6) for a, b in zip(pretrained_cfg[k], want[k]))
                for k in ("mean", "std")):
            return mode
    return None


def dataset_description(root: Optional[str]) -> tuple[Optional[str], Optional[list]]:
    """(dataset name, class names) from a local shard directory's info file, else what the
    path says; remote roots are not read (an export must not wait on the network)."""
    if not root:
        return None, None
    if os.path.isdir(root):
        from pretrain.data.info import DatasetInfoError, read_info
        try:
            info = read_info(root)
            return info.name or Path(root).name, info.classes
        except (DatasetInfoError, OSError, ValueError):
            pass
    return Path(str(root).rstrip("/")).name or str(root), None


def _run_settings(c: Consolidated) -> dict:
    """``data.normalize`` and ``data.root`` of the run that wrote the checkpoint (pretraining
    exports carry the run's config; without one the project's defaults hold)."""
    if not c.config_yaml:
        return {}
    import yaml
    try:
        config = yaml.safe_load(c.config_yaml) or {}
    except yaml.YAMLError:
        return {}
    data = dict(config.get("data") or {})
    root = data.get("root")
    from pretrain.data.info import is_url
    if root and not os.path.isabs(root) and not is_url(root):
        # relative: from the folder the run was launched in, where that can be told (an
        # export made from elsewhere lost the dataset's class names)
        from pretrain.producing_run import launch_dir
        base = launch_dir(Path(c.source).parent.parent, config.get("output_dir"))
        if base is not None and os.path.isdir(base / root):
            data["root"] = os.path.normpath(base / root)
    return {k: data[k] for k in ("normalize", "root") if data.get(k)}


def _run_normalize(c: Consolidated) -> str:
    """The run's ``data.normalize``, the project's default where its config does not say."""
    return _run_settings(c).get("normalize", "minus_one_one")


def timm_state(c: Consolidated, head: bool) -> dict:
    """ViTClassifier keys -> timm VisionTransformer keys, with or without the head."""
    state = timm_backbone_state(c.state_dict)
    if head:
        if c.spec.representation_size:
            raise CheckpointError(
                f"model '{c.spec.name}' has a pre-logits layer, which timm's VisionTransformer "
                f"cannot hold; export it without the head (the backbone folder)")
        if not c.spec.num_classes:
            raise CheckpointError(f"model '{c.spec.name}' has no head; export the backbone")
        state.update({k: v for k, v in c.state_dict.items() if k.startswith("head.")})
    unknown = [k for k in c.state_dict if not k.startswith((BACKBONE_PREFIX, "head.",
                                                               "pre_logits."))]
    if unknown:
        raise CheckpointError(f"unexpected tensors {unknown[:3]} in the model; is it a "
                              f"ViTClassifier state dict?")
    return state


def head_fits(spec) -> bool:
    """Whether the model's head goes into timm's ViT: one there is, with nothing between it and
    the backbone (timm's ViT has no pre-logits layer to put it behind)."""
    return bool(spec.num_classes) and not spec.representation_size


def write_timm_folder(source: Union[str, os.PathLike, Consolidated], out: Union[str, os.PathLike],
                      *, head: bool = False, normalize: Optional[str] = None,
                      crop_pct: float = EVAL_CROP_PCT, dataset: Optional[str] = None,
                      label_names: Optional[list] = None, metrics: Optional[dict] = None,
                      lineage: Optional[dict] = None) -> Path:
    """Write ``out/`` (config.json, model.safetensors, README.md) for timm's ``local-dir:``.

    ``head``: the whole classifier (no pre-logits allowed) instead of the backbone alone.
    ``normalize`` / ``dataset``: the run's ``data.normalize`` / ``data.root`` (read from the
    checkpoint's config when not given). ``metrics`` and ``lineage`` go into the model card."""
    from safetensors.torch import save_file

    c = _as_consolidated(source)
    spec = c.spec
    run = _run_settings(c)
    normalize = normalize or _run_normalize(c)
    name, classes = dataset_description(dataset or run.get("root"))
    num_classes = spec.num_classes if head else 0
    state = timm_state(c, head)
    if label_names is None and head and classes and len(classes) == num_classes:
        label_names = list(classes)

    pretrained_cfg = {**data_config(spec.img_size, normalize, crop_pct, spec.in_chans),
                      "num_classes": num_classes, "fixed_input_size": True,
                      "first_conv": "patch_embed.proj", "classifier": "head"}
    if label_names:
        pretrained_cfg["label_names"] = list(label_names)
    config = {"architecture": spec.name, "num_classes": num_classes,
              "num_features": spec.embed_dim, "global_pool": "token",
              "model_args": timm_model_args(spec), "pretrained_cfg": pretrained_cfg}

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", "source": c.source}  # "pt": what HF tooling expects in the header
    if c.step is not None:
        meta["step"] = str(c.step)
    if c.tracking_run_id:  # a fine-tune from this folder names the run it comes from
        meta["tracking_run_id"] = c.tracking_run_id
    write_atomic(out / WEIGHTS, lambda p: save_file(
        {k: v.detach().float().cpu().contiguous() for k, v in state.items()}, str(p),
        metadata=meta))
    write_atomic(out / CONFIG, lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))
    card = model_card(c, config, dataset=name, metrics=metrics, lineage=lineage,
                      normalize=normalize)
    write_atomic(out / CARD, lambda p: p.write_text(card))
    return out


def model_card(c: Consolidated, config: dict, *, dataset: Optional[str], metrics: Optional[dict],
               lineage: Optional[dict], normalize: str) -> str:
    """README.md: YAML metadata (library_name, tags, datasets, metrics, source) + a short body."""
    import yaml

    spec, head = c.spec, bool(config["num_classes"])
    metrics = {k: float(v) for k, v in (metrics or {}).items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    source = {"checkpoint": c.source}
    if c.step is not None:
        source["step"] = c.step
    if c.tracking_run_id:
        source["tracking_run_id"] = c.tracking_run_id
    if lineage:
        source["init"] = lineage
    meta = {"library_name": "timm",
            "pipeline_tag": "image-classification" if head else "image-feature-extraction",
            "tags": ["timm", "vision-transformer", "vitscale",
                     "image-classification" if head else "image-feature-extraction"]}
    if dataset:
        meta["datasets"] = [dataset]
    if any(k.endswith(("top1", "top5")) for k in metrics):
        meta["metrics"] = ["accuracy"]
    meta["vitscale"] = {"source": source, **({"results": metrics} if metrics else {})}

    size = spec.img_size
    pcfg = config["pretrained_cfg"]
    kind = (f"a {spec.num_classes}-class classifier" if head else
            "the backbone (class-token features, no head"
            + (", no pre-logits layer: timm's ViT has none" if spec.representation_size else "")
            + ")")
    lines = [
        "---", yaml.safe_dump(meta, sort_keys=False, default_flow_style=False).rstrip(), "---",
        "", f"# {spec.name} ({size} px, patch {spec.patch_size}, width {spec.embed_dim}, "
            f"depth {spec.depth})", "",
        f"A ViT trained with vitscale: {kind}. Weights from `{c.source}`"
        + (f" at step {c.step}" if c.step is not None else "")
        + (f", dataset `{dataset}`" if dataset else "") + ".", "",
        "```python", "import timm", "from PIL import Image", "",
        'model = timm.create_model("local-dir:PATH/TO/THIS/FOLDER", pretrained=True).eval()',
        "cfg = timm.data.resolve_model_data_config(model)",
        "transform = timm.data.create_transform(**cfg)",
        'x = transform(Image.open("image.jpg").convert("RGB")).unsqueeze(0)',
        "out = model(x)  " + ("# logits" if head else "# features"), "```", "",
        f"Eval preprocessing of the run: resize the shorter side to {size}/{pcfg['crop_pct']}, "
        f"centre crop {size}, {pcfg['interpolation']}, normalisation `{normalize}` "
        f"(mean {pcfg['mean']}, std {pcfg['std']}).", ""]
    if metrics:
        lines += ["| metric | value |", "|---|---|",
                  *(f"| {k} | {v:.4f} |" for k, v in sorted(metrics.items())), ""]
    return "\n".join(lines)


def read_card(folder: Union[str, os.PathLike]) -> dict:
    """The YAML metadata block of a folder's README.md ({} when there is none or it does not
    parse: the card is documentation, a user may have edited it)."""
    import yaml
    path = Path(folder) / CARD
    try:
        text = path.read_text()
        if not text.startswith("---\n"):
            return {}
        meta = yaml.safe_load(text.split("---\n", 2)[1])
    except (OSError, UnicodeDecodeError, IndexError, yaml.YAMLError):
        return {}
    return meta if isinstance(meta, dict) else {}


def load_timm_folder(folder: Union[str, os.PathLike]) -> torch.nn.Module:
    """``timm.create_model("local-dir:" + folder, pretrained=True)`` in eval mode."""
    import timm
    return timm.create_model(f"local-dir:{Path(folder).resolve()}", pretrained=True).eval()

"""Any model this project writes -> a ready model, the settings its run evaluated it with, and
the MLflow run that produced it: what ``launch/evaluate.py`` needs to reproduce a run's figure.

``load_model(path)`` takes

* a **folder in timm's layout** (``config.json`` + ``model.safetensors``): a fine-tune's ``best/``
  and ``final/``, ``launch/export.py RUN --out FOLDER``. timm builds it (``local-dir:``), exactly
  as a user loads it; its ``pretrained_cfg`` gives the resolution, normalisation and label names;
* a **safetensors file**: a fine-tune's ``best/final.safetensors`` (a JSON model card in the
  header; the architecture and ``data.normalize`` come from the run's ``config.yaml`` next to
  it, else from the timm folder of the same name) or ``export.py``'s full file (spec and config
  in the header);
* a **checkpoint**: a pretraining output dir or ``checkpoints/step_N/`` (DeepSpeed, merged by
  :func:`pretrain.consolidate.consolidate`), or a fine-tune's (Accelerate's files plus
  ``client_state.pt``, read with ``weights_only``; under an Accelerate DeepSpeed config the
  module from DeepSpeed's screened files). A fine-tune with ``train.ema_decay`` is read as its
  EMA weights: those are what its figures and exports are of.

The source run is the run id the model carries (card, header, client state), else the one in the
producing run's ``output_dir/tracking/run.json``, whose ``uri`` says where it is. Anything else is
refused with :class:`ModelFileError`: one line naming the problem and the fix.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Optional

from torch import nn

from pretrain.checkpoint import CLIENT_STATE
from pretrain.config import ConfigError, ModelConfig
from pretrain.producing_run import (RUN_CONFIG, attach_run, find_source_run, launch_dir,
                                    run_config_at, run_state, same_run)

EMA_STATE = "custom_checkpoint_0.pkl"  # Accelerate's file for the first registered object


class ModelFileError(ConfigError):
    """MODEL cannot be evaluated: one line naming the path, the problem and the fix."""


@dataclass
class ModelFile:
    """A model ready for evaluation (eval mode, CPU) plus what its run knew about it."""

    model: nn.Module
    kind: str  # "timm folder", "safetensors file", "pretraining checkpoint", ...
    path: Path
    name: str  # the timm architecture (the ``model`` tag of the runs)
    img_size: int
    num_classes: int
    normalize: str  # data.normalize: "minus_one_one" or "imagenet"
    label_names: Optional[list] = None
    step: Optional[int] = None
    run_dir: Optional[Path] = None  # the producing run's output_dir, when found
    run_config: dict = field(default_factory=dict)  # its config.yaml as plain data
    source_run_id: Optional[str] = None
    source_uri: Optional[str] = None  # where that run is, from its run.json
    notes: list = field(default_factory=list)  # what had to be assumed, one line each
    lineage: Optional[dict] = None  # a fine-tune checkpoint's: the init it started from

    @property
    def stage(self) -> Optional[str]:
        """"finetune" / "pretrain" when the run's config is known (only a fine-tune has init)."""
        if not self.run_config:
            return None
        return "finetune" if "init" in self.run_config else "pretrain"

    @property
    def trained_on(self) -> Optional[str]:
        """The run's data.root; a relative one as the run saw it, from the folder it was
        launched in (where its run_dir ends in its relative output_dir), else as is (from here).
        """
        return self.data_roots[0] if self.data_roots else None

    def trained_on_data(self, root: str) -> bool:
        """Whether ``root`` is the dataset the run trained on; a relative data.root is taken
        from where the run was launched, or from here (a run moved since, a symlinked path)."""
        return any(os.path.realpath(r) == os.path.realpath(root) for r in self.data_roots)

    @property
    def data_roots(self) -> list:
        """Where the run's data.root may be from here: as it saw it first."""
        root = (self.run_config.get("data") or {}).get("root")
        from pretrain.data.info import is_url
        if not root or is_url(str(root)) or os.path.isabs(root) or self.run_dir is None:
            return [root] if root else []
        base = launch_dir(self.run_dir, self.run_config.get("output_dir"))
        return [os.path.normpath(base / root), root] if base is not None else [root]

    @property
    def precision(self) -> str:
        return (self.run_config.get("train") or {}).get("precision") or "fp32"


def load_model(path) -> ModelFile:
    """Read MODEL (see the module docstring); raises :class:`ModelFileError`."""
    from pretrain.timm_folder import CONFIG, WEIGHTS

    p = Path(path).expanduser()
    if not p.exists():
        raise ModelFileError(f"MODEL '{path}' not found")
    if p.is_dir() and (p / CONFIG).is_file() and (p / WEIGHTS).is_file():
        mf = _timm_folder(p)
    elif p.is_file() and p.suffix == ".safetensors":
        mf = _safetensors(p)
    elif p.is_dir():
        mf = _checkpoint(p)
    else:
        raise ModelFileError(
            f"MODEL '{path}' is neither a model folder in timm's layout (config.json + "
            f"model.safetensors), a .safetensors file nor a checkpoint dir; pass e.g. "
            f"runs/NAME/final, runs/NAME/final.safetensors or runs/NAME")
    if not mf.num_classes:
        raise ModelFileError(
            f"MODEL '{path}' is a backbone without a classifier head (num_classes=0), nothing to "
            f"take top-1 of; evaluate " + (
                f"{p.with_suffix('.safetensors')}, beside it" if p.is_dir() and
                p.with_suffix(".safetensors").is_file() else
                "the run's checkpoint or its full .safetensors export"))
    find_source_run(mf)
    return mf


# --------------------------------------------------------------------------------------------
# The three kinds of MODEL
# --------------------------------------------------------------------------------------------
def _timm_folder(p: Path) -> ModelFile:
    from pretrain.timm_folder import (CONFIG, EVAL_CROP_PCT, EVAL_INTERPOLATION,
                                      load_timm_folder, normalize_of, read_card)

    try:
        config = json.loads((p / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ModelFileError(f"MODEL '{p}': unreadable {CONFIG} ({e})") from None
    pcfg = config.get("pretrained_cfg") or {}
    normalize = normalize_of(pcfg)
    if normalize is None:
        raise ModelFileError(
            f"MODEL '{p}': its pretrained_cfg mean/std ({pcfg.get('mean')}, {pcfg.get('std')}) "
            f"is neither of this project's normalisations; it was not written by vitscale")
    # the evaluation runs this project's eval transform: another one would change the figure
    # (timm's defaults where the file leaves a value out or null)
    crop = pcfg.get("crop_pct") or EVAL_CROP_PCT
    interpolation = pcfg.get("interpolation") or EVAL_INTERPOLATION
    mode = pcfg.get("crop_mode") or "center"
    if not (isinstance(crop, (int, float)) and math.isclose(crop, EVAL_CROP_PCT)) \
            or interpolation != EVAL_INTERPOLATION or mode != "center":
        raise ModelFileError(
            f"MODEL '{p}': its pretrained_cfg asks for crop_pct {crop}, {interpolation} "
            f"resizing and a {mode} crop, not this project's eval transform (crop_pct "
            f"{EVAL_CROP_PCT}, {EVAL_INTERPOLATION}, center); it was not written by vitscale: "
            f"evaluate it with timm's own pipeline")
    try:
        model = load_timm_folder(p)
    except Exception as e:  # noqa: BLE001 -- timm's own messages are long; say which folder
        raise ModelFileError(f"MODEL '{p}': timm cannot build it ({_first_line(e)})") from None
    from timm.models.vision_transformer import VisionTransformer
    if not isinstance(model, VisionTransformer):
        raise ModelFileError(f"MODEL '{p}' is a {type(model).__name__}, not a timm "
                             f"VisionTransformer; this project evaluates ViTs")
    source = (read_card(p).get("vitscale") or {}).get("source") or {}
    mf = ModelFile(model=model, kind="timm folder", path=p,
                   name=config.get("architecture") or type(model).__name__,
                   img_size=int(model.patch_embed.img_size[0]),
                   num_classes=int(getattr(model, "num_classes", 0) or 0), normalize=normalize,
                   label_names=pcfg.get("label_names"), step=_int(source.get("step")),
                   source_run_id=source.get("tracking_run_id"))
    # the card's source is the run's file or checkpoint: its run dir is one or two levels up
    src = Path(str(source["checkpoint"])) if source.get("checkpoint") else None
    attach_run(mf, *([src.parent, src.parent.parent] if src else []), p.parent)
    return mf


def _safetensors(p: Path) -> ModelFile:
    from safetensors.torch import load_file

    from pretrain.export import FULL_FORMAT, TIMM_FORMAT, read_metadata

    try:
        meta = read_metadata(p)
        state = load_file(str(p))
    except Exception as e:  # noqa: BLE001 -- a corrupt header is the user's file, not a bug
        raise ModelFileError(f"MODEL '{p}' is not a readable safetensors file "
                             f"({_first_line(e)})") from None
    if meta.get("format") == TIMM_FORMAT:
        raise ModelFileError(f"MODEL '{p}' is a timm backbone export without a head; evaluate "
                             f"the full export (launch/export.py --out FILE.safetensors)")
    if meta.get("format") == FULL_FORMAT:  # launch/export.py: spec and config in the header
        model_cfg, run_config = _header_model(meta)
        mf = _built(p, "safetensors file (export)", model_cfg, state, run_config,
                    step=_int(meta.get("step")))
        mf.source_run_id = meta.get("tracking_run_id")
        src = Path(meta["source"]) if meta.get("source") else None  # the checkpoint dir
        attach_run(mf, *([src.parent.parent] if src else []))
        return mf
    if "model_card" not in meta:
        raise ModelFileError(f"MODEL '{p}' carries no vitscale header (a fine-tune's "
                             f"model_card or export.py's format/spec); this command evaluates "
                             f"this project's models")
    card = json.loads(meta["model_card"])
    run_config, in_run = run_config_at(p.parent), True
    normalize = None
    if "spec" in meta:  # the file's own architecture and config: it may have left its run, or
        # been copied into another run's folder, whose config.yaml is then not its settings
        folder_config = run_config
        model_cfg, run_config = _header_model(meta)
        in_run = same_run(p.parent, folder_config, run_config, card.get("tracking_run_id"))
    elif run_config.get("model"):  # written by an older version, in its run's folder
        model_cfg = _model_config(run_config, p.parent / RUN_CONFIG)
    else:  # written by an older version: the timm folder of the same name knows the rest
        model_cfg, normalize = _from_sibling_folder(p, card)
    mf = _built(p, "safetensors file (fine-tune)", model_cfg, state, run_config,
                step=_int(card.get("step")))
    mf.source_run_id = card.get("tracking_run_id")  # also where the file left its run's folder
    # where its run wrote it, which a copy that left that folder finds it by: only where the
    # MLflow run there is the file's (a relative output_dir, or a run moved aside and another
    # of the same recipe started there, could name another run's folder)
    there = Path(run_config["output_dir"]) if "spec" in meta and run_config.get("output_dir") \
        else None
    if run_config and in_run:
        mf.run_dir = p.parent
    elif there is not None and card.get("tracking_run_id") and \
            getattr(run_state(there), "run_id", None) == card["tracking_run_id"]:
        mf.run_dir = there
    elif normalize is not None:
        mf.normalize = normalize
    elif not run_config:  # (with one, _built took the normalisation from it)
        mf.notes.append(f"{p} does not say how its inputs were normalised and no {RUN_CONFIG} "
                        f"is next to it: assuming the default, minus_one_one")
    return mf


def _header_model(meta: dict) -> tuple[ModelConfig, dict]:
    """The architecture and run config a file's safetensors header carries (``spec``, ``config``:
    export.py's full file, and a fine-tune's exports)."""
    import yaml

    from pretrain.model import ViTSpec
    spec = ViTSpec(**json.loads(meta["spec"]))
    return spec_config(spec), yaml.safe_load(meta.get("config") or "") or {}


def _checkpoint(p: Path) -> ModelFile:
    from pretrain.checkpoint import CheckpointError

    ckpt = _checkpoint_dir(p)
    if ckpt is None:
        raise ModelFileError(
            f"MODEL '{p}' is a folder but neither a model folder in timm's layout "
            f"(config.json + model.safetensors) nor a checkpoint (an output dir with "
            f"checkpoints/step_*/, or one step dir); pass e.g. runs/NAME/final or runs/NAME")
    if (ckpt / CLIENT_STATE).is_file():
        return _accelerate_checkpoint(ckpt)
    from pretrain.consolidate import consolidate
    try:
        c = consolidate(ckpt, origin=p)
    except CheckpointError as e:
        raise ModelFileError(str(e)) from None
    import yaml
    run_config = yaml.safe_load(c.config_yaml or "") or {}
    mf = _built(ckpt, "pretraining checkpoint", spec_config(c.spec), c.state_dict, run_config,
                step=c.step)
    mf.source_run_id = c.tracking_run_id
    attach_run(mf, ckpt.parent.parent)
    return mf


def _checkpoint_dir(p: Path) -> Optional[Path]:
    """The checkpoint a path means (newest complete one for an output dir), or None."""
    from pretrain.checkpoint import TAG_RE, CheckpointStore
    from pretrain.consolidate import resolve_checkpoint

    if (p / CLIENT_STATE).is_file() or any(p.glob("*model_states.pt")):
        if TAG_RE.match(p.name) and p.name not in {
                c.path.name for c in CheckpointStore(p.parent).complete()}:
            raise ModelFileError(f"checkpoint '{p}' is incomplete (a save was interrupted); pick "
                                 f"another step in {p.parent} or the output dir itself")
        return p
    for root in (p / "checkpoints", p):
        if root.is_dir() and any(TAG_RE.match(d.name) for d in root.iterdir() if d.is_dir()):
            latest = CheckpointStore(root).latest()
            if latest is None:
                raise ModelFileError(f"no complete checkpoint under '{root}' (every save there "
                                     f"was interrupted)")
            return latest.path
    if (p / "latest").is_file():  # DeepSpeed's own save_checkpoint layout
        return resolve_checkpoint(p)
    return None


def _accelerate_checkpoint(ckpt: Path) -> ModelFile:
    """A fine-tune's checkpoint: the weights the run evaluated (the EMA's with ema_decay)."""
    import yaml
    from accelerate.utils import load as load_weights_only  # numpy's RNG arrays allowed

    try:
        client = load_weights_only(ckpt / CLIENT_STATE, map_location="cpu")
        run_config = yaml.safe_load(client["config"]) or {}
    except Exception as e:  # noqa: BLE001 -- weights_only refuses anything executable
        raise ModelFileError(f"cannot read '{ckpt / CLIENT_STATE}' safely (weights_only): "
                             f"{_first_line(e)}") from None
    train = run_config.get("train") or {}
    ema = bool(train.get("ema_decay"))
    state = _accelerate_weights(ckpt, ema, train.get("precision"))
    mf = _built(ckpt, "fine-tune checkpoint" + (" (EMA weights)" if ema else ""),
                _model_config(run_config, ckpt / CLIENT_STATE), state, run_config,
                step=_int(client.get("step")))
    mf.source_run_id = client.get("tracking_run_id")
    mf.lineage = (client.get("stage") or {}).get("lineage")
    attach_run(mf, ckpt.parent.parent)
    return mf


def _accelerate_weights(ckpt: Path, ema: bool, precision: Optional[str]) -> dict:
    from accelerate.utils import MODEL_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_NAME
    from accelerate.utils import load as load_weights_only

    if ema:
        f = ckpt / EMA_STATE
        if not f.is_file():
            raise ModelFileError(f"checkpoint '{ckpt}' of a run with train.ema_decay has no "
                                 f"{EMA_STATE} (the EMA weights it evaluated)")
        state = load_weights_only(f, map_location="cpu")
        # timm's ModelEmaV3 keeps the averaged copy as ``.module``
        return {k[len("module."):]: v for k, v in state.items() if k.startswith("module.")}
    if (ckpt / SAFE_WEIGHTS_NAME).is_file():
        from safetensors.torch import load_file
        return load_file(str(ckpt / SAFE_WEIGHTS_NAME))
    if (ckpt / WEIGHTS_NAME).is_file():
        return load_weights_only(ckpt / WEIGHTS_NAME, map_location="cpu")
    if (ckpt / MODEL_NAME).is_dir():  # under an Accelerate DeepSpeed config
        return _deepspeed_weights(ckpt / MODEL_NAME, precision)
    exports = [n for n in ("final", "best") if (ckpt.parent.parent / n).is_dir()]
    raise ModelFileError(
        f"checkpoint '{ckpt}' holds no whole-model file ({SAFE_WEIGHTS_NAME} or {WEIGHTS_NAME}) "
        f"nor DeepSpeed's files ({MODEL_NAME}/): an FSDP save, which is read back only by "
        f"relaunching its run; " + (f"evaluate the run's {' or '.join(e + '/' for e in exports)} "
                                    f"instead" if exports else
                                    "its exports (final/, best/) come at the run's end"))


def _deepspeed_weights(files: Path, precision: Optional[str]) -> dict:
    """The module the run evaluated, from DeepSpeed's files of the checkpoint: whole in the
    model file up to ZeRO-2 (in the run's precision), and under ZeRO-3 its fp32 master
    weights, merged by DeepSpeed's zero_to_fp32 and rounded to the precision the module held
    them in (DeepSpeed casts the masters after each update: the same values)."""
    import torch

    from pretrain.checkpoint import CheckpointError
    from pretrain.consolidate import fp32_from_zero_shards, read_client_state
    try:
        if not any(files.glob("zero_pp_rank_*_model_states.pt")):  # ZeRO 0-2: mp_rank_00_...
            module = read_client_state(files, with_module=True)["module"]
            return {k: v.float() if v.is_floating_point() else v for k, v in module.items()}
        state = fp32_from_zero_shards(files)
    except CheckpointError as e:
        raise ModelFileError(str(e)) from None
    except (OSError, ValueError, KeyError) as e:  # a file missing (optimizer shards left out
        raise ModelFileError(           # of a copy), or not DeepSpeed's
            f"cannot read the weights from DeepSpeed's files in '{files}' "
            f"({_first_line(e)}); evaluate the run's final/ or best/ export instead") from None
    held = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision or "", torch.float32)
    return {k: v.to(held).float() if v.is_floating_point() else v for k, v in state.items()}


# --------------------------------------------------------------------------------------------
# Building our model from a state dict
# --------------------------------------------------------------------------------------------
def spec_config(spec) -> ModelConfig:
    """The ModelConfig that rebuilds ``spec`` (a :class:`pretrain.model.ViTSpec`)."""
    return ModelConfig(name=spec.name, img_size=spec.img_size, patch_size=spec.patch_size,
                       embed_dim=spec.embed_dim, depth=spec.depth, num_heads=spec.num_heads,
                       mlp_ratio=spec.mlp_ratio, representation_size=spec.representation_size,
                       num_classes=spec.num_classes)


def _model_config(run_config: dict, where: Path) -> ModelConfig:
    try:
        return ModelConfig.model_validate(run_config.get("model") or {})
    except Exception as e:  # noqa: BLE001 -- a config from another version of this code
        raise ModelFileError(f"the model section of {where} does not validate "
                             f"({_first_line(e)})") from None


def _built(path: Path, kind: str, model_cfg: ModelConfig, state: dict, run_config: dict,
           step: Optional[int]) -> ModelFile:
    from pretrain.consolidate import tensors_that_differ
    from pretrain.model import create_model

    model = create_model(model_cfg, device="meta")  # no init work: every tensor is replaced
    diff = tensors_that_differ(model.state_dict(), state)
    if diff:
        raise ModelFileError(f"MODEL '{path}' does not hold the model its config describes "
                             f"({model_cfg.name}, {len(diff)} tensors differ, e.g. {diff[0]})")
    model.load_state_dict({k: v.float() for k, v in state.items()}, assign=True)
    left = [n for n, t in chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if left:  # a buffer the state dict does not carry: would be garbage, not a figure
        raise ModelFileError(f"MODEL '{path}': {left[0]} is not in the file")
    spec = model.spec
    data = run_config.get("data") or {}
    return ModelFile(model=model.eval(), kind=kind, path=path, name=spec.name,
                     img_size=spec.img_size, num_classes=spec.num_classes,
                     normalize=data.get("normalize", "minus_one_one"),
                     step=step, run_config=run_config)


def trained_classes(mf: "ModelFile") -> Optional[list]:
    """The model's class names: its own (a timm folder's), else those of the dataset its run
    trained on."""
    return mf.label_names or next(
        (c for c in (_trained_classes(r, mf.num_classes) for r in mf.data_roots) if c), None)


def _trained_classes(root, num_classes: int) -> Optional[list]:
    """The class names of the dataset a run trained on, where its folder is still here: what
    an evaluation on another dataset with as many classes is told apart by (a checkpoint keeps
    no names of its own). A URL or a folder gone since: None (nothing is fetched for it)."""
    from pretrain.data.info import read_info
    from pretrain.data.remote import is_remote
    if not root or is_remote(str(root)) or not Path(root).is_dir():
        return None
    try:
        classes = read_info(str(root)).classes
    except Exception:  # noqa: BLE001 -- an unreadable info file only loses the note
        return None
    return list(classes[:num_classes]) if classes and len(classes) >= num_classes else None


def _from_sibling_folder(p: Path, card: dict) -> tuple[ModelConfig, Optional[str]]:
    from pretrain.timm_folder import CONFIG, normalize_of

    folder = p.with_suffix("")
    try:
        config = json.loads((folder / CONFIG).read_text())
        args = config["model_args"]
    except (OSError, ValueError, KeyError):
        raise ModelFileError(
            f"MODEL '{p}': cannot tell its architecture (no {RUN_CONFIG} next to it and no "
            f"{folder.name}/{CONFIG}); evaluate it where the fine-tune wrote it, or its "
            f"{folder.name}/ folder") from None
    keys = ("img_size", "patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio")
    cfg = ModelConfig(name=config.get("architecture") or card.get("model"),
                      num_classes=int(config.get("num_classes") or card.get("num_classes") or 0),
                      **{k: args[k] for k in keys if k in args})
    return cfg, normalize_of(config.get("pretrained_cfg") or {})


def _int(value) -> Optional[int]:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]

"""A pretraining checkpoint, read back as one fp32 ``ViTClassifier`` state dict.

``consolidate(path)`` turns a pretraining output directory (its newest complete checkpoint) or one
checkpoint directory into ONE fp32 state dict plus what produced it (resolved config, step,
tracking run id, ``ViTSpec``): a :class:`Consolidated`, which :mod:`pretrain.export` writes out.
The ZeRO shards are merged by DeepSpeed's own ``zero_to_fp32`` utilities, which read the fp32
master weights from the optimizer shards, so ZeRO-1/2/3 and bf16 runs give the full-precision
weights, not the bf16 copies. Without ZeRO (stage 0) the weights are in the single model file
(fp32 masters in its optimizer part under bf16/fp16).

Safety: DeepSpeed's loaders unpickle with ``weights_only=False`` (its optimizer shards hold a few
DeepSpeed objects: ``LossScaler``, ``ZeroStageEnum``, ``fragment_address``). Before handing a
directory to them, every ``.pt`` file's pickle is screened (``pickle_screen.check_pickles_are_inert``,
which executes nothing) and anything that references a Python object outside a short list of
those known, inert types is refused. Our own reads of the client
state use ``torch.load(weights_only=True)`` with numpy's array types allowed (the saved RNG state).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Union

import torch

from pretrain.checkpoint import MANIFEST, TAG_RE, CheckpointError, CheckpointStore
from pretrain.pickle_screen import check_pickles_are_inert
from pretrain.config import PretrainConfig
from pretrain.model import ViTSpec

log = logging.getLogger(__name__)


@dataclass
class Consolidated:
    """A whole ViTClassifier in fp32 plus where it came from."""

    state_dict: dict  # ViTClassifier.state_dict() keys -> fp32 CPU tensors
    spec: ViTSpec
    source: str
    step: Optional[int] = None
    config_yaml: Optional[str] = None
    tracking_run_id: Optional[str] = None
    zero_stage: Optional[int] = None
    world_size: Optional[int] = None
    extra: dict = field(default_factory=dict)

    def metadata(self, fmt: str) -> dict:
        """safetensors metadata (str -> str) of a file of format ``fmt``; ``None`` values are
        left out."""
        meta = {"format": fmt, "spec": json.dumps(asdict(self.spec)), "source": self.source,
                "step": self.step, "config": self.config_yaml,
                "tracking_run_id": self.tracking_run_id, "zero_stage": self.zero_stage,
                "world_size": self.world_size, **self.extra}
        from pretrain.spool import redacted  # a file to share: no URL's password in it
        return {k: redacted(str(v)) for k, v in meta.items() if v is not None}


# --------------------------------------------------------------------------------------------
# Finding the checkpoint
# --------------------------------------------------------------------------------------------
def _is_checkpoint_dir(d: Path) -> bool:
    return any(d.glob("*model_states.pt"))


def is_finetune_dir(d: Path) -> bool:
    import yaml
    if (d / "final.safetensors").is_file():
        return True
    try:
        saved = yaml.safe_load((d / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(saved, dict) and "init" in saved  # a key only the fine-tune has


def resolve_checkpoint(path: Union[str, os.PathLike], warn: bool = True) -> Path:
    """A pretraining output dir, its ``checkpoints/`` dir, a plain DeepSpeed save dir with a
    ``latest`` file, or one checkpoint dir -> the checkpoint dir to read; ``warn``: say why an
    incomplete checkpoint was passed over."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint '{p}' not found")
    if not p.is_dir():
        raise CheckpointError(f"'{p}' is a file, not a pretraining output dir or a DeepSpeed "
                              f"checkpoint dir")
    whole = p.resolve()  # ("." inside checkpoints/ has no name)
    run = whole.parent if whole.name == "checkpoints" and is_finetune_dir(whole.parent) else p
    if is_finetune_dir(run):  # its checkpoints are Accelerate's, and it exports by itself
        raise CheckpointError(f"'{p}' is a fine-tune's {'checkpoints' if run != p else 'output'} "
                              f"dir; {'its run' if run != p else 'it'} writes its exports itself "
                              f"when it ends: "
                              f"{run / 'final.safetensors'} and {run / 'final'}/ (timm folder), "
                              f"best.* likewise; launch/export.py exports one of its checkpoints "
                              f"({run / 'checkpoints'}/step_N)")
    if TAG_RE.match(p.name) and is_finetune_dir(p.parent.parent):
        raise CheckpointError(f"'{p}' is a fine-tune's checkpoint (Accelerate's, for its resume); "
                              f"export it with launch/export.py, or take its run's exports: "
                              f"{p.parent.parent / 'final.safetensors'}, best.* likewise")
    if _is_checkpoint_dir(p):
        if TAG_RE.match(p.name):  # one of ours: only a complete one (COMPLETE.json checked)
            valid = {c.path.name for c in CheckpointStore(p.parent).complete()}
            if p.name not in valid:
                raise CheckpointError(
                    f"checkpoint '{p}' is incomplete (a save was interrupted or a rank's shard "
                    f"is missing); pick another step in {p.parent} or the output dir itself")
        return p
    for store_root in (p / "checkpoints", p):
        if store_root.is_dir() and any(TAG_RE.match(d.name) for d in store_root.iterdir()):
            valid = CheckpointStore(store_root).complete(warn=warn)
            latest = valid[0] if valid else None
            if latest is None:
                raise CheckpointError(f"no complete checkpoint under '{store_root}' "
                                      f"(every save there was interrupted)")
            return latest.path
    if (p / "latest").is_file():  # DeepSpeed's own save_checkpoint(save_latest=True) layout
        tag = (p / "latest").read_text().strip()
        if _is_checkpoint_dir(p / tag):
            return p / tag
    raise CheckpointError(f"'{p}' holds no checkpoint: expected a pretraining output dir (with "
                          f"checkpoints/step_*/) or a DeepSpeed checkpoint dir (*_model_states.pt)")


# --------------------------------------------------------------------------------------------
# Reading it
# --------------------------------------------------------------------------------------------
def _numpy_safe_globals() -> list:
    import numpy as np
    try:
        from numpy._core.multiarray import _reconstruct, scalar
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct, scalar
    dtypes = [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")]
    return [_reconstruct, scalar, np.ndarray, np.dtype, *dtypes]


def _model_states_file(ckpt: Path) -> Path:
    files = sorted(ckpt.glob("*model_states.pt"))
    if not files:
        raise CheckpointError(f"'{ckpt}' has no *_model_states.pt: not a DeepSpeed checkpoint")
    return files[0]  # mp_rank_00_... (ZeRO 0-2) or zero_pp_rank_0_... (ZeRO-3): both rank 0's


def read_client_state(ckpt: Path, with_module: bool = False) -> dict:
    """The rank-0 model-states file (client state: step, config, tracking run id, ...),
    read with ``weights_only=True``; ``module`` and ``optimizer`` dropped unless asked for."""
    f = _model_states_file(ckpt)
    try:
        with torch.serialization.safe_globals(_numpy_safe_globals()):
            state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means "refuse this file"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot read '{f}' safely (weights_only): {first}") from None
    if not with_module:
        state = {k: v for k, v in state.items() if k not in ("module", "optimizer")}
    return state


def _config_of(client: dict, ckpt: Path) -> tuple[PretrainConfig, str]:
    import yaml

    text = client.get("config")
    if not isinstance(text, str):  # a checkpoint saved before the config was in the client state
        saved = ckpt.parent.parent / "config.yaml"
        text = saved.read_text() if saved.is_file() else None
    if text is None:
        raise CheckpointError(f"checkpoint '{ckpt}' carries no config (client state 'config' "
                              f"or ../../config.yaml): cannot tell which architecture it holds")
    try:
        return PretrainConfig.model_validate(yaml.safe_load(text)), text
    except Exception as e:  # noqa: BLE001 - a config this code no longer accepts
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"checkpoint '{ckpt}': its saved config does not validate "
                              f"({first})") from None


def _fp32_from_deepspeed(ckpt: Path, zero_stage: int, cfg: PretrainConfig) -> dict:
    if zero_stage > 0:
        return fp32_from_zero_shards(ckpt)
    return _fp32_from_stage0(ckpt, cfg)


def fp32_from_zero_shards(ckpt: Path) -> dict:
    """The fp32 master weights of DeepSpeed's ZeRO-1/2/3 files in ``ckpt`` (one tag's folder),
    merged by DeepSpeed's ``zero_to_fp32`` once every pickle in it is screened. Also a
    fine-tune's under an Accelerate DeepSpeed config (its ``pytorch_model/``)."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    check_pickles_are_inert(ckpt)
    # it prints progress lines and tqdm bars; our caller reports what matters
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name)


def _fp32_from_stage0(ckpt: Path, cfg: PretrainConfig) -> dict:
    """No ZeRO: the whole model is in the one model file. Under bf16/fp16 those are the
    half-precision copies; the fp32 masters are the optimizer's ``fp32_groups``, in the order of
    the optimizer's parameter groups, which the trainer builds with ``engine.param_groups``."""
    from pretrain.engine import param_groups
    from pretrain.model import create_model

    state = read_client_state(ckpt, with_module=True)
    module = {k: v.float() for k, v in state["module"].items()}
    groups = (state.get("optimizer") or {}).get("fp32_groups")
    half = any(v.dtype in (torch.bfloat16, torch.float16) for v in state["module"].values())
    if not half:
        return module
    if groups is None:  # e.g. DeepSpeed's BF16_Optimizer, whose masters zero_to_fp32 cannot read
        log.warning("checkpoint %s (no ZeRO, half precision) holds no fp32 master weights that "
                    "can be read: exporting its %s weights as fp32", ckpt,
                    next(iter(state["module"].values())).dtype)
        return module
    meta = create_model(cfg.model, device="meta")
    names = {id(p): n for n, p in meta.named_parameters()}
    order = [names[id(p)] for g in param_groups(meta, 0.0) for p in g["params"]]
    flat = [t for g in groups or [] for t in g]
    ok = len(order) == len(flat) and all(
        tuple(t.shape) == tuple(module[n].shape)
        and torch.equal(t.to(state["module"][n].dtype), state["module"][n])
        for n, t in zip(order, flat))
    if not ok:
        raise CheckpointError(f"checkpoint '{ckpt}' (no ZeRO, half precision): its fp32 master "
                              f"weights do not line up with the model's parameters")
    module.update({n: t.float() for n, t in zip(order, flat)})
    return module


def _tracking_run_id(client: dict, ckpt: Path) -> Optional[str]:
    """The MLflow run of the pretraining: in the client state, or - for a checkpoint written
    before the tracker had reached MLflow - in the output dir's ``tracking/run.json``."""
    if client.get("tracking_run_id"):
        return str(client["tracking_run_id"])
    from pretrain.spool import STATE, TRACKING_DIR

    state = ckpt.parent.parent / TRACKING_DIR / STATE
    if ckpt.parent.name == "checkpoints" and state.is_file():
        try:
            return json.loads(state.read_text()).get("run_id") or None
        except ValueError:
            return None
    return None


def tensors_that_differ(expected: dict, got: dict) -> list[str]:
    """Names missing from either state dict, then those whose shapes differ (sorted)."""
    want = {k: tuple(v.shape) for k, v in expected.items()}
    have = {k: tuple(v.shape) for k, v in got.items()}
    return sorted(set(want) ^ set(have)) + sorted(k for k in set(want) & set(have)
                                                 if want[k] != have[k])


def consolidate(path: Union[str, os.PathLike],
                origin: Optional[Union[str, os.PathLike]] = None) -> Consolidated:
    """Pretraining output dir or checkpoint dir -> the whole ViTClassifier in fp32 + metadata.
    ``origin``: the path the user gave, when ``path`` is the checkpoint already resolved from it.
    A job still saving into the output dir may prune the checkpoint while it is read: then the
    newest one is read instead (an output dir given), or that is said (a step given)."""
    origin = Path(origin if origin is not None else path)
    ckpt = resolve_checkpoint(path)
    for _ in range(3):
        try:
            return _consolidate(ckpt)
        except Exception:
            if not _pruned(ckpt):
                raise
            newest = ckpt
            if origin.resolve() != ckpt.resolve():
                try:
                    newest = resolve_checkpoint(origin, warn=False)
                except CheckpointError:
                    pass
            if newest == ckpt:
                raise CheckpointError(
                    f"checkpoint '{ckpt}' was removed while it was read (a job still saving "
                    f"there prunes old steps: checkpoint.keep_last); name a newer step, or the "
                    f"output dir for the newest") from None
            log.warning("checkpoint %s was removed while it was read (pruned by the job "
                        "saving there); reading %s instead", ckpt, newest)
            ckpt = newest
    raise CheckpointError(f"the checkpoints of '{origin}' were pruned while each was read; stop "
                          f"the job saving there, or export one of its steps once it is done")


def _pruned(ckpt: Path) -> bool:
    """Whether ``ckpt`` is gone or going (a prune deletes its files before the folder)."""
    if not ckpt.exists():
        return True
    if not TAG_RE.match(ckpt.name):  # not in one of our stores: nothing prunes it
        return False
    try:
        return ckpt.name not in {c.path.name for c in CheckpointStore(ckpt.parent).complete()}
    except OSError:  # a file of its listing went meanwhile
        return True


def _consolidate(ckpt: Path) -> Consolidated:
    from pretrain.model import create_model, resolve_spec

    client = read_client_state(ckpt)
    cfg, config_yaml = _config_of(client, ckpt)
    spec = resolve_spec(cfg.model)
    manifest = json.loads((ckpt / MANIFEST).read_text()) if (ckpt / MANIFEST).is_file() else {}
    zero_stage = manifest.get("zero_stage")
    if zero_stage is None:
        zero_stage = int((client.get("ds_config") or {}).get("zero_optimization", {})
                         .get("stage", 0))
    try:
        sd = _fp32_from_deepspeed(ckpt, int(zero_stage), cfg)
    except CheckpointError:
        raise
    except (FileNotFoundError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"DeepSpeed could not consolidate '{ckpt}': {first}") from None
    sd = {k: v.detach().float().contiguous().cpu() for k, v in sd.items()}

    # The weights must be exactly the architecture the config describes.
    diff = tensors_that_differ(create_model(cfg.model, "meta").state_dict(), sd)
    if diff:
        raise CheckpointError(f"checkpoint '{ckpt}' does not hold the model its config describes "
                              f"({len(diff)} tensors differ, e.g. {diff[0]})")
    step = client.get("step", manifest.get("step"))
    return Consolidated(state_dict=sd, spec=spec, source=str(ckpt),
                        step=int(step) if step is not None else None, config_yaml=config_yaml,
                        tracking_run_id=_tracking_run_id(client, ckpt), zero_stage=int(zero_stage),
                        world_size=manifest.get("world_size", client.get("world_size")))

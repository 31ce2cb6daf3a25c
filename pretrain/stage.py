"""What a stage adds to the one training loop (:func:`pretrain.trainer.train`).

A stage picks the backend that runs the step, the weights the model starts from, what is
evaluated every N steps (and on which weights), and what is done with the results. The base
class is pretraining's answer where it has one; :class:`finetune.stage.FinetuneStage` overrides
what fine-tuning does differently.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Callable, Optional

from torch import nn

from pretrain.config import RunConfig


class Stage:
    name = "pretrain"  # MLflow's ``stage`` tag
    verb = "training"  # the start line: "training vit_large... for 90000 steps"

    def backend(self, cfg: RunConfig):
        """Join the process group; the backend builds the engine later (:meth:`build`)."""
        from pretrain.engine import DeepSpeedBackend
        return DeepSpeedBackend(cfg)

    def prepare_data(self, cfg: RunConfig) -> None:
        """The built-in demo's data, generated on first use."""
        if cfg.data.generate_demo:
            from pretrain.demo import ensure_demo_data
            ensure_demo_data(cfg.data.root, cfg.model.num_classes)

    def inputs(self, cfg: RunConfig) -> list:
        """Paths the run reads (never moved aside with an earlier run in its output_dir)."""
        return [cfg.data.root, cfg.eval.fewshot_root]

    def holdout(self, cfg: RunConfig) -> float:
        """Share of the train split kept out of training (fine-tuning's dev split)."""
        return 0.0

    # init_weights(model) runs on a fresh run, before the backend wraps the model; None: the
    # model's own initialisation
    init_weights: Optional[Callable[[nn.Module], None]] = None

    def evaluators(self, cfg: RunConfig, spec, backend) -> list:
        return []

    def evaluated(self, backend) -> nn.Module:
        """The weights the figures (and exports) are of."""
        return backend.module

    def after_eval(self, results: dict, step: int, backend, tracker) -> None:
        """Act on an evaluation's results (collective: every rank calls it)."""

    def finish(self, backend, step: int, sink, tracker, stop_point: Callable[[str], None]) \
            -> dict:
        """After the last step (``step``: train.total_steps, or past it where a relaunch lowered
        it) and its checkpoint; returns more final metrics. Every rank
        calls ``stop_point(what comes next)`` at the same points, before each long part (an
        evaluation, exports): a rank's stop signal ends the job there (exit code 4)."""
        return {}

    # Whether finish() reads the trained weights from the backend. Pretraining's reads the
    # checkpoint's files, so a run relaunched after its last step (a requeue after the
    # finish, say) takes only the step and its MLflow run from the checkpoint: on another world
    # size nothing is converted to DeepSpeed's universal layout (a checkpoint-sized copy).
    finish_reads_weights = False

    def tracking_tags(self) -> dict:
        return {}

    def describe_start(self) -> str:
        return ""

    # what the stage keeps across a restart, in the checkpoint's client state (plain data)
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class PretrainStage(Stage):
    """Pretraining: DeepSpeed, held-out classification and the few-shot probe; with
    ``tracking.log_model`` the backbone is exported and logged as an MLflow model at the end."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg

    def inputs(self, cfg: RunConfig) -> list:
        return super().inputs(cfg) + [cfg.deepspeed.config]

    def evaluators(self, cfg: RunConfig, spec, backend) -> list:
        return build_evaluators(cfg, spec, backend.rank, backend.world_size, backend.device,
                                backend.dtype)

    def finish(self, backend, step: int, sink, tracker, stop_point) -> dict:
        t = self.cfg.tracking
        if t.logs_model(by_default=False):
            stop_point("the backbone's export for MLflow")
            if backend.rank == 0:
                log_backbone(self.cfg.output_dir, tracker, t.register_as)
        return {}


def log_backbone(output_dir, tracker, register_as: Optional[str]) -> None:
    """``output_dir/backbone/`` (timm's layout, :mod:`pretrain.timm_folder`) from the newest
    complete checkpoint, which the loop has just written, logged as the run's MLflow model."""
    import logging

    from pretrain.consolidate import consolidate
    from pretrain.timm_folder import write_timm_folder
    out = Path(output_dir)
    logging.getLogger(__name__).info("exporting the backbone to %s for MLflow (timm layout, "
                                     "from the newest checkpoint)", out / "backbone")
    try:
        c = consolidate(out)
        folder = write_timm_folder(c, out / "backbone")
    except Exception as e:  # noqa: BLE001 -- training is done and checkpointed: say, go on
        logging.getLogger(__name__).warning(
            "could not export the backbone for MLflow (%s); `python launch/export.py %s --out "
            "FOLDER` writes it from the checkpoint", str(e).splitlines()[0] if str(e) else
            type(e).__name__, out)
        return
    tracker.log_model(folder, register_as, about={"export": "backbone", "step": c.step})


def build_evaluators(cfg: RunConfig, spec, rank: int, world: int, device, dtype) -> list:
    """Held-out classification on data.val_split; the few-shot probe when eval.fewshot_root."""
    from pretrain.data.device_batch import normalize
    from pretrain.evaluate import ClassificationEvaluator

    common = dict(normalize=functools.partial(normalize, mode=cfg.data.normalize),
                  device=device, dtype=dtype)
    out = []
    if not cfg.data.val_split and rank == 0:
        warn_unused(cfg, ("val_name", "every_steps", "max_samples")
                     + (() if cfg.eval.fewshot_root else ("batch_size",)),
                     "data.val_split=null: there is no held-out classification")
    if cfg.data.val_split:
        out.append(ClassificationEvaluator(
            eval_data(cfg, spec, rank, world, cfg.data.val_split, num_classes=spec.num_classes),
            name=cfg.eval.val_name, every_steps=cfg.eval.every_steps,
            max_samples=cfg.eval.max_samples, **common))
    return out + fewshot_evaluators(cfg, spec, rank, world, **common)


def eval_data(cfg: RunConfig, spec, rank: int, world: int, split: str, *,
              root: Optional[str] = None, holdout: float = 0.0,
              num_classes: Optional[int] = None) -> Callable:
    """What an evaluator iterates: ``split`` of ``root`` (data.root by default), or the
    ``holdout`` share of it. Built now, so a missing or unreadable split fails at start, not at
    the first evaluation. ``num_classes``: the model's; a label beyond it is skipped and
    counted, as in training, rather than indexing past the logits."""
    from pretrain.data.eval_loader import build_eval_loader

    data = cfg.data if root is None else cfg.data.model_copy(update={"root": root})
    loader = build_eval_loader(data, img_size=spec.img_size, split=split,
                               batch_size=cfg.eval.batch_size, rank=rank, world_size=world,
                               holdout=holdout, num_classes=num_classes)
    return lambda: loader


def fewshot_name(root: str) -> str:
    """``fewshot_<folder>``: the probe's metric prefix, in the characters MLflow takes."""
    import re  # a safe subset of pretrain.config.METRIC_NAME_CHARS: no spaces in a prefix
    return "fewshot_" + re.sub(r"[^\w\-.]", "_", Path(root.rstrip("/")).name)


def check_fewshot_root(cfg: RunConfig, info=None):
    """eval.fewshot_root's info (None when unset; ``info``: read already), refused as the run
    refuses it, in the probe's own keys (``--dry-run`` checks a root it can read too)."""
    from pretrain.data.info import DatasetInfoError, read_info

    e = cfg.eval
    if not e.fewshot_root:
        return None
    try:
        info = info or read_info(e.fewshot_root)
        for split in (e.fewshot_train_split, e.fewshot_test_split):
            info.split(split)
    except DatasetInfoError as err:
        raise in_probe_keys(err) from None
    return info


def in_probe_keys(err):
    """A data error whose fix names the data.* keys, naming the probe's, which are meant."""
    from pretrain.data.info import VAL_SPLIT_NULL
    return type(err)(str(err).replace(VAL_SPLIT_NULL, "")
                     .replace("data.train_split / data.val_split",
                              "eval.fewshot_train_split / eval.fewshot_test_split")
                     .replace("data.root", "eval.fewshot_root"))


def warn_unused(cfg: RunConfig, keys: tuple, why: str) -> None:
    """One warning for the eval.* ``keys`` the recipe or command line set that do nothing."""
    unused = [f"eval.{k}={getattr(cfg.eval, k)}" for k in keys if k in cfg.eval.model_fields_set]
    if unused:
        logging.getLogger(__name__).warning("%s %s nothing: %s", ", ".join(unused),
                                            "does" if len(unused) == 1 else "do", why)


def fewshot_evaluators(cfg: RunConfig, spec, rank: int, world: int, **common) -> list:
    """The few-shot linear probe on eval.fewshot_root, when it is set (either stage)."""
    from pretrain.data.info import DatasetInfoError
    from pretrain.fewshot import FewShotEvaluator

    e = cfg.eval
    info = check_fewshot_root(cfg)
    if info is None:
        if rank == 0:
            warn_unused(cfg, ("fewshot_train_split", "fewshot_test_split", "fewshot_shots",
                               "fewshot_every_steps", "fewshot_l2_reg"),
                         "eval.fewshot_root is unset: there is no few-shot probe")
        return []
    classes = info.classes
    try:
        train, test = (eval_data(cfg, spec, rank, world, split, root=e.fewshot_root)
                       for split in (e.fewshot_train_split, e.fewshot_test_split))
    except DatasetInfoError as err:
        raise in_probe_keys(err) from None
    return [FewShotEvaluator(
        train, test, name=fewshot_name(e.fewshot_root),
        every_steps=e.fewshot_every_steps, shots=e.fewshot_shots, l2_reg=e.fewshot_l2_reg,
        num_classes=len(classes) if classes else None, seed=cfg.seed, **common)]

"""Fine-tuning (ViT paper, App. B.1.1) as a stage of the one training loop: one
zero-initialised head on a pretrained backbone, SGD with momentum, cosine decay, a dev split
carved from train for choosing and the official test/val split for the reported figure; the
best (by dev top-1) and final weights exported as safetensors with a small JSON model card.

The loop itself -- checkpoints, exact resume, stopping on a signal, the non-finite guard and
rollback, tracking -- is :func:`pretrain.trainer.train`, shared with pretraining.
"""
from __future__ import annotations

import dataclasses
import functools
import io
import json
import logging
from pathlib import Path
from typing import Optional

from finetune.config import FinetuneConfig
from pretrain.distributed import rank
from pretrain.spool import redacted
from pretrain.stage import Stage

log = logging.getLogger("finetune")

# Fewer dev images than this, and best.safetensors is chosen on a top-1 that moves in steps of
# 4 % or more: the choice is noise, and the run says so.
DEV_IMAGES_FEW = 25


def finetune(cfg: FinetuneConfig) -> dict:
    """Fine-tune until ``train.total_steps``; returns the final metrics (rank 0's view)."""
    from pretrain.trainer import train
    return train(cfg, FinetuneStage(cfg))


def _store_of(run_id: Optional[str], *places) -> Optional[str]:
    """The MLflow store of the pretraining run ``run_id``, where one of ``places`` (the init
    given: an output_dir, a checkpoint in its checkpoints/) is its output_dir."""
    from pretrain.producing_run import run_state
    for place in filter(None, places):
        for folder in (Path(place), Path(place).parent.parent):
            state = run_state(folder) if run_id and folder.is_dir() else None
            if state is not None and state.run_id == run_id:
                return state.uri
    return None


class FinetuneStage(Stage):
    name = "finetune"
    verb = "fine-tuning"

    def __init__(self, cfg: FinetuneConfig):
        self.cfg = cfg
        self.lineage = {"format": "scratch"}
        self.best = -1.0  # dev top-1 of best.safetensors
        self.test = None
        self.dev = None  # the dev split's evaluator, which best.safetensors is chosen on

    def backend(self, cfg):
        from finetune.backend import AccelerateBackend
        return AccelerateBackend(cfg)

    def prepare_data(self, cfg) -> None:
        from pretrain.checkpoint import resume_point
        # a wrong init fails now, not after the data and the model are built; a resumed run
        # has its weights in its checkpoint (its init may be gone: a pretraining checkpoint
        # removed by keep_last, a purged scratch folder)
        if cfg.init and resume_point(cfg) is None:
            from finetune.weights import check_init
            check_init(cfg.init)
        if cfg.model.representation_size and rank() == 0:
            log.warning("model.representation_size=%s keeps a pre-logits layer, which timm's "
                        "ViT has no place for: best/ and final/ will hold the backbone without "
                        "its head, and no MLflow model is logged (best.safetensors and "
                        "final.safetensors hold the whole classifier, for evaluate.py); "
                        "model.representation_size=null is the paper's transfer",
                        cfg.model.representation_size)
        if cfg.data.generate_demo:
            from pretrain.demo import ensure_demo_data
            ensure_demo_data(cfg.data.root, cfg.model.num_classes, layout="cifar10")

    def inputs(self, cfg) -> list:
        return super().inputs(cfg) + [cfg.init]

    def holdout(self, cfg) -> float:
        return cfg.data.dev_fraction

    finish_reads_weights = True  # the test split and the exports are of the final weights

    def init_weights(self, model) -> None:
        if self.cfg.init:
            from finetune.weights import load_init
            # plain data: it goes into the checkpoint's client state (read weights_only)
            self.lineage = json.loads(json.dumps(
                load_init(model, self.cfg.init, normalize=self.cfg.data.normalize), default=str))
            if rank() == 0:
                log.info("%s", init_line(self.lineage, model.spec.grid))
            if "pre_logits" in self.lineage["new"] and rank() == 0:
                log.warning("init '%s' has no pre-logits layer: model.representation_size=%s "
                            "starts it from random weights (set model.representation_size=null "
                            "to drop it, as the paper's transfer does)", self.cfg.init,
                            self.cfg.model.representation_size)

    def describe_start(self) -> str:
        return f" from {self.cfg.init or 'scratch'}"

    def tracking_tags(self) -> dict:
        from pretrain.run_info import lineage_tags
        if not self.cfg.init:
            return {"init": "scratch"}
        run_id = self.lineage.get("pretrain_run_id")
        return lineage_tags(run_id, self.lineage.get("path"), self.lineage.get("step"),
                            store=_store_of(run_id, self.cfg.init, self.lineage.get("path")))

    def evaluators(self, cfg, spec, backend) -> list:
        from pretrain.data.device_batch import normalize
        from pretrain.engine import input_dtype
        from pretrain.evaluate import ClassificationEvaluator
        from pretrain.stage import warn_unused, eval_data, fewshot_evaluators

        # under train.precision's autocast, as the training forward (and launch/evaluate.py):
        # the EMA copy and the probe's pre-logits call are outside Accelerate's autocast
        common = dict(normalize=functools.partial(normalize, mode=cfg.data.normalize),
                      device=backend.device, dtype=input_dtype(cfg.train.precision))
        rank, world = backend.rank, backend.world_size

        def evaluator(name, split, holdout=0.0):
            empty = {"fix_if_empty": f"the hash of its keys held none of '{split}' out: raise "
                                     f"data.dev_fraction={holdout:g}"} if holdout else {}
            return ClassificationEvaluator(
                eval_data(cfg, spec, rank, world, split, holdout=holdout,
                          num_classes=spec.num_classes),
                name=name, every_steps=cfg.eval.every_steps, max_samples=cfg.eval.max_samples,
                **common, **empty)

        if cfg.data.val_split:  # the reported figure: once, after the last step (finish)
            self.test = evaluator(cfg.eval.val_name or cfg.data.val_split, cfg.data.val_split)
        elif rank == 0:
            warn_unused(cfg, ("val_name",), "data.val_split=null: no split is evaluated after "
                                             "the last step")
        # model selection on the dev split held out of train, every eval.every_steps
        dev = [evaluator("dev", cfg.data.train_split, cfg.data.dev_fraction)] \
            if cfg.data.dev_fraction else []
        self.dev = dev[0] if dev else None
        if not dev and "every_steps" in cfg.eval.model_fields_set and rank == 0:
            log.warning("eval.every_steps=%d evaluates nothing: the fine-tune's periodic "
                        "evaluation (and its best export) is on the dev split, and "
                        "data.dev_fraction=0 holds none out; %s", cfg.eval.every_steps,
                        f"'{cfg.data.val_split}' is evaluated once, after the last step"
                        if cfg.data.val_split else "no split is evaluated")
        if not dev and not cfg.data.val_split and rank == 0:
            warn_unused(cfg, ("max_samples",) + (() if cfg.eval.fewshot_root else ("batch_size",)),
                        "data.val_split=null and data.dev_fraction=0: no split is evaluated")
        return dev + fewshot_evaluators(cfg, spec, rank, world, **common)

    def evaluated(self, backend):
        """The EMA weights when there are any: figures and exports are of the average."""
        return backend.ema.module if backend.ema is not None else backend.model

    def after_eval(self, results: dict, step: int, backend, tracker) -> None:
        top1 = results.get("eval/dev/top1")
        if top1 is not None and self.best < 0 and backend.rank == 0 and \
                self.dev.samples < DEV_IMAGES_FEW:  # said once, at the first dev evaluation
            d = self.cfg.data
            log.warning("the dev split holds %d image%s (data.dev_fraction=%g of '%s'): "
                        "best.safetensors is chosen on a top-1 that moves in steps of %.0f %%; "
                        "raise data.dev_fraction%s (the paper holds out 2 %% of CIFAR's train, "
                        "1,000 images)", self.dev.samples, "" if self.dev.samples == 1 else "s",
                        d.dev_fraction, d.train_split, 100 / self.dev.samples,
                        "" if self.cfg.eval.max_samples is None else
                        f" or eval.max_samples={self.cfg.eval.max_samples}, which caps it")
        if top1 is not None and top1 > self.best:
            self.best = top1
            self._export(backend, "best", step, results, tracker.settled_run_id())

    def finish(self, backend, step: int, sink, tracker, stop_point) -> dict:
        results = {}
        if self.test is not None:
            stop_point(f"the final evaluation on '{self.test.name}'")
            results = {f"eval/{self.test.name}/{k}": v
                       for k, v in self.test.run(self.evaluated(backend), step).items()}
            sink.log(results, step)
            if backend.rank == 0:
                per_class = {str(c): acc for c, acc in enumerate(self.test.per_class_top1)}
                out = Path(self.cfg.output_dir)
                (out / "per_class_top1.json").write_text(json.dumps(per_class, indent=1))
                tracker.log_artifact_bytes("per_class_top1.json", json.dumps(per_class).encode())
                tracker.log_artifact_bytes("per_class_top1.png",
                                           per_class_png(self.test.per_class_top1, self.test.name))
        stop_point("the final exports")
        self._export(backend, "final", step, results, tracker.settled_run_id())
        t = self.cfg.tracking
        # (a model that kept its pre-logits exports a backbone: not one to log as the run's)
        if backend.rank == 0 and t.logs_model(by_default=not self.cfg.model.representation_size):
            # the model a user would pick: best by dev top-1 (final without a dev split)
            out = Path(self.cfg.output_dir)
            name = "best" if (out / "best").is_dir() else "final"
            try:
                about, description = self._about(out, name, step, results)
            except (OSError, ValueError, KeyError) as e:  # a card gone or edited: still logged
                log.warning("cannot read %s (%s); the MLflow model is logged without its step "
                            "and figures", out / f"{name}.json", e)
                about, description = {"export": name}, None
            tracker.log_model(out / name, t.register_as, about, description)
        return results

    def _about(self, out: Path, name: str, steps: int, results: dict) -> tuple[dict, str]:
        """Which weights the logged model is, for its run's tags and its registered version:
        the run's test figures are of the final weights, which best may not be."""
        card = json.loads((out / f"{name}.json").read_text())
        about = {"export": name, "step": card["step"],
                 **{k: f"{v:.6g}" for k, v in card["metrics"].items()}}
        if name == "final" or card["step"] == steps:
            return about, f"{name}: the weights after step {steps}, of which the run's figures are"
        text = (f"best: the weights at step {card['step']} of {steps}, with the highest "
                f"eval/dev/top1 ({card['metrics'].get('eval/dev/top1', float('nan')):.4f})")
        if results:
            d = self.cfg.data
            text += (f"; the run's {', '.join(sorted(results))} are of its final weights (step "
                     f"{steps}); `python launch/evaluate.py {out / 'best'} --data {d.root} "
                     f"--split {d.val_split}` gives this model's")
        return about, text

    def state_dict(self) -> dict:
        return {"best": self.best, "lineage": self.lineage}

    def load_state_dict(self, state: dict) -> None:
        self.best = float(state.get("best", -1.0))
        self.lineage = state.get("lineage") or self.lineage

    def _export(self, backend, name: str, step: int, metrics: dict,
                run_id: Optional[str]) -> None:
        """``<name>.safetensors`` plus ``<name>.json``, a model card a person or script can read,
        and the folder ``<name>/`` for timm (collective: the weights are gathered from every rank
        first). ``run_id``: this run's MLflow run, so a copy of the files that left the output
        folder still names the run it came from (None where the server was not reached)."""
        from safetensors.torch import save_file

        from pretrain.atomic_write import write_atomic
        from pretrain.evaluation_report import set_aside_evaluations

        state = backend.full_state_dict(backend.ema.module if backend.ema is not None else None)
        if state is None:  # not the main process
            return
        cfg, spec = self.cfg, backend.module.spec
        root = redacted(cfg.data.root) if cfg.data.root else cfg.data.root  # (a file to share)
        card = {"model": spec.name, "resolution": spec.img_size, "ema_decay": cfg.train.ema_decay,
                "num_classes": spec.num_classes, "dataset": root, "step": step,
                "tracking_run_id": run_id, "init": self.lineage,
                "metrics": {k: v for k, v in metrics.items() if k.startswith("eval/")}}
        path = Path(cfg.output_dir) / f"{name}.safetensors"
        set_aside_evaluations(path.parent, name, step)
        # the architecture and the run's config too, as export.py's full file has them: a copy
        # of the file alone still evaluates and fine-tunes
        metadata = {"model_card": json.dumps(card), "spec": json.dumps(dataclasses.asdict(spec)),
                    "config": redacted(cfg.to_yaml())}
        write_atomic(path, lambda tmp: save_file(state, str(tmp), metadata=metadata))
        write_atomic(path.with_suffix(".json"), json.dumps(card, indent=1))
        self._export_timm_folder(state, spec, Path(cfg.output_dir) / name, step, card["metrics"],
                                 run_id)

    def _export_timm_folder(self, state: dict, spec, out: Path, step: int, metrics: dict,
                            run_id: Optional[str]) -> None:
        """``<name>/`` in timm's layout (config.json, model.safetensors, README.md): loads with
        ``timm.create_model("local-dir:<name>", pretrained=True)`` and nothing else."""
        from pretrain.consolidate import Consolidated

        c = Consolidated(state_dict=state, spec=spec, source=str(out.with_suffix(".safetensors")),
                         step=step, tracking_run_id=run_id)
        write_finetune_folder(c, out, normalize=self.cfg.data.normalize,
                              dataset=self.cfg.data.root, metrics=metrics, lineage=self.lineage)


def write_finetune_folder(c, out, *, normalize: Optional[str] = None,
                          dataset: Optional[str] = None, metrics: Optional[dict] = None,
                          lineage: Optional[dict] = None) -> Path:
    """A fine-tune's weights (a :class:`pretrain.consolidate.Consolidated`) as ``out/`` in timm's
    layout, head included (the run's own exports, ``launch/export.py`` of one of its
    checkpoints); ``normalize`` / ``dataset``: from ``c``'s run config when not given."""
    from pretrain.timm_folder import head_fits, write_timm_folder

    # a fine-tune swaps the pre-logits away; a model that kept them (trained from scratch with
    # model.representation_size) cannot carry its head into timm's ViT: its backbone then
    return write_timm_folder(c, out, head=head_fits(c.spec),
                             normalize=normalize, dataset=dataset, metrics=metrics,
                             lineage=lineage)


def init_line(lineage: dict, grid: int) -> str:
    """What the init gave the model, said at the start: the paper's transfer is checked in the
    log (position embeddings resampled, pre-logits and head dropped, a new head)."""
    step = f" at step {lineage['step']}" if lineage.get("step") is not None else ""
    was = lineage.get("pos_embed_grid") or []
    moved = f"; position embeddings resampled from {was[0]}x{was[0]} to {grid}x{grid}" \
        if was and was[0] != grid else ""
    dropped = f"; left out: {', '.join(lineage['dropped'])}" if lineage.get("dropped") else ""
    fresh = list(lineage.get("new") or []) + ([] if "head" in (lineage.get("loaded") or [])
                                              else ["head"])
    new = f"; new: {', '.join(fresh)}" if fresh else ""
    return (f"init: {', '.join(lineage.get('loaded') or []) or 'nothing'} from "
            f"{lineage.get('path')} ({lineage.get('format')}{step}){moved}{dropped}{new}")


def per_class_png(per_class: list, split: str) -> bytes:
    """A bar chart of top-1 per class (classes absent from the split are left out)."""
    import matplotlib
    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt

    shown = [(c, acc) for c, acc in enumerate(per_class) if acc is not None]
    fig, ax = plt.subplots(figsize=(max(6, len(shown) * 0.12), 3), dpi=100)
    ax.bar([c for c, _ in shown], [acc for _, acc in shown], width=0.9)
    ax.set(xlabel="class", ylabel="top-1", ylim=(0, 1), title=f"per-class top-1 on {split}")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()

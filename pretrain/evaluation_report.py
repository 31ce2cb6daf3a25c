"""Where ``launch/evaluate.py``'s figures go: the output folder, its files (metrics, per-class
top-1, the confusion matrix as CSV + PNG or sparse JSON), the lines printed, and the MLflow
evaluation run. Kept apart from :mod:`pretrain.evaluate_model`, which computes the figures and
writes nothing: what is written, printed and logged can change without touching the figures.

MLflow: the evaluation is written as a run record into ``OUT/tracking/`` (run.json, one spool
line, the artifacts) and delivered by :func:`pretrain.mlflow_delivery.upload_spool`, the mechanism
training's tracker and ``launch/upload_spool.py`` share. So a server that is down costs one
warning, and ``python launch/upload_spool.py OUT`` sends the evaluation later. The run goes into
the source run's experiment, nested under it.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from pretrain.evaluate_model import EvaluateError, Evaluation
from pretrain.model_files import ModelFile
from pretrain.spool import redacted

log = logging.getLogger(__name__)

OUTPUTS = ("metrics.json", "per_class_top1.json", "confusion_matrix.csv",
           "confusion_matrix.json", "confusion_matrix.png")
DENSE_MAX_CLASSES = 1000  # beyond: the confusion matrix as sparse JSON cells, no picture
SHOW_ALL_CLASSES = 20  # printed in full up to this many classes; beyond, the worst and best
SHOW_FEW = 5
DEFAULT_EXPERIMENT = "vitscale"  # tracking.experiment's default, both stages


# --------------------------------------------------------------------------------------------
# Where the results go, and what is written there
# --------------------------------------------------------------------------------------------
def output_dir(model: str, split: str, out: Optional[str], overwrite: bool) -> Path:
    """``--out``, refused when it already holds an evaluation (unless ``overwrite``); by default
    a new folder next to the model, ``<model>-eval-<split>`` (``-2``, ``-3``... when taken)."""
    if out:
        p = Path(out)
        if p.exists() and not p.is_dir():
            raise EvaluateError(f"--out '{out}' is a file; name a folder")
        if (p / "config.json").is_file() and (p / "model.safetensors").is_file():
            # the folder one publishes: its files are the model's, not an evaluation's
            raise EvaluateError(f"--out '{out}' is a model folder; name another folder (e.g. "
                                f"{p.name}-eval-{split})")
        if (p / "config.yaml").is_file() or (p / "checkpoints").is_dir():
            # --overwrite there would replace a fine-tune's per_class_top1.json and tracking/
            raise EvaluateError(f"--out '{out}' is a training run's output dir; name another "
                                f"folder (e.g. {p.name}-eval-{split})")
        held = [f for f in (*OUTPUTS, "tracking") if (p / f).exists()]
        if held and not overwrite:
            raise EvaluateError(f"--out '{out}' already holds an evaluation ({held[0]}); name a "
                                f"new folder, or pass --overwrite to replace it")
        return _writable(p, f"--out '{out}'")
    m = _out_of_checkpoints(Path(model.rstrip("/")))  # not among the step dirs
    base = m.with_name(f"{m.name}-eval-{split}")
    p, i = base, 2
    while p.exists():
        p, i = base.with_name(f"{base.name}-{i}"), i + 1
    return _writable(p, f"the results' folder '{p}' (next to the model)")


def set_aside_evaluations(folder: Path, name: str, step: Optional[int]) -> list[str]:
    """Before a run replaces its export ``name`` (``final``, ``best``: the folder and the
    ``.safetensors``) with the weights of ``step``: the evaluations made of the export it
    replaces (``name-eval-*``, ``name.safetensors-eval-*``) would sit next to the new weights
    and pass for theirs. Each is renamed after the weights it describes,
    ``name-step<N>-eval-<split>`` (``name.safetensors-step<N>-...``), nothing deleted; one of
    these same weights (the end done again at the same step) stays. Rank 0; returns
    ``"old -> new"`` for each folder renamed, and says them in the log."""
    moved = []
    for prefix in (name, f"{name}.safetensors"):
        for p in sorted(folder.glob(f"{prefix}-eval-*")):
            try:
                was = json.loads((p / "metrics.json").read_text()).get("step")
            except (OSError, ValueError, AttributeError):  # not an evaluation's folder: the
                continue                                  # user's, left as it is
            if was == step:
                continue
            new_name = f"{prefix}-{'earlier' if was is None else f'step{was}'}" \
                       f"{p.name[len(prefix):]}"
            target, i = p.with_name(new_name), 2
            while target.exists():
                target, i = p.with_name(f"{new_name}-{i}"), i + 1
            try:
                p.rename(target)
            except OSError as e:
                log.warning("%s is an evaluation of the %s the run now replaces, and could not "
                            "be renamed (%s): it does not describe the new %s", p, prefix,
                            e.strerror or e, prefix)
                continue
            moved.append(f"{p.name} -> {target.name}")
    if moved:
        log.info("%s: replaced by the weights of step %s; its evaluations of the earlier ones "
                 "were renamed after the weights they describe (nothing deleted): %s",
                 folder / name, step, ", ".join(moved))
    return moved


def _writable(p: Path, what: str) -> Path:
    """``p``, once a file can be made there: found now, not after an evaluation of hours."""
    made = not p.exists()
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        raise EvaluateError(f"{what} cannot be written ({e.strerror or e}); name a folder "
                            f"with --out that can") from None
    if made:
        p.rmdir()  # (made again with the results)
    return p


def _out_of_checkpoints(path: Path) -> Path:
    """A checkpoint's step dir as if it sat in its run dir (``RUN/step_N``): where its results
    go, and what names its evaluation (``RUN/checkpoints/step_N`` of every run reads alike)."""
    from pretrain.checkpoint import TAG_RE
    if TAG_RE.match(path.name) and path.parent.name == "checkpoints":
        return path.parent.parent / path.name
    return path


def run_name(split: str, model: os.PathLike | str) -> str:
    """The evaluation's MLflow run name: the split and the model's folder and name."""
    return f"eval {split}: {'/'.join(_out_of_checkpoints(Path(model).resolve()).parts[-2:])}"


def write_outputs(ev: Evaluation, out: Path) -> list[Path]:
    """metrics.json, per_class_top1.json, the confusion matrix (CSV + PNG, or sparse JSON
    beyond :data:`DENSE_MAX_CLASSES`) into ``out``; returns the files written."""
    from pretrain.evaluate import confusion_matrix
    from pretrain.atomic_write import write_atomic

    out.mkdir(parents=True, exist_ok=True)
    for stale in OUTPUTS:  # --overwrite: an older evaluation's files must not linger
        (out / stale).unlink(missing_ok=True)
    mf = ev.mf
    metrics = {"model": str(mf.path), "kind": mf.kind, "architecture": mf.name,
               "step": mf.step, "img_size": mf.img_size, "normalize": mf.normalize,
               "data": redacted(_absolute(ev.root)), "dataset": ev.dataset, "split": ev.split,
               "samples": ev.samples, "top1": ev.top1, "top5": ev.top5, "device": ev.device,
               "precision": ev.precision, "batch_size": ev.batch_size,
               "source_run_id": mf.source_run_id, "reported": ev.reported,
               "warnings": ev.warnings,
               "per_class": ev.per_class}
    files = {"metrics.json": json.dumps(metrics, indent=1),
             # the fine-tune's own per_class_top1.json layout: class index -> top-1
             "per_class_top1.json": json.dumps({str(c["class"]): c["top1"]
                                                for c in ev.per_class}, indent=1)}
    n = mf.num_classes
    if n <= DENSE_MAX_CLASSES:
        dense = confusion_matrix(ev.cells, n)
        files["confusion_matrix.csv"] = _csv(dense, ev.names)
    else:
        dense = None
        files["confusion_matrix.json"] = json.dumps(
            {"classes": n, "names": ev.names, "cells (true, predicted, count)":
             ev.cells.tolist()})
    written = []
    for name, text in files.items():
        write_atomic(out / name, text.encode())
        written.append(out / name)
    if dense is not None:
        write_atomic(out / "confusion_matrix.png", confusion_png(dense, ev))
        written.append(out / "confusion_matrix.png")
    return written


def _csv(dense: torch.Tensor, names: Optional[list]) -> str:
    import csv
    import io
    labels = names or [str(i) for i in range(len(dense))]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["true \\ predicted", *labels])
    for label, row in zip(labels, dense.tolist()):
        w.writerow([label, *row])
    return buf.getvalue()


def confusion_png(dense: torch.Tensor, ev: Evaluation) -> bytes:
    """Rows normalised to the true class's samples; names on the axes when they fit."""
    import io

    import matplotlib
    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt

    n = len(dense)
    rows = dense.double().sum(dim=1, keepdim=True)
    share = (dense.double() / rows.clamp(min=1)).numpy()
    side = min(max(5.0, 0.45 * n + 2.5), 20.0)
    fig, ax = plt.subplots(figsize=(side, side * 0.9), dpi=100)
    im = ax.imshow(share, cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
    if n <= 40:
        labels = ev.names or [str(i) for i in range(n)]
        ax.set_xticks(range(n), labels, rotation=90)
        ax.set_yticks(range(n), labels)
    if n <= 15:
        for t in range(n):
            for p in range(n):
                if dense[t, p]:
                    ax.text(p, t, str(int(dense[t, p])), ha="center", va="center", fontsize=8,
                            color="white" if share[t, p] > 0.5 else "black")
    ax.set(xlabel="predicted", ylabel="true",
           title=f"{ev.dataset} {ev.split}: top-1 {100 * ev.top1:.2f} % ({ev.samples} images)")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="share of the true class")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def report_lines(ev: Evaluation, out: Path, written: list) -> list[str]:
    mf = ev.mf
    lines = [f"model   {mf.path} ({mf.kind}: {mf.name}, {mf.img_size} px, {mf.num_classes} "
             f"classes" + (f", step {mf.step}" if mf.step is not None else "") + ")",
             f"data    {redacted(ev.root)} split '{ev.split}': {ev.samples} images, {ev.device} "
             f"{ev.precision}, normalize {mf.normalize}, batch {ev.batch_size}",
             f"top-1   {100 * ev.top1:.2f} %", f"top-5   {100 * ev.top5:.2f} %"]
    if ev.reported:
        r = ev.reported
        same = "the same" if abs(r["value"] - ev.top1) <= 1e-9 else \
            f"differs by {100 * (ev.top1 - r['value']):+.2f} points"
        lines.append(f"        the run reported {r['metric']} = {100 * r['value']:.2f} % at step "
                     f"{r['step']}: {same}")
    lines += [f"        warning: {w}" for w in ev.warnings]
    shown = [c for c in ev.per_class if c["samples"]]
    width = max([len(c["name"]) for c in shown] + [5])

    def row(c):
        return f"  {c['name']:<{width}}  {100 * c['top1']:6.2f} %  ({c['correct']}/{c['samples']})"

    lines.append(f"per-class top-1 ({len(ev.per_class)} classes"
                 + (f", {len(ev.per_class) - len(shown)} absent from the split" if
                    len(shown) < len(ev.per_class) else "") + "):")
    if len(shown) <= SHOW_ALL_CLASSES:
        lines += [row(c) for c in shown]
    else:
        ranked = sorted(shown, key=lambda c: (c["top1"], c["class"]))
        lines += [f" worst {SHOW_FEW}:", *map(row, ranked[:SHOW_FEW]),
                  f" best {SHOW_FEW}:", *map(row, ranked[-SHOW_FEW:]),
                  f" all {len(ev.per_class)}: {out / 'metrics.json'} (per_class), "
                  f"{out / 'per_class_top1.json'}"]
    lines.append(f"wrote   {out}/ ({', '.join(p.name for p in written)})")
    return lines


# --------------------------------------------------------------------------------------------
# MLflow
# --------------------------------------------------------------------------------------------
def tracking_uri(mf: ModelFile, given: Optional[str]) -> str:
    """--tracking-uri, else MLFLOW_TRACKING_URI, else where the source run is (its run.json),
    else training's default for this directory (:func:`pretrain.tracking_store.resolve_uri`)."""
    from pretrain.tracking_store import resolve_uri
    return given or os.environ.get("MLFLOW_TRACKING_URI") or mf.source_uri or resolve_uri()


def log_to_mlflow(ev: Evaluation, out: Path, written: list, uri: str) -> list[str]:
    """Record the evaluation in ``out/tracking/`` and deliver it; returns the lines to print.
    Never raises for MLflow's sake: a failure is one warning (the record stays for
    ``launch/upload_spool.py``)."""
    from pretrain.atomic_write import write_atomic
    from pretrain.mlflow_delivery import HTTP_DEFAULTS, upload_spool
    from pretrain.spool import ARTIFACTS, SPOOL, TRACKING_DIR, RunState, TrackingError, one_line
    for k, v in HTTP_DEFAULTS.items():  # fail fast when the server is down
        os.environ.setdefault(k, v)
    mf = ev.mf
    track = out / TRACKING_DIR
    if track.exists():  # --overwrite: the old evaluation's record goes with its files
        shutil.rmtree(track)
    parent, experiment, parent_dir = None, DEFAULT_EXPERIMENT, None
    source = _unsent_source(mf)
    if source is not None:  # its run is in its spool only: nested once that is uploaded
        parent_dir, experiment = str((mf.run_dir / TRACKING_DIR).resolve()), source.experiment
    elif mf.source_run_id:
        try:
            parent, experiment = _source_run(uri, mf.source_run_id)
        except Exception as e:  # noqa: BLE001 -- unreachable: upload_spool below says it once
            parent = mf.source_run_id  # the best guess; nested once the server has it
            log.debug("source run lookup failed: %s", one_line(e))
        if parent is None:
            log.info("source run %s is not in the MLflow store at %s: the evaluation is not "
                     "nested under it", mf.source_run_id, uri)
    else:
        log.info("no source run known for %s (no run id in the model, no tracking/run.json "
                 "in its run dir): the evaluation is not nested", mf.path)
    state = RunState(uri=uri, experiment=experiment, ended="FINISHED",
                     start_time=int(ev.started * 1000) if ev.started else None,
                     end_time=int(time.time() * 1000),
                     run_name=run_name(ev.split, mf.path),
                     params=_params(ev), tags=_tags(ev, parent), parent_dir=parent_dir,
                     parent_started=source.start_time if source is not None else None)
    (track / ARTIFACTS).mkdir(parents=True)
    for f in written:
        shutil.copy2(f, track / ARTIFACTS / f.name)
    record = {"step": mf.step or 0, "time": int(time.time() * 1000),
              "metrics": {f"eval/{ev.figure_name}/top1": ev.top1,
                          f"eval/{ev.figure_name}/top5": ev.top5}}
    write_atomic(track / SPOOL, (json.dumps(record) + "\n").encode())
    state.save(track)
    try:
        upload_spool(out, uri)
    except TrackingError as e:
        log.warning("%s; the figures above are complete, and `python launch/upload_spool.py "
                    "%s` sends the evaluation to MLflow later", e, out)
        return []
    run_id = RunState.load(track).run_id
    return [f"MLflow  run {run_id} ('{state.run_name}') in experiment '{experiment}' at {uri}"
            + (f", nested under run {parent}" if parent else "")]


def _unsent_source(mf: ModelFile):
    """The run state of the model's run when that run never reached MLflow (its run.json has
    no run id yet) and the model names no other run; else None."""
    from pretrain.producing_run import run_state
    if mf.source_run_id or mf.run_dir is None:
        return None
    state = run_state(mf.run_dir)
    return state if state is not None and state.run_id is None else None


def _source_run(uri: str, run_id: str) -> tuple[Optional[str], str]:
    """(run id, experiment name) of the source run in this store; (None, default) when the
    store does not hold it. Raises when the store cannot be reached."""
    from mlflow import MlflowClient

    from pretrain.mlflow_delivery import is_permanent
    client = MlflowClient(uri)
    try:
        run = client.get_run(run_id)
    except Exception as e:  # noqa: BLE001
        if is_permanent(e):
            return None, DEFAULT_EXPERIMENT
        raise
    return run_id, client.get_experiment(run.info.experiment_id).name


def _absolute(root: str) -> str:
    """A local --data as a path that names it from anywhere (the report outlives the shell)."""
    from pretrain.data.info import is_url
    return root if is_url(root) else os.path.abspath(root)


def _params(ev: Evaluation) -> dict:
    mf = ev.mf
    return {k: str(v) for k, v in {
        "model.path": Path(mf.path).resolve(), "model.kind": mf.kind, "model.step": mf.step,
        "model.img_size": mf.img_size, "data.root": redacted(_absolute(ev.root)),
        "data.split": ev.split, "data.normalize": mf.normalize, "eval.samples": ev.samples,
        "eval.device": ev.device, "eval.precision": ev.precision,
        "eval.batch_size": ev.batch_size}.items()}


def _tags(ev: Evaluation, parent: Optional[str]) -> dict:
    from pretrain.cli import REPO_ROOT
    from pretrain.run_info import git_info, source_tags
    mf = ev.mf
    tags = {"stage": "evaluate", "model": mf.name, "dataset": ev.dataset,
            "eval.split": ev.split, "eval.model_path": str(Path(mf.path).resolve()),
            **git_info(REPO_ROOT), **source_tags()}
    if mf.source_run_id:
        tags["eval.source_run_id"] = mf.source_run_id
    if parent:
        tags["mlflow.parentRunId"] = parent
    return tags

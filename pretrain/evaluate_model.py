"""``launch/evaluate.py``'s figures: a model on one split of a prepared dataset -- top-1, top-5,
per-class top-1, the confusion matrix's cells -- next to the figure its run reported. Where they
go (the files, the printed report, the MLflow run) is :mod:`pretrain.evaluation_report`.

Same figure as the run: the model is read by :mod:`pretrain.model_files` (the EMA weights of a
fine-tune that kept them), the split by the project's own eval loader
(:func:`pretrain.data.eval_loader.build_eval_loader`: centre crop 87.5 %, bilinear, the run's
``data.normalize``) and scored by :class:`pretrain.evaluate.ClassificationEvaluator`, in one
process, under the run's ``train.precision`` autocast, as both stages' backends evaluate on
a GPU and on the CPU alike. The run's eval batch size is kept too (a batched
matmul's last bits may depend on the batch). A pretraining run in bf16 evaluated its bf16 copy
of the weights, we the fp32 masters: equal up to rounding, exact in fp32.
"""
from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from pretrain.config import ConfigError
from pretrain.metrics import format_duration
from pretrain.model_files import ModelFile, trained_classes

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
log = logging.getLogger(__name__)


class EvaluateError(ConfigError):
    """Bad input to the command: one line naming the problem and the fix."""


@dataclass
class Evaluation:
    mf: ModelFile
    root: str
    split: str
    dataset: str
    names: Optional[list]
    top1: float
    top5: float
    per_class: list  # {"class", "name", "samples", "correct", "top1"} per class
    cells: torch.Tensor  # the confusion matrix's non-zero cells: (true, predicted, count)
    device: str
    precision: str
    batch_size: int
    reported: Optional[dict] = None  # the run's own figure for this split, when it has one
    notes: list = field(default_factory=list)
    # what puts the figure itself in doubt (labels that may mean other classes): shown with it
    warnings: list = field(default_factory=list)
    started: Optional[float] = None  # unix time the evaluation began: its MLflow run's start
    run_name_of_split: Optional[str] = None  # eval/<this>/top1 in the run's metrics.jsonl

    @property
    def samples(self) -> int:
        return sum(c["samples"] for c in self.per_class)

    @property
    def figure_name(self) -> str:
        """What the figures are logged under, eval/<name>/top1: the name the model's run logged
        this split under, where this is the run's held-out split of its dataset (its
        eval.val_name), so that the run and its evaluations share a chart and a column in
        MLflow; else the split's name."""
        return self.run_name_of_split or self.split


# --------------------------------------------------------------------------------------------
# Evaluating
# --------------------------------------------------------------------------------------------
def evaluate(mf: ModelFile, root: str, split: str, *, batch_size: Optional[int] = None,
             workers: Optional[int] = None, device: Optional[str] = None,
             precision: str = "auto", progress_every_s: float = 30.0) -> Evaluation:
    """``progress_every_s``: a line of images done, rate and ETA that often (a split of 50,000
    images takes an hour on a CPU; the figures come only at the end)."""
    started = time.time()
    from pretrain.config import DataConfig
    from pretrain.data.device_batch import normalize
    from pretrain.data.eval_loader import build_eval_loader
    from pretrain.evaluate import ClassificationEvaluator

    run_eval = mf.run_config.get("eval") or {}
    run_data = mf.run_config.get("data") or {}
    source, holdout = dev_split(mf, split)
    info = dataset_info(root, source, with_dev=mf.stage == "finetune"
                        and bool(run_data.get("dev_fraction")))
    classes, notes = info.classes, list(mf.notes)
    trained_on = mf.trained_on
    same_data = mf.trained_on_data(root)
    if split == run_data.get("train_split", "train") and same_data:
        notes.append(f"the model was trained on '{split}': its figure there is a training "
                     f"accuracy")
    if holdout and not same_data:
        notes.append(f"the run held its dev split out of {trained_on}; this is the same share "
                     f"of {root}'s '{source}'")
    if classes is not None and len(classes) < mf.num_classes:
        raise EvaluateError(
            f"MODEL '{mf.path}' has {mf.num_classes} classes but --data '{root}' has "
            f"{len(classes)}; evaluate it on the dataset it was trained on")
    if classes is not None and len(classes) > mf.num_classes:
        # ImageNet-21k's class list with a model of its first N classes (the built-in demo):
        # fine as long as no label of the split is beyond the head; prepare_data.py records
        # the labels the samples use, else the loop checks each one
        used = info.extra.get("num_labels")
        if isinstance(used, int) and used > mf.num_classes:
            raise EvaluateError(
                f"--data '{root}' has labels up to {used - 1} but MODEL '{mf.path}' has "
                f"{mf.num_classes} classes; evaluate it on the dataset it was trained on")
        if not isinstance(used, int):
            notes.append(f"{root} lists {len(classes)} classes, the model has "
                         f"{mf.num_classes}: the split's labels must all be below "
                         f"{mf.num_classes}")
        classes = classes[:mf.num_classes]
    own = trained_classes(mf)
    names = own or classes
    warnings = []
    if own and classes and list(own) != list(classes):
        c = next(i for i, (a, b) in enumerate(zip(own, classes)) if a != b)
        warnings.append(f"the model's label names differ from {root}'s classes (class {c}: "
                     f"'{own[c]}' vs '{classes[c]}'); is it the same dataset?")
    if run_eval.get("max_samples") and split == run_data.get("val_split"):
        notes.append(f"the run evaluated only the first {run_eval['max_samples']} samples "
                     f"(eval.max_samples); this evaluates the whole split")

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if precision == "auto":
        precision = mf.precision
    batch_size = batch_size or run_eval.get("batch_size") or 100
    workers = workers if workers is not None else min(int(run_data.get("num_workers", 2)),
                                                      os.cpu_count() or 1)
    data = DataConfig(root=root, val_split=source, num_workers=workers)
    # no num_classes: the run's loader skipped nothing for its label; a label beyond the head
    # is a wrong dataset, said in one line, not a sample to skip
    loader = build_eval_loader(data, img_size=mf.img_size, batch_size=batch_size, split=source,
                               holdout=holdout)

    total = max(round(info.split(source).num_samples * (holdout or 1)), 1)  # (dev: about)

    def batches():
        seen, start = 0, time.monotonic()
        last = start
        for batch in loader:
            top = int(batch.labels.max()) if len(batch.labels) else -1
            if top >= mf.num_classes:
                raise EvaluateError(f"--split '{split}' of {root} has label {top}, beyond the "
                                    f"model's {mf.num_classes} classes; evaluate it on the "
                                    f"dataset it was trained on")
            yield batch  # back here once the batch is scored
            seen += int((batch.labels >= 0).sum())  # not the padding rows (label -1)
            now = time.monotonic()
            if now - last >= progress_every_s and 0 < seen < total:
                last, rate = now, seen / max(now - start, 1e-9)
                log.info("%s: %s/%s images (%.1f %%), %.0f images/s, ETA %s", split,
                         f"{seen:,}", f"{total:,}", 100 * seen / total, rate,
                         format_duration((total - seen) / rate))

    evaluator = ClassificationEvaluator(
        batches, normalize=functools.partial(normalize, mode=mf.normalize), name=split,
        device=dev, dtype=PRECISIONS[precision], confusion=True)
    result = evaluator.run(mf.model.to(dev), mf.step or 0)
    correct, total = evaluator.per_class_counts
    per_class = [{"class": c, "name": names[c] if names else str(c), "samples": int(n),
                  "correct": int(k), "top1": k / n if n else None}
                 for c, (k, n) in enumerate(zip(correct, total))]
    reported, logged_as = reported_figure(mf, root, split)
    return Evaluation(mf=mf, root=root, split=split, dataset=info.name, names=names,
                      top1=result["top1"], top5=result.get("top5", result["top1"]),
                      per_class=per_class, cells=evaluator.confusion, device=str(dev),
                      precision=precision, batch_size=batch_size,
                      reported=reported, run_name_of_split=logged_as, notes=notes,
                      warnings=warnings, started=started)


def dev_split(mf: ModelFile, split: str) -> tuple[str, float]:
    """The split of the dataset to read and the hashed share of it to keep: ``dev``, which a
    fine-tune carves out of its training split (``data.dev_fraction``) and picks its best
    model by, is that share again (the same keys); any other split is itself, whole."""
    if split != "dev":
        return split, 0.0
    data = mf.run_config.get("data") or {}
    if mf.stage != "finetune" or not data.get("dev_fraction"):
        raise EvaluateError(f"--split dev is the share of the training split a fine-tune holds "
                            f"out (data.dev_fraction), and MODEL '{mf.path}' comes from no such "
                            f"run; pass a split of --data")
    return data.get("train_split", "train"), float(data["dev_fraction"])


def dataset_info(root: str, split: str, with_dev: bool = False):
    """``root``'s info file, with ``split`` in it; ``with_dev``: the model's run held a dev
    split out (:func:`dev_split`), which a refusal names among the splits to pass."""
    from pretrain.data.info import INFO_NAMES, DatasetInfoError, NoInfo, is_url, read_info

    if not is_url(root) and not os.path.isdir(root):
        raise EvaluateError(f"--data '{root}' " + (
            f"is a file; point it at the folder holding the dataset ({INFO_NAMES[0]})"
            if os.path.isfile(root) else "not found; point it at a folder written by "
                                         "launch/prepare_data.py"))
    try:
        info = read_info(root)
    except NoInfo:
        local = not is_url(root)  # (images are read locally)
        raise EvaluateError(f"--data '{root}' holds no {' or '.join(INFO_NAMES)}: point it at a "
                            f"{'folder' if local else 'prefix'} written by "
                            f"launch/prepare_data.py" + (
                                f" (a folder of images is prepared first: launch/prepare_data.py "
                                f"imagefolder --src {root} ...)" if local else "")) from None
    except DatasetInfoError as e:  # unreadable, or malformed: its own message says which
        raise EvaluateError(f"--data '{root}': {e}") from None
    if split not in info.splits:
        raise EvaluateError(f"--split '{split}' is not in dataset '{info.name}' at {root} "
                            f"(its splits: {', '.join(sorted(info.splits)) or 'none'}); pass one "
                            f"of those" + (", or dev: the share of the training split the "
                                           "fine-tune held out" if with_dev else ""))
    return info


def reported_figure(mf: ModelFile, root: str, split: str) -> tuple[Optional[dict], Optional[str]]:
    """The top-1 the run logged for this split at the model's step (metrics.jsonl), if any, and
    the name it logged the split under (eval/<name>/top1) at any step."""
    from pretrain.metrics import read_jsonl

    data = mf.run_config.get("data") or {}
    if mf.run_dir is None or split not in (data.get("val_split"), "dev") \
            or not mf.trained_on_data(root):
        return None, None
    # a fine-tune's figure is named after its split unless eval.val_name is set (fine-tunes from
    # before it took effect there saved an unused "i21k_val": the split's name is tried next)
    val_name = (mf.run_config.get("eval") or {}).get("val_name") if split != "dev" else None
    try:
        records = read_jsonl(mf.run_dir / "metrics.jsonl")
    except OSError:
        return None, None
    names = [n for n in dict.fromkeys((val_name, split)) if n
             and any(f"eval/{n}/top1" in r for r in records)]
    for name in names:
        key = f"eval/{name}/top1"
        rows = [r for r in records if key in r and (mf.step is None or r.get("step") == mf.step)]
        if rows:
            return {"metric": key, "step": rows[-1]["step"], "value": rows[-1][key]}, name
    return None, names[0] if names else None

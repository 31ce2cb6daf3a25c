"""Evaluators that run every N steps during pretraining, aggregated across ranks.

Each evaluator (big_vision style) has a ``name``, an ``every_steps`` and
``run(model, step) -> {metric: value}``; :func:`run_due` runs the ones due at a step and names
their results ``eval/<name>/<metric>`` for the logger.

- :class:`ClassificationEvaluator`: top-1/top-5 on a held-out split.
- :class:`pretrain.fewshot.FewShotEvaluator`: the ViT paper's few-shot linear probe, built on
  the plumbing below.

Data contract: ``data()`` returns this rank's iterable of batches, each ``(images, labels)``
(a loader ``Batch`` works: its first two fields are used), images uint8 (B, 3, H, W), labels
int64; rows labelled -1 are padding and are skipped. Ranks must receive disjoint samples.
``normalize`` turns the uint8 batch on the device into the model's float input, and ``dtype``
(bf16/fp16) turns on autocast on ``device``; otherwise the input is cast to the model's dtype.

Works without torch.distributed (one process) and under it with any world size. Every rank runs
the same number of forward passes -- a rank out of data runs a one-image dummy pass while others
still have batches -- because under ZeRO-3 a forward gathers parameters collectively and
unequal counts would hang the run.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from pretrain.distributed import rank_world

DataFn = Callable[[], Iterable[Any]]
Normalize = Callable[[torch.Tensor], torch.Tensor]


class Evaluator(Protocol):
    name: str
    every_steps: int

    def run(self, model: nn.Module, step: int) -> Dict[str, float]: ...


def run_due(evaluators: Sequence[Evaluator], model: nn.Module, step: int,
            force: bool = False) -> Dict[str, float]:
    """Run the evaluators due at ``step`` (all of them with ``force``, e.g. at the last step);
    results keyed ``eval/<name>/<metric>``. Collective: call it on every rank."""
    out = {}
    for ev in evaluators:
        if is_due(ev, step, force):
            out.update({f"eval/{ev.name}/{k}": v for k, v in ev.run(model, step).items()})
    return out


def is_due(ev: Evaluator, step: int, force: bool = False) -> bool:
    return force or step % ev.every_steps == 0


# --------------------------------------------------------------------------------------------
# Distributed plumbing
# --------------------------------------------------------------------------------------------
def _comm_device() -> torch.device:
    # NCCL only moves CUDA tensors; gloo (the CPU runs) only CPU ones.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(t: torch.Tensor, op=None) -> torch.Tensor:
    """``t`` reduced over ranks (sum by default), on the CPU; ``t`` itself when not distributed."""
    if rank_world()[1] == 1:
        return t.cpu()
    buf = t.to(_comm_device())
    dist.all_reduce(buf, op=op or dist.ReduceOp.SUM)
    return buf.cpu()


def all_gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` (n_r, ...) stacked in rank order, on every rank (n_r may differ)."""
    world = rank_world()[1]
    if world == 1:
        return t.cpu()
    dev = _comm_device()
    counts = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([t.shape[0]], device=dev))
    counts = [int(c) for c in counts]
    padded = torch.zeros((max(counts), *t.shape[1:]), dtype=t.dtype, device=dev)
    padded[:t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:n].cpu() for p, n in zip(parts, counts)])


def valid_rows(batch: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    images, labels = batch[0], batch[1]
    keep = labels >= 0
    if not bool(keep.all()):
        images, labels = images[keep], labels[keep]
    return images, labels


class Forward:
    """Runs a model function on uint8 batches: device transfer, normalisation, precision."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], module: nn.Module,
                 normalize: Normalize, device: torch.device | str,
                 dtype: Optional[torch.dtype]):
        self.fn, self.normalize = fn, normalize
        self.device = torch.device(device)
        self.autocast = dtype in (torch.bfloat16, torch.float16)
        self.dtype = dtype
        self.input_dtype = next(module.parameters()).dtype

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        x = self.normalize(images.to(self.device, non_blocking=True))
        if not self.autocast:
            x = x.to(self.input_dtype)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.autocast):
            return self.fn(x).float()

    def lockstep(self, batches: Iterable[Tuple[torch.Tensor, torch.Tensor]]
                 ) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """(outputs, labels) of this rank's non-empty batches, with as many forward passes on
        every rank (dummy ones on a rank that ran out)."""
        world = rank_world()[1]
        it = iter(batches)
        while True:
            item = next(it, None)
            if world > 1:
                shape = tuple(item[0].shape[1:]) if item is not None else (0, 0, 0)
                state = all_reduce(torch.tensor([int(item is not None), *shape]),
                                   dist.ReduceOp.MAX)
                if state[0] == 0:
                    return
                if item is None:
                    self(torch.zeros((1, *state[1:].tolist()), dtype=torch.uint8))
                    continue
            elif item is None:
                return
            yield self(item[0]), item[1].to(self.device, non_blocking=True)


class EvalMode:
    """Model in eval mode for the block, back to its previous mode afterwards (even on error)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self):
        self.was_training = self.model.training
        self.model.eval()

    def __exit__(self, *exc):
        self.model.train(self.was_training)


def unwrap(model: nn.Module) -> nn.Module:
    """The ViTClassifier inside a DeepSpeed engine / DDP wrapper (they keep it as ``module``)."""
    while not hasattr(model, "forward_pre_logits") and hasattr(model, "module"):
        model = model.module
    return model


# --------------------------------------------------------------------------------------------
# Held-out classification
# --------------------------------------------------------------------------------------------
class ClassificationEvaluator:
    """Top-k accuracy of the model's logits on a held-out split, exact across ranks.

    Softmax and sigmoid heads are ranked the same way: both are monotonic in the logits, so
    top-k is taken on the logits (argmax-based) for either loss -- a sample counts as a top-k
    hit when its label is among the k largest logits. Ties (a zero-initialised head at step 0)
    go to the lower class index. ``max_samples``: at most that many samples over all ranks,
    each rank taking its share from the start of its stream.

    After :meth:`run`: ``per_class_top1`` and ``per_class_counts`` ((correct, total) per class).
    With ``confusion=True`` also ``confusion``, the non-zero cells of the confusion matrix as
    int64 rows (true class, top-1 prediction, count): one int64 per sample is kept, not a (C, C)
    matrix, which at 21k classes would take 3.8 GB; off by default (the training-time
    evaluations never pay for it). :func:`confusion_matrix` makes it dense.
    """

    def __init__(self, data: DataFn, *, normalize: Normalize, name: str = "val",
                 every_steps: int = 1000, device: torch.device | str = "cpu",
                 dtype: Optional[torch.dtype] = None, max_samples: Optional[int] = None,
                 topk: Sequence[int] = (1, 5), confusion: bool = False,
                 fix_if_empty: str = "check its split (data.val_split) and eval.max_samples"):
        self.data, self.normalize, self.name, self.every_steps = data, normalize, name, every_steps
        self.fix_if_empty = fix_if_empty  # what the one line says when no sample came
        self.device, self.dtype, self.max_samples, self.topk = device, dtype, max_samples, topk
        self.track_confusion = confusion

    def _batches(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        rank, world = rank_world()
        left = math.inf
        if self.max_samples is not None:
            left = self.max_samples // world + (rank < self.max_samples % world)
        for batch in self.data():
            if left <= 0:
                return
            images, labels = valid_rows(batch)
            if len(labels) > left:
                images, labels = images[:left], labels[:left]
            if len(labels):
                left -= len(labels)
                yield images, labels

    def run(self, model: nn.Module, step: int) -> Dict[str, float]:
        forward = Forward(model, unwrap(model), self.normalize, self.device, self.dtype)
        hits = torch.zeros(len(self.topk) + 1, dtype=torch.int64, device=forward.device)
        per_class = None  # (correct, total) per class, sized on the first batch
        cells = [] if self.track_confusion else None  # true * C + predicted, per sample
        with EvalMode(model):
            for logits, labels in forward.lockstep(self._batches()):
                k = min(max(self.topk), logits.shape[1])
                top = logits.topk(k, dim=1).indices
                ranked = top == labels[:, None]
                if cells is not None:  # the same top-1 as the hits: the diagonal is the hits
                    cells.append((labels * logits.shape[1] + top[:, 0]).cpu())
                for i, kk in enumerate(self.topk):
                    hits[i] += ranked[:, :kk].any(dim=1).sum()
                hits[-1] += len(labels)
                if per_class is None:
                    per_class = torch.zeros(2, logits.shape[1], dtype=torch.int64,
                                            device=forward.device)
                per_class[0].index_add_(0, labels, ranked[:, 0].long())
                per_class[1].index_add_(0, labels, torch.ones_like(labels))
        hits = all_reduce(hits)
        total = int(hits[-1])
        if total == 0:  # (every rank has the sum: they all raise it, rank 0 says it)
            from pretrain.data.shards import LoaderError
            from pretrain.distributed import agreed
            raise agreed(LoaderError(f"evaluator '{self.name}' got no labelled samples on any "
                                     f"rank; {self.fix_if_empty}"))
        if per_class is None:  # this rank had no real batch: contribute zeros of the same size
            per_class = torch.zeros(2, unwrap(model).spec.num_classes, dtype=torch.int64,
                                    device=forward.device)
        counts = all_reduce(per_class)
        # Top-1 per class (None for a class absent from the split): what a confusion-style
        # report needs at the end of a fine-tune; not logged as metrics (there are 21k classes).
        self.per_class_counts = counts.tolist()
        self.samples = total
        self.per_class_top1 = [c / n if n else None for c, n in zip(*self.per_class_counts)]
        if cells is not None:
            n = per_class.shape[1]
            flat = all_gather_rows(torch.cat(cells) if cells else
                                   torch.zeros(0, dtype=torch.int64))
            cell, count = torch.unique(flat, return_counts=True)
            self.confusion = torch.stack([cell // n, cell % n, count], dim=1)
        return {f"top{k}": int(hits[i]) / total for i, k in enumerate(self.topk)}


def confusion_matrix(cells: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``ClassificationEvaluator.confusion`` as a dense (true, predicted) int64 matrix."""
    out = torch.zeros(num_classes * num_classes, dtype=torch.int64)
    if len(cells):
        out.index_add_(0, cells[:, 0] * num_classes + cells[:, 1], cells[:, 2])
    return out.view(num_classes, num_classes)


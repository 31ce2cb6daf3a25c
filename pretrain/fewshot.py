"""The ViT paper's few-shot linear probe: closed-form ridge regression on pre-logits features.

:class:`FewShotEvaluator` is an evaluator like :class:`pretrain.evaluate.ClassificationEvaluator`
(``name``, ``every_steps``, ``run(model, step)`` giving ``1shot`` ... ``25shot``), with the same
data contract and the same rank lockstep, whose plumbing it takes from :mod:`pretrain.evaluate`.
Kept apart from the held-out classification: the ridge solve and how the shots are chosen are a
method of their own.
"""
from __future__ import annotations

import logging
import math
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pretrain.distributed import rank_world
from pretrain.evaluate import (DataFn, EvalMode, Forward, Normalize, all_gather_rows, all_reduce,
                               unwrap, valid_rows)

log = logging.getLogger(__name__)

# A large constant bias feature: ridge barely penalises its weight, so the probe effectively
# learns an unregularised per-class bias (big_vision does the same).
BIAS_FEATURE = 100.0


def fit_ridge(x: torch.Tensor, y: torch.Tensor, num_classes: int, l2_reg: float
              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Closed-form ridge regression of {-1, +1} one-hot targets on features, in float64.

    Features are standardised with the training examples' own mean and std (as big_vision
    does: pre-logits of different models have very different scales, and one l2_reg should fit
    them all), plus a constant :data:`BIAS_FEATURE` column. Returns (mean, std, weights);
    predict with :func:`ridge_predict`. The primal or dual system is solved, whichever is
    smaller: with few shots there are far fewer examples than feature dimensions.
    """
    x = x.double()
    mean = x.mean(dim=0)
    std = x.std(dim=0, unbiased=False) + 1e-5
    xs = _design(x, mean, std)
    targets = 2.0 * F.one_hot(y, num_classes).double() - 1.0
    n, d = xs.shape
    if n >= d:
        w = torch.linalg.solve(xs.T @ xs + l2_reg * torch.eye(d, dtype=xs.dtype), xs.T @ targets)
    else:
        w = xs.T @ torch.linalg.solve(xs @ xs.T + l2_reg * torch.eye(n, dtype=xs.dtype), targets)
    return mean, std, w


def ridge_predict(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor,
                  w: torch.Tensor) -> torch.Tensor:
    return (_design(x.double(), mean, std) @ w).argmax(dim=1)


def _design(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    xs = (x - mean) / std
    return torch.cat([xs, torch.full((len(xs), 1), BIAS_FEATURE, dtype=xs.dtype)], dim=1)


def _with_width(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if len(x) else x.new_zeros(0, width)


class FewShotEvaluator:
    """The few-shot linear probe of the ViT paper / big_vision: ``{k}shot`` test accuracy.

    Per run: pre-logits features (``model.forward_pre_logits``) of a pool of train examples
    and of the whole test split are extracted once, spread over the ranks. The pool: each rank
    keeps the first ``2 * ceil(max(shots) / world)`` examples of every class in its stream
    (reading stops early once all classes are full, when ``num_classes`` is given) -- enough
    for the largest shot count without running the model on the whole train split. The pool is
    gathered on every rank; for each class a permutation seeded by ``seed`` orders it, and the
    k-shot probe uses the first k (so the 5-shot examples include the 1-shot one). The pool,
    hence the choice, is fixed for a given dataset, seed and world size.

    For each k a ridge regression (:func:`fit_ridge`, ``l2_reg``) is solved on the CPU in
    float64 by every rank on identical inputs; each rank scores its test features and the
    correct counts are summed over ranks, so every rank returns the same numbers. A class with
    fewer than k pool examples uses those it has (logged once).
    """

    def __init__(self, train_data: DataFn, test_data: DataFn, *, normalize: Normalize,
                 name: str = "fewshot", every_steps: int = 5000,
                 shots: Sequence[int] = (1, 5, 10, 25), l2_reg: float = 1024.0,
                 num_classes: Optional[int] = None, seed: int = 0,
                 device: torch.device | str = "cpu", dtype: Optional[torch.dtype] = None):
        if not shots or min(shots) < 1:
            raise ValueError(f"few-shot '{name}': shots must be positive integers, got "
                             f"{list(shots)}")
        self.train_data, self.test_data, self.normalize = train_data, test_data, normalize
        self.name, self.every_steps, self.shots = name, every_steps, tuple(shots)
        self.l2_reg, self.num_classes, self.seed = l2_reg, num_classes, seed
        self.device, self.dtype = device, dtype
        self._warned = False

    def _pool_batches(self, per_class: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        taken: Dict[int, int] = {}
        full = 0
        for batch in self.train_data():
            images, labels = valid_rows(batch)
            keep = []
            for i, c in enumerate(labels.tolist()):
                n = taken.get(c, 0)
                if n < per_class:
                    keep.append(i)
                    taken[c] = n + 1
                    full += n + 1 == per_class
            if keep:
                yield images[keep], labels[keep]
            if self.num_classes is not None and full >= self.num_classes:
                return

    def _features(self, forward: Forward, batches) -> Tuple[torch.Tensor, torch.Tensor]:
        feats: List[torch.Tensor] = []
        labels: List[torch.Tensor] = []
        for f, y in forward.lockstep(batches):
            feats.append(f)
            labels.append(y)
        if not feats:
            return (torch.zeros(0, 0, device=forward.device),
                    torch.zeros(0, dtype=torch.int64, device=forward.device))
        return torch.cat(feats), torch.cat(labels)

    def run(self, model: nn.Module, step: int) -> Dict[str, float]:
        rank, world = rank_world()
        vit = unwrap(model)
        forward = Forward(vit.forward_pre_logits, vit, self.normalize, self.device, self.dtype)
        per_class = 2 * math.ceil(max(self.shots) / world)
        with EvalMode(model):
            pool_x, pool_y = self._features(forward, self._pool_batches(per_class))
            test_x, test_y = self._features(
                forward, (b for b in map(valid_rows, self.test_data()) if len(b[1])))

        # A rank without data has no feature width; take it from the others.
        width = int(all_reduce(torch.tensor([pool_x.shape[1], test_x.shape[1]]),
                               dist.ReduceOp.MAX).max())
        pool_x = all_gather_rows(_with_width(pool_x, width))
        pool_y = all_gather_rows(pool_y)
        num_classes = self.num_classes
        if num_classes is None:
            top = max(int(pool_y.max()) if len(pool_y) else -1,
                      int(test_y.max()) if len(test_y) else -1)
            num_classes = int(all_reduce(torch.tensor([top]), dist.ReduceOp.MAX)) + 1
        if len(pool_y) == 0:
            raise RuntimeError(f"few-shot '{self.name}' got no labelled train samples on any "
                               f"rank; check eval.fewshot_root and eval.fewshot_train_split")
        order = self._class_orders(pool_y, num_classes)
        self._warn_short(order, rank)

        test_x, test_y = _with_width(test_x, width).cpu(), test_y.cpu()
        correct = torch.zeros(len(self.shots) + 1, dtype=torch.int64)
        for i, k in enumerate(self.shots):
            idx = torch.cat([o[:k] for o in order])
            mean, std, w = fit_ridge(pool_x[idx], pool_y[idx], num_classes, self.l2_reg)
            if len(test_y):
                correct[i] = (ridge_predict(test_x, mean, std, w) == test_y).sum()
        correct[-1] = len(test_y)
        correct = all_reduce(correct)
        total = int(correct[-1])
        if total == 0:
            raise RuntimeError(f"few-shot '{self.name}' got no labelled test samples on any "
                               f"rank; check eval.fewshot_test_split")
        return {f"{k}shot": int(correct[i]) / total for i, k in enumerate(self.shots)}

    def _class_orders(self, pool_y: torch.Tensor, num_classes: int) -> List[torch.Tensor]:
        """Pool indices of each class in a seeded random order (identical on every rank)."""
        gen = torch.Generator().manual_seed(self.seed)
        order = []
        for c in range(num_classes):
            idx = torch.nonzero(pool_y == c).flatten()
            order.append(idx[torch.randperm(len(idx), generator=gen)])
        return order

    def _warn_short(self, order: List[torch.Tensor], rank: int) -> None:
        counts = torch.tensor([len(o) for o in order])
        k = max(self.shots)
        short = int((counts < k).sum())
        if short and not self._warned and rank == 0:
            log.warning("few-shot '%s': %d of %d classes have fewer than %d train examples "
                        "(fewest: %d); their probes use the ones there are", self.name, short,
                        len(order), k, int(counts.min()))
        self._warned = self._warned or bool(short)

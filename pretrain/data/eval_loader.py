"""The eval loader: one unshuffled pass over a split per ``iter()``, every sample once across
the world, in the same number of full-size batches on every rank (see :class:`EvalLoader`).

It reads the shards dealt by :mod:`pretrain.data.shards`, as the train loader does, but has no
position to keep: each pass starts from the beginning.
"""
from __future__ import annotations

import math
from typing import Iterator, Optional

import torch
from torch.utils.data import IterableDataset, get_worker_info

from pretrain.data.device_batch import Batch
from pretrain.data.loader_workers import (failed, iterate_workers, new_batch_images, raise_failed,
                                          worker_loader)
from pretrain.data.remote import retry_policy
from pretrain.data.samples import Skip, decode_sample
from pretrain.data.shards import LoaderError, RateLimitedLog, ShardPlan, ShardSet, _records, deal
from pretrain.data.transforms import EvalTransform


class _EvalDataset(IterableDataset):
    def __init__(self, plan: ShardPlan, rank: int, workers: int, batches: int, batch_size: int,
                 transform: EvalTransform, num_classes: Optional[int], name_skips: bool):
        self.plan, self.rank, self.workers, self.batches = plan, rank, workers, batches
        self.batch_size, self.transform, self.num_classes = batch_size, transform, num_classes
        self.name_skips = name_skips

    def __iter__(self):
        info = get_worker_info()
        slot = self.rank * self.workers + (info.id if info else 0)
        warn = RateLimitedLog()
        samples = (s for s in _records(self.plan, self.plan.slot_shards(0, slot), warn)
                   if isinstance(s, dict))  # what a bad shard lost is only warned about
        try:
            yield from self._batches(samples, warn)
        except LoaderError as e:
            yield failed(e)

    def _batches(self, samples, warn: RateLimitedLog):
        for _ in range(self.batches):
            images = new_batch_images(self.batch_size, self.transform.size)
            images.zero_()
            labels = torch.full((self.batch_size,), -1, dtype=torch.int64)
            keys = [""] * self.batch_size
            filled = 0
            for sample in samples:
                decoded = decode_sample(sample, self.num_classes, self.transform)
                if isinstance(decoded, Skip):
                    if self.name_skips:
                        warn.warning("skipping sample %s: %s (said at the first evaluation "
                                     "only)", sample.get("__key__"), decoded.reason)
                    continue
                labels[filled], images[filled] = decoded
                keys[filled] = sample["__key__"]
                filled += 1
                if filled == self.batch_size:
                    break
            yield images, labels, keys, torch.zeros(self.batch_size, dtype=torch.int64)


class EvalLoader:
    """One pass over a split per ``iter()``: every sample once across the world, unshuffled.

    Every rank yields the same number of full-size batches, so sharded models (ZeRO-3) never
    wait on a rank that ran out; padding rows have label -1 and key "" -- mask them out.
    Corrupt samples are dropped (they become padding), named in a warning on the first pass
    only: the same ones are dropped on every pass, which would repeat the warnings at every
    evaluation of a run.
    """

    def __init__(self, shards: ShardSet, *, img_size: int, batch_size: int, rank: int = 0,
                 world_size: int = 1, num_workers: int = 0, num_classes: Optional[int] = None,
                 crop_pct: float = 0.875):
        self.shards, self.rank, self.num_workers = shards, rank, num_workers
        self.workers = max(1, num_workers)
        slots = world_size * self.workers
        if any(n < 0 for n in shards.lengths):
            raise LoaderError(f"eval split '{shards.name}' lacks shard_lengths in its info file; "
                              f"equal batch counts per rank need them")
        dealt, loads = deal(range(len(shards.urls)), shards.lengths, [0] * slots)
        self.plan = ShardPlan(shards, slots, seed=0, override_epoch=0, override_slots=dealt)
        longest = max(loads)
        self.batches_per_worker = math.ceil(longest / batch_size)
        self.batch_size = batch_size
        self.transform = EvalTransform(img_size, crop_pct)
        self.num_classes = num_classes
        self.passes = 0

    def __len__(self) -> int:
        return self.batches_per_worker * self.workers

    def __iter__(self) -> Iterator[Batch]:
        dataset = _EvalDataset(self.plan, self.rank, self.workers, self.batches_per_worker,
                               self.batch_size, self.transform, self.num_classes,
                               name_skips=self.passes == 0)
        self.passes += 1
        loader = worker_loader(dataset, self.num_workers)
        for item in iterate_workers(loader):
            raise_failed(item)
            yield Batch(*item)


def held_out(shards: ShardSet, holdout: float, split: str, root: str) -> ShardSet:
    """The ``holdout`` share of ``shards`` (a fine-tune's dev split, data.dev_fraction); one
    that would hold no image out is refused (its first evaluation would find nothing)."""
    total = shards.num_samples
    held = shards.holding_out(holdout, "held")
    if total and not held.num_samples:  # (the hash decides exactly: this is about)
        fraction = min(25 / total, 0.5)  # 25 images, or half of a split too small for them
        raise LoaderError(f"data.dev_fraction={holdout:g} holds out no image of the {total:,} "
                          f"in split '{split}' of {root}; raise it to at least {fraction:.2g} "
                          f"(about {round(fraction * total):,} images; the paper holds out 1 % "
                          f"of ImageNet's train, 2 % of CIFAR's)")
    return held


def build_eval_loader(data, *, img_size: int, batch_size: int, rank: int = 0,
                      world_size: int = 1, num_classes: Optional[int] = None,
                      split: Optional[str] = None, holdout: float = 0.0) -> EvalLoader:
    """The eval loader of ``data.val_split`` (or ``split``); with ``holdout``, only that
    hashed share of the split (the dev split a train loader with the same share leaves out)."""
    split = split or data.val_split
    if not data.root or not split:
        raise LoaderError("evaluation needs data.root and data.val_split")
    shards = ShardSet.from_info(data.root, split, retry_policy(data), data.missing_shards)
    shards.check_present(data.missing_shards, rank)
    if holdout:
        shards = held_out(shards, holdout, split, data.root)
    return EvalLoader(shards, img_size=img_size,
                      batch_size=batch_size, rank=rank, world_size=world_size,
                      num_workers=data.num_workers, num_classes=num_classes)

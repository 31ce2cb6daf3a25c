"""The shards of a split, how they are dealt to reader slots, and one slot's raw stream.

The world has ``world_size x W`` reader *slots* (``W = max(1, data.num_workers)``); slot
``rank * W + w`` is data-loader worker ``w`` of rank ``rank``. For every epoch the split's shards
are put in a seeded order and dealt, whole, to the slots -- each shard to the slot with the least
data so far, counted over all epochs, so no slot falls behind the others as epochs go by. A slot
reads its shards, shuffles the samples with a seeded buffer, and decodes. Its stream is therefore
a pure function of (seed, epoch, slot): every sample of an epoch is read exactly once across the
world, and a slot's position is just "epoch, samples emitted in that epoch".

Resampling (``data.resample``): each slot draws ``ceil(shards / slots)`` shards with replacement
per epoch; an infinite stream without the exactly-once guarantee, for splits with fewer shards
than slots.

Shards are read where they live (:mod:`pretrain.data.remote`: paths, ``s3://``, ``gs://``,
``http(s)://``, ``pipe:``), with retries that resume at the byte reached, so a flaky network
changes nothing in the stream. What cannot be read is skipped and counted by cause
(:data:`SKIP_CAUSES`): a shard that is missing or stays unreachable (``data.missing_shards``:
"skip" counts its samples, "error" stops the run), a tar cut short; the decoding side adds
undecodable or empty images and bad labels.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import heapq
import itertools
import logging
import math
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from webdataset.tariterators import group_by_keys, tar_file_iterator

from pretrain.data.info import StorageUnreachable, join, read_info
from pretrain.data.remote import Rejected, RetryPolicy, Unreachable, is_remote, open_shard

log = logging.getLogger("pretrain.data.loader")  # one logger for what the loader warns about

# Why a sample was skipped; the metrics are data/skipped/<cause>.
SKIP_CAUSES = ("undecodable", "empty", "bad_label", "truncated_shard", "missing_shard",
               "unreachable_shard")


def describe_skips(counts: Dict[str, int]) -> str:
    """One line for the end of a run: the samples skipped over all ranks, by cause."""
    total = sum(counts.values())
    if not total:
        return "no sample skipped"
    parts = ", ".join(f"{n} {cause.replace('_', ' ')}" for cause, n in counts.items() if n)
    return f"{total} sample(s) skipped over all ranks: {parts}"


class LoaderError(ValueError):
    """The loader cannot be built as configured (one line naming the problem and the fix)."""


class ShardUnreachable(LoaderError, StorageUnreachable):
    """A shard failed every retry under ``data.missing_shards=error``."""


class RateLimitedLog:
    """Warnings about skipped data, from every rank and worker without flooding the log: the
    first ``burst`` lines, then one per ``every_s`` seconds saying how many were not shown."""

    def __init__(self, burst: int = 20, every_s: float = 60.0):
        self.burst, self.every_s = burst, every_s
        self.shown, self.hidden, self.last = 0, 0, 0.0

    def warning(self, msg: str, *args) -> None:
        now = time.monotonic()
        if self.shown < self.burst or now - self.last >= self.every_s:
            more = f" ({self.hidden} more not shown)" if self.hidden else ""
            log.warning(msg + more, *args)
            self.shown, self.hidden, self.last = self.shown + 1, 0, now
        else:
            self.hidden += 1


@dataclass
class ShardSet:
    """The shards of one split: locations and (when known) sample counts."""

    urls: List[str]
    lengths: List[int]  # -1 where unknown
    name: str = "train"
    # A held-out part carved from the split by a seeded hash of each key (e.g. fine-tuning's
    # dev split): ``holdout_side`` "rest" reads the split without it, "held" only it.
    holdout_fraction: float = 0.0
    holdout_side: str = "rest"
    holdout_seed: int = 0
    # How a remote shard is read, and what a shard that is gone or stays unreachable during
    # the run means (data.missing_shards): "skip" counts its samples, "error" stops the run.
    retry: RetryPolicy = RetryPolicy()
    on_missing: str = "skip"

    @property
    def num_samples(self) -> int:
        total = sum(n for n in self.lengths if n > 0)
        if not self.holdout_fraction:
            return total
        held = round(total * self.holdout_fraction)  # expected size; the hash decides exactly
        return held if self.holdout_side == "held" else total - held

    def fingerprint(self) -> str:
        names = "\n".join(f"{os.path.basename(u)}:{n}" for u, n in zip(self.urls, self.lengths))
        if self.holdout_fraction:
            names += f"\nholdout:{self.holdout_fraction}:{self.holdout_side}:{self.holdout_seed}"
        return hashlib.sha1(names.encode()).hexdigest()[:16]

    def holding_out(self, fraction: float, side: str, seed: int = 0) -> "ShardSet":
        """This split without (side "rest") or restricted to (side "held") a hashed share."""
        return dataclasses.replace(self, holdout_fraction=fraction, holdout_side=side,
                                   holdout_seed=seed, name=f"{self.name}[{side} {fraction:g}]")

    def keeps(self, key: str) -> bool:
        if not self.holdout_fraction:
            return True
        digest = hashlib.sha1(f"{self.holdout_seed}:{key}".encode()).digest()
        held = int.from_bytes(digest[:8], "big") < self.holdout_fraction * 2 ** 64
        return held == (self.holdout_side == "held")

    def missing(self) -> List[str]:
        """Shards that should be files on this machine but are not (remote URLs not checked)."""
        return [url for url in self.urls if not is_remote(url)
                and not os.path.exists(url[len("file://"):] if url.startswith("file://") else url)]

    def check_present(self, policy: str, rank: int = 0) -> None:
        """``data.missing_shards``: "error" refuses to start on a missing shard file, "skip"
        warns once; the loader then counts that shard's samples as skipped every epoch."""
        gone = self.missing()
        if not gone:
            return
        names = ", ".join(os.path.basename(u) for u in gone[:3]) + \
            (f" and {len(gone) - 3} more" if len(gone) > 3 else "")
        gone_set = set(gone)
        lost = sum(n for u, n in zip(self.urls, self.lengths) if u in gone_set and n > 0)
        what = (f"{len(gone)} of {len(self.urls)} '{self.name}' shard files are missing "
                f"({names}, {lost} samples) in {os.path.dirname(gone[0]) or '.'}")
        if policy == "error":
            raise LoaderError(f"{what}; restore them, or set data.missing_shards=skip to go on "
                              f"without them")
        if rank == 0:
            log.warning("%s; data.missing_shards=skip: their samples are skipped and counted", what)

    @classmethod
    def from_info(cls, root: str, split: str, retry: RetryPolicy = RetryPolicy(),
                  on_missing: str = "skip", num_classes: Optional[int] = None,
                  exact_classes: bool = False, rank: int = 0) -> "ShardSet":
        """``split`` as the info file of ``root`` lists it. ``num_classes``: the model's; a
        dataset with more classes is refused (all but a few of its samples would be skipped),
        with ``exact_classes`` one with fewer too (otherwise rank 0 warns of it)."""
        dataset = read_info(root, retry)
        dataset.check_labels(root, num_classes, exact_classes)
        wider = None if exact_classes or rank else dataset.wider_head(root, num_classes)
        if wider:
            log.warning("%s", wider)
        return cls.from_dataset(root, dataset, split, retry, on_missing)

    @classmethod
    def from_dataset(cls, root: str, dataset, split: str, retry: RetryPolicy = RetryPolicy(),
                     on_missing: str = "skip") -> "ShardSet":
        """``split`` of ``dataset``, the info file of ``root`` read already."""
        info = dataset.split(split)
        lengths = list(info.shard_lengths) or [-1] * len(info.filenames)
        if len(lengths) != len(info.filenames):
            raise LoaderError(f"'{root}' split '{split}': {len(info.filenames)} filenames but "
                              f"{len(lengths)} shard_lengths; rewrite the info file")
        return cls([join(root, f) for f in info.filenames], lengths, split, retry=retry,
                   on_missing=on_missing)

    @classmethod
    def from_urls(cls, urls: Sequence[str], lengths: Optional[Sequence[int]] = None) -> "ShardSet":
        return cls(list(urls), list(lengths) if lengths else [-1] * len(urls), "shards")


@dataclass
class ShardPlan:
    """Which shards each slot reads in each epoch; picklable, shipped to every worker."""

    shards: ShardSet
    num_slots: int
    seed: int
    resample: bool = False
    # A one-off assignment for one epoch, made when resuming with a different layout.
    override_epoch: Optional[int] = None
    override_slots: Optional[List[List[int]]] = None
    _cache: Dict[int, List[List[int]]] = field(default_factory=dict, repr=False)
    _loads: Optional[Tuple[int, List[int]]] = field(default=None, repr=False)

    def slot_shards(self, epoch: int, slot: int) -> List[int]:
        if self.override_slots is not None and epoch == self.override_epoch:
            return self.override_slots[slot]
        if self.resample:
            n = len(self.shards.urls)
            rng = random.Random(f"resample:{self.seed}:{epoch}:{slot}")
            return rng.choices(range(n), k=math.ceil(n / self.num_slots))
        return self._dealt(epoch)[slot]

    def epoch_shards(self, epoch: int) -> List[int]:
        """Every shard of ``epoch`` (the re-dealt remainder for an override epoch)."""
        if self.override_slots is not None and epoch == self.override_epoch:
            return [s for slot in self.override_slots for s in slot]
        return list(range(len(self.shards.urls)))

    def _dealt(self, epoch: int) -> List[List[int]]:
        # Loads carry over epochs so a slot that got more data in one epoch gets less in the
        # next: the slots' positions in the stream never drift more than about one shard apart.
        if epoch not in self._cache:
            done, loads = self._loads or (0, [0] * self.num_slots)
            if done > epoch:
                done, loads = 0, [0] * self.num_slots
            for e in range(done, epoch + 1):
                order = list(range(len(self.shards.urls)))
                random.Random(f"shards:{self.seed}:{e}").shuffle(order)
                slots, loads = deal(order, self.shards.lengths, loads)
            self._loads = (epoch + 1, loads)
            self._cache = {epoch: slots}
        return self._cache[epoch]


def deal(order: Sequence[int], lengths: Sequence[int], loads: Sequence[int]
         ) -> Tuple[List[List[int]], List[int]]:
    """Give each shard in ``order`` to the least-loaded slot (ties: lowest slot)."""
    heap = [(load, slot) for slot, load in enumerate(loads)]
    heapq.heapify(heap)
    slots: List[List[int]] = [[] for _ in loads]
    for shard in order:
        load, slot = heapq.heappop(heap)
        slots[slot].append(shard)
        heapq.heappush(heap, (load + max(lengths[shard], 1), slot))
    new_loads = [0] * len(loads)
    for load, slot in heap:
        new_loads[slot] = load
    return slots, new_loads


# --------------------------------------------------------------------------------------------
# One slot's stream: raw records -> seeded shuffle -> (epoch, index, record)
# --------------------------------------------------------------------------------------------
class _Lost(NamedTuple):
    count: int
    reason: str
    cause: str  # one of SKIP_CAUSES


def _read_shard(url: str, retry: RetryPolicy) -> Iterator[dict]:
    with contextlib.closing(open_shard(url, retry)) as stream:
        members = ({**m, "__url__": url} for m in tar_file_iterator(stream))
        yield from group_by_keys(members)


def _records(plan: ShardPlan, shard_ids: Sequence[int], warn: RateLimitedLog) -> Iterator[Any]:
    """Raw samples of the given shards in order; a ``_Lost`` marker for what a bad shard lost."""
    shards = plan.shards
    for sid in shard_ids:
        url, expected = shards.urls[sid], shards.lengths[sid]
        read, reason, cause = 0, "shorter than _info.json says", "truncated_shard"
        try:
            for sample in _read_shard(url, shards.retry):
                read += 1
                if shards.keeps(sample.get("__key__", "")):
                    yield sample
        except Exception as e:  # noqa: BLE001 -- truncated tar, unreachable storage, garbage
            reason = f"{type(e).__name__}: {e}"
            # Missing is a FileNotFoundError; a refusal (no read permission, the credentials
            # refused) or a request the server rejects is the input's fault too, and no retry
            # changes it: counted as missing
            if isinstance(e, (FileNotFoundError, PermissionError, Rejected, Unreachable)):
                cause = "unreachable_shard" if isinstance(e, Unreachable) else "missing_shard"
                if shards.on_missing == "error" and isinstance(e, (PermissionError, Rejected)):
                    fix = ("the credentials or the storage's permissions"
                           if isinstance(e, PermissionError) else "the URL or the server")
                    raise LoaderError(f"shard {url} cannot be read ({e}); fix {fix}, or set "
                                      f"data.missing_shards=skip to go on without it") from None
                if shards.on_missing == "error" and cause == "missing_shard":
                    raise LoaderError(f"shard {url} is missing ({e}); check the storage, or set "
                                      f"data.missing_shards=skip to go on without it") from None
                if shards.on_missing == "error":
                    raise ShardUnreachable(
                        f"shard {url} is unreachable ({e}); check the storage (relaunching "
                        f"resumes from the newest complete checkpoint), or set "
                        f"data.missing_shards=skip to go on without it") from None
            if expected < 0:  # unknown length: at least the sample being read is gone
                expected = read + 1
        if expected > read:
            warn.warning("shard %s: %d sample(s) lost (%s)", url, expected - read, reason)
            yield _Lost(expected - read, reason, cause)


def buffer_shuffle(items: Iterator[Any], size: int, rng: random.Random) -> Iterator[Any]:
    """Seeded shuffle buffer; ``_Lost`` markers pass straight through without touching the rng."""
    buf: List[Any] = []
    for item in items:
        if isinstance(item, _Lost):
            yield item
        elif len(buf) < size:
            buf.append(item)
        else:
            j = rng.randrange(size)
            item, buf[j] = buf[j], item
            yield item
    rng.shuffle(buf)
    yield from buf


@dataclass
class WorkerPos:
    """Where one slot is: the next sample to emit is number ``index`` of ``epoch``.

    ``skipped`` counts skipped samples per epoch, ``causes`` per cause over the run (keys are
    str so the state is plain JSON); ``fresh`` means nothing of this position was consumed yet,
    so the lost-sample markers just before it have not been counted.
    """

    epoch: int = 0
    index: int = 0
    skipped: Dict[str, int] = field(default_factory=dict)
    fresh: bool = True
    causes: Dict[str, int] = field(default_factory=dict)

    def count(self, epoch: int, cause: str, n: int = 1) -> None:
        self.skipped[str(epoch)] = self.skipped.get(str(epoch), 0) + n
        self.causes[cause] = self.causes.get(cause, 0) + n

    def copy(self) -> "WorkerPos":
        return WorkerPos(self.epoch, self.index, dict(self.skipped), self.fresh,
                         dict(self.causes))


def add_counts(total: Dict[str, int], counts: Dict[str, int]) -> Dict[str, int]:
    for k, n in counts.items():
        total[k] = total.get(k, 0) + n
    return total


def slot_stream(plan: ShardPlan, slot: int, buffer: int, start: WorkerPos,
                skips: WorkerPos, warn: RateLimitedLog) -> Iterator[Tuple[int, int, dict]]:
    """(epoch, index, raw sample) of one slot from ``start`` on, forever.

    Lost-sample markers are counted in ``skips`` except those a consumed batch already counted
    (the ones up to ``start`` when resuming).
    """
    empty_epochs = 0
    for epoch in itertools.count(start.epoch):
        resuming = epoch == start.epoch
        skip_to = start.index if resuming else 0
        rng = random.Random(f"buffer:{plan.seed}:{epoch}:{slot}")
        shard_ids = plan.slot_shards(epoch, slot)
        index = 0
        for item in buffer_shuffle(_records(plan, shard_ids, warn), buffer, rng):
            if isinstance(item, _Lost):
                if not (resuming and not start.fresh and index <= skip_to):
                    skips.count(epoch, item.cause, item.count)
                continue
            if index >= skip_to:
                yield epoch, index, item
            index += 1
        empty_epochs = 0 if index or not shard_ids else empty_epochs + 1
        if empty_epochs >= 2:
            raise LoaderError(f"reader slot {slot} found no readable sample in two epochs of its "
                              f"shards (e.g. {plan.shards.urls[shard_ids[0]]}); check data.root "
                              f"and the storage")



def unfinished_shards(plan: ShardPlan, positions: Sequence[WorkerPos], buffer: int
                      ) -> Tuple[int, List[int], int]:
    """(oldest unfinished epoch, its shards not yet fully emitted, samples that will repeat).

    A slot's emission order is replayed from shard indices alone (the shuffle's random draws
    depend only on the buffer size), so this reads no data; it assumes shards hold the number
    of samples _info.json records.
    """
    epoch = min(p.epoch for p in positions)
    unfinished, repeats = [], 0
    for slot, pos in enumerate(positions):
        if pos.epoch > epoch:
            repeats += pos.index  # samples of the next epoch: that epoch restarts afresh
            continue
        shard_ids = plan.slot_shards(epoch, slot)
        lengths = [max(plan.shards.lengths[s], 0) for s in shard_ids]
        emitted = [0] * len(shard_ids)
        rng = random.Random(f"buffer:{plan.seed}:{epoch}:{slot}")
        order = itertools.chain.from_iterable([i] * n for i, n in enumerate(lengths))
        for i in itertools.islice(buffer_shuffle(order, buffer, rng), pos.index):
            emitted[i] += 1
        for i, sid in enumerate(shard_ids):
            if emitted[i] < lengths[i] or lengths[i] == 0:
                unfinished.append(sid)
                repeats += emitted[i]
    return epoch, unfinished, repeats

"""The streaming train loader over WebDataset shards described by ``_info.json``.

Which shards each worker reads, and in which order, is :mod:`pretrain.data.shards`: each
data-loader worker of each rank is a reader *slot* whose stream is a pure function of (seed,
epoch, slot), so every sample of an epoch is read exactly once across the world and a worker's
position is just "epoch, samples emitted in that epoch".

Epoch boundaries: the stream never ends. When a worker finishes its share of epoch ``e`` it goes
on with its share of ``e + 1``, and a batch may hold samples of both (each sample carries its
epoch in ``Batch.epochs``). Ranks therefore always take the same number of steps -- a
distributed run cannot hang on unequal shards -- and no sample is dropped or padded; the
training loop counts steps (``train.epochs`` is turned into steps from ``num_samples``).

Exact resume: :meth:`TrainLoader.state_dict` (collective under ``torch.distributed``) returns
every worker's (epoch, index) plus the rank's round-robin position; restored with the same world
size and workers, each worker skips the already-emitted samples without decoding them and the run
continues with exactly the batches it would have produced. Restored with a different layout, the
shards of the oldest unfinished epoch that were not fully consumed are re-dealt to the new slots
(samples of shards that were in flight are seen twice; the number is logged) and later epochs
follow the new layout.

Bad input -- undecodable or empty image bytes, a missing or non-integer ``cls``, a truncated,
missing or unreachable shard -- is skipped, warned about by the rank that met it (rate-limited)
and counted by cause (:attr:`TrainLoader.skipped_by_cause`); it never ends an epoch.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils.data import IterableDataset, get_worker_info

from pretrain.data.device_batch import Batch
from pretrain.data.loader_workers import (failed, iterate_workers, new_batch_images, raise_failed,
                                          worker_loader)
from pretrain.data.remote import retry_policy
from pretrain.data.samples import Skip, decode_sample
from pretrain.data.shards import (SKIP_CAUSES, LoaderError, RateLimitedLog, ShardPlan, ShardSet,
                                  WorkerPos, add_counts, deal, slot_stream, unfinished_shards)
from pretrain.data.transforms import TrainTransform
log = logging.getLogger(__name__)

STATE_FORMAT = 1


@dataclass
class _RankState:
    workers: List[WorkerPos]
    next_worker: int = 0
    # Skips counted before a change of layout (kept on rank 0 so a world sum stays right).
    skipped_base: Dict[str, int] = field(default_factory=dict)
    causes_base: Dict[str, int] = field(default_factory=dict)

    def copy(self) -> "_RankState":
        return _RankState([w.copy() for w in self.workers], self.next_worker,
                          dict(self.skipped_base), dict(self.causes_base))


class _TrainDataset(IterableDataset):
    """Runs inside each data-loader worker: one logical worker's batches, forever."""

    def __init__(self, plan: ShardPlan, rank: int, workers: int, state: _RankState,
                 buffer: int, batch_size: int, transform: TrainTransform,
                 num_classes: Optional[int]):
        self.plan, self.rank, self.workers, self.state = plan, rank, workers, state
        self.buffer, self.batch_size, self.transform = buffer, batch_size, transform
        self.num_classes = num_classes

    def __iter__(self):
        info = get_worker_info()
        # DataLoader serves its workers round-robin starting at worker 0; rotating the
        # logical ids makes the rank's batch order continue where the saved state left it.
        logical = ((info.id if info else 0) + self.state.next_worker) % self.workers
        slot = self.rank * self.workers + logical
        start = self.state.workers[logical]
        skips, warn = start.copy(), RateLimitedLog()
        good = self._decoded(slot_stream(self.plan, slot, self.buffer, start, skips, warn),
                             slot, skips, warn)
        try:
            yield from self._batches(logical, good, skips)
        except LoaderError as e:
            yield failed(e)

    def _batches(self, logical: int, good, skips: WorkerPos):
        # One good sample is always decoded ahead: a batch's position is that of the next
        # good sample, so the skips before it belong to the batch and a resume never
        # counts them twice.
        pending = next(good)
        while True:
            images = new_batch_images(self.batch_size, self.transform.size)
            labels, keys, epochs = [], [], []
            for i in range(self.batch_size):
                epoch, _, key, label, image = pending
                images[i] = image
                labels.append(label)
                keys.append(key)
                epochs.append(epoch)
                pending = next(good)
            meta = (logical, pending[0], pending[1], dict(skips.skipped), dict(skips.causes))
            yield (images, torch.tensor(labels, dtype=torch.int64), keys,
                   torch.tensor(epochs, dtype=torch.int64), meta)

    def _decoded(self, stream, slot: int, skips: WorkerPos, warn: RateLimitedLog):
        for epoch, index, sample in stream:
            rng = random.Random(f"aug:{self.plan.seed}:{epoch}:{slot}:{index}")
            decoded = decode_sample(sample, self.num_classes,
                                    lambda data: self.transform(data, rng))
            if isinstance(decoded, Skip):
                skips.count(epoch, decoded.cause)
                warn.warning("skipping sample %s: %s", sample.get("__key__"), decoded.reason)
                continue
            yield (epoch, index, sample["__key__"]) + decoded


def reader_slots(shards: ShardSet, world_size: int, num_workers: int, resample: bool) -> int:
    """The readers an epoch's shards are dealt to (every rank's workers); refused where some
    would get none (exactly-once epochs deal whole shards)."""
    workers = max(1, num_workers)
    slots = world_size * workers
    if len(shards.urls) < slots and not resample:
        # (a dev share held out of the split is in every shard: the user's split name)
        most = len(shards.urls) // world_size  # the workers a rank can have
        fewer = f"lower data.num_workers to {most}, " if workers > 1 and most else ""
        raise LoaderError(
            f"split '{shards.name.partition('[')[0]}' has {len(shards.urls)} shards but world "
            f"size {world_size} x {workers} workers = {slots} reader slots; {fewer}write "
            f"smaller shards (prepare_data.py --shard-size), or set data.resample=true (no "
            f"exactly-once epochs)")
    return slots


class TrainLoader:
    """The rank's infinite stream of uint8 train batches; see the module docstring.

    Iterate it (``for batch in loader`` or ``next(it)``); every new ``iter()`` continues from
    the current state. :meth:`state_dict` / :meth:`load_state_dict` give exact resume.
    """

    def __init__(self, shards: ShardSet, *, img_size: int, batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, num_workers: int = 0,
                 shuffle_buffer: int = 5000, resample: bool = False,
                 crop_scale: Sequence[float] = (0.05, 1.0), hflip: float = 0.5,
                 randaugment: Optional[str] = None, num_classes: Optional[int] = None,
                 log_sample_keys: Optional[str] = None, pin_memory: bool = False,
                 prefetch_factor: int = 2):
        if not shards.urls:
            raise LoaderError(f"split '{shards.name}' has no shards; check data.root")
        self.shards, self.rank, self.world_size = shards, rank, world_size
        self.batch_size, self.seed, self.num_workers = batch_size, seed, num_workers
        self.workers = max(1, num_workers)
        self.shuffle_buffer, self.resample = shuffle_buffer, resample
        slots = reader_slots(shards, world_size, num_workers, resample)
        self.plan = ShardPlan(shards, slots, seed, resample)
        self.transform = TrainTransform(img_size, crop_scale, hflip, randaugment)
        self.num_classes = num_classes
        self.pin_memory, self.prefetch_factor = pin_memory, prefetch_factor
        self._state = _RankState([WorkerPos() for _ in range(self.workers)])
        self._keys_path = (Path(log_sample_keys) / f"rank{rank}.txt") if log_sample_keys else None

    # ---- what the training loop reads ------------------------------------------------------
    @property
    def num_samples(self) -> int:
        """Samples in one epoch of the split (from _info.json)."""
        return self.shards.num_samples

    @property
    def skipped(self) -> int:
        """Corrupt or lost samples skipped so far by this rank's workers (all-reduce for a total)."""
        return sum(self.skipped_by_epoch.values())

    @property
    def skipped_by_epoch(self) -> Dict[int, int]:
        """Skips per epoch; an epoch's count is final once every worker has moved past it."""
        total: Dict[str, int] = dict(self._state.skipped_base)
        for w in self._state.workers:
            add_counts(total, w.skipped)
        return {int(e): n for e, n in sorted(total.items(), key=lambda kv: int(kv[0]))}

    @property
    def skipped_by_cause(self) -> Dict[str, int]:
        """This rank's skips per cause, every cause of :data:`SKIP_CAUSES` listed."""
        total = add_counts({c: 0 for c in SKIP_CAUSES}, self._state.causes_base)
        for w in self._state.workers:
            add_counts(total, w.causes)
        return total

    @property
    def epoch(self) -> float:
        """Fractional epoch this rank's workers have reached (for logging)."""
        per_slot = max(1, self.num_samples) / self.plan.num_slots
        return sum(w.epoch + w.index / per_slot for w in self._state.workers) / self.workers

    def __iter__(self) -> Iterator[Batch]:
        state = self._state.copy()
        dataset = _TrainDataset(self.plan, self.rank, self.workers, state, self.shuffle_buffer,
                                self.batch_size, self.transform, self.num_classes)
        loader = worker_loader(dataset, self.num_workers, pin_memory=self.pin_memory,
                               prefetch_factor=self.prefetch_factor if self.num_workers else None)
        keys_file = self._open_keys_file()
        try:
            for item in iterate_workers(loader):
                raise_failed(item)
                images, labels, keys, epochs, meta = item
                self._advance(meta)
                if keys_file is not None:
                    keys_file.write("".join(k + "\n" for k in keys))
                    keys_file.flush()
                yield Batch(images, labels, keys, epochs)
        finally:
            if keys_file is not None:
                keys_file.close()

    def _advance(self, meta: Tuple[int, int, int, dict, dict]) -> None:
        logical, epoch, index, skipped, causes = meta
        if logical != self._state.next_worker:
            raise RuntimeError(f"data loader served worker {logical} out of turn (expected "
                               f"{self._state.next_worker}); exact resume needs in-order loading")
        self._state.workers[logical] = WorkerPos(epoch, index, skipped, False, causes)
        self._state.next_worker = (logical + 1) % self.workers

    def _open_keys_file(self):
        if self._keys_path is None:
            return None
        self._keys_path.parent.mkdir(parents=True, exist_ok=True)
        return open(self._keys_path, "a")

    # ---- resume ----------------------------------------------------------------------------
    def layout(self) -> dict:
        return dict(seed=self.seed, world_size=self.world_size, workers=self.workers,
                    resample=self.resample, shuffle_buffer=self.shuffle_buffer)

    def local_state(self) -> dict:
        return dict(workers=[vars(w.copy()) for w in self._state.workers],
                    next_worker=self._state.next_worker,
                    skipped_base=dict(self._state.skipped_base),
                    causes_base=dict(self._state.causes_base),
                    keys_bytes=self._keys_path.stat().st_size
                    if self._keys_path is not None and self._keys_path.exists() else 0)

    def _rewind_keys_files(self, ranks: Sequence[dict]) -> None:
        """Cut each rank's key log back to the saved position: batches consumed after the
        checkpoint were never trained on for good, and the resumed run consumes them again."""
        if self._keys_path is None:
            return
        mine = [self.rank] if len(ranks) == self.world_size else \
            (range(len(ranks)) if self.rank == 0 else [])
        for r in mine:
            path = self._keys_path.with_name(f"rank{r}.txt")
            if path.exists() and path.stat().st_size > ranks[r].get("keys_bytes", 0):
                with open(path, "r+b") as f:
                    f.truncate(ranks[r].get("keys_bytes", 0))

    def state_dict(self) -> dict:
        """The whole world's loader position (small, JSON-serialisable).

        Collective under an initialised ``torch.distributed`` with world_size > 1: call it on
        every rank at the same step; every rank gets the same dict (rank 0 can save it).
        """
        local = self.local_state()
        ranks = [local]
        if self.world_size > 1 and torch.distributed.is_available() \
                and torch.distributed.is_initialized():
            ranks = [None] * self.world_size
            torch.distributed.all_gather_object(ranks, local)
        elif self.world_size > 1:
            raise LoaderError("state_dict() of a multi-rank loader needs torch.distributed "
                              "initialised (it gathers every rank's position)")
        return dict(format=STATE_FORMAT, fingerprint=self.shards.fingerprint(), **self.layout(),
                    override_epoch=self.plan.override_epoch,
                    override_slots=self.plan.override_slots, ranks=ranks)

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: exactly, when the layout matches; else without losing data."""
        if state.get("format") != STATE_FORMAT:
            raise LoaderError(f"loader state format {state.get('format')} is not "
                              f"{STATE_FORMAT}; it was written by another version")
        if state["fingerprint"] != self.shards.fingerprint():
            raise LoaderError("the loader state was saved for different shards than "
                              f"split '{self.shards.name}' has now; resume with the same data.root")
        self.plan.override_epoch = state["override_epoch"]
        self.plan.override_slots = state["override_slots"]
        old = {k: state[k] for k in self.layout()}
        self._rewind_keys_files(state["ranks"])
        if old == self.layout():
            mine = state["ranks"][self.rank]
            self._state = _RankState([WorkerPos(**w) for w in mine["workers"]],
                                     mine["next_worker"], dict(mine["skipped_base"]),
                                     dict(mine.get("causes_base", {})))
            return
        self._replan(state, old)

    def _replan(self, state: dict, old: dict) -> None:
        old_plan = ShardPlan(self.shards, old["world_size"] * old["workers"], old["seed"],
                             old["resample"], state["override_epoch"], state["override_slots"])
        positions = [WorkerPos(**w) for r in state["ranks"] for w in r["workers"]]
        if self.resample or old["resample"]:
            # No exactly-once promise to keep: start a fresh epoch in the new layout.
            epoch = max(p.epoch for p in positions) + 1
            remaining, duplicates = list(range(len(self.shards.urls))), 0
            self.plan = ShardPlan(self.shards, self.plan.num_slots, self.seed, self.resample)
        else:
            epoch, remaining, duplicates = unfinished_shards(old_plan, positions,
                                                             old["shuffle_buffer"])
            slots, _ = deal(remaining, self.shards.lengths, [0] * self.plan.num_slots)
            self.plan = ShardPlan(self.shards, self.plan.num_slots, self.seed, False, epoch,
                                  slots)
        total: Dict[str, int] = {}
        causes: Dict[str, int] = {}
        for p in positions:
            add_counts(total, p.skipped)
            add_counts(causes, p.causes)
        for r in state["ranks"]:
            add_counts(total, r["skipped_base"])
            add_counts(causes, r.get("causes_base", {}))
        self._state = _RankState([WorkerPos(epoch=epoch) for _ in range(self.workers)], 0,
                                 total if self.rank == 0 else {},
                                 causes if self.rank == 0 else {})
        if self.rank == 0:
            log.warning(
                "data loader resumed with a different layout (%s -> %s): epoch %d goes on with "
                "its %d unfinished of %d shards re-dealt; %d samples already seen will be seen "
                "again (shards in flight)", _describe(old), _describe(self.layout()), epoch,
                len(remaining), len(old_plan.epoch_shards(epoch)), duplicates)


def _describe(layout: dict) -> str:
    return (f"world {layout['world_size']} x {layout['workers']} workers, seed {layout['seed']}, "
            f"buffer {layout['shuffle_buffer']}")


# --------------------------------------------------------------------------------------------
# Construction from the config
# --------------------------------------------------------------------------------------------
def build_train_loader(data, *, img_size: int, batch_size: int, rank: int = 0,
                       world_size: int = 1, seed: int = 0, num_classes: Optional[int] = None,
                       log_sample_keys: Optional[str] = None, pin_memory: bool = False,
                       holdout: float = 0.0, exact_classes: bool = False,
                       read_before: bool = False) -> TrainLoader:
    """The train loader of ``data`` (a :class:`pretrain.config.DataConfig`), without the
    ``holdout`` share of the split (a dev split, see :meth:`ShardSet.holding_out`).
    ``exact_classes``: refuse a dataset of fewer classes than ``num_classes`` too.
    ``read_before``: the run read this data in an earlier job (it has checkpoints): storage
    that does not answer now is an outage to wait out with every retry, not a wrong address
    said in seconds (pretrain.data.info.FIRST_CONTACT_S)."""
    if not data.root:
        raise LoaderError("data.root is not set; point it at a directory with _info.json")
    retry = retry_policy(data)
    if read_before:
        retry = dataclasses.replace(retry, first_contact_s=math.inf)
    shards = ShardSet.from_info(data.root, data.train_split, retry,
                                data.missing_shards, num_classes, exact_classes, rank)
    shards.check_present(data.missing_shards, rank)
    if holdout:
        shards = shards.holding_out(holdout, "rest")
    return TrainLoader(shards, img_size=img_size,
                       batch_size=batch_size, rank=rank, world_size=world_size, seed=seed,
                       num_workers=data.num_workers, shuffle_buffer=data.shuffle_buffer,
                       resample=data.resample, crop_scale=data.crop_scale, hflip=data.hflip,
                       randaugment=data.randaugment, num_classes=num_classes,
                       log_sample_keys=log_sample_keys, pin_memory=pin_memory)

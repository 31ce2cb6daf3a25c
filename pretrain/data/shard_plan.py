"""Which sample goes into which shard: the index of a raw source and the shard plan made from it.

The index holds every sample of the source as compact numpy columns (key, label, where the
bytes are): about 60 bytes a sample, so ImageNet-21k's 14 M samples fit in well under 1 GB, and
it is cached so an interrupted run does not scan the source again. The plan holds out a seeded
validation split, sorts by key and shuffles each split into shards. Everything here is
deterministic given the samples and the options; :mod:`pretrain.data.shard_writer` turns the plan
into tar files.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional

import numpy as np

from pretrain.atomic_write import write_atomic

from .scan_journal import ScanJournal
from .sources import Entry, PrepareError, Source, same_source, source_fingerprint, what_changed

SPLITS = ("train", "validation", "test")
COLUMNS = ("split", "key", "label", "part", "name", "offset", "size")

Index = Dict[str, np.ndarray]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# The index
# --------------------------------------------------------------------------------------------
def build_index(entries: Iterable[Entry], chunk: int = 1 << 20) -> Index:
    """Compact numpy columns of all entries, built a chunk at a time so Python objects stay few."""
    chunks: List[Index] = []
    batch: List[Entry] = []
    for entry in entries:
        batch.append(entry)
        if len(batch) == chunk:
            chunks.append(columns(batch))
            batch = []
    if batch or not chunks:
        chunks.append(columns(batch))
    return {c: np.concatenate([ch[c] for ch in chunks]) for c in COLUMNS}


def columns(batch: List[Entry]) -> Index:
    return dict(
        split=np.array([SPLITS.index(e.split) for e in batch], dtype=np.uint8),
        key=np.array([e.key.encode() for e in batch], dtype=bytes),
        label=np.array([e.label for e in batch], dtype=np.int32),
        part=np.array([e.part for e in batch], dtype=np.int32),
        # A file name that is not UTF-8 must still open the file it came from.
        name=np.array([e.name.encode("utf-8", "surrogateescape") for e in batch], dtype=bytes),
        offset=np.array([e.offset for e in batch], dtype=np.int64),
        size=np.array([e.size for e in batch], dtype=np.int64),
    )


def take_rows(index: Index, rows: np.ndarray) -> Index:
    return {c: index[c][rows] for c in COLUMNS}


def index_entries(index: Index) -> Iterable[Entry]:
    for s, k, l, p, n, o, z in zip(*(index[c].tolist() for c in COLUMNS)):
        yield Entry(SPLITS[s], k.decode(), l, p, n.decode("utf-8", "surrogateescape"), o, z)


def save_npz(path: Path, index: Index) -> None:
    with open(path, "wb") as f:  # np.savez given a name without ".npz" would add the suffix
        np.savez(f, **index)


def load_or_build_index(source: Source, src: str, work: Path, progress: bool,
                        shards_written: bool) -> Index:
    """The cached index of an interrupted run, or a scan of the source (then cached); a scan
    that was cut off goes on where its journal says, for the sources that keep one. A source
    that changed since its cached index was made is scanned again while no shard has been
    written; after, it is refused: the shards written follow the old index, and the rest
    would leave out what was added (and fail on what was removed)."""
    cache, scan = work / "index.npz", work / "scan.json"
    tops = source.top_folders()
    stamp = source_fingerprint(src, source.reads, tops)
    # scan.json outlives a finished run's index: a shard lost since is written again only
    # from the source the others were written from
    if scan.is_file():
        state = json.loads(scan.read_text())
        was = state.get("src_fingerprint")
        if was is None or same_source(was, stamp, src, tops):  # (not kept by the oldest versions)
            if cache.is_file():
                source.parts, source.unknown = state["parts"], state["unknown"]
                with np.load(cache) as z:
                    return {c: z[c] for c in COLUMNS}
        elif shards_written:
            raise PrepareError(f"{src} changed ({what_changed(was, stamp)} this run listed it), "
                               f"and shards of that listing are written in {work.parent}; put "
                               f"the source back as it was to resume, or start afresh in a new "
                               f"output folder (--out, or --stage for a remote --out)")
        else:
            log.warning("%s changed (%s this run listed it), before any shard was written: "
                        "listing it again", src, what_changed(was, stamp))
            cache.unlink(missing_ok=True)
    journal = ScanJournal(work / "scan", src, stamp) if source.resumable_scan else None
    if journal is None or journal.state is None:
        shutil.rmtree(work / "spill", ignore_errors=True)
    entries = source.entries(journal) if journal is not None else source.entries()
    index = build_index(_with_progress(source, entries, progress))
    # on disk before the journal that stands for them goes
    write_atomic(cache, lambda tmp: save_npz(tmp, index), durable=journal is not None)
    write_atomic(scan, json.dumps({"parts": source.parts, "unknown": source.unknown,
                                   "src_fingerprint": stamp}), durable=journal is not None)
    if journal is not None:
        journal.clear()
    return index


def _with_progress(source: Source, entries: Iterable[Entry], progress: bool) -> Iterator[Entry]:
    """The "index" bar: images listed, and where the source can say, how far through it the
    pass is (tars, or bytes of an outer tar) with an ETA."""
    if not progress:
        yield from entries
        return
    from .progress import progress_bar

    total, unit = source.scan_size()
    bar, n = None, 0

    def show_where_the_source_is():
        bar.set_postfix_str(f"{n:,} images", refresh=False)
        bar.update(source.scan_done - bar.n)
    try:
        for n, entry in enumerate(entries, 1):
            if bar is None:  # a resumed pass has set where it resumes by its first entry
                bar = progress_bar(desc="index", total=total, unit=unit, unit_scale=unit == "B",
                                   unit_divisor=1024, initial=source.scan_done, mininterval=1.0)
            yield entry
            if total is None:
                bar.update()
            elif source.scan_done != bar.n:
                show_where_the_source_is()
        if bar is not None and total is not None:
            show_where_the_source_is()
    finally:
        if bar is not None:
            bar.close()


def key_hash(keys: np.ndarray, seed: int) -> np.ndarray:
    """A seeded 64-bit hash per key: stable across runs, machines and Python versions."""
    salt = str(seed).encode()
    return np.fromiter((int.from_bytes(hashlib.blake2b(k, digest_size=8, key=salt).digest(), "little")
                        for k in keys.tolist()), dtype=np.uint64, count=len(keys))


def hold_out(index: Index, val_count: int, seed: int) -> None:
    """Move the ``val_count`` training samples with the smallest key hash to ``validation``."""
    train = np.flatnonzero(index["split"] == SPLITS.index("train"))
    if val_count >= len(train):
        raise PrepareError(f"--val-count {val_count} leaves no training images ({len(train)} found); "
                           f"lower it")
    hashes = key_hash(index["key"][train], seed)
    chosen = train[np.argpartition(hashes, val_count - 1)[:val_count]] if val_count else train[:0]
    index["split"][chosen] = SPLITS.index("validation")


def sort_by_key(index: Index, source: Optional[Source] = None) -> Index:
    """Sorted by key, so the output depends on the set of samples, not on the scan order.

    A key must be unique within its split only: the splits' shards are separate, and datasets
    exported split by split number their files afresh in each (``train/cat/0001.png`` and
    ``val/cat/0001.png``).
    """
    index = take_rows(index, np.argsort(index["key"], kind="stable"))
    for code, split in enumerate(SPLITS):
        rows = np.flatnonzero(index["split"] == code)
        keys = index["key"][rows]
        dup = np.flatnonzero(keys[1:] == keys[:-1])
        if len(dup):
            first, second = index_entries(take_rows(index, rows[dup[0]:dup[0] + 2]))
            both = f"{source.describe(first)} and {source.describe(second)}" if source else "two images"
            raise PrepareError(f"{both} share the sample key '{first.key}' in split '{split}'; "
                               f"rename one of them")
    return index


# --------------------------------------------------------------------------------------------
# The plan: which rows go to which shard
# --------------------------------------------------------------------------------------------
@dataclass
class Shard:
    split: str
    filename: str
    rows: np.ndarray  # positions in the index, in the order written


def plan_shards(index: Index, name: str, shard_size: int, seed: int) -> List[Shard]:
    shards = []
    for code, split in enumerate(SPLITS):
        rows = np.flatnonzero(index["split"] == code)
        # A seeded permutation of the whole split: class-sorted sources come out mixed.
        rows = rows[np.random.default_rng([seed, code]).permutation(len(rows))]
        for j, start in enumerate(range(0, len(rows), shard_size)):
            shards.append(Shard(split, f"{name}-{split}-{j:06d}.tar", rows[start:start + shard_size]))
    return shards

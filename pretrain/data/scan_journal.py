"""The index pass over ImageNet-21k, saved as it goes so a rerun goes on where it was cut off.

Listing ImageNet-21k's 14 M images is hours of work: 21k per-synset tars whose headers are read
one by one, or the 1.3 TB outer tar read front to back with every image spilled to disk. A time
limit or a crash in that pass used to send the rerun back to the first byte. The two readers
(:mod:`pretrain.data.imagenet21k`) list their samples one inner tar at a time; after an inner tar
is done, at most every :data:`SAVE_EVERY_S`, the journal writes the entries listed since the last
save to a numbered chunk file and then the state that says where to go on from: how many inner
tars are done, where the next one starts in the outer stream, which spill files hold their bytes
and how long the last of those is. Each is on disk (fsync) before the state that names it, so a
state never names data that is not there, after a kill or a power loss alike; whatever was
listed after the last state is listed again.

A rerun replays the saved entries, cuts the last spill file back to its saved length and reads on
from the next inner tar. The state also records
:func:`~pretrain.data.sources.source_fingerprint` of ``--src`` (the size and modification time of
the outer tar, or of each per-synset tar): a source that changed since is scanned again from the
start, with a warning.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import numpy as np

from pretrain.atomic_write import write_atomic

from .sources import Entry, same_source

log = logging.getLogger(__name__)

SAVE_EVERY_S = 60.0  # a cut-off pass loses at most this much work (plus one inner tar)
STATE = "state.json"


class ScanJournal:
    """The saved progress of one source's index pass, in ``folder``."""

    def __init__(self, folder: Path, src: str, fingerprint: Dict[str, str]) -> None:
        """``fingerprint``: :func:`~pretrain.data.sources.source_fingerprint` of ``src``,
        computed once per run."""
        self.folder, self.src = Path(folder), src
        self._buffer: List[Entry] = []
        self._chunks: List[str] = []
        self._saved_at = time.monotonic()
        self.state: Optional[dict] = None  # where a resumed pass goes on from; None: the start
        self._src_was = [src, fingerprint]
        path = self.folder / STATE
        if path.is_file():
            state = json.loads(path.read_text())
            saved = state.get("src") or [None, None]
            if saved[0] == src and same_source(saved[1], fingerprint, src):
                self.state, self._chunks = state, list(state["chunks"])
            else:
                log.warning("%s changed since the interrupted index pass: scanning it again from "
                            "the start", src)
                self.clear()

    def replay(self) -> Iterator[Entry]:
        """The entries saved by the interrupted pass, in the order they were listed."""
        from .shard_plan import COLUMNS, index_entries

        for name in self._chunks:
            with np.load(self.folder / name) as z:
                yield from index_entries({c: z[c] for c in COLUMNS})

    def note(self, entry: Entry) -> Entry:
        self._buffer.append(entry)
        return entry

    def due(self) -> bool:
        return time.monotonic() - self._saved_at >= SAVE_EVERY_S

    def save(self, **state) -> None:
        """Record that every entry noted so far is listed, and where the pass goes on from
        (``state``: the source's own, JSON). Call at an inner tar's end, spill files synced."""
        from .shard_plan import columns, save_npz

        self.folder.mkdir(parents=True, exist_ok=True)
        if self._buffer:
            name = f"chunk-{len(self._chunks):06d}.npz"
            index = columns(self._buffer)
            write_atomic(self.folder / name, lambda tmp: save_npz(tmp, index), durable=True)
            self._chunks.append(name)
            self._buffer = []
        state = dict(state, src=self._src_was, chunks=self._chunks)
        write_atomic(self.folder / STATE, json.dumps(state), durable=True)
        self._saved_at = time.monotonic()

    def clear(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        self.state, self._chunks, self._buffer = None, [], []

"""The two ImageNet-21k layouts, labelled by a synset list (``--synsets``).

* a folder of per-synset tars (``n01440764.tar`` holding ``n01440764_*.JPEG``), read in place
  by member offset (:class:`SynsetTars`);
* the outer ``fall11_whole.tar`` / ``winter21_whole.tar.gz``, read once as a stream whose member
  bytes are spilled into a few large work files (:class:`OuterTarStream`).

Both list one inner tar at a time and keep a journal of the listing, so a pass over 14 M images
that is cut off goes on where it stopped (:mod:`pretrain.data.scan_journal`).
"""
from __future__ import annotations

import bz2
import contextlib
import errno
import gzip
import logging
import lzma
import os
import re
import tarfile
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Iterator, List, Optional, Tuple

from pretrain.atomic_write import fsync_path
from pretrain.data.sources import (Entry, PrepareError, Source, is_image, load_synsets,
                                   sample_key, visible)
from pretrain.helper_processes import pool_map

if TYPE_CHECKING:
    from .scan_journal import ScanJournal

log = logging.getLogger(__name__)

# Spill files of the outer-tar stream rotate at this size, so no single file gets huge.
SPILL_FILE_BYTES = 1 << 30


def _read_range(path: str, offset: int, size: int) -> bytes:
    # A tar cut short gives fewer bytes; the image decoder then reports the sample as truncated.
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


# The compressions tarfile's "r|*" reads, by the magic bytes that start the file.
_COMPRESSED = ((b"\x1f\x8b", gzip.GzipFile), (b"BZh", bz2.BZ2File),
               (b"\xfd7zXZ\x00", lzma.LZMAFile))


def _open_stream(path: str, position: int) -> Tuple[BinaryIO, BinaryIO]:
    """(the file, its decompressed stream) with the stream at ``position``. A plain tar is
    entered there directly; a compressed one has no way in but from its start, so the bytes
    before ``position`` are decompressed and dropped (no spilling: far quicker than reading
    them the first time)."""
    raw = open(path, "rb", buffering=0)  # tarfile reads in records of its own
    try:
        head = raw.read(6)
        raw.seek(0)
        stream = next((kind(fileobj=raw) for magic, kind in _COMPRESSED if head.startswith(magic)),
                      raw)
        if stream is raw:
            raw.seek(position)
        elif position:
            log.info("index: decompressing %s up to byte %d of its stream (a compressed tar has "
                     "no way in but from its start)", path, position)
            left = position
            while left:
                got = len(stream.read(min(left, 16 << 20)))
                if not got:
                    raise EOFError(f"the stream ends before byte {position}")
                left -= got
    except BaseException:
        raw.close()
        raise
    return raw, stream


class _SynsetLabels(Source):
    """Shared by the two ImageNet-21k layouts: a synset list gives each synset its label."""

    name = "imagenet21k"
    resumable_scan = True

    def __init__(self, src: str, synsets: str, skip_unknown: bool) -> None:
        super().__init__()
        self.src = src
        self.classes = load_synsets(synsets)
        self._label = {s: i for i, s in enumerate(self.classes)}
        self._synsets, self._skip_unknown = synsets, skip_unknown

    def label_of(self, synset: str, where: str) -> Optional[int]:
        label = self._label.get(synset)
        if label is None:
            if not self._skip_unknown:
                raise PrepareError(f"synset {synset} ({where}) is not in the '{self._synsets}' synset list "
                                   f"({len(self.classes)} classes); pass --skip-unknown to leave it out "
                                   f"or choose another --synsets")
            self.unknown.append(synset)
        return label



def _list_tar(path: str) -> List[Tuple[str, int, int]]:
    """(sample key, byte offset, size) of each image in the tar at ``path``: its headers only."""
    try:
        with tarfile.open(path, "r:") as tar:
            listed = [(sample_key(os.path.splitext(os.path.basename(m.name))[0]), m.offset_data,
                       m.size) for m in tar if m.isfile() and is_image(m.name)]
        with open(path, "rb") as f:  # a tar ends in two zero blocks: a cut between members
            f.seek(max(0, os.path.getsize(path) - 1024))  # lists fine without them
            if f.read() != bytes(1024):
                log.warning("%s does not end as a tar does (a download cut off?): %d images "
                            "listed from it; download it again if it holds more", path,
                            len(listed))
        return listed
    except tarfile.TarError as e:  # not an OSError: it would end the run as a traceback
        # an error page saved as the tar, or a download cut off: one of 21k files, named
        raise PrepareError(f"{path} is not a readable tar ({e}); download it again, or move it "
                           f"out of --src to leave synset {Path(path).stem} out") from None


class SynsetTars(_SynsetLabels):
    """A folder of per-synset tars, read in place: the index records each member's byte range.

    Listing them reads every header: 14 M small reads for ImageNet-21k, CPU-bound on a local
    disk and a round trip each on a cluster file system, so ``workers`` processes read the
    tars' headers in parallel (in order: the index is the same for any count).
    """

    def __init__(self, src: str, synsets: str, skip_unknown: bool, workers: int = 1) -> None:
        super().__init__(src, synsets, skip_unknown)
        self.workers = workers

    def _tars(self) -> List[Path]:
        # (hidden ones left out: macOS's ._n00004475.tar beside each tar copied from a Mac)
        tars = sorted(p for p in Path(self.src).iterdir()
                      if p.name.endswith(".tar") and visible(p.name))
        if not tars:
            raise PrepareError(f"no per-synset tars (n01440764.tar ...) in {self.src}; point --src at "
                               f"their folder or at fall11_whole.tar / winter21_whole.tar.gz")
        if len(tars) <= 2 and not any(p.name[:-4] in self._label or
                                      re.fullmatch(r"n\d{8}", p.name[:-4]) for p in tars):
            raise PrepareError(f"{self.src} holds {tars[0].name}, not per-synset tars "
                               f"(n01440764.tar ...); an outer tar is read as --src itself: "
                               f"--src {tars[0]}")
        return tars

    def scan_size(self) -> Tuple[Optional[int], str]:
        return len(self._tars()), "tar"

    def reads(self, name: str) -> bool:
        return name.endswith(".tar")

    def entries(self, journal: Optional["ScanJournal"] = None) -> Iterator[Entry]:
        tars = self._tars()
        # every synset missing from the list is named now, not hours into the listing
        self.unknown = []
        labels = [self.label_of(path.name[:-4], str(path)) for path in tars]
        if journal is not None and journal.state is not None:
            self.scan_done, self.parts = journal.state["tars_done"], journal.state["parts"]
            log.info("index: going on after %d of %d tars, where the interrupted pass left off",
                     self.scan_done, len(tars))
            yield from journal.replay()
        todo = [i for i in range(self.scan_done, len(tars)) if labels[i] is not None]
        paths = [str(tars[i]) for i in todo]
        listed = pool_map(_list_tar, paths, self.workers, ahead=4 * self.workers) \
            if self.workers > 1 and len(todo) > 1 else map(_list_tar, paths)
        try:
            for i, members in zip(todo, listed):
                if journal is not None and journal.due():
                    journal.save(tars_done=i, parts=self.parts)  # unknown: from the names
                self.parts.append(str(tars[i]))
                for key, offset, size in members:
                    entry = Entry("train", key, labels[i], len(self.parts) - 1, "", offset, size)
                    yield journal.note(entry) if journal is not None else entry
                self.scan_done = i + 1
            self.scan_done = len(tars)
        finally:
            if hasattr(listed, "close"):  # the pool's generator: its workers stop now
                listed.close()

    def read(self, entry: Entry) -> bytes:
        return _read_range(self.parts[entry.part], entry.offset, entry.size)

    def describe(self, entry: Entry) -> str:
        return f"{self.parts[entry.part]}:{entry.key}"


class SpillWriteError(OSError):
    """Writing a spill file failed (a full or failing disk where the output is prepared), not
    reading the source: said as such an error is (launch/prepare_data.py), naming the file."""


def _spilled(state: dict) -> bool:
    """Whether the spill files a journal's ``state`` names are all there, the last one at
    least as long as it says (someone may have cleaned the work folder)."""
    parts = state["parts"]
    return all(os.path.isfile(p) for p in parts) and \
        (not parts or os.path.getsize(parts[-1]) >= state["spill_bytes"])


class OuterTarStream(_SynsetLabels):
    """``fall11_whole.tar`` / ``winter21_whole.tar.gz`` read once, front to back, never extracted.

    A compressed tar has no random access, so each member's bytes are appended to large spill
    files under ``spill_dir`` as the stream goes by, and the index records their byte ranges;
    from there the writer reads samples in any order, exactly as from per-synset tars.
    """

    def __init__(self, src: str, synsets: str, skip_unknown: bool, spill_dir: str) -> None:
        super().__init__(src, synsets, skip_unknown)
        self.spill_dir = spill_dir
        self._where: dict = {}

    def scan_size(self) -> Tuple[Optional[int], str]:
        return os.path.getsize(self.src), "B"  # of the file as stored (compressed or not)

    def entries(self, journal: Optional["ScanJournal"] = None) -> Iterator[Entry]:
        os.makedirs(self.spill_dir, exist_ok=True)
        spill, start = None, 0
        state = journal.state if journal is not None else None
        if state is not None and not _spilled(state):
            log.warning("the spill files of the interrupted index pass are gone from %s: "
                        "scanning %s again from the start", self.spill_dir, self.src)
            journal.clear()
            state = None
        if state is not None:
            start, self.parts, self.unknown = state["position"], state["parts"], state["unknown"]
            self.scan_done = state["read"]
            log.info("index: going on at byte %d of the stream of %s, where the interrupted pass "
                     "left off", start, self.src)
            yield from journal.replay()
            if self.parts:  # what was spilled after the last save is spilled again
                spill = open(self.parts[-1], "r+b")
                spill.truncate(state["spill_bytes"])
                spill.seek(0, os.SEEK_END)
        raw = stream = None
        try:
            raw, stream = _open_stream(self.src, start)
            with tarfile.open(fileobj=stream, mode="r|") as outer:
                for inner_info in outer:
                    if journal is not None and journal.due():  # every earlier member is done
                        if spill is not None:
                            with self._writing_spill():
                                spill.flush()
                                os.fsync(spill.fileno())
                        journal.save(position=start + inner_info.offset, read=self.scan_done,
                                     parts=self.parts, unknown=self.unknown,
                                     spill_bytes=spill.tell() if spill is not None else 0)
                    self.scan_done = raw.tell()
                    if not (inner_info.isfile() and inner_info.name.endswith(".tar")):
                        continue
                    synset = os.path.basename(inner_info.name)[:-4]
                    label = self.label_of(synset, f"{self.src}:{inner_info.name}")
                    if label is None:
                        continue
                    with tarfile.open(fileobj=outer.extractfile(inner_info), mode="r|") as inner:
                        for member in inner:
                            if not (member.isfile() and is_image(member.name)):
                                continue
                            data = inner.extractfile(member).read()
                            with self._writing_spill():
                                if spill is None or spill.tell() >= SPILL_FILE_BYTES:
                                    spill = self._next_spill(spill)
                                offset = spill.tell()
                                spill.write(data)
                            stem = os.path.splitext(os.path.basename(member.name))[0]
                            entry = Entry("train", sample_key(stem), label, len(self.parts) - 1,
                                          "", offset, member.size)
                            yield journal.note(entry) if journal is not None else entry
            self.scan_done = raw.tell()
            if spill is not None:
                with self._writing_spill():
                    spill.close()  # (its last bytes go to disk now)
        except SpillWriteError:
            raise
        except (tarfile.ReadError, EOFError, OSError, zlib.error, lzma.LZMAError) as e:
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise  # writing the journal, not reading the tar
            raise PrepareError(f"cannot read {self.src} as a tar of per-synset tars ({e}); check the "
                               f"download is complete") from None
        finally:
            for f in (spill, stream, raw):  # (the spill is closed above when all went well)
                if f is not None:
                    with contextlib.suppress(OSError):  # not instead of the error that ends it
                        f.close()

    @contextlib.contextmanager
    def _writing_spill(self):
        """A write error here is this machine's disk, not the source: said naming the file."""
        try:
            yield
        except OSError as e:
            raise SpillWriteError(e.errno, e.strerror,
                                  self.parts[-1] if self.parts else self.spill_dir) from None

    def _next_spill(self, spill):
        if spill is not None:  # on disk before a journal's state counts on it
            spill.flush()
            os.fsync(spill.fileno())
            spill.close()
            if len(self.parts) == 1:
                fsync_path(self.spill_dir)  # holds the names of this file and the next ones
        self.parts.append(os.path.join(self.spill_dir, f"spill-{len(self.parts):05d}.bin"))
        return open(self.parts[-1], "wb")

    def read(self, entry: Entry) -> bytes:
        return _read_range(self.parts[entry.part], entry.offset, entry.size)

    def describe(self, entry: Entry) -> str:
        return f"{self.src}:{entry.key}"

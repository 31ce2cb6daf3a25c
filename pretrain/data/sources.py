"""Readers of raw image datasets, one small class per on-disk layout, and what they share.

A source knows a layout and nothing about shards: it lists its samples lazily as :class:`Entry`
tuples (split, key, label, and where the bytes are) and reads the bytes of one entry back on
demand, so the writer can build a compact index of millions of samples without holding images.

Layouts (README, "Prepare data"), each opened by :func:`open_source`:

* ``imagenet21k``: a folder of per-synset tars (``n01440764.tar`` holding
  ``n01440764_*.JPEG``), read in place by member offset; or the outer ``fall11_whole.tar`` /
  ``winter21_whole.tar.gz``, read once as a stream whose member bytes are spilled into a few
  large work files. Both list one inner tar at a time and keep a journal of the listing, so a
  cut-off pass goes on where it stopped (:mod:`pretrain.data.scan_journal`);
  :mod:`pretrain.data.imagenet21k`.
* ``imagefolder`` and ``imagenet1k``: class folders, :mod:`pretrain.data.folders`.
* ``cifar10`` / ``cifar100``: the python pickle version, :mod:`pretrain.data.cifar`.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import unicodedata
from pathlib import Path
from typing import (TYPE_CHECKING, Callable, Collection, Dict, Iterator, List, NamedTuple,
                    Optional, Set, Tuple)

if TYPE_CHECKING:
    from .scan_journal import ScanJournal

log = logging.getLogger(__name__)

SOURCES = ("imagenet21k", "imagefolder", "imagenet1k", "cifar10", "cifar100")
# What PIL reads and exports commonly hold; each is stored as JPEG (GIF: its first frame).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".jfif", ".png", ".webp", ".bmp", ".tif", ".tiff", ".gif")
# Which timm list each ``--synsets`` name means (timm/data/_info).
SYNSET_LISTS = {"goog": "imagenet21k_goog_synsets.txt", "fall11": "imagenet22k_synsets.txt"}


class PrepareError(ValueError):
    """A problem with the input or the options, phrased as one line that says how to fix it."""


class Entry(NamedTuple):
    split: str
    key: str
    label: int
    part: int  # index into the source's ``parts`` (a tar, a folder, a pickle batch, a spill file)
    name: str  # file name inside a folder part; "" for parts read by offset
    offset: int  # byte offset in a tar/spill part; row in a pickle batch
    size: int  # byte count in a tar/spill part; -1 when the whole file is read


def as_text(name: str) -> str:
    """A file name as text that encodes to UTF-8 and compares equal however it was spelled.

    Bytes that are not UTF-8 (archives made on old Windows machines) come from the file system as
    lone surrogates, which neither a tar header nor JSON can hold; macOS hands out accents
    decomposed (NFD), so the same class folder would otherwise be two classes.
    """
    if name.isascii():  # nearly every name; skips the work for millions of ImageNet keys
        return name
    name = name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return unicodedata.normalize("NFC", name)


def sample_key(stem: str) -> str:
    # webdataset splits a tar member name into key and extension at the first dot, and drops
    # members under a "__name__/" folder as its own metadata; keys are logged one per line.
    key = as_text(stem).replace(".", "_")
    if not key.isprintable():
        key = "".join(c if c.isprintable() else "_" for c in key)
    return "_" + key.lstrip("_") if key.startswith("__") else key


def timm_info_file(filename: str) -> Path:
    """A file of timm's ``data/_info`` folder, found without importing timm (and torch)."""
    spec = importlib.util.find_spec("timm")
    if spec is None or not spec.submodule_search_locations:
        raise PrepareError("timm is not installed; pip install timm (it ships the ImageNet synset lists)")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "_info" / filename


def load_synsets(which: str) -> List[str]:
    """``goog`` (21843 classes), ``fall11`` (21841) or the path of a text file, one synset a line."""
    path = timm_info_file(SYNSET_LISTS[which]) if which in SYNSET_LISTS else Path(which)
    if not path.is_file():
        raise PrepareError(f"synset list '{which}' not found; use --synsets goog, fall11 or the path "
                           f"of a text file with one synset per line")
    synsets = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if len(set(synsets)) != len(synsets):
        raise PrepareError(f"synset list '{which}' names a synset twice; fix the file")
    return synsets


def is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


# What a macOS zip unpacks next to the class folders; never a class of its own.
IGNORED_FOLDERS = ("__MACOSX",)


def visible(name: str) -> bool:
    """Whether a source reads the file or folder ``name``: hidden entries are editor, notebook
    and macOS leftovers (.ipynb_checkpoints, ._x.jpg), and so is ``__MACOSX``."""
    return not name.startswith(".") and name not in IGNORED_FOLDERS


def _not_hidden(name: str) -> bool:  # what versions before IGNORED_FOLDERS left out
    return not name.startswith(".")


def _walk(src: str, shown: Callable[[str], bool] = visible,
          tops: Optional[Collection[str]] = None) -> Iterator[Tuple[str, List[str]]]:
    """(folder, its file names sorted) below the folder ``src`` as the sources read it: what is
    not ``shown`` left out, and of the folders of ``src`` itself those not in ``tops`` (None:
    all), links followed down to the deepest level a source reads (``ROOT/split/class/image``),
    so a link loop ends."""
    top = src.rstrip(os.sep).count(os.sep)
    for folder, dirs, files in os.walk(src, followlinks=True):
        depth = folder.count(os.sep) - top
        if depth >= 3:
            dirs[:] = []
        dirs[:] = sorted(d for d in dirs if shown(d) and (depth or _in(d, tops)))
        yield folder, sorted(f for f in files if shown(f))


def _in(top_folder: str, tops: Optional[Collection[str]]) -> bool:
    return tops is None or top_folder in tops


def _stat_line(path: str) -> Optional[str]:
    try:
        stat = os.stat(path)
    except FileNotFoundError:  # a link to nothing
        return None
    return f"{stat.st_size}:{stat.st_mtime_ns}"


def source_fingerprint(src: str, reads: Callable[[str], bool],
                       tops: Optional[Collection[str]] = None) -> Dict[str, str]:
    """What says that ``src`` changed, folder by folder (its path below ``src`` -> a digest),
    so that a change can be named. A file (an outer tar, rewritten in place by
    ``rsync --inplace`` say): its size and modification time, under "". In a folder: each image
    by its path alone (an image is read whole when its shard is written, so one added, removed
    or renamed changes the output, one copied over with new times does not; and a name costs
    no stat, which over millions of images on a network file system would be hours); each other
    file the layout ``reads`` (a tar or a pickle whose byte ranges the index holds, a label
    file) by its size and modification time; others (notes, thumbnails) not at all. Every
    folder counts, an empty one too (a class), as :func:`_walk` lists them; of the folders of
    ``src`` itself only those in ``tops``, the ones the layout reads (:meth:`Source.top_folders`:
    a test/ folder of unlabelled images, say, may change)."""
    if not os.path.isdir(src):
        return {"": _stat_line(src) or ""}
    folders = {}
    for folder, files in _walk(src, tops=tops):
        digest = hashlib.sha256()
        beside_splits = tops is not None and folder == src  # (os.walk's first: src itself)
        for name in files:
            line = name
            if is_image(name) and beside_splits:  # no split, no class: left out
                continue
            if not is_image(name):
                stat = _stat_line(os.path.join(folder, name)) if reads(name) else None
                if stat is None:
                    continue
                line += f":{stat}"
            digest.update(f"{line}\n".encode("utf-8", "surrogateescape"))
        folders[os.path.relpath(folder, src)] = digest.hexdigest()
    return folders


def same_source(was, now: Dict[str, str], src: str,
                tops: Optional[Collection[str]] = None) -> bool:
    """Whether a fingerprint kept by a run (``was``) is the source's ``now`` (both of the
    ``tops`` the layout reads). Versions before the fingerprint was kept by folder kept one
    digest of every file (a string): compared in their way, so that an interrupted run of
    theirs resumes."""
    if isinstance(was, str):
        return was == _fingerprint_before_folders(src)
    # kept before __MACOSX, or folders the layout does not read, were left out: they may have
    # changed since, which is no change
    return {k: v for k, v in was.items() if all(map(visible, Path(k).parts))
            and (k in ("", ".") or _in(Path(k).parts[0], tops))} == now


def _fingerprint_before_folders(src: str) -> str:
    if not os.path.isdir(src):
        return _stat_line(src) or ""
    digest = hashlib.sha256()
    for folder, files in _walk(src, _not_hidden):
        for name in files:
            path = os.path.join(folder, name)
            line = os.path.relpath(path, src)
            if not is_image(name):
                stat = _stat_line(path)
                if stat is None:
                    continue
                line += f":{stat}"
            digest.update(f"{line}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def what_changed(was, now: Dict[str, str]) -> str:
    """Where two :func:`source_fingerprint` of one source differ, for a message."""
    if isinstance(was, str):  # kept by an older version: one digest of the whole
        return "files added, removed or rewritten since"
    if "" in was or "" in now:  # a file
        return "rewritten since"
    where = sorted(k for k in was.keys() | now.keys() if was.get(k) != now.get(k))
    named = ", ".join("its top folder" if w == "." else f"'{w}'" for w in where[:3]) + \
        (f" and {len(where) - 3} more folders" if len(where) > 3 else "")
    return f"files added, removed or rewritten in {named} since"


class Source:
    """Base of every layout: ``entries()`` lists the samples, ``read()`` gets one sample's bytes."""

    name = "dataset"
    has_validation = False  # the layout brings its own held-out split
    # The listing takes hours and keeps a journal (pretrain.data.scan_journal): ``entries``
    # takes one and ``src`` names what it reads.
    resumable_scan = False

    def __init__(self) -> None:
        self.classes: List[str] = []
        self.parts: List[str] = []
        # Classes present in the raw data but left out (``--skip-unknown``), for the report.
        self.unknown: List[str] = []
        self.scan_done = 0  # how far ``entries`` has got, in the unit of ``scan_size``

    def entries(self, journal: Optional["ScanJournal"] = None) -> Iterator[Entry]:
        raise NotImplementedError

    def scan_size(self) -> Tuple[Optional[int], str]:
        """(the total of ``scan_done``, its unit) for a progress bar; (None, "img"): unknown,
        the bar counts images."""
        return None, "img"

    def read(self, entry: Entry) -> bytes:
        raise NotImplementedError

    def reads(self, name: str) -> bool:
        """Whether a file of this name below ``--src`` that is no image is read by this layout
        (then its size and time say whether the source changed: :func:`source_fingerprint`)."""
        return False

    def top_folders(self) -> Optional[Set[str]]:
        """The folders of ``--src`` itself this layout reads; None: all of them."""
        return None

    def describe(self, entry: Entry) -> str:
        """Where a sample came from, for the report of unreadable files."""
        part = self.parts[entry.part]
        return os.path.join(part, entry.name) if entry.name else f"{part}@{entry.offset}"


def open_source(kind: str, src: str, *, synsets: str = "goog", skip_unknown: bool = False,
                work_dir: Optional[str] = None, workers: int = 1) -> Source:
    """The reader for ``kind`` (one of :data:`SOURCES`) over ``src``.

    ``work_dir`` holds the spill files when an outer ImageNet-21k tar is streamed; ``workers``
    processes list a folder of per-synset tars.
    """
    # Imported here, not at the top: these readers import Source and Entry from this module.
    from pretrain.data.cifar import Cifar
    from pretrain.data.folders import ImageFolder, ImageNet1k
    from pretrain.data.imagenet21k import OuterTarStream, SynsetTars

    if not os.path.exists(src):
        raise PrepareError(f"--src {src} does not exist; point it at the raw {kind} data")
    src = os.path.abspath(src)
    if kind == "imagenet21k":
        if os.path.isdir(src):
            return SynsetTars(src, synsets, skip_unknown, workers)
        return OuterTarStream(src, synsets, skip_unknown, os.path.join(work_dir or ".", "spill"))
    if synsets != "goog":
        raise PrepareError("--synsets applies to imagenet21k only; drop it")
    if skip_unknown and kind != "imagenet1k":  # the others have no label list to miss
        raise PrepareError("--skip-unknown applies to imagenet21k and imagenet1k (a fixed label "
                           "list) only; drop it")
    if kind == "imagefolder":
        return ImageFolder(src)
    if kind == "imagenet1k":
        return ImageNet1k(src, skip_unknown=skip_unknown)
    if kind in ("cifar10", "cifar100"):
        return Cifar(src, kind)
    raise PrepareError(f"unknown source '{kind}'; choose one of {', '.join(SOURCES)}")

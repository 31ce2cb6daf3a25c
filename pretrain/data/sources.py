"""Readers of raw image datasets, one small class per on-disk layout.

A source knows a layout and nothing about shards: it lists its samples lazily as :class:`Entry`
tuples (split, key, label, and where the bytes are) and reads the bytes of one entry back on
demand, so the writer can build a compact index of millions of samples without holding images.

Layouts (README, "Prepare data"):

* ``imagenet21k``: a folder of per-synset tars (``n01440764.tar`` holding ``n01440764_*.JPEG``),
  read in place by member offset; or the outer ``fall11_whole.tar`` / ``winter21_whole.tar.gz``,
  read once as a stream whose member bytes are spilled into a few large work files.
* ``imagefolder``: ``root/<class>/*``; ``root/train/<class>`` + ``root/val/<class>`` give two splits.
  Keys are unique per split (exports number their files afresh in each split) and carry the
  class folder (``cat/0001`` and ``dog/0001`` are the usual case, not a clash).
* ``imagenet1k``: the same with timm's 1000-synset order; ``val/`` in synset folders or flat with
  a label file.
* ``cifar10`` / ``cifar100``: the python pickle version, unpickled only after a structure check.
"""
from __future__ import annotations

import csv
import importlib.util
import io
import os
import pickle
import tarfile
import unicodedata
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Iterator, List, NamedTuple, Optional, Sequence

import numpy as np

SOURCES = ("imagenet21k", "imagefolder", "imagenet1k", "cifar10", "cifar100")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp")
# Which timm list each ``--synsets`` name means (timm/data/_info).
SYNSET_LISTS = {"goog": "imagenet21k_goog_synsets.txt", "fall11": "imagenet22k_synsets.txt"}
IMAGENET1K_SYNSETS = "imagenet_synsets.txt"
# Label files recognised next to a flat ImageNet-1k ``val/`` folder.
VAL_LABEL_FILES = ("LOC_val_solution.csv", "val_labels.txt", "val.txt")
# Spill files of the outer-tar stream rotate at this size, so no single file gets huge.
SPILL_FILE_BYTES = 1 << 30
FOLDER_LAYOUT = "<root>/<class>/<image> or <root>/{train,val}/<class>/<image>"
# What a macOS zip unpacks next to the class folders; never a class of its own.
IGNORED_FOLDERS = ("__MACOSX",)


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


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def _visible(name: str) -> bool:
    # Hidden entries are editor, notebook and macOS leftovers (.ipynb_checkpoints, ._x.jpg).
    return not name.startswith(".") and name not in IGNORED_FOLDERS


def _subfolders(folder: Path) -> List[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and _visible(p.name))


def _images_below(folder: str) -> Optional[str]:
    """The first image anywhere under ``folder``, or None."""
    for here, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if _visible(d))
        image = next((f for f in sorted(files) if _visible(f) and _is_image(f)), None)
        if image is not None:
            return os.path.join(here, image)
    return None


def _read_range(path: str, offset: int, size: int) -> bytes:
    # A tar cut short gives fewer bytes; the image decoder then reports the sample as truncated.
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


class Source:
    """Base of every layout: ``entries()`` lists the samples, ``read()`` gets one sample's bytes."""

    name = "dataset"
    has_validation = False  # the layout brings its own held-out split

    def __init__(self) -> None:
        self.classes: List[str] = []
        self.parts: List[str] = []
        # Classes present in the raw data but left out (``--skip-unknown``), for the report.
        self.unknown: List[str] = []

    def entries(self) -> Iterator[Entry]:
        raise NotImplementedError

    def read(self, entry: Entry) -> bytes:
        raise NotImplementedError

    def describe(self, entry: Entry) -> str:
        """Where a sample came from, for the report of unreadable files."""
        part = self.parts[entry.part]
        return os.path.join(part, entry.name) if entry.name else f"{part}@{entry.offset}"


class _SynsetLabels(Source):
    """Shared by the two ImageNet-21k layouts: a synset list gives each synset its label."""

    name = "imagenet21k"

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

    def _members(self, tar: tarfile.TarFile, label: int, part: int) -> Iterator[Entry]:
        for member in tar:
            if member.isfile() and _is_image(member.name):
                stem = os.path.splitext(os.path.basename(member.name))[0]
                yield Entry("train", sample_key(stem), label, part, "", member.offset_data, member.size)


class SynsetTars(_SynsetLabels):
    """A folder of per-synset tars, read in place: the index records each member's byte range."""

    def entries(self) -> Iterator[Entry]:
        tars = sorted(p for p in Path(self.src).iterdir() if p.name.endswith(".tar"))
        if not tars:
            raise PrepareError(f"no per-synset tars (n01440764.tar ...) in {self.src}; point --src at "
                               f"their folder or at fall11_whole.tar / winter21_whole.tar.gz")
        for path in tars:
            label = self.label_of(path.name[:-4], str(path))
            if label is None:
                continue
            self.parts.append(str(path))
            with tarfile.open(path, "r:") as tar:
                yield from self._members(tar, label, len(self.parts) - 1)

    def read(self, entry: Entry) -> bytes:
        return _read_range(self.parts[entry.part], entry.offset, entry.size)

    def describe(self, entry: Entry) -> str:
        return f"{self.parts[entry.part]}:{entry.key}"


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

    def entries(self) -> Iterator[Entry]:
        os.makedirs(self.spill_dir, exist_ok=True)
        spill = None
        try:
            with tarfile.open(self.src, "r|*") as outer:
                for inner_info in outer:
                    if not (inner_info.isfile() and inner_info.name.endswith(".tar")):
                        continue
                    synset = os.path.basename(inner_info.name)[:-4]
                    label = self.label_of(synset, f"{self.src}:{inner_info.name}")
                    if label is None:
                        continue
                    with tarfile.open(fileobj=outer.extractfile(inner_info), mode="r|") as inner:
                        for member in inner:
                            if not (member.isfile() and _is_image(member.name)):
                                continue
                            if spill is None or spill.tell() >= SPILL_FILE_BYTES:
                                spill = self._next_spill(spill)
                            offset = spill.tell()
                            spill.write(inner.extractfile(member).read())
                            stem = os.path.splitext(os.path.basename(member.name))[0]
                            yield Entry("train", sample_key(stem), label, len(self.parts) - 1, "",
                                        offset, member.size)
        except (tarfile.ReadError, EOFError, OSError) as e:
            raise PrepareError(f"cannot read {self.src} as a tar of per-synset tars ({e}); check the "
                               f"download is complete") from None
        finally:
            if spill is not None:
                spill.close()

    def _next_spill(self, spill):
        if spill is not None:
            spill.close()
        self.parts.append(os.path.join(self.spill_dir, f"spill-{len(self.parts):05d}.bin"))
        return open(self.parts[-1], "wb")

    def read(self, entry: Entry) -> bytes:
        return _read_range(self.parts[entry.part], entry.offset, entry.size)

    def describe(self, entry: Entry) -> str:
        return f"{self.src}:{entry.key}"


class ImageFolder(Source):
    """``root/<class>/*`` (one split ``train``) or ``root/train/<class>`` + ``root/val/<class>``."""

    name = "imagefolder"

    def __init__(self, src: str, classes: Optional[Sequence[str]] = None, skip_unknown: bool = False) -> None:
        super().__init__()
        self.src = src
        self.split_dirs = self._split_dirs(Path(src))
        self.has_validation = "validation" in self.split_dirs
        # A fixed class list (ImageNet-1k) pins the labels; otherwise the training folders, sorted.
        self.fixed_classes = classes is not None
        self.classes = list(classes) if classes is not None else self._folder_classes()
        self._label = {c: i for i, c in enumerate(self.classes)}
        self._skip_unknown = skip_unknown

    @staticmethod
    def _split_dirs(root: Path) -> dict:
        if not root.is_dir():
            raise PrepareError(f"--src {root} is not a folder; point it at the dataset root")
        val = next((root / n for n in ("val", "validation") if (root / n).is_dir()), None)
        if (root / "train").is_dir() and val is not None:
            return {"train": root / "train", "validation": val}
        return {"train": root}

    def _folder_classes(self) -> List[str]:
        classes = sorted({as_text(p.name) for p in _subfolders(self.split_dirs["train"])})
        if not classes:
            raise PrepareError(f"no class folders in {self.split_dirs['train']}; expected {FOLDER_LAYOUT}")
        return classes

    def _key(self, class_name: str, stem: str) -> str:
        return sample_key(f"{class_name}/{stem}")

    def label_of(self, class_name: str, where: str) -> Optional[int]:
        label = self._label.get(class_name)
        if label is None:
            if not self._skip_unknown:
                hint = ("pass --skip-unknown to leave it out" if self.fixed_classes else
                        "every validation class needs a training folder of the same name")
                raise PrepareError(f"class folder '{class_name}' ({where}) is not a known class; {hint}")
            self.unknown.append(class_name)
        return label

    def entries(self) -> Iterator[Entry]:
        for split, root in self.split_dirs.items():
            yield from self._folder_split(split, root)

    def _folder_split(self, split: str, root: Path) -> Iterator[Entry]:
        # Images outside class folders would have no label, and images below them a wrong one:
        # both are refused rather than dropped or mislabelled.
        loose = next((e.name for e in os.scandir(root) if e.is_file() and _visible(e.name)
                      and _is_image(e.name)), None)
        if loose is not None:
            raise PrepareError(f"found images directly in {root} (e.g. {loose}), outside any class folder; "
                               f"expected {FOLDER_LAYOUT}; move them into a folder named after their class")
        for class_dir in _subfolders(root):
            class_name = as_text(class_dir.name)
            label = self.label_of(class_name, str(class_dir))
            if label is None:
                continue
            names, subfolders = [], []
            for e in os.scandir(class_dir):
                if not _visible(e.name):
                    continue
                if e.is_dir():
                    subfolders.append(e.path)
                elif e.is_file() and _is_image(e.name):
                    names.append(e.name)
            for sub in sorted(subfolders):
                nested = _images_below(sub)
                if nested is not None:
                    raise PrepareError(f"found images two levels down in {class_dir} (e.g. {nested}); "
                                       f"expected {FOLDER_LAYOUT}; point --src at the folder whose "
                                       f"subfolders are the classes, or move the images up into their class folder")
            self.parts.append(str(class_dir))
            names.sort()
            stems = [sample_key(os.path.splitext(n)[0]) for n in names]
            repeated = {stem for stem, n in Counter(stems).items() if n > 1}
            for name, stem in zip(names, stems):
                # "a.jpg" next to "a.png" would share a key; keep the extension for those only.
                unique = sample_key(name) if stem in repeated else stem
                yield Entry(split, self._key(class_name, unique), label, len(self.parts) - 1, name, 0, -1)

    def read(self, entry: Entry) -> bytes:
        with open(os.path.join(self.parts[entry.part], entry.name), "rb") as f:
            return f.read()


class ImageNet1k(ImageFolder):
    """``train/<synset>/*.JPEG`` with timm's 1000-synset order; ``val/`` in synset folders or flat.

    A flat ``val/`` needs a label file in ``ROOT`` or ``ROOT/val``: Kaggle's ``LOC_val_solution.csv``
    (``ImageId,PredictionString`` with the synset first) or ``val_labels.txt`` / ``val.txt`` with
    lines ``<file name> <synset or class index>``.
    """

    name = "imagenet1k"

    def __init__(self, src: str, skip_unknown: bool = False) -> None:
        synsets = timm_info_file(IMAGENET1K_SYNSETS).read_text().split()
        super().__init__(src, classes=synsets, skip_unknown=skip_unknown)
        if "validation" not in self.split_dirs:
            raise PrepareError(f"{src} needs train/ and val/ folders (ImageNet-1k layout); use "
                               f"'imagefolder' for a single folder of classes")

    def _key(self, class_name: str, stem: str) -> str:
        # ImageNet file names are unique on their own (n01440764_10026, ILSVRC2012_val_00000001).
        return sample_key(stem)

    def _folder_split(self, split: str, root: Path) -> Iterator[Entry]:
        if split == "validation" and not _subfolders(root):
            yield from self._flat_val(root)
        else:
            yield from super()._folder_split(split, root)

    def _flat_val(self, root: Path) -> Iterator[Entry]:
        labels = self._val_labels(root)
        self.parts.append(str(root))
        part = len(self.parts) - 1
        for name in sorted(e.name for e in os.scandir(root)
                           if e.is_file() and _visible(e.name) and _is_image(e.name)):
            stem = os.path.splitext(name)[0]
            if stem not in labels:
                raise PrepareError(f"{root / name} has no entry in the validation label file; "
                                   f"fix the label file or remove the image")
            label = self.label_of(labels[stem], str(root / name))
            if label is not None:
                yield Entry("validation", sample_key(stem), label, part, name, 0, -1)

    def _val_labels(self, root: Path) -> dict:
        """File stem -> synset, from whichever known label file is present."""
        for folder in (root.parent, root):
            for filename in VAL_LABEL_FILES:
                path = folder / filename
                if path.is_file():
                    return self._parse_val_labels(path)
        raise PrepareError(f"{root} is flat but no label file was found; put one of "
                           f"{', '.join(VAL_LABEL_FILES)} next to it, or sort val/ into synset folders")

    def _parse_val_labels(self, path: Path) -> dict:
        labels = {}
        with open(path, newline="") as f:
            rows = csv.reader(f) if path.suffix == ".csv" else (line.split() for line in f)
            for row in rows:
                if len(row) < 2 or row[0] == "ImageId":
                    continue
                stem, label = os.path.splitext(row[0])[0], row[1].split()[0]
                labels[stem] = self.classes[int(label)] if label.isdigit() else label
        return labels


class _CifarUnpickler(pickle.Unpickler):
    """Only what a CIFAR batch needs: a dict, lists, strings, ints and one numpy array."""

    # _frombuffer: how numpy pickles an array under protocol 5 (pickle.HIGHEST_PROTOCOL).
    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in a CIFAR batch")
        # numpy 2 moved numpy.core to numpy._core; pickles name whichever numpy wrote them.
        if module.startswith("numpy.core.") and hasattr(np, "_core"):
            module = "numpy._core." + module[len("numpy.core."):]
        elif module.startswith("numpy._core.") and not hasattr(np, "_core"):
            module = "numpy.core." + module[len("numpy._core."):]
        return super().find_class(module, name)


def _str_keys(obj) -> Optional[dict]:
    """A CIFAR dict with str keys: the official files unpickled with encoding="latin1" have them,
    files re-saved by Python 3 scripts that loaded them with encoding="bytes" have bytes keys."""
    if not isinstance(obj, dict):
        return None
    return {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in obj.items()}


def _name_text(name):
    if not isinstance(name, bytes):
        return name
    try:
        return name.decode("utf-8")
    except UnicodeDecodeError:
        return name.decode("latin1")


def load_cifar_batch(path: str, label_key: str) -> tuple:
    """(N x 32 x 32 x 3 uint8 images, N labels) of one CIFAR pickle, after checking its structure."""
    try:
        with open(path, "rb") as f:
            batch = _CifarUnpickler(f, encoding="latin1").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError) as e:
        raise PrepareError(f"{path} is not a CIFAR python batch ({e}); download the python version "
                           f"(cifar-10-python.tar.gz / cifar-100-python.tar.gz)") from None
    batch = _str_keys(batch) or {}
    data, labels = batch.get("data"), batch.get(label_key)
    rows_ok = (isinstance(data, np.ndarray) and data.dtype == np.uint8
               and data.ndim == 2 and data.shape[1] == 3072)
    if not (rows_ok and isinstance(labels, list) and len(labels) == len(data)
            and all(isinstance(x, int) for x in labels)):
        raise PrepareError(f"{path} does not hold a dict with 'data' (N x 3072 uint8) and '{label_key}' "
                           f"(N ints); is --src the right CIFAR version?")
    # Rows are channel-major (1024 red, 1024 green, 1024 blue values).
    return data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), labels


class Cifar(Source):
    """CIFAR-10/100, python version: ``cifar-10-batches-py`` or ``cifar-100-python`` (or their parent)."""

    LAYOUTS = {
        "cifar10": ("cifar-10-batches-py", {"train": [f"data_batch_{i}" for i in range(1, 6)],
                                            "test": ["test_batch"]}, "batches.meta", "label_names", "labels"),
        "cifar100": ("cifar-100-python", {"train": ["train"], "test": ["test"]}, "meta",
                     "fine_label_names", "fine_labels"),
    }

    def __init__(self, src: str, kind: str) -> None:
        super().__init__()
        self.name = kind
        self.has_validation = True  # CIFAR's own test split is the held-out set
        folder, self.files, meta, names_key, self.label_key = self.LAYOUTS[kind]
        root = Path(src)
        self.root = root / folder if (root / folder).is_dir() else root
        missing = [n for n in [meta] + sum(self.files.values(), []) if not (self.root / n).is_file()]
        if missing:
            raise PrepareError(f"{self.root} lacks {', '.join(missing)}; point --src at the extracted "
                               f"{folder} folder")
        self.classes = self._class_names(self.root / meta, names_key)

    @staticmethod
    def _class_names(path: Path, names_key: str) -> List[str]:
        with open(path, "rb") as f:
            try:
                meta = _CifarUnpickler(f, encoding="latin1").load()
            except (pickle.UnpicklingError, EOFError, ValueError) as e:
                raise PrepareError(f"{path} is not a CIFAR meta file ({e})") from None
        names = (_str_keys(meta) or {}).get(names_key)
        if isinstance(names, list):
            names = [_name_text(n) for n in names]
        if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
            raise PrepareError(f"{path} has no '{names_key}' list of class names; "
                               f"is --src the right CIFAR version?")
        return names

    def entries(self) -> Iterator[Entry]:
        for split, files in self.files.items():
            index = 0
            for filename in files:
                self.parts.append(str(self.root / filename))
                _, labels = load_cifar_batch(self.parts[-1], self.label_key)
                for row, label in enumerate(labels):
                    if not 0 <= label < len(self.classes):
                        raise PrepareError(f"{self.parts[-1]} row {row} has label {label}, outside the "
                                           f"{len(self.classes)} classes of the meta file")
                    yield Entry(split, f"{split}_{index:06d}", label, len(self.parts) - 1, "", row, -1)
                    index += 1

    def read(self, entry: Entry) -> bytes:
        from PIL import Image

        images, _ = _cached_cifar_batch(self.parts[entry.part], self.label_key)
        out = io.BytesIO()
        Image.fromarray(images[entry.offset]).save(out, format="PNG")  # lossless hand-over to the writer
        return out.getvalue()


@lru_cache(maxsize=8)
def _cached_cifar_batch(path: str, label_key: str) -> tuple:
    return load_cifar_batch(path, label_key)


def open_source(kind: str, src: str, *, synsets: str = "goog", skip_unknown: bool = False,
                work_dir: Optional[str] = None) -> Source:
    """The reader for ``kind`` (one of :data:`SOURCES`) over ``src``.

    ``work_dir`` holds the spill files when an outer ImageNet-21k tar is streamed.
    """
    if not os.path.exists(src):
        raise PrepareError(f"--src {src} does not exist; point it at the raw {kind} data")
    src = os.path.abspath(src)
    if kind == "imagenet21k":
        if os.path.isdir(src):
            return SynsetTars(src, synsets, skip_unknown)
        return OuterTarStream(src, synsets, skip_unknown, os.path.join(work_dir or ".", "spill"))
    if synsets != "goog":
        raise PrepareError("--synsets applies to imagenet21k only; drop it")
    if kind == "imagefolder":
        return ImageFolder(src, skip_unknown=skip_unknown)
    if kind == "imagenet1k":
        return ImageNet1k(src, skip_unknown=skip_unknown)
    if kind in ("cifar10", "cifar100"):
        return Cifar(src, kind)
    raise PrepareError(f"unknown source '{kind}'; choose one of {', '.join(SOURCES)}")

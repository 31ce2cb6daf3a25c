"""The class-folder layouts, read in place file by file (README, "Prepare data"):

* ``imagefolder``: ``root/<class>/*``; ``root/train/<class>`` with ``root/val/<class>`` (or
  ``valid``, ``validation``) and/or ``root/test/<class>`` give two or three splits.
  Keys are unique per split (exports number their files afresh in each split) and carry the
  class folder (``cat/0001`` and ``dog/0001`` are the usual case, not a clash).
* ``imagenet1k``: the same with timm's 1000-synset order; ``val/`` in synset folders or flat with
  a label file.
"""
from __future__ import annotations

import csv
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Set

from pretrain.data.sources import (IMAGE_EXTENSIONS, Entry, PrepareError, Source, as_text, is_image,
                                   sample_key, timm_info_file, visible as _visible)

IMAGENET1K_SYNSETS = "imagenet_synsets.txt"
# Label files recognised next to a flat ImageNet-1k ``val/`` folder.
VAL_LABEL_FILES = ("LOC_val_solution.csv", "val_labels.txt", "val.txt")
FOLDER_LAYOUT = "<root>/<class>/<image> or <root>/{train,val,test}/<class>/<image>"
# The split folders exports name (Roboflow: train/valid/test), first match each.
SPLIT_FOLDERS = {"train": ("train",), "validation": ("val", "validation", "valid"),
                 "test": ("test",)}

log = logging.getLogger(__name__)


def _subfolders(folder: Path) -> List[Path]:
    """The folders in ``folder`` a source reads. A link to nothing that is no image (a class
    folder on a file system not mounted here) is refused: left out, it would renumber the
    classes. (Links to images that are not there are counted and left out by the listing.)"""
    entries = [p for p in folder.iterdir() if _visible(p.name)]
    gone = [p for p in entries if p.is_symlink() and not p.exists() and not is_image(p.name)]
    if gone:
        others = f" (and {len(gone) - 1} more in {folder})" if len(gone) > 1 else ""
        raise PrepareError(f"{gone[0]} is a link to {os.readlink(gone[0])}, which is not "
                           f"there{others}; mount what it leads to, or remove the link")
    return sorted(p for p in entries if p.is_dir())


def _images_below(folder: str) -> Optional[str]:
    """The first image anywhere under ``folder``, or None."""
    for here, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if _visible(d))
        image = next((f for f in sorted(files) if _visible(f) and is_image(f)), None)
        if image is not None:
            return os.path.join(here, image)
    return None


class ImageFolder(Source):
    """``root/<class>/*`` (one split ``train``) or ``root/train/<class>`` with ``val`` and/or
    ``test`` beside it."""

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
        # what the folders hold besides images, and classes without any: said, not dropped unseen
        self.not_images: List[str] = []
        self.broken_links: List[str] = []  # symbolic links to nothing (a moved or unmounted target)
        self.empty_classes: List[str] = []

    def top_folders(self) -> Optional[Set[str]]:
        # the split folders; a single split is the source itself, whose folders are classes
        if self.split_dirs == {"train": Path(self.src)}:
            return None
        return {p.name for p in self.split_dirs.values()}

    @staticmethod
    def _split_dirs(root: Path) -> dict:
        if not root.is_dir():
            raise PrepareError(f"--src {root} is not a folder; point it at the dataset root")
        # any case (Train/, VAL/: exports from Windows tools), the exact spelling first
        by_name = {}
        for p in sorted(_subfolders(root), key=lambda p: p.name != p.name.lower()):
            by_name.setdefault(p.name.lower(), p)
        found = {split: next((by_name[n] for n in names if n in by_name), None)
                 for split, names in SPLIT_FOLDERS.items()}
        # train/ alone is the training split of an export that has no other; beside class
        # folders, a folder named train is one more class (a vehicle dataset's, COCO's)
        alone = found["train"] is not None and len(by_name) == 1
        if found["train"] is None or (found["validation"] is None and found["test"] is None
                                      and not alone):
            return {"train": root}
        if found["test"] is not None and not _subfolders(found["test"]):
            # ImageNet's and Kaggle's test images come without labels, loose in one folder
            log.warning("left out %s: no class folders in it (unlabelled test images)",
                        found["test"])
            found["test"] = None
        dirs = {split: folder for split, folder in found.items() if folder is not None}
        others = [p.name for p in _subfolders(root)
                  if p not in dirs.values() and p.name.lower() != "test"]
        if others:
            log.warning("left out the folders %s of %s: the splits are read from %s",
                        ", ".join(others), root, ", ".join(p.name for p in dirs.values()))
        loose = sorted(p.name for p in root.iterdir()
                       if _visible(p.name) and is_image(p.name) and p.is_file())
        if loose:  # no split and no class: nothing to label them with
            log.warning("left out %d image%s loose in %s, beside its split folders (e.g. %s): "
                        "move them into a class folder of a split to have them", len(loose),
                        "s" if len(loose) > 1 else "", root, as_text(loose[0]))
        return dirs

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
                raise PrepareError(f"class folder '{class_name}' ({where}) is not a known class; "
                                   f"{self._unknown_hint()}")
            self.unknown.append(class_name)
        return label

    def _unknown_hint(self) -> str:
        return ("pass --skip-unknown to leave them out" if self.fixed_classes else
                "every class of a val or test folder needs a training folder of the same name")

    def _check_known(self, root: Path, names: List[str]) -> None:
        """All the class folders of ``root`` that name no class, in one line (it took a rerun
        to find each), a spelling that differs only in case pointed out."""
        unknown = [n for n in names if n not in self._label]
        if not unknown or self._skip_unknown:
            return
        by_case = {c.lower(): c for c in self.classes}
        said = [f"'{n}'" + (f" (the class '{by_case[n.lower()]}' in another case?)"
                            if n.lower() in by_case else "") for n in unknown[:10]]
        more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
        raise PrepareError(f"class folder{'s' if len(unknown) > 1 else ''} {', '.join(said)}"
                           f"{more} in {root} "
                           f"{'are not known classes' if len(unknown) > 1 else 'is not a known class'}"
                           f"; {self._unknown_hint()}")

    def entries(self) -> Iterator[Entry]:
        trained = set()
        for split, root in self.split_dirs.items():
            listed = 0
            for entry in self._folder_split(split, root):
                listed += 1
                if split == "train":
                    trained.add(entry.label)
                yield entry
            if not listed and split != "train":  # the run would learn of it at its start
                log.warning("%s holds no images: the dataset gets no %s split (a training run "
                            "evaluating it would stop at its start; data.val_split=null there)",
                            root, split)
        if self.not_images:
            found = sorted(self.not_images)  # not the file system's listing order
            kinds = Counter(os.path.splitext(n)[1].lower() or "(none)" for n in found)
            log.warning("left out %d files that are not images (by extension: %s; e.g. %s); "
                        "images are %s", len(found),
                        ", ".join(f"{k} {n}" for k, n in sorted(kinds.items(),
                                                                key=lambda kn: (-kn[1], kn[0]))),
                        found[0], " ".join(IMAGE_EXTENSIONS))
        if self.broken_links:
            log.warning("left out %d links that lead nowhere (e.g. %s): their targets moved or "
                        "are not mounted here", len(self.broken_links),
                        sorted(self.broken_links)[0])
        absent = [c for i, c in enumerate(self.classes) if i not in trained]
        if self.fixed_classes and len(absent) > len(self.empty_classes):  # folders not there
            log.warning("%d of the %d classes of the label list have no training images (e.g. "
                        "%s): their labels are kept, with no samples", len(absent),
                        len(self.classes), ", ".join(absent[:3]))
        elif self.empty_classes:
            log.warning("%d class folders hold no images (%s): their labels are kept, with no "
                        "samples", len(self.empty_classes), ", ".join(self.empty_classes[:10]))

    def _folder_split(self, split: str, root: Path) -> Iterator[Entry]:
        # Images outside class folders would have no label, and images below them a wrong one:
        # both are refused rather than dropped or mislabelled.
        files = [e.name for e in os.scandir(root) if e.is_file() and _visible(e.name)]
        loose = next((name for name in files if is_image(name)), None)
        # the rest (notes.txt, a LICENSE) is left out, and counted in the warning like others
        self.not_images += [os.path.join(root.name, as_text(name)) for name in files
                            if not is_image(name)]
        if loose is not None:
            # ImageNet-1k's val/ comes flat, with a label file beside it: another source reads it
            flat_val = ("; or, for ImageNet-1k's flat val/ and its label file, use the source "
                        "imagenet1k") if split == "validation" and not self.fixed_classes else ""
            raise PrepareError(f"found images directly in {root} (e.g. {loose}), outside any class folder; "
                               f"expected {FOLDER_LAYOUT}; move them into a folder named after their class"
                               + flat_val)
        self._check_known(root, [as_text(d.name) for d in _subfolders(root)])
        seen = {}
        for class_dir in _subfolders(root):
            class_name = as_text(class_dir.name)
            if class_name in seen:  # names that are not UTF-8 (or NFC and NFD spellings)
                raise PrepareError(f"the class folders {os.fsencode(seen[class_name])!r} and "
                                   f"{os.fsencode(class_dir.name)!r} in {root} both read as class "
                                   f"'{class_name}'; rename one of them")
            seen[class_name] = class_dir.name
            label = self.label_of(class_name, str(class_dir))
            if label is None:
                continue
            names, subfolders = [], []
            for e in os.scandir(class_dir):
                if not _visible(e.name):
                    continue
                if e.is_dir():
                    subfolders.append(e.path)
                elif e.is_file() and is_image(e.name):
                    names.append(e.name)
                elif e.is_symlink() and not os.path.exists(e.path):
                    self.broken_links.append(os.path.join(class_name, as_text(e.name)))
                else:  # another kind of file
                    self.not_images.append(os.path.join(class_name, as_text(e.name)))
            if not names and split == "train":
                self.empty_classes.append(class_name)
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

    A flat ``val/`` needs a label file in ``ROOT/val``, ``ROOT`` or a folder above it (Kaggle
    puts ``LOC_val_solution.csv``, ``ImageId,PredictionString`` with the synset first, three
    levels above ``ILSVRC/Data/CLS-LOC``), or ``val_labels.txt`` / ``val.txt`` with lines
    ``<file name> <synset or class index>``.
    """

    name = "imagenet1k"

    def __init__(self, src: str, skip_unknown: bool = False) -> None:
        if os.path.isfile(src) and src.endswith(".tar"):  # ILSVRC2012_img_train.tar as it came
            raise PrepareError(f"--src {src} is a tar; extract it into train/ (a tar per synset "
                               f"inside: extract each into a folder of its name) beside val/, "
                               f"and point --src at their folder")
        synsets = timm_info_file(IMAGENET1K_SYNSETS).read_text().split()
        self._val_labels_read: dict = {}
        super().__init__(src, classes=synsets, skip_unknown=skip_unknown)
        if "validation" not in self.split_dirs:
            raise PrepareError(f"{src} needs train/ and val/ folders (ImageNet-1k layout); use "
                               f"'imagefolder' for a single folder of classes")
        train = self.split_dirs["train"]
        tars = sorted(e.name for e in os.scandir(train) if e.is_file() and _visible(e.name)
                      and e.name.endswith(".tar") and e.name[:-4] in self._label)
        if tars:  # ILSVRC2012_img_train.tar unpacked once: its synsets are tars still
            raise PrepareError(
                f"{train} holds per-synset tars ({tars[0]}"
                f"{f', ... {len(tars)} of them' if len(tars) > 1 else ''}), as "
                f"ILSVRC2012_img_train.tar unpacks; extract each into a folder of its name "
                f"first: cd {train} && for f in n*.tar; do mkdir ${{f%.tar}} && tar -xf $f "
                f"-C ${{f%.tar}} && rm $f; done")
        val = self.split_dirs["validation"]
        if not _subfolders(val):  # a missing label file said now, not after listing train/
            self._val_labels(val)

    def reads(self, name: str) -> bool:
        return name in VAL_LABEL_FILES

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
        found = 0
        for name in sorted(e.name for e in os.scandir(root)
                           if e.is_file() and _visible(e.name) and is_image(e.name)):
            stem = os.path.splitext(name)[0]
            if stem not in labels:
                raise PrepareError(f"{root / name} has no entry in the validation label file; "
                                   f"fix the label file or remove the image")
            found += 1
            label = self.label_of(labels[stem], str(root / name))
            if label is not None:
                yield Entry("validation", sample_key(stem), label, part, name, 0, -1)
        if found < len(labels):  # a download cut short, or the label file of another set
            log.warning("the validation label file names %d images, %d of them not in %s",
                        len(labels), len(labels) - found, root)

    def _val_labels(self, root: Path) -> dict:
        """File stem -> synset, from whichever known label file is present."""
        if root in self._val_labels_read:
            return self._val_labels_read[root]
        # Kaggle's download: LOC_val_solution.csv beside ILSVRC/, val/ in ILSVRC/Data/CLS-LOC/
        kaggle = [folder / VAL_LABEL_FILES[0] for folder in root.resolve().parents[1:4]]
        for path in [f / n for f in (root.parent, root) for n in VAL_LABEL_FILES] + kaggle:
            if path.is_file():
                self._val_labels_read[root] = self._parse_val_labels(path)
                return self._val_labels_read[root]
        raise PrepareError(f"{root} is flat but no label file was found; put one of "
                           f"{', '.join(VAL_LABEL_FILES)} next to it, or sort val/ into synset folders")

    def _parse_val_labels(self, path: Path) -> dict:
        labels, single = {}, 0
        with open(path, newline="", encoding="utf-8-sig") as f:  # (a BOM: Excel's CSV)
            rows = csv.reader(f) if path.suffix == ".csv" else (line.split() for line in f)
            for row in rows:
                single += len(row) == 1
                if len(row) < 2 or row[0] == "ImageId":
                    continue
                stem, label = os.path.splitext(row[0])[0], row[1].split()[0]
                if label.isdigit() and int(label) >= len(self.classes):
                    raise PrepareError(f"{path}: class index {label} for {row[0]} is beyond the "
                                       f"{len(self.classes)} classes; indices count from 0 in "
                                       f"timm's synset order (the devkit's ids count from 1 in "
                                       f"another order: give synsets instead)")
                labels[stem] = self.classes[int(label)] if label.isdigit() else label
        if single and not labels:  # ILSVRC2012_validation_ground_truth.txt: ids, no names
            raise PrepareError(f"{path} has one value per line and no file names (the devkit's "
                               f"ILSVRC2012_validation_ground_truth.txt, whose ids follow "
                               f"another class order?); give lines '<file name> <synset>', or "
                               f"Kaggle's LOC_val_solution.csv")
        return labels

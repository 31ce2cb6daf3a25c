"""CIFAR-10/100 in the python pickle version, unpickled only after a structure check.

A pickle may name any global to call, so :class:`_CifarUnpickler` lets through only those a
CIFAR batch needs, and :func:`load_cifar_batch` checks what it got before anything uses it.
"""
from __future__ import annotations

import io
import pickle
from functools import lru_cache
from pathlib import Path
from typing import Iterator, List, Optional

import numpy as np

from pretrain.data.sources import Entry, PrepareError, Source


class _CifarUnpickler(pickle.Unpickler):
    """Only what a CIFAR batch needs: a dict, lists, strings, ints and numpy arrays (or numpy
    ints: labels a script re-saved as ``list(array)``)."""

    # _frombuffer: how numpy pickles an array under protocol 5 (pickle.HIGHEST_PROTOCOL);
    # scalar: a numpy number, made from its dtype and bytes
    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
               ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
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


def _ints(labels) -> Optional[list]:
    """Labels as Python ints: the official files' list, or the numpy array (or list of numpy
    ints) a script re-saved; None for anything else."""
    if isinstance(labels, np.ndarray) and labels.ndim == 1 and labels.dtype.kind in "iu":
        return labels.tolist()
    if isinstance(labels, list) and all(isinstance(x, (int, np.integer)) and
                                        not isinstance(x, bool) for x in labels):
        return [int(x) for x in labels]
    return None


def load_cifar_batch(path: str, label_key: str) -> tuple:
    """(N x 32 x 32 x 3 uint8 images, N labels) of one CIFAR pickle, after checking its structure."""
    try:
        with open(path, "rb") as f:
            batch = _CifarUnpickler(f, encoding="latin1").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError) as e:
        raise PrepareError(f"{path} is not a CIFAR python batch ({e}); download the python version "
                           f"(cifar-10-python.tar.gz / cifar-100-python.tar.gz)") from None
    batch = _str_keys(batch) or {}
    data, labels = batch.get("data"), _ints(batch.get(label_key))
    rows_ok = (isinstance(data, np.ndarray) and data.dtype == np.uint8
               and data.ndim == 2 and data.shape[1] == 3072)
    if not (rows_ok and labels is not None and len(labels) == len(data)):
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

    def reads(self, name: str) -> bool:  # its batches and its meta file
        return name == self.LAYOUTS[self.name][2] or any(name in f for f in self.files.values())

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

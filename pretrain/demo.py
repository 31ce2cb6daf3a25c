"""The built-in demo dataset: procedural images of a few classes, written in ImageNet-21k's raw
per-synset-tar layout and converted by the same ``prepare`` step as real data, so the demo runs
through the path a real run takes. Generated once; later runs reuse the shards."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

from pretrain.data.info import INFO_NAMES
from pretrain.distributed import barrier, rank

log = logging.getLogger(__name__)

TRAIN_PER_CLASS = 320
VAL_COUNT = 600
SHARD_SIZE = 200
IMAGE_SIZE = (48, 48)
# the fine-tune demo: a CIFAR-10-format set of new images of the same procedural classes
CIFAR_TRAIN = 2000
CIFAR_TEST = 500


def check_demo_root(root: str | Path) -> None:
    """Refuse to write the demo into a folder holding other files (someone's own images, most
    likely) and no prepared dataset, nor one being prepared."""
    from pretrain.config import ConfigError
    from pretrain.data.shard_writer import WORK_DIR
    root = Path(root)
    if root.is_dir() and any(root.iterdir()) and not (root / WORK_DIR).is_dir():
        raise ConfigError(
            f"data.root '{root}' holds files but no prepared dataset, and data.generate_demo=true "
            f"would write the demo data there; to train on your images prepare them (python "
            f"launch/prepare_data.py imagefolder --src {root} --out DIR) and set data.root=DIR "
            f"data.generate_demo=false")


def ensure_demo_data(root: str | Path, num_classes: int, layout: str = "imagenet21k") -> None:
    """Rank 0 writes the dataset when ``root`` has none; every rank waits for it.

    ``layout`` "imagenet21k": per-synset tars with a held-out ``validation`` split (the
    pretraining demo); "cifar10": CIFAR-10's pickles with ``train``/``test`` (the fine-tune demo).
    """
    root = Path(root)
    if layout == "cifar10" and num_classes != 10 and not any((root / n).is_file()
                                                              for n in INFO_NAMES):
        # (every rank: they all read the same config) it said 20 classes and wrote 10
        from pretrain.data.sources import PrepareError
        raise PrepareError(f"data.generate_demo makes a 10-class CIFAR-10-format set, and "
                           f"model.num_classes is {num_classes}; set model.num_classes=10, or "
                           f"data.generate_demo=false to train on data of your own")
    if rank() == 0 and not any((root / n).is_file() for n in INFO_NAMES):
        from pretrain.data.shard_writer import prepare
        check_demo_root(root)
        from pretrain.data.sources import load_synsets
        from pretrain.data.synthetic import write_cifar, write_synset_tars

        # a warning: where the demo is asked for by mistake (a recipe built on the demo's), a
        # run on procedural images must not pass for one on real data
        log.warning("data.generate_demo=true and '%s' holds no dataset: generating the built-in "
                    "demo dataset there (procedural images, %d classes, %s layout); for real "
                    "data give a recipe with --config, or set data.generate_demo=false", root,
                    num_classes, layout)
        # A fixed raw folder (not a temp one): an interrupted preparation resumes on re-run.
        raw = root.with_name(root.name + "-raw")
        if layout == "cifar10":
            write_cifar(raw, "cifar10", n_train=CIFAR_TRAIN, n_test=CIFAR_TEST, seed=1)
            prepare("cifar10", str(raw / "cifar-10-batches-py"), str(root), name="demo_cifar10",
                    shard_size=SHARD_SIZE, workers=1, progress=False)
        else:
            synsets = load_synsets("goog")[:num_classes]  # labels 0..n-1 of the 21k list
            write_synset_tars(raw, synsets, TRAIN_PER_CLASS + VAL_COUNT // num_classes,
                              size=IMAGE_SIZE)
            prepare("imagenet21k", str(raw), str(root), name="demo", shard_size=SHARD_SIZE,
                    val_count=VAL_COUNT, workers=1, progress=False)
        shutil.rmtree(raw)
    barrier()


"""The description that sits next to a set of shards: timm's ``_info.json`` layout.

``{"name": ..., "splits": {"train": {"name", "num_samples", "filenames", "shard_lengths"}, ...},
"classes": [...]}`` -- ``splits`` is keyed by split name because timm's ``reader_wds`` looks
splits up that way; shard file names are relative to the directory (or URL prefix) of the file.
Shards downloaded from the Hugging Face ``timm/imagenet-22k-wds`` family carry the same file,
sometimes named ``info.json``.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from pretrain.atomic_write import write_atomic

INFO_NAMES = ("_info.json", "info.json")
# the missing-split message's way out for the run's evaluation split (not the few-shot probe's)
VAL_SPLIT_NULL = " (data.val_split=null evaluates none)"


class DatasetInfoError(ValueError):
    """The shard directory has no usable description (missing file, unknown split...)."""


class InfoNotRead(DatasetInfoError):
    """No info file was found, or it could not be read (unreachable, no permission): unlike a
    malformed one, possibly fine where the run itself reads it."""


class StorageNotReached(InfoNotRead):
    """Nothing answered at the storage of a URL prefix when its info file was first read --
    the connection refused or no such host for ``FIRST_CONTACT_S`` seconds, or an
    ``AWS_ENDPOINT_URL`` answering as no S3 server does: a wrong address, said in seconds with
    the fix, not after the minutes of back-off meant for an outage of storage that was there."""


# How long the first read of a URL prefix's info file tries storage that has not answered yet
# (the connection refused, no such host): long enough for a server that is still starting (a
# MinIO started by the same job), short enough that a mistyped endpoint is said at once.
FIRST_CONTACT_S = 5.0


class StorageUnreachable(Exception):
    """Part of the errors of storage that answered at the run's start (its info file was read)
    and then failed every retry (an outage longer than ``data.read_attempts`` covers): unlike
    bad input it may end by itself, so the launchers exit with code 1, as a crash does (the
    relaunch resumes from the newest complete checkpoint), not 2. Storage that never answered
    (a mistyped host, a wrong endpoint, a missing ``pipe:`` command) fails the info file's read
    at the start: bad input, code 2. The job's own outages of that kind are said the same way:
    a node that never came to the rendezvous (pretrain/distributed.py), a node's late view of
    output_dir (pretrain/checkpoint.py)."""


PREPARE_WORK_DIR = ".prepare"  # prepare_data.py's bookkeeping in its output folder


class NoInfo(InfoNotRead):
    """The folder holds no info file at all: not prepared (yet)."""


# The key of the info file an upload that replaces a dataset under a prefix puts there first
# (pretrain/data/publish.py): until its own info file lands last, no reader takes the shards
# of two preparations for one dataset.
UPLOAD_IN_PROGRESS = "prepare_data_upload_in_progress"


class BucketMissing(DatasetInfoError):
    """The S3 bucket of the prefix does not exist (a mistyped name, another endpoint's)."""


class UploadInProgress(DatasetInfoError):
    """The prefix's dataset is being replaced by an upload that has not finished."""


@dataclass
class SplitInfo:
    name: str
    num_samples: int
    filenames: List[str]
    shard_lengths: List[int]


@dataclass
class DatasetInfo:
    name: str
    splits: Dict[str, SplitInfo]
    classes: Optional[List[str]] = None
    # Anything else the writer recorded (source, configuration, counts); kept on round trips.
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def num_labels(self) -> Optional[int]:
        """How many labels the samples use (largest + 1), as prepare_data.py records it; else
        the length of ``classes``; None when neither tells. prepare_data.py lists every synset
        of ImageNet-21k in ``classes`` even when only some were prepared, so for its output
        from before it recorded the count (no ``num_labels``) the list says nothing."""
        recorded = self.extra.get("num_labels")
        if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded > 0:
            return recorded
        prepared = self.extra.get("prepare")
        if isinstance(prepared, dict) and prepared.get("source") == "imagenet21k":
            return None
        return len(self.classes) if self.classes else None

    def check_labels(self, root: str, num_classes: Optional[int], exact: bool = False) -> None:
        """Refuse to train a model of ``num_classes`` outputs on this dataset when its labels
        reach beyond them: all but a few of its samples would be skipped. ``exact`` (a
        fine-tune's new head): fewer labels than outputs are refused too."""
        labels = self.num_labels
        if exact and num_classes and labels and labels < num_classes:
            raise DatasetInfoError(
                f"'{root}' has {labels} classes but model.num_classes is {num_classes}: the "
                f"head's other {num_classes - labels} outputs would never be a right answer, and "
                f"the exports would not know the class names; set model.num_classes={labels}")
        if not num_classes or not labels or labels <= num_classes:
            return
        recorded = "num_labels" in self.extra
        what = (f"has labels up to {labels - 1}" if recorded else
                f"lists {labels} classes (no num_labels in its info file)")
        raise DatasetInfoError(
            f"'{root}' {what} but model.num_classes is {num_classes}: set "
            f"model.num_classes={labels}, or point data.root at the dataset the model is for"
            + ("" if recorded else "; if its samples use only labels below K, add "
                                   "\"num_labels\": K to its info file"))

    def wider_head(self, root: str, num_classes: Optional[int]) -> Optional[str]:
        """Why a head of ``num_classes`` outputs is wider than this dataset needs, or None.
        Pretraining allows it (part of ImageNet-21k keeps the label numbers of the whole), but
        it is mostly a recipe's num_classes left as it was."""
        labels = self.num_labels
        if not num_classes or not labels or labels >= num_classes \
                or len(self.classes) >= num_classes:  # a label list the head follows
            return None
        return (f"model.num_classes is {num_classes} but '{root}' has {labels} classes: the "
                f"head's other {num_classes - labels} outputs are never a right answer; set "
                f"model.num_classes={labels}, unless its labels are part of a larger set on "
                f"purpose (a subset of ImageNet-21k)")

    def split(self, name: str) -> SplitInfo:
        if name not in self.splits:
            have = ", ".join(sorted(self.splits)) or "none"
            raise DatasetInfoError(f"split '{name}' not found in dataset '{self.name}' "
                                   f"(splits: {have}); set data.train_split / data.val_split "
                                   f"to one of them{VAL_SPLIT_NULL}")
        return self.splits[name]

    def to_json(self) -> dict:
        out = dict(self.extra)
        out.update(name=self.name, splits={k: asdict(v) for k, v in self.splits.items()})
        if self.classes is not None:
            out["classes"] = list(self.classes)
        return out


def is_url(root: str) -> bool:
    return "://" in root or root.startswith("pipe:")


def join(root: str, filename: str) -> str:
    """A shard's location: a path under a directory, or the same suffix under a URL prefix."""
    if is_url(filename) or os.path.isabs(filename):
        return filename
    return root.rstrip("/") + "/" + filename if is_url(root) else os.path.join(root, filename)


def read_info(root: str | os.PathLike, retry=None) -> DatasetInfo:
    """Read ``_info.json`` (or ``info.json``) from a local directory or a URL prefix (read with
    ``retry``, a :class:`pretrain.data.remote.RetryPolicy`; storage that never answers is given
    ``FIRST_CONTACT_S``: :class:`StorageNotReached`)."""
    from dataclasses import replace

    from pretrain.data.remote import (Missing, NoBucket, NotAnswered, NotS3, RetryPolicy,
                                      read_bytes)
    root = str(root)
    raw = loc = None
    # the info file is where a run or a tool first reaches its storage: see FIRST_CONTACT_S
    retry = retry or RetryPolicy()
    if retry.first_contact_s is None:
        retry = replace(retry, first_contact_s=FIRST_CONTACT_S)
    for name in INFO_NAMES:
        loc = join(root, name)
        if is_url(root):
            try:
                raw = read_bytes(loc, retry)
                break
            except (NotAnswered, NotS3) as e:
                raise StorageNotReached(f"{e}; {_address_fix(root, isinstance(e, NotS3))}") \
                    from None
            except NoBucket as e:  # the storage answered: the name is wrong, not the network
                raise BucketMissing(f"{e}; check the bucket in '{root}' (and "
                                       f"AWS_ENDPOINT_URL: another endpoint has other "
                                       f"buckets)") from None
            except Missing:
                continue
            except OSError as e:  # unreachable after the retries, or no permission
                raise InfoNotRead(f"cannot read {loc}: {e}") from None
        elif os.path.isfile(loc):
            try:
                raw = Path(loc).read_bytes()
            except OSError as e:
                raise InfoNotRead(f"cannot read {loc}: {e}") from None
            break
    if raw is None:
        if not is_url(root) and os.path.isfile(os.path.join(root, PREPARE_WORK_DIR, "config.json")):
            # not "maybe readable elsewhere": the preparation was cut off here (its info last)
            raise DatasetInfoError(f"'{root}' is a preparation launch/prepare_data.py has not "
                                   f"finished ({PREPARE_WORK_DIR}/ is there, "
                                   f"{INFO_NAMES[0]} not yet); rerun the same prepare_data.py "
                                   f"command to finish it")
        raise NoInfo(f"no {' or '.join(INFO_NAMES)} in '{root}'; point data.root at a "
                               f"directory written by launch/prepare_data.py")
    # The file is edited by hand at times (num_labels, a split renamed): a typo is named here
    # rather than surfacing as a JSON traceback.
    try:
        raw = json.loads(raw)
    except ValueError as e:
        raise DatasetInfoError(f"{loc} is not valid JSON ({e}); fix it, or write it again "
                               f"with launch/prepare_data.py") from None
    if not isinstance(raw, dict):
        raise DatasetInfoError(f"{loc} holds a JSON {type(raw).__name__}, not an object with "
                               f"'splits'; fix it, or write it again with launch/prepare_data.py")
    if UPLOAD_IN_PROGRESS in raw:
        raise UploadInProgress(f"'{root}' is being replaced by a launch/prepare_data.py upload "
                               f"that has not finished (its shards are sent first, {loc} last); "
                               f"rerun that prepare_data.py command to finish it")
    splits = raw.get("splits")
    if not isinstance(splits, dict):
        raise DatasetInfoError(f"'{root}' info file has no 'splits' object keyed by split name")
    parsed = {}
    for key, s in splits.items():
        try:
            parsed[key] = SplitInfo(name=s.get("name", key), num_samples=int(s["num_samples"]),
                                    filenames=list(s["filenames"]),
                                    shard_lengths=[int(n) for n in s.get("shard_lengths", [])])
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise DatasetInfoError(f"'{root}' info file: split '{key}' is malformed ({e})") from None
    extra = {k: v for k, v in raw.items() if k not in ("name", "splits", "classes")}
    return DatasetInfo(name=raw.get("name", Path(root).name), splits=parsed,
                       classes=raw.get("classes"), extra=extra)


def _address_fix(root: str, answered: bool = False) -> str:
    """What to check where nothing (``answered``: no S3 server) answered at the storage of URL
    prefix ``root``."""
    start = "" if answered else ", or start that server"
    if root.startswith("s3://"):
        bucket = root[len("s3://"):].partition("/")[0]
        return (f"set AWS_ENDPOINT_URL to the address of the S3 server holding bucket "
                f"'{bucket}' (unset: AWS itself){start}")
    return f"check the host and port in '{root}'{start}"


def write_info(root: str | os.PathLike, info: DatasetInfo, name: str = INFO_NAMES[0]) -> Path:
    """Write the info file atomically, so a reader never sees half of it."""
    return write_atomic(Path(root) / name, json.dumps(info.to_json(), indent=1))

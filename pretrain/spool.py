"""A run's MLflow records kept on disk: what :mod:`pretrain.tracking`'s tracker writes and
``launch/upload_spool.py`` reads.

``output_dir/tracking/`` holds ``run.json`` (:class:`RunState`: everything needed to create or
find the MLflow run later), ``spool.jsonl`` (every metric record, appended by the training
thread), ``delivered`` (the spool's byte offset up to which everything reached MLflow),
``artifacts/`` (files waiting for upload) and ``lock``. Their delivery to MLflow is
:mod:`pretrain.mlflow_delivery`; how a job uses both, :mod:`pretrain.tracking`.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from pretrain.atomic_write import write_atomic
from pretrain.file_lock import try_lock

log = logging.getLogger(__name__)

TRACKING_DIR = "tracking"
SPOOL = "spool.jsonl"
STATE = "run.json"
CURSOR = "delivered"
ARTIFACTS = "artifacts"
LOCK = "lock"


class TrackingError(RuntimeError):
    """A tracking problem the user has to act on (one line)."""


# --------------------------------------------------------------------------------------------
# Local state: run.json, the spool and its delivery cursor
# --------------------------------------------------------------------------------------------
# the tags of the job running the run, which a resumed job sets anew (pretrain.tracking)
# where the run is: a run moved and resumed in another folder names that one (pretrain.tracking)
JOB_TAGS = ("world_size", "hosts", "num_hosts", "world_size.history", "config.changed", "jobs",
            "output_dir")
CONFIG_NOW = "config.now."  # + a key a relaunch changed: its value now (pretrain.tracking)
RUN_NAME_TAG = "mlflow.runName"  # the tag MLflow shows as a run's name


@dataclass
class RunState:
    """``tracking/run.json``: everything needed to create (or find) the MLflow run later."""

    uri: str
    experiment: str
    run_name: Optional[str] = None
    run_id: Optional[str] = None
    params: dict = field(default_factory=dict)
    tags: dict = field(default_factory=dict)
    params_logged: bool = False
    uploaded: list = field(default_factory=list)  # artifact paths already in MLflow
    ended: Optional[str] = None  # FINISHED / FAILED / KILLED once the job is over
    # the run's start and its job's end (unix ms), for MLflow's times: a run delivered later
    # (the server was down, upload_spool.py) would otherwise start and end at its delivery
    start_time: Optional[int] = None
    end_time: Optional[int] = None
    # an evaluation of a model whose run had not reached MLflow yet: that run's tracking dir,
    # where its run id appears once it is uploaded (the evaluation is nested under it then),
    # and its start_time, which tells that run from a new one started in the same output_dir
    parent_dir: Optional[str] = None
    parent_started: Optional[int] = None
    end_tags: dict = field(default_factory=dict)  # set on the run when it is ended
    stops: int = 0  # jobs of this run that ended KILLED (a signal): the stop.count tag
    # MLflow models among the artifacts: {"path": artifact path, "register_as": registered
    # model name or None, "version": its version once registered, "tags", "description",
    # "model_id": its logged model (None: a run artifact) once made, "ready": once finalized,
    # "superseded": replaced by a newer package (a logged model left incomplete ends FAILED)}
    models: list = field(default_factory=list)
    # runs of this output_dir found deleted from the store (or missing there) and replaced by
    # ``run_id``: a resume from a checkpoint that names one of them goes on in ``run_id``
    gone: list = field(default_factory=list)
    # the run of the output_dir this one was copied from (its checkpoints name that run until
    # this one writes its own): a resume from them goes on in ``run_id``, not there
    copied_from: Optional[str] = None
    # a name a relaunch gave (tracking.run_name), set on the run once: a rename made in the UI
    # later stays
    rename_to: Optional[str] = None

    @classmethod
    def load(cls, track_dir: Path) -> "RunState":
        return cls(**json.loads((track_dir / STATE).read_text()))

    def save(self, track_dir: Path) -> None:
        write_atomic(track_dir / STATE, json.dumps(asdict(self), indent=1).encode())


def read_cursor(track_dir: Path, name: str = CURSOR) -> int:
    """The offset up to which a file of records reached MLflow: the spool's (``delivered``), or
    a node's system metrics' (``system/<host>.delivered``)."""
    try:
        return int((track_dir / name).read_text() or 0)
    except (OSError, ValueError):  # none, or unreadable: from the start (MLflow's own record
        return 0                    # of what it holds keeps values from going in twice)


def write_cursor(track_dir: Path, offset: int, name: str = CURSOR) -> None:
    write_atomic(track_dir / name, str(offset).encode())


def read_spool(path: Path, offset: int = 0) -> Iterator[tuple[dict, int]]:
    """(record, byte offset after it) from ``offset`` on; a line a crash cut short is skipped."""
    if not path.exists():
        return
    with open(path, "rb") as f:
        f.seek(offset)
        pos = offset
        for line in f:
            pos += len(line)
            if not line.endswith(b"\n"):
                break  # being written (or cut by a kill): not a record yet
            try:
                yield json.loads(line), pos
            except json.JSONDecodeError:
                continue


def undelivered(track_dir: Path) -> int:
    """Records in the spool that never reached MLflow."""
    return sum(1 for _ in read_spool(track_dir / SPOOL, read_cursor(track_dir)))


def lock(track_dir: Path):
    """Exclusive lock on the tracking directory (a job and the upload command never both send);
    the returned file holds it until closed. None when someone else holds it."""
    return try_lock(track_dir / LOCK)


def redacted(text: str) -> str:
    """``text`` fit to print or log as a param: the password of any URL in it
    (``postgresql://u:pw@host/db``, ``https://u:token@host``) becomes ``***``."""
    # up to the last "@" before the path: a password (or a user name, an e-mail address) may
    # hold "@" itself, as the HTTP reader takes it
    return re.sub(r"(://[^/\s:]+):[^/\s]*@", r"\1:***@", text)


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = redacted(text)  # the URLs it quotes
    # urllib3 puts the root cause ("Connection refused", "too many 500 error responses") last
    cause = text.rfind("(Caused by ")
    if len(text) > 200 and cause > 0:
        return text[:150].rstrip() + " ... " + text[cause:][:150]
    return text[:200]

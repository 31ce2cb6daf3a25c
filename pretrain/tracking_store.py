"""Where a run's MLflow records go, and why a store refused them, in one line with the fix.

``tracking.uri`` from the config, else ``MLFLOW_TRACKING_URI``, else MLflow's own default in
the directory the job is launched from -- ``sqlite:///mlflow.db`` (``./mlruns`` when that
already holds a file store and this MLflow still accepts file stores), i.e. what a plain
``mlflow ui`` started there shows.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

from pretrain.spool import TrackingError, one_line

log = logging.getLogger("pretrain.tracking")


def resolve_uri(configured: Optional[str] = None) -> str:
    """``tracking.uri``, else ``MLFLOW_TRACKING_URI``, else MLflow's default for the current
    directory (what ``mlflow ui`` started there reads), as an absolute URI."""
    if configured:
        return _absolute(configured)
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return _absolute(os.environ["MLFLOW_TRACKING_URI"])
    mlruns, db = Path.cwd() / "mlruns", Path.cwd() / "mlflow.db"
    # MLflow 3 keeps using a ./mlruns file store that already holds experiments; else sqlite
    if mlruns.is_dir() and any(d.name.isdigit() and (d / "meta.yaml").exists()
                               for d in mlruns.iterdir()):
        if _file_store_allowed():
            return mlruns.as_uri()
        log.warning("%s holds a file store, which this MLflow neither reads nor writes unless "
                    "MLFLOW_ALLOW_FILE_STORE=true; runs go to %s instead (`mlflow ui "
                    "--backend-store-uri sqlite:///%s` shows them; `mlflow migrate-filestore` "
                    "moves the earlier ones there)", mlruns, db, db)
    return f"sqlite:///{db}"


def _absolute(uri: str) -> str:
    """``sqlite:///mlflow.db`` is relative to the directory the job starts in: made absolute, a
    resume or ``upload_spool.py`` started elsewhere still finds the same store (run.json keeps
    the URI)."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
        return prefix + str(Path(uri[len(prefix):]).absolute())
    return uri


def check_store(tracking) -> None:
    """A ``tracking.uri`` (or ``MLFLOW_TRACKING_URI``) naming a file store that this MLflow
    refuses, as one line at the start: found only by the tracker's first delivery, the run
    would train on with its metrics in the spool alone. Cheap: MLflow is imported only for a
    file store's URI."""
    if tracking.enabled:
        check_uri(tracking.uri, "tracking.uri")


def check_uri(given: Optional[str], key: str) -> None:
    """:func:`check_store` for a URI given as ``key`` (a config key, a command's option), else
    ``MLFLOW_TRACKING_URI``: also for the commands that send to a store after their work
    (``evaluate.py``, ``upload_spool.py``), where a bad one was found only then, in MLflow's
    own words cut short."""
    key = key if given else "MLFLOW_TRACKING_URI"
    uri = given or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri or uri in ("databricks", "databricks-uc", "uc"):  # MLflow's names, not paths
        return
    try:
        # MLflow opens a file store for a bare path or a file: URI
        scheme = urlparse(uri).scheme
        if scheme not in ("", "file") and scheme.split("+")[0] not in _store_schemes():
            # a typo (htps://) would train on with every metric in the spool alone
            raise TrackingError(f"{key}={uri}: '{scheme}' is no MLflow tracking store; write "
                                f"http(s)://HOST:PORT for a server, sqlite:///PATH.db, or a "
                                f"database URL (postgresql://, mysql://, mssql://)")
        if scheme not in ("", "file") or _file_store_allowed():
            return
    except ValueError as e:  # a malformed URI, or MLFLOW_ALLOW_FILE_STORE not true/false
        raise TrackingError(f"{key}={uri}: {e}") from None
    if re.fullmatch(r"[\w.-]+:\d+(/.*)?", uri):  # "10.0.0.5:5000": a server without http://
        raise TrackingError(f"{key}={uri} is read as a file store path; for a tracking server "
                            f"write {key}=http://{uri}")
    path = Path(urlparse(uri).path if scheme == "file" else uri)
    raise TrackingError(f"{key}={uri} is a file store, which this MLflow refuses: set "
                        f"{key}=sqlite:///{path.parent / 'mlflow.db'} (`mlflow "
                        f"migrate-filestore` moves runs already there), or set "
                        f"MLFLOW_ALLOW_FILE_STORE=true")


# databases MLflow's client opens itself (``postgresql+psycopg2://`` too), in this process
DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


def opened_in_process(uri: str) -> bool:
    """A store MLflow's client opens itself (a database, a folder), not a server's."""
    return urlparse(uri).scheme.split("+")[0] in ("", "file", *DATABASE_SCHEMES)


def _store_schemes() -> set:
    """URI schemes MLflow's tracking client opens: its own and those of installed plugins."""
    from importlib.metadata import entry_points
    return {"http", "https", *DATABASE_SCHEMES, "databricks", "uc", "databricks-uc",
            *(e.name for e in entry_points(group="mlflow.tracking_store"))}


def _file_store_allowed() -> bool:
    try:
        from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE
    except ImportError:  # an MLflow from before file stores were refused
        return True
    return bool(MLFLOW_ALLOW_FILE_STORE.get())


def store_refusal(exc: BaseException) -> str:
    """Why MLflow refused the run, in one line with its fix."""
    if "MLFLOW_ALLOW_FILE_STORE" in str(exc):  # newer MLflow refuses ./mlruns-style stores
        return ("this MLflow refuses file stores: set tracking.uri=sqlite:///<dir>/mlflow.db "
                "(`mlflow migrate-filestore` moves earlier runs there; `python "
                "launch/upload_spool.py OUTPUT_DIR --uri ...` sends this one), or set "
                "MLFLOW_ALLOW_FILE_STORE=true")
    return one_line(exc)

"""Delivering a run's spooled records to MLflow (:mod:`pretrain.spool` keeps them on disk):
:class:`Remote` is one run's connection, used by the tracker's background thread and by
:func:`upload_spool` (``launch/upload_spool.py``). It creates or re-attaches the run, sends
records (one value per step, except the steps a rollback trains again: a ``"rewind"`` record
lets those through once more) and artifacts, registers models, and ends the run with its end
tags and the job's times (and the run an earlier job left RUNNING when it died, FAILED).
:func:`is_permanent` and :func:`failure_kind` tell the tracker what a failed delivery means.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
from pathlib import Path, PurePosixPath
from typing import Callable, Optional

from pretrain.spool import (ARTIFACTS, CONFIG_NOW, CURSOR, JOB_TAGS, RUN_NAME_TAG, SPOOL,
                            STATE, TRACKING_DIR, RunState, TrackingError, lock, one_line,
                            read_cursor, read_spool, redacted, write_cursor)
from pretrain.system_metrics import PREFIX as SYSTEM_PREFIX, SYSTEM_DIR

log = logging.getLogger(__name__)

# MLflow 3's UI picks its view per experiment from this tag (JS: ExperimentKind); without it
# an experiment opens in the GenAI view, where training runs do not show
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
STOP_COUNT_TAG = "stop.count"
SUPERSEDED_TAG = "stop.superseded_by"  # on a run ended by us because another replaced it

# MLflow's HTTP client retries 7 times with exponential backoff (minutes) and waits 120 s per
# request by default; our thread retries by itself, so each attempt should fail fast. Set only
# when the user has not chosen values.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}
MAX_METRICS_PER_BATCH = 1000  # MLflow's log_batch limits
MAX_PARAMS_PER_BATCH = 100


# --------------------------------------------------------------------------------------------
# Talking to MLflow: shared by the background thread and launch/upload_spool.py
# --------------------------------------------------------------------------------------------
def is_permanent(exc: BaseException) -> bool:
    """A request MLflow rejected (4xx other than 429): retrying cannot help."""
    from mlflow.exceptions import MlflowException
    if not isinstance(exc, MlflowException):
        return False
    status = exc.get_http_status_code()
    return 400 <= status < 500 and status != 429


def is_page_not_found(exc: BaseException) -> bool:
    """A 404 whose body is no answer of MLflow's: a proxy or ingress in front of a server that
    is away (or a wrong path in the URI). Not a refusal of the run: retried as an outage."""
    return getattr(exc, "error_code", None) == "ENDPOINT_NOT_FOUND"


def is_missing(exc: BaseException) -> bool:
    """The store answered that the run (or model) does not exist; a proxy's 404 in front of a
    server that is away is not that (ENDPOINT_NOT_FOUND), nor is a run deleted but kept."""
    return getattr(exc, "error_code", None) == "RESOURCE_DOES_NOT_EXIST"


def failure_kind(exc: BaseException) -> str:
    """Why a delivery failed: "missing module" (an optional package the store needs: boto3,
    psycopg2), "bug" (raised in this project's own code, not by MLflow or the network), else
    "outage" (the server, a proxy in front of it, the network: retried until it is back)."""
    if isinstance(exc, ImportError):
        return "missing module"
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = os.path.abspath(tb.tb_frame.f_code.co_filename) if tb is not None else ""
    here = os.path.dirname(os.path.abspath(__file__))
    ours = (here, os.path.join(os.path.dirname(here), "finetune"))  # the packages of both stages
    return "bug" if where.startswith(tuple(d + os.sep for d in ours)) else "outage"


class Remote:
    """One run's connection: create or re-attach the run, upload artifacts, send records.
    Every method may raise when the server is unreachable; the state on disk stays consistent.
    With ``on_write_error``, failing writes of run.json and the cursor go there instead of
    raising (the running job: its state in memory is what counts; the files only help a resume
    or upload_spool.py do less work)."""

    def __init__(self, track_dir: Path, state: RunState,
                 on_write_error: Optional[Callable[[Path, OSError], None]] = None):
        for k, v in HTTP_DEFAULTS.items():
            os.environ.setdefault(k, v)
        self.dir = track_dir
        self.state = state
        self.on_write_error = on_write_error
        self.client = None  # made on first connect: importing mlflow takes seconds
        self.connected = False
        self.last_step: dict[str, int] = {}  # per metric: highest step MLflow holds
        # per system metric: the time of the latest sample MLflow holds; a sample sent again
        # (its file's cursor could not be written, or a crash came before it was) is skipped
        self.last_time: dict[str, int] = {}
        # per cursor file: the offset sent up to, which a failed cursor write cannot set back
        self.sent_to: dict[str, int] = {}
        # the spool's records up to this offset went to a run that is gone: a running job,
        # whose queue starts after them, queues them again for the new run (MlflowTracker)
        self.resend_to = 0
        # the state is changed by the delivery thread and by the training thread (log_model,
        # close, an artifact written): what both may change, and every save of run.json,
        # holds this lock, never a request
        self.state_lock = threading.RLock()
        # artifact files written again since this upload pass listed them (a name, or a folder
        # "model/" replaced whole by log_model): what the pass sent of them is not recorded
        self.replaced: set[str] = set()

    def save_state(self) -> None:
        with self.state_lock:
            self._write(self.dir / STATE, lambda: self.state.save(self.dir))

    def _write(self, path: Path, write: Callable[[], None]) -> None:
        try:
            write()
        except OSError as e:
            if self.on_write_error is None:
                raise
            self.on_write_error(path, e)

    def connect(self, reopen: bool = True) -> str:
        """Find or create the run; ``reopen`` marks an ended run RUNNING again (a resumed job)."""
        from mlflow import MlflowClient
        from mlflow.entities import Param, RunTag
        if self.client is None:
            if redacted(self.state.uri) != self.state.uri:  # MLflow prints "View run ... at
                # <the URI>" as a run ends, password and all: the log names the run already
                os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
            self.client = MlflowClient(self.state.uri)
        s = self.state
        if s.run_id is not None:
            try:
                run = self.client.get_run(s.run_id)
            except Exception as e:  # noqa: BLE001
                if not is_missing(e):
                    raise
                self.forget_run("is not in")  # upload_spool.py --uri another store; a reset
            else:
                if run.info.lifecycle_stage == "deleted":  # MLflow keeps it, refusing records
                    self.forget_run("was deleted from")
            if s.run_id is not None:
                self.last_step = {m.key: m.step for m in run.data._metric_objs}
                self.last_time = {m.key: m.timestamp for m in run.data._metric_objs
                                  if m.key.startswith(SYSTEM_PREFIX)}
                # a resumed job's own tags (its ranks and hosts) replace the earlier job's; the
                # others are left as they are in MLflow (a user may have corrected one there)
                retag = {k: v for k, v in s.tags.items() if (k in JOB_TAGS or k.startswith(
                    CONFIG_NOW)) and run.data.tags.get(k) != v}
                if s.rename_to:  # once: a rename in the UI after it is the user's
                    retag[RUN_NAME_TAG] = s.rename_to
                if retag:
                    self.client.log_batch(s.run_id, tags=[RunTag(k, v)
                                                          for k, v in sorted(retag.items())])
                if s.rename_to:
                    s.rename_to = None
                    self.save_state()
                # MLflow's count wins when this output_dir's run.json does not know the stops
                with self.state_lock:  # (close counts a stop meanwhile)
                    s.stops = max(s.stops, _int(run.data.tags.get(STOP_COUNT_TAG)))
                if reopen and run.info.status != "RUNNING":
                    self.client.update_run(s.run_id, status="RUNNING")
                self._mark_experiment(run.info.experiment_id)
        if s.run_id is None:
            exp = self.client.get_experiment_by_name(s.experiment)
            if exp is None:
                try:
                    exp_id = self.client.create_experiment(
                        s.experiment, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
                except Exception:  # noqa: BLE001 -- another job created it meanwhile
                    exp_id = self.client.get_experiment_by_name(s.experiment).experiment_id
            else:
                exp_id = exp.experiment_id
                self._mark_experiment(exp_id, exp)
            run = self.client.create_run(exp_id, run_name=s.run_name, tags=s.tags,
                                         start_time=s.start_time)
            s.run_id, s.rename_to = run.info.run_id, None  # (created under its latest name)
            self.save_state()  # from now on a retry re-attaches instead of creating another
            self.last_step, self.last_time = {}, {}
        if s.parent_dir:
            self._nest()
        if not s.params_logged:
            items = sorted(s.params.items())
            for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
                self.client.log_batch(s.run_id, params=[
                    Param(k, v) for k, v in items[i:i + MAX_PARAMS_PER_BATCH]])
            s.params_logged = True
            self.save_state()
        self.connected = True
        return s.run_id

    def run_gone(self) -> str:
        """Whether the run, found or created by :meth:`connect`, has since been deleted from
        the store (in the UI, ``mlflow runs delete``: "was deleted from") or the store lost it
        (reset, restored from an older backup: "is not in"), for :meth:`forget_run`; "" while
        it is there. MLflow refuses every request for a run gone as a bad request."""
        try:
            run = self.client.get_run(self.state.run_id)
        except Exception as e:  # noqa: BLE001
            if not is_missing(e):
                raise
            return "is not in"
        return "was deleted from" if run.info.lifecycle_stage == "deleted" else ""

    def forget_run(self, how: str) -> None:
        """The run ``is not in`` the store or ``was deleted from`` it: leave it, so that the next
        :meth:`connect` creates a new run, which is sent everything, the records, system
        samples, artifacts and model registrations delivered to the old one included."""
        s = self.state
        log.warning("MLflow run %s %s the store at %s; a new run gets everything this run "
                    "logged", s.run_id, how, redacted(s.uri))
        self.resend_to = max(self.resend_to, read_cursor(self.dir), self.sent_to.get(CURSOR, 0))
        with self.state_lock:
            s.gone.append(s.run_id)
            s.run_id, s.params_logged, s.uploaded = None, False, []
            s.models = [m for m in s.models if not m.get("superseded")]
            for m in s.models:
                for k in ("version", "model_id", "ready"):  # made in the store left
                    m.pop(k, None)
        self.sent_to.clear()
        self.last_step, self.last_time = {}, {}
        for f in [self.dir / CURSOR, *(self.dir / SYSTEM_DIR).glob("*.delivered")]:
            self._write(f, lambda: f.unlink(missing_ok=True))
        self.connected = False

    def _nest(self) -> None:
        """Nest the run under the run of ``parent_dir`` once that one is in this store."""
        from mlflow.entities import RunTag
        s = self.state
        there = Path(s.parent_dir).parent
        try:
            parent = RunState.load(Path(s.parent_dir))
        except (OSError, ValueError, TypeError) as e:
            log.info("not nested: the run that made the model, in %s, cannot be read (%s)",
                     there, one_line(e))
            return
        if parent.start_time != s.parent_started:  # checkpoint.resume=false started another
            log.info("not nested: %s holds another run than the one that made the model", there)
            s.parent_dir = None
            self.save_state()
            return
        if parent.run_id is None:
            log.info("the run of %s has not reached MLflow yet: `python launch/upload_spool.py "
                     "%s` sends it, then `python launch/upload_spool.py %s` nests this one under "
                     "it", there, there, self.dir.parent)
            return
        try:
            self.client.get_run(parent.run_id)
        except Exception as e:  # noqa: BLE001
            if not is_permanent(e):
                raise
            log.info("not nested: the run of %s (%s) is not in the store at %s", there,
                     parent.run_id, redacted(s.uri))
            return
        tags = {"mlflow.parentRunId": parent.run_id, "eval.source_run_id": parent.run_id}
        self.client.log_batch(s.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        with self.state_lock:
            s.tags.update(tags)
            s.parent_dir = None
            self.save_state()
        log.info("nested under run %s", parent.run_id)

    def _mark_experiment(self, exp_id: str, exp=None) -> None:
        """Tag an experiment made before this tag existed (or by someone else); a user's own
        choice of kind stays. Best effort: a server that refuses it must not cost the run."""
        try:
            exp = exp or self.client.get_experiment(exp_id)
            if EXPERIMENT_KIND_TAG not in exp.tags:
                self.client.set_experiment_tag(exp_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        except Exception as e:  # noqa: BLE001
            if not is_permanent(e):
                raise  # the server is down: the whole attempt is retried
            log.info("could not tag experiment %s with %s (%s); the MLflow 3 UI shows its runs "
                     "with ?workflowType=machine_learning", exp_id, EXPERIMENT_KIND_TAG,
                     one_line(e))

    def pending_artifacts(self) -> list[Path]:
        return pending_artifacts(self.dir, self.state)

    def written_again(self, name: str) -> None:
        """The artifact ``name`` (a folder: ending in "/") is written anew: sent again, even
        if an upload of the old one is in flight. Call under :attr:`state_lock`."""
        self.replaced.add(name)
        self.state.uploaded = [u for u in self.state.uploaded
                               if not (u == name or name.endswith("/") and u.startswith(name))]

    def _replaced(self, rel: str) -> bool:
        return any(rel == r or r.endswith("/") and rel.startswith(r) for r in self.replaced)

    def _model_of(self, rel: str) -> Optional[dict]:
        """The model, not one replaced since, whose package holds the artifact ``rel``."""
        with self.state_lock:
            return next((m for m in self.state.models if not m.get("superseded")
                         and rel.startswith(m["path"] + "/")), None)

    def _logged_model(self, m: dict) -> Optional[str]:
        """The logged model that the files of model ``m`` go to, made before the first of
        them; None: they are artifacts of the run (a server before MLflow 3, or a package
        whose upload an earlier version of this program began there: one place for all)."""
        if "model_id" not in m:
            from pretrain.model_registry import new_logged_model
            with self.state_lock:
                begun = any(u.startswith(m["path"] + "/") for u in self.state.uploaded)
            s = self.state
            # the settings of the weights it holds: a relaunch's changes over the start's
            # params (which MLflow keeps as they were), and where a fine-tune started from
            now = {k[len(CONFIG_NOW):]: v for k, v in s.tags.items() if k.startswith(CONFIG_NOW)}
            lineage = {k: v for k, v in s.tags.items() if k.startswith("pretrain.")}
            model_id = None if begun else new_logged_model(
                self.client, s.run_id, m["path"], {**s.params, **now},
                {**lineage, **(m.get("tags") or {})})
            with self.state_lock:
                m["model_id"] = model_id
                self.save_state()
        return m["model_id"]

    def _refused(self, m: dict, e: BaseException) -> None:
        """The store refused a request about ``m``'s logged model (4xx): deleted meanwhile (in
        the UI, say), its package goes again to a new one; refused otherwise, to the run's
        artifacts. Not an outage: retrying the same request would never end."""
        gone = is_missing(e)
        log.warning("MLflow refused the logged model of '%s' (%s); its package is sent again %s",
                    m["path"], one_line(e), "to a new logged model" if gone
                    else "as artifacts of the run")
        with self.state_lock:
            for k in ("model_id", "ready"):
                m.pop(k, None)
            if not gone:
                m["model_id"] = None
            self.written_again(m["path"] + "/")
            self.save_state()

    def upload_artifacts(self) -> int:
        root = self.dir / ARTIFACTS
        with self.state_lock:
            self.replaced.clear()
            new = self.pending_artifacts()
        sent = 0
        for p in new:
            rel, sub = p.relative_to(root).as_posix(), p.parent.relative_to(root).as_posix()
            m = self._model_of(rel)
            model_id = self._logged_model(m) if m else None
            try:
                if model_id:
                    inner = PurePosixPath(sub).relative_to(m["path"]).as_posix()
                    self.client.log_model_artifact(model_id, str(p),
                                                   artifact_path=None if inner == "." else inner)
                else:
                    self.client.log_artifact(self.state.run_id, str(p),
                                             artifact_path=None if sub == "." else sub)
            except FileNotFoundError:
                with self.state_lock:
                    if not self._replaced(rel):
                        raise
                continue
            except Exception as e:  # noqa: BLE001
                if not (model_id and is_permanent(e) and not is_page_not_found(e)):
                    raise
                self._refused(m, e)
                continue
            with self.state_lock:
                if self._replaced(rel):  # written again meanwhile: the next pass sends it
                    continue
                self.state.uploaded.append(rel)
                self.save_state()
            sent += 1
        return sent

    def finish_models(self) -> int:
        """Finish the models whose files are all uploaded (call after :meth:`upload_artifacts`:
        a READY model or a version must not point at a half-uploaded one): a logged model is
        marked READY and listed among the run's outputs, then registered if it asks. A logged
        model replaced before it was finished ends FAILED. Returns how many were registered."""
        from pretrain.model_registry import finish_logged_model, register
        with self.state_lock:
            todo = [m for m in self.state.models if m.get("superseded")
                    or m.get("model_id") and not m.get("ready")
                    or m.get("register_as") and not m.get("version")]
            if not todo:  # (the common case: no listing of the artifacts every attempt)
                return 0
            pending = [p.relative_to(self.dir / ARTIFACTS).as_posix()
                       for p in self.pending_artifacts()]
        done = 0
        for m in todo:
            model_id = m.get("model_id")
            if m.get("superseded"):
                try:
                    if model_id and not m.get("ready"):
                        finish_logged_model(self.client, self.state.run_id, model_id, m["path"],
                                            None)
                except Exception as e:  # noqa: BLE001
                    if not is_permanent(e) or is_page_not_found(e):
                        raise  # an outage: retried
                    log.info("could not mark the replaced logged model %s FAILED (%s)",
                             model_id, one_line(e))
                with self.state_lock:
                    self.state.models = [k for k in self.state.models if k is not m]
                    self.save_state()
                continue
            if any(p.startswith(m["path"] + "/") for p in pending):
                continue
            try:
                if model_id and not m.get("ready"):
                    finish_logged_model(self.client, self.state.run_id, model_id, m["path"],
                                        _int(str((m.get("tags") or {}).get("step", 0))))
                    with self.state_lock:
                        m["ready"] = True
                        self.save_state()
            except Exception as e:  # noqa: BLE001
                if not is_permanent(e) or is_page_not_found(e):
                    raise
                self._refused(m, e)
                continue
            if m.get("register_as") and not m.get("version"):
                try:
                    version = register(self.client, self.state.run_id, m["register_as"],
                                       m["path"], tags=m.get("tags"),
                                       description=m.get("description"), model_id=model_id)
                except Exception as e:  # noqa: BLE001
                    if not is_permanent(e) or is_page_not_found(e):
                        raise
                    source = f"models:/{model_id}" if model_id else \
                        f"runs:/{self.state.run_id}/{m['path']}"
                    log.warning("MLflow refused to register %s as '%s' (%s); "
                                "mlflow.register_model('%s', '%s') tries again", source,
                                m["register_as"], one_line(e), source, m["register_as"])
                    with self.state_lock:
                        m["register_as"] = None
                        self.save_state()
                    continue
                with self.state_lock:
                    m["version"] = version
                    self.save_state()
                done += 1
        return done

    def send(self, records: collections.deque, cursor: str = CURSOR) -> int:
        """Send ``records`` ((record, end offset in its file or None if it is not in the file),
        oldest first), popping each once it is in MLflow and advancing the ``cursor`` file.
        Records with a ``step`` are the spool's; those without are a node's system metrics
        (:mod:`pretrain.system_metrics`), numbered on from each metric's last step in MLflow.
        Returns how many were sent."""
        from mlflow.entities import Metric
        sent = 0
        while records:
            batch, metrics, last, last_time = [], [], dict(self.last_step), dict(self.last_time)
            for rec, end in records:
                if rec.get("rewind"):  # a rollback: the steps after rec["step"] are new values
                    last = {k: s if k.startswith(SYSTEM_PREFIX) else min(s, int(rec["step"]))
                            for k, s in last.items()}
                if "step" in rec:
                    new = [Metric(k, float(v), int(rec["time"]), int(rec["step"]))
                           for k, v in rec["metrics"].items()
                           if rec["step"] > last.get(k, -1 << 62)]
                else:
                    new = [Metric(k, float(v), int(rec["time"]), last.get(k, -1) + 1)
                           for k, v in rec["metrics"].items()
                           if rec["time"] > last_time.get(k, -1 << 62)]
                if metrics and len(metrics) + len(new) > MAX_METRICS_PER_BATCH:
                    break
                for m in new:
                    last[m.key] = m.step
                    if "step" not in rec:
                        last_time[m.key] = m.timestamp
                batch.append(end)
                metrics += new
            try:
                if metrics:
                    self.client.log_batch(self.state.run_id, metrics=metrics)
            except Exception as e:  # noqa: BLE001
                if not is_permanent(e) or self.run_gone():
                    raise  # a run deleted meanwhile refuses everything: see Remote.run_gone
                # e.g. a value MLflow refuses: dropping this batch beats blocking all later ones
                kept = (f"{self.dir / SPOOL} and metrics.jsonl" if cursor == CURSOR else
                        str(self.dir / cursor.replace(".delivered", ".jsonl")))
                log.warning("MLflow rejected %d metrics (%s); they are not in MLflow, but in %s",
                            len(metrics), one_line(e), kept)
            self.last_step, self.last_time = last, last_time
            for _ in batch:
                records.popleft()
            spooled = [end for end in batch if end is not None]
            if spooled:
                self.sent_to[cursor] = spooled[-1]
                self._write(self.dir / cursor, lambda: write_cursor(self.dir, spooled[-1], cursor))
            sent += len(batch)
        return sent

    def send_system(self) -> int:
        """Send the system metrics every node sampled (``system/<host>.jsonl``) that MLflow does
        not hold yet. Returns how many samples were read past (sent, or found in MLflow)."""
        pending = []
        for path in (self.dir / SYSTEM_DIR).glob("*.jsonl"):
            cursor = f"{SYSTEM_DIR}/{path.stem}.delivered"
            start = max(read_cursor(self.dir, cursor), self.sent_to.get(cursor, 0))
            records = collections.deque(read_spool(path, start))
            if records:
                pending.append((records[0][0]["time"], cursor, records))
        # oldest first: a one-node run requeued on another host has two files of the same
        # names, and the earlier host's backlog comes before the new host's samples
        return sum(self.send(records, cursor) for _, cursor, records in sorted(pending))

    def settle_earlier(self, old: RunState) -> bool:
        """The earlier run of this output_dir, which this one replaces: a run whose job died
        without ending it (SIGKILL, the OOM killer, a node lost) ends FAILED, with why and
        which run replaced it (left alone it would show RUNNING forever); one moved aside
        (checkpoint.resume=false) gets its tag output_dir naming where its files are now, not
        the folder this run took over. False: its server is down, try again later."""
        from mlflow import MlflowClient
        from mlflow.entities import RunTag
        client = self.client if old.uri == self.state.uri else MlflowClient(old.uri)
        try:
            run = client.get_run(old.run_id)
            running = run.info.status == "RUNNING"
            tags = {**old.end_tags, SUPERSEDED_TAG: self.state.run_id} if running else {}
            where = old.tags.get("output_dir")
            if where and run.data.tags.get("output_dir") != where:
                tags["output_dir"] = where
            if tags:
                client.log_batch(old.run_id, tags=[RunTag(k, str(v))
                                                   for k, v in sorted(tags.items())])
            if running:
                client.set_terminated(old.run_id, "FAILED")
                log.info("MLflow run %s of the job that died here ended FAILED", old.run_id)
        except Exception as e:  # noqa: BLE001 -- never the reason this run's records wait
            if not is_permanent(e):
                return False
            log.info("could not settle MLflow run %s of the earlier run here (%s)", old.run_id,
                     one_line(e))
        return True

    def finish(self, status: str) -> None:
        """End the run; its end tags go on first, so a run never shows KILLED without why."""
        from mlflow.entities import RunTag
        tags = dict(self.state.end_tags)
        if self.state.stops:
            tags[STOP_COUNT_TAG] = str(self.state.stops)
        if tags:
            self.client.log_batch(self.state.run_id, tags=[
                RunTag(k, str(v)) for k, v in sorted(tags.items())])
        self.client.set_terminated(self.state.run_id, status, end_time=self.state.end_time)
        for old in self.state.gone:
            self._end_restored(old)

    def _end_restored(self, run_id: str) -> None:
        """A run this one replaced when it was deleted may have been restored since (the UI's
        Restore, a restored experiment): it ends FAILED, naming its replacement, rather than
        showing RUNNING beside it forever."""
        from mlflow.entities import RunTag
        try:
            run = self.client.get_run(run_id)
            if run.info.lifecycle_stage == "active" and run.info.status == "RUNNING":
                self.client.log_batch(run_id, tags=[RunTag(SUPERSEDED_TAG, self.state.run_id)])
                self.client.set_terminated(run_id, "FAILED")
                log.info("MLflow run %s, restored after run %s replaced it, ended FAILED",
                         run_id, self.state.run_id)
        except Exception as e:  # noqa: BLE001 -- not in this store (upload_spool.py --uri)
            if not is_permanent(e):
                raise


def _int(text: Optional[str]) -> int:
    try:
        return int(text or 0)
    except ValueError:
        return 0



def pending_artifacts(track_dir: Path, state: RunState) -> list[Path]:
    """The run's artifact files in ``track_dir`` not uploaded yet."""
    root = track_dir / ARTIFACTS
    done = set(state.uploaded)
    return [p for p in sorted(root.rglob("*")) if p.is_file()
            and p.relative_to(root).as_posix() not in done] if root.is_dir() else []


def lacking(track_dir: Path, state: RunState, records: str = "") -> list[str]:
    """What MLflow lacks of the run in ``track_dir``: itself, ``records`` (said by the caller,
    which knows them best), the artifact files not uploaded, the logged models not finished,
    the registrations not made."""
    files = pending_artifacts(track_dir, state)
    out = [] if state.run_id else ["the run itself (never created there)"]
    if records:
        out.append(records)
    if files:
        out.append(f"{len(files)} artifact files "
                   f"({sum(f.stat().st_size for f in files) / 2 ** 20:.1f} MiB)")
    current = [m for m in state.models if not m.get("superseded")]
    out += [f"the READY mark of logged model '{m['path']}'" for m in current
            if m.get("model_id") and not m.get("ready")]
    return out + [f"the registration as '{m['register_as']}'" for m in current
                  if m.get("register_as") and not m.get("version")]


# --------------------------------------------------------------------------------------------
# Uploading a spool afterwards
# --------------------------------------------------------------------------------------------
def upload_spool(output_dir: os.PathLike | str, uri: Optional[str] = None) -> list[str]:
    """Send every undelivered record (and artifact) of ``output_dir``'s tracking directories to
    MLflow, creating the run if it never was; returns one summary line per directory."""
    out = Path(output_dir)
    dirs = [d for d in [out / TRACKING_DIR, *sorted(out.glob(TRACKING_DIR + ".*"))]
            if (d / STATE).is_file()]
    if not dirs:
        raise TrackingError(f"no MLflow spool in '{out}' (expected {out / TRACKING_DIR / STATE})")
    lines = []
    for d in dirs:
        held = lock(d)
        if held is None:
            raise TrackingError(f"{d} is in use by a running job; run this after it ends")
        try:
            state = RunState.load(d)
            if uri:
                state.uri = uri
            remote = Remote(d, state)
            try:
                remote.connect(reopen=False)
                pending = collections.deque(read_spool(d / SPOOL, read_cursor(d)))
                files = remote.pending_artifacts()
                # a model's files can be GBs: what is sent, before the minutes it may take
                log.info("%s: sending %d records and %d artifact files (%.1f MiB) to run %s",
                         d, len(pending), len(files),
                         sum(f.stat().st_size for f in files) / 2 ** 20, state.run_id)
                n = remote.send(pending)
                samples = remote.send_system()
                a = remote.upload_artifacts()
                remote.finish_models()
                if state.ended:
                    remote.finish(state.ended)
            except Exception as e:  # noqa: BLE001
                raise TrackingError(f"could not upload {d} to MLflow at {redacted(state.uri)}: "
                                    f"{one_line(e)}") from None
            state.save(d)
            lines.append(f"{d}: {n} records, {samples} system metric samples, {a} artifacts "
                         f"-> run {state.run_id} at "
                         f"{redacted(state.uri)}")
        finally:
            held.close()
    return lines

"""The MLflow sink of a run (rank 0): :class:`MlflowTracker` spools every record and a background
thread delivers them; :class:`NoTracking` stands in on other ranks. How a job uses them, and why,
is :mod:`pretrain.tracking`.
"""
from __future__ import annotations

import atexit
import collections
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Mapping, Optional

from pretrain.atomic_write import write_atomic
from pretrain.metrics import LineFile
from pretrain.run_info import sample_grid_png
from pretrain.mlflow_delivery import (Remote, failure_kind, is_page_not_found, is_permanent,
                                      lacking)
from pretrain.spool import (ARTIFACTS, SPOOL, RunState, TrackingError, lock, one_line,
                            read_cursor, read_spool, redacted)
from pretrain.tracking_store import store_refusal

log = logging.getLogger("pretrain.tracking")  # one logger for the tracking modules

SAMPLES_PNG = "train_samples.png"
MAX_RETRY_WAIT_S = 30.0  # the longest pause between two delivery attempts


# --------------------------------------------------------------------------------------------
# The sink
# --------------------------------------------------------------------------------------------
class NodeSampling:
    """What both trackers hold: the node's system metrics sampler (on its first rank), and
    when the job must be gone."""

    sampler = None  # a NodeSampler (pretrain.system_metrics), set by start_tracking
    # when (time.monotonic()) the job must be gone, a stop signal having come, or None: the
    # close waits for MLflow no longer (the trainer sets its StopSignals.leave_by)
    leave_by = staticmethod(lambda: None)

    def stop_sampling(self) -> None:
        """Stop this node's sampler; its last sample is then in its file. At a job's end every
        rank stops before the ranks' last collective, after which rank 0's tracker closes: its
        last delivery has every node's samples."""
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None


class NoTracking(NodeSampling):
    """Ranks other than 0, or ``tracking.enabled=false``: every public call of
    :class:`MlflowTracker`, doing nothing."""

    run_id = None
    unwritten = 0

    def settled_run_id(self, timeout: float = 60.0) -> Optional[str]:
        return None

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def rewind(self, step: int) -> None:
        pass

    def log_artifact_bytes(self, name: str, data: bytes) -> None:
        pass

    def log_sample_grid(self, images) -> None:
        pass

    def log_model(self, folder: os.PathLike | str, register_as: Optional[str] = None,
                  about: Optional[Mapping[str, str]] = None,
                  description: Optional[str] = None) -> None:
        pass

    def close(self, status: str = "FINISHED", tags: Optional[Mapping[str, str]] = None) -> None:
        self.stop_sampling()

    def fail(self, tags: Optional[Mapping[str, str]] = None) -> None:
        self.close()


class MlflowTracker(NodeSampling):
    """The MLflow sink (``MetricsLogger``): ``log`` spools and queues, a thread delivers (the
    lines of every node's sampler too)."""

    def __init__(self, track_dir: os.PathLike | str, state: RunState, *,
                 flush_every_s: float = 2.0, close_timeout_s: float = 120.0,
                 earlier: Optional[RunState] = None):
        self.dir = Path(track_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = lock(self.dir)
        if self._lock is None:
            raise TrackingError(f"{self.dir} is locked by another process (a job still running, "
                                f"or upload_spool.py); wait for it to end")
        self._write_error: Optional[OSError] = None
        self._write_error_lock = threading.Lock()  # both threads write; one warning in all
        # artifacts the disk had no room for, kept until it has (name -> bytes); the lock
        # also keeps both threads from writing the same file at once
        self._held: dict[str, bytes] = {}
        self._held_lock = threading.Lock()
        self.state = state
        self._earlier = earlier  # the run this one replaces here (Remote.settle_earlier)
        self._remote = Remote(self.dir, state, on_write_error=self._write_failed)
        state.ended = state.end_time = None
        self._remote.save_state()
        self.flush_every_s = flush_every_s
        self.close_timeout_s = close_timeout_s
        # undelivered records of an earlier job in this output_dir go first
        self._pending: collections.deque = collections.deque()
        self._outbox = collections.deque(read_spool(self.dir / SPOOL, read_cursor(self.dir)))
        self._spool = LineFile(self.dir / SPOOL, lambda e: self._write_failed(self.dir / SPOOL, e))
        self._stop = threading.Event()
        self._down = False
        self._closed = False
        self._ended_there = False  # the run ended in MLflow (its status and end tags set)
        self._close_done = threading.Event()
        self.seconds_in_log = 0.0  # training-thread time inside log(), for the closing note
        self.seconds_setup = 0.0  # ... and in start_tracking / log_sample_grid (once per job)
        self.log_calls = 0
        self._first_attempt = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mlflow-tracker", daemon=True)
        self._thread.start()
        atexit.register(self._at_exit)

    @property
    def run_id(self) -> Optional[str]:
        return self.state.run_id

    def settled_run_id(self, timeout: float = 60.0) -> Optional[str]:
        """The run id, once the first attempt to create or re-open the run has ended. That
        attempt starts with the job, so only what a job writes in its first seconds waits here,
        and an unreachable server fails it within MLFLOW_HTTP_REQUEST_TIMEOUT. For files that
        name their run (a fine-tune's exports); None when the server was not reached."""
        if not self._first_attempt.wait(timeout):
            self._first_attempt.set()  # waited once; later calls take what is known at once
        return self.run_id

    @property
    def unwritten(self) -> int:
        """Records that could not be written to the spool (a full disk). They are still sent to
        MLflow from memory; only a crash before that loses them."""
        return self._spool.unwritten

    def _write_failed(self, path: Path, exc: OSError) -> None:
        with self._write_error_lock:
            if self._write_error is not None:
                return
            self._write_error = exc
        log.warning("cannot write %s (%s); training goes on, metrics still go to MLflow from "
                    "memory, records missing from the spool are counted", path, exc)

    # -- training thread -------------------------------------------------------------------
    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self._closed:  # ended by a stall's last words while the main thread went on a bit
            return
        t0 = time.perf_counter()
        self._record({"step": int(step), "time": int(time.time() * 1000),
                      "metrics": {k: float(v.item() if hasattr(v, "item") else v)
                                  for k, v in metrics.items()}})
        self.log_calls += 1
        self.seconds_in_log += time.perf_counter() - t0

    def rewind(self, step: int) -> None:
        """The run rolled back to checkpoint ``step``: what it logs for later steps is sent
        again, though MLflow already holds values for them (those of the discarded steps)."""
        self._record({"step": int(step), "time": int(time.time() * 1000), "metrics": {},
                      "rewind": True})

    def _record(self, rec: dict) -> None:
        # in the OS's hands at once: survives a SIGKILL of this process. Queued whether or not
        # it made it to disk: the thread sends it either way
        end = self._spool.append((json.dumps(rec) + "\n").encode())
        self._pending.append((rec, end))

    def log_artifact_bytes(self, name: str, data: bytes) -> None:
        """Queue a file for the run's artifacts (uploaded by the thread). On a full disk it is
        kept in memory and written once there is room."""
        with self._held_lock:
            self._held[name] = data
        self._write_held()

    def _write_held(self) -> None:
        # under the state lock: the thread lists no half-written file, and a file written
        # again (a relaunch's samples.png) is uploaded again, not taken for the one sent
        with self._held_lock, self._remote.state_lock:
            for name, data in list(self._held.items()):
                path = self.dir / ARTIFACTS / name
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    write_atomic(path, data)
                except OSError as e:
                    self._write_failed(path, e)
                else:
                    del self._held[name]
                    was_sent = name in self.state.uploaded
                    self._remote.written_again(name)
                    if was_sent:
                        self._remote.save_state()

    def log_model(self, folder: os.PathLike | str, register_as: Optional[str] = None,
                  about: Optional[Mapping[str, str]] = None,
                  description: Optional[str] = None) -> None:
        """Log the timm ``folder`` as the run's MLflow model ``model`` (and register it as a new
        version of ``register_as``); see :mod:`pretrain.model_registry`. Packaged here, uploaded
        and registered by the thread. A failure is one warning: the files on disk stay.
        ``about``: which weights they are (``{"export": "best", "step": "20"}``), tags of the
        run (``model.export``, ...) and of the registered version; ``description``: the
        version's."""
        import shutil

        from pretrain.model_registry import MODEL_ARTIFACT, package
        path = self.dir / ARTIFACTS / MODEL_ARTIFACT
        partial = self.dir / (MODEL_ARTIFACT + ".partial")  # out of the thread's sight
        try:
            package(folder, partial)
            with self._remote.state_lock:  # the thread may be uploading the package replaced
                if path.exists():  # a second finish of the same run (relaunched after it)
                    shutil.rmtree(path)
                # one rename: the uploading thread sees the whole package or none of it
                path.parent.mkdir(parents=True, exist_ok=True)
                os.replace(partial, path)
                self._remote.written_again(MODEL_ARTIFACT + "/")
                s = self.state
                entry = {"path": MODEL_ARTIFACT, "register_as": register_as, "version": None,
                         "tags": dict(about or {}), "description": description}
                same = next((m for m in s.models if m["path"] == MODEL_ARTIFACT and about
                             and not m.get("superseded") and m.get("ready")
                             and m.get("model_id") and m.get("tags") == entry["tags"]), None)
                if same is not None:  # the same weights again (a relaunch that only registers
                    # them): sent to the same logged model, not a second one alike beside it
                    entry["model_id"] = same["model_id"]
                    s.models.remove(same)
                for m in s.models:  # a logged model left incomplete ends FAILED
                    if m["path"] == MODEL_ARTIFACT:
                        m["superseded"] = True
                s.models.append(entry)
                s.end_tags.update({f"model.{k}": str(v) for k, v in (about or {}).items()})
                self._remote.save_state()
        except Exception as e:  # noqa: BLE001 -- the exported files are there; MLflow is extra
            log.warning("could not log %s as an MLflow model (%s); the files on disk are "
                        "complete", folder, one_line(e))
            return
        where = f"runs:/{self.run_id}/{MODEL_ARTIFACT}" if self.run_id else \
            f"the run's '{MODEL_ARTIFACT}' once the run reaches MLflow"
        log.info("MLflow model of %s: %s%s", folder, where,
                 f", to be registered as '{register_as}'" if register_as else "")

    def log_sample_grid(self, images) -> None:
        t0 = time.perf_counter()
        self.log_artifact_bytes(SAMPLES_PNG, sample_grid_png(images))
        self.seconds_setup += time.perf_counter() - t0

    def close(self, status: str = "FINISHED", tags: Optional[Mapping[str, str]] = None) -> None:
        """Deliver what is pending (waiting up to ``close_timeout_s`` for an unreachable server),
        set ``tags`` on the run and end it with ``status``, say where anything undelivered is.

        ``close("KILLED", tags={"stop.signal": "SIGTERM", "stop.step": "7"})`` after a signal
        stop also counts it in the ``stop.count`` tag; the tags are kept (run.json) so that
        upload_spool.py sets them when the server was down, and stay on the run when a resumed
        job re-opens it and ends it FINISHED.
        """
        if self._closed:
            return
        self._closed = True
        self.stop_sampling()  # its last sample is in its file: the thread sends it
        try:
            self._close(status, tags)
        finally:
            self._close_done.set()

    def _close(self, status: str, tags: Optional[Mapping[str, str]]) -> None:
        with self._remote.state_lock:
            self.state.end_tags.update({k: str(v) for k, v in (tags or {}).items()})
            if status == "KILLED":
                self.state.stops += 1
            self.state.ended, self.state.end_time = status, int(time.time() * 1000)
        self._stop.set()
        # a short wait in any case: a healthy server takes the last records and the run's end
        # in well under EXIT_MARGIN_S, a stop checkpoint that took all the grace period or not
        self._thread.join(2.0)
        if self._thread.is_alive():
            by = self.leave_by()
            if by is None or by > time.monotonic():  # slow or away: say why the job is not over
                log.info("tracking: waiting for MLflow to take %d pending records (up to %.0f s)",
                         len(self._pending) + len(self._outbox), self.close_timeout_s)
            self._wait_for_delivery(self.close_timeout_s + 58)
        self._spool.close()
        self._write_held()  # the disk may have room again: upload_spool.py can send them then
        self._remote.save_state()
        left = list(self._pending) + list(self._outbox)
        lost = sum(end is None for _, end in left)
        undelivered = self._undelivered(status, len(left), lost)
        if undelivered:
            log.warning("not delivered to MLflow at %s: %s; `python launch/upload_spool.py %s` "
                        "sends them", redacted(self.state.uri), ", ".join(undelivered),
                        self.dir.parent)
        if self.unwritten:
            log.warning("%d metric records were not written to %s (%s); %s", self.unwritten,
                        self.dir / SPOOL, self._write_error,
                        f"{lost} of them never reached MLflow either: lost" if lost
                        else "all of them reached MLflow")
        if self._held:
            log.warning("artifacts %s were not written to %s (%s) and are not in MLflow",
                        ", ".join(sorted(self._held)), self.dir / ARTIFACTS, self._write_error)
        if self.log_calls:
            log.info("tracking: %d log calls took %.3f ms in the training thread (%.3f ms per "
                     "call); setup %.1f ms once", self.log_calls, 1e3 * self.seconds_in_log,
                     1e3 * self.seconds_in_log / self.log_calls, 1e3 * self.seconds_setup)
        self._lock.close()

    def _wait_for_delivery(self, seconds: float) -> None:
        """Wait up to ``seconds`` for the delivery thread to end, less when the job has to leave
        first (a stop signal's grace period ends: the state saved then is what upload_spool.py
        works from, where a SIGKILL would save none)."""
        end = time.monotonic() + seconds
        while self._thread.is_alive():
            by = self.leave_by()
            left = (end if by is None else min(end, by)) - time.monotonic()
            if left <= 0:
                if by is not None and by <= end:
                    log.warning("tracking: a stop signal came and its grace period (checkpoint."
                                "grace_period_s) ends: not waiting for MLflow any longer")
                return
            self._thread.join(min(left, 0.5))  # (a signal's handler runs in between)

    def _undelivered(self, status: str, records: int, lost: int) -> list[str]:
        """What MLflow lacks of this run at its end, for upload_spool.py to send."""
        out = lacking(self.dir, self.state, f"{records} metric records ({records - lost} of "
                      f"them in {self.dir / SPOOL})" if records else "")
        if self.state.run_id and not self._ended_there:
            out.append(f"the run's end (status {status} and its tags)")
        return out

    def fail(self, tags: Optional[Mapping[str, str]] = None) -> None:
        """The job is going down (the training loop raised, the rank stalled): send what we
        have and end the run FAILED with ``tags`` saying why, without lingering."""
        if not self._closed:
            self.close_timeout_s = min(self.close_timeout_s, 10.0)
            self.close("FAILED", tags)
        else:  # the main thread is closing (a crash): its close is all there is to wait for
            self._close_done.wait(self.close_timeout_s + 60)

    def _at_exit(self) -> None:
        self.fail()

    # -- background thread -----------------------------------------------------------------
    def _loop(self) -> None:
        wait = 0.0  # first attempt at once: create the run while the model is being built
        deadline = None
        while True:
            stopping = self._stop.wait(wait)
            if stopping and deadline is None:
                deadline = time.monotonic() + self.close_timeout_s
            try:
                self._attempt()
                if stopping:
                    self._finish()
            except Exception as e:  # noqa: BLE001 -- any failure: keep training, retry later
                if self._run_lost(e):  # a new run gets everything, from the next attempt on
                    wait = self.flush_every_s
                    continue
                if is_permanent(e) and not self._remote.connected and not is_page_not_found(e):
                    log.warning("MLflow at %s refused the run (%s); metrics stay in %s",
                                redacted(self.state.uri), store_refusal(e), self.dir / SPOOL)
                    return
                if not self._down:
                    self._down = failure_kind(e)
                    if self._down == "missing module":
                        log.error("MLflow at %s needs a module that is not installed here (%s); "
                                  "install it (pip install ...) and relaunch, or send the "
                                  "metrics spooled to %s later with launch/upload_spool.py",
                                  redacted(self.state.uri), one_line(e), self.dir / SPOOL)
                    elif self._down == "bug":  # not an outage: said, or it reads as one forever
                        log.error("MLflow tracking failed on an error of this program, not of "
                                  "the server at %s (%s); training continues, metrics are kept "
                                  "and spooled to %s; please report this",
                                  redacted(self.state.uri), one_line(e), self.dir / SPOOL,
                                  exc_info=True)
                    else:
                        log.warning("MLflow at %s unreachable (%s); training continues, "
                                    "metrics are kept and spooled to %s until it is back",
                                    redacted(self.state.uri), one_line(e), self.dir / SPOOL)
                wait = min(max(2 * wait, self.flush_every_s),
                           min(MAX_RETRY_WAIT_S, 10 * self.flush_every_s))
            else:
                if self._down:
                    log.info("MLflow at %s %s; pending metrics delivered",
                             redacted(self.state.uri), "reachable again"
                             if self._down == "outage" else "taking the run's records now")
                    self._down = False
                wait = self.flush_every_s
                if stopping:
                    return
            if stopping:
                if time.monotonic() >= deadline:
                    return
                wait = min(wait, max(deadline - time.monotonic(), 0.0))

    def _run_lost(self, exc: BaseException) -> bool:
        """``exc`` because the run was deleted from the store since it was found (or the store
        lost it): leave it, and queue again what it had been sent for the new run."""
        r = self._remote
        try:
            how = is_permanent(exc) and r.connected and r.run_gone()
        except Exception:  # noqa: BLE001 -- the server went away meanwhile: an outage
            return False
        if how:
            r.forget_run(how)
        return bool(how)

    def _attempt(self) -> None:
        r = self._remote
        if self._held:  # the disk was full: maybe there is room again
            self._write_held()
        if not r.connected:
            try:
                r.connect()
            finally:
                self._first_attempt.set()  # the run id is decided (or not): see settled_run_id
            if r.resend_to:  # a new run, for one that is gone: it gets what that one had too
                self._outbox.extendleft(reversed([(rec, end) for rec, end in read_spool(
                    self.dir / SPOOL) if end <= r.resend_to]))
                r.resend_to = 0
        while self._pending:  # the training thread appends to _pending; only we touch _outbox
            self._outbox.append(self._pending.popleft())
        r.send(self._outbox)
        r.send_system()
        r.upload_artifacts()
        r.finish_models()
        if self._earlier is not None and r.settle_earlier(self._earlier):
            self._earlier = None

    def _finish(self) -> None:
        self._remote.finish(self.state.ended or "FINISHED")
        self._ended_there = True


"""MLflow tracking for both stages: one MLflow run per training run, rank 0 only, and never the
reason a run dies. The run's records on disk and their delivery to MLflow (shared with
``launch/upload_spool.py``) are :mod:`pretrain.spool` and :mod:`pretrain.mlflow_delivery`.

Where runs go: :func:`pretrain.tracking_store.resolve_uri`.

What a run records (made by :mod:`pretrain.run_info`): the resolved config flattened into
params (``optimizer.lr``, ...); tags ``stage``, ``model``, ``dataset``, ``git.commit``,
``git.dirty``, ``world_size``, ``hosts`` (the newest job's, with ``world_size.history`` once a
resume changes it), ``jobs``, ``config.changed`` (a relaunch's changed settings) + lineage tags
for fine-tunes; artifacts
``config.yaml``, ``deepspeed_config.json``, ``environment.json``, ``train_samples.png``; the
trainer's metrics against the global step; every node's ``system/*`` metrics, sampled with
MLflow's collectors and spooled the same way (:mod:`pretrain.system_metrics`).

How it stays out of the way (:class:`pretrain.tracker.MlflowTracker`):

- ``log()`` on the training thread only appends one JSON line to the spool
  ``output_dir/tracking/spool.jsonl`` and puts the record on an in-memory queue. A background
  thread sends the queue in batches (``log_batch``) every ``tracking.flush_every_s``.
- Server unreachable: ONE warning per outage; records stay queued (and are in the spool), the
  thread retries with backoff and delivers them when the server is back, or at the end
  (``close`` waits up to ``tracking.close_timeout_s``). A run that cannot reach the server at
  start trains anyway; its MLflow run is created once the server answers. Whatever is still
  undelivered when the process ends stays in the spool: ``python launch/upload_spool.py
  OUTPUT_DIR`` sends it. ``output_dir/tracking/delivered`` holds the spool's byte offset up to
  which everything reached MLflow.
- Resume: the run id comes from the checkpoint (``tracking_run_id``; ``tracking/run.json`` when
  the checkpoint was written before the run existed). The resumed job re-sends what the killed
  one spooled but never delivered, and then, per metric, only steps above the highest step
  MLflow already holds. MLflow keeps every value logged at a step (``get_metric_history``
  returns duplicates), so this filter is what keeps one value per step: steps the killed job
  delivered after its last checkpoint keep the killed job's values (identical on an exact resume).
- The run deleted in MLflow (by a user, mid-job or before a resume) or lost by its store: MLflow
  refuses every record for it, so the tracker leaves it and a new run gets the whole spool from
  its first line, the system samples and the artifacts (``Remote.run_gone``, ``forget_run``).
- Rolled back (non-finite losses): the steps after the checkpoint are trained again on other
  batches, so their new values are sent too (``rewind(step)``): MLflow holds both, the later
  one is the metric's latest value, and the chart shows the discarded stretch and the retrained
  one, as ``metrics.jsonl`` does.
- Stopped by a signal: the trainer ends the run KILLED with ``stop.*`` tags
  (``close("KILLED", tags=...)``); ``stop.count`` counts the stops. The relaunch re-opens the same
  run (RUNNING again), which ends FINISHED: one run in the UI, the stops in its tags.
- Full disk: ONE warning per tracker; a record that cannot be spooled is still queued and sent
  (``unwritten`` counts those, which a crash would lose), state files and artifacts are written
  again once there is space. Nothing raises into the training thread.
- The experiment is tagged ``mlflow.experimentKind=custom_model_development``: MLflow 3's UI then
  opens it on its runs, not on the GenAI traces view.

Spool line: ``{"step": 12, "time": <unix ms>, "metrics": {"train/loss": 2.1, ...}}``; a
rollback to step 10 adds ``{"step": 10, "time": ..., "metrics": {}, "rewind": true}``.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

from pretrain.distributed import agreed, first_of_node, gather
from pretrain.run_info import (PARENT_STORE, dataset_name, environment, flatten, git_info,
                               source_tags)
from pretrain.spool import (CONFIG_NOW, STATE, TRACKING_DIR, RunState, TrackingError, lock,
                            one_line, redacted, undelivered)
from pretrain.system_metrics import NodeSampler, prefix_for
from pretrain.tracker import MlflowTracker, NoTracking
from pretrain.tracking_store import resolve_uri

log = logging.getLogger(__name__)

MAX_TAG_CHARS = 5000  # of a tag value: this MLflow takes 8000, older servers 5000
# config keys that say how a run is tracked and launched, not what it trains: no params
NOT_PARAMS = ("tracking.", "debug.", "checkpoint.resume", "data.generate_demo")


# --------------------------------------------------------------------------------------------
# Wiring for a stage's trainer
# --------------------------------------------------------------------------------------------
def start_tracking(cfg, stage: str, output_dir: os.PathLike | str, rank: int, *,
                   world_size: int, hosts: Sequence[str] = (), ds_config: Optional[dict] = None,
                   run_id: Optional[str] = None, resumed_at: Optional[int] = None,
                   dataset: Optional[str] = None, extra_tags: Optional[Mapping[str, str]] = None,
                   resolved: Optional[Mapping[str, object]] = None, changed: Iterable[str] = (),
                   set_aside: Optional[Path] = None):
    """The tracker of a run: :class:`MlflowTracker` on rank 0, :class:`NoTracking` elsewhere;
    on the first rank of each node it also samples the node's system metrics
    (:mod:`pretrain.system_metrics`), which rank 0's tracker sends.

    ``run_id``/``resumed_at``: the MLflow run id from the checkpoint being resumed and its
    step (None for a fresh run). ``resolved``: values the run worked out for config keys left
    unset (``train.total_steps`` from epochs, the batch layout, the architecture from the model
    name), logged as those params instead of "None". ``extra_tags``: e.g.
    :func:`pretrain.run_info.lineage_tags` for a fine-tune. ``changed``: the settings a resumed
    job changed (``"optimizer.lr: 0.002 -> 0.001"``), which the params (MLflow's are immutable)
    cannot show: the ``config.changed`` tag and a ``resume_step_N/config.yaml`` artifact say
    them. ``set_aside``: where checkpoint.resume=false just moved the earlier run of
    ``output_dir``, whose MLflow run learns its new place. Call it on every rank, ``hosts`` holding every rank's host (cheap: rank 0 does the
    work, and the ranks wait for it once).
    """
    t = cfg.tracking
    if not t.enabled:
        unused = [f"tracking.{k}" for k in sorted(t.model_fields_set) if k != "enabled"]
        if unused and rank == 0:
            log.warning("%s %s nothing: tracking.enabled=false (metrics.jsonl only)",
                        ", ".join(unused), "does" if len(unused) == 1 else "do")
        return NoTracking()
    tracker, error = NoTracking(), None
    if rank == 0:
        try:
            tracker = _rank0_tracker(
                cfg, stage, output_dir, world_size=world_size, hosts=hosts, ds_config=ds_config,
                run_id=run_id, resumed_at=resumed_at, dataset=dataset, extra_tags=extra_tags,
                resolved=resolved, changed=changed, set_aside=set_aside)
        except Exception as e:  # noqa: BLE001 -- raised below, once every rank knows it
            error = e
    # a start rank 0 refused ends every rank alike (else the others train into their first
    # collective and wait there); and the samplers write into the tracking directory, which
    # rank 0 may have just moved aside for a new run: they start after it
    refused = gather(None if error is None else one_line(error), world_size)[0]
    if error is not None:
        raise error
    if refused is not None:
        raise agreed(TrackingError(refused))
    if t.system_metrics and first_of_node():
        tracker.sampler = _sampler(t, output_dir, hosts)
    return tracker


def _sampler(t, output_dir: os.PathLike | str, hosts: Sequence[str]) -> Optional[NodeSampler]:
    """This node's system-metrics sampler; None, with a warning, where it cannot start (a full
    disk, say): training goes on without it."""
    host = socket.gethostname()
    try:
        return NodeSampler(Path(output_dir) / TRACKING_DIR, output_dir,
                           t.system_metrics_every_s, prefix_for(host, hosts), host)
    except Exception as e:  # noqa: BLE001 -- never the reason a run does not start
        log.warning("system metrics of %s not sampled (%s); training goes on", host,
                    one_line(e))
        return None


def _rank0_tracker(cfg, stage: str, output_dir: os.PathLike | str, *, world_size: int,
                   hosts: Iterable[str], ds_config: Optional[dict], run_id: Optional[str],
                   resumed_at: Optional[int], dataset: Optional[str],
                   extra_tags: Optional[Mapping[str, str]],
                   resolved: Optional[Mapping[str, object]], changed: Iterable[str],
                   set_aside: Optional[Path] = None):
    t = cfg.tracking
    from pretrain.cli import REPO_ROOT
    from pretrain.config_files import to_yaml

    t0 = time.perf_counter()
    track_dir = Path(output_dir) / TRACKING_DIR
    earlier = RunState.load(track_dir) if (track_dir / STATE).is_file() else None
    replaced = None  # the earlier run here, which this one replaces (Remote.settle_earlier)
    if resumed_at is None and earlier is not None:
        replaced = _set_aside(track_dir)
        earlier = None
    if set_aside is not None and (set_aside / TRACKING_DIR / STATE).is_file():
        moved = RunState.load(set_aside / TRACKING_DIR)  # (its output_dir tag names set_aside)
        replaced = moved if moved.run_id else replaced
    original = _copied_from(earlier, output_dir) if resumed_at is not None else None
    if original is not None:  # its records are the original's, which still has them
        copied_run = earlier.run_id
        track_dir.rename(track_dir.with_name(f"{TRACKING_DIR}-of-the-original-{int(time.time())}"))
        # (which of the two folders was copied, which moved, no file tells: the run stays in
        # the folder where it last ran, which its tag output_dir names)
        log.info("output_dir %s holds a copy of the run in %s, which goes on in its MLflow run "
                 "%s (where that run last ran): %s gets a run of its own from step %d (tag "
                 "copied_from)", output_dir, original, copied_run, output_dir, resumed_at)
        earlier, run_id = None, None
        extra_tags = {**(extra_tags or {}), "copied_at_step": str(resumed_at),
                      **({"copied_from": copied_run} if copied_run else {})}
    track_dir.mkdir(parents=True, exist_ok=True)
    uri = resolve_uri(t.uri)
    if earlier is not None:  # a resumed job: same run, whether it exists in MLflow yet or not
        state = earlier
        state.uri = uri
        # the checkpoint's run, unless it was found deleted and replaced since it was written
        # (a copy's checkpoints name the original's run until it writes its own: a relaunch
        # after a crash before then stays in the copy's)
        state.run_id = run_id if run_id and run_id not in (*earlier.gone, earlier.copied_from) \
            else earlier.run_id
        state.tags.update(_resumed_job_tags(state.tags, world_size, hosts, resumed_at))
        _follow_a_move(state, output_dir)
        # every relaunch counts, a SIGKILL's too (stop.count counts the stops asked for)
        state.tags["jobs"] = str(int(state.tags.get("jobs") or 1) + 1)
        if t.run_name and t.run_name != state.run_name:
            state.run_name = state.rename_to = t.run_name
        changed = list(changed)
        if changed:
            said = [*filter(None, state.tags.get("config.changed", "").split(" | ")),
                    f"from step {resumed_at}: {'; '.join(changed)}"]
            while len(said) > 1 and len(" | ".join(said)) > MAX_TAG_CHARS:
                said.pop(0)  # the oldest relaunch's changes: its resume_step_N/ still has them
            state.tags["config.changed"] = " | ".join(said)[-MAX_TAG_CHARS:]
            # a param cannot change in MLflow: what a changed key is now, as a tag Compare can
            # show beside the params ("optimizer.lr: 0.002 -> 0.0005", check_same_run's form)
            for change in changed:
                key, _, values = change.partition(": ")
                state.tags[CONFIG_NOW + key] = values.rpartition(" -> ")[2][:MAX_TAG_CHARS]
    else:
        dataset = dataset or dataset_name(cfg.data.root)
        tags = {"stage": stage, "model": cfg.model.name,
                "dataset": dataset, **_job_tags(world_size, hosts), "jobs": "1",
                "output_dir": str(Path(output_dir).resolve()),
                **git_info(REPO_ROOT), **source_tags(), **(extra_tags or {})}
        _nest_only_in_the_same_store(tags, uri)
        params = flatten(cfg.model_dump(mode="json"))
        for key in cfg.optimizer.unused():  # the other optimizer's: clutter in Compare
            params.pop(f"optimizer.{key}", None)
        params.update({k: str(v) for k, v in (resolved or {}).items()
                       if params.get(k) == "None"})
        # how the run is watched and launched, not what it trains: differences in Compare that
        # say nothing of the results (config.yaml, an artifact of the run, keeps them)
        params = {k: v for k, v in params.items() if not k.startswith(NOT_PARAMS)}
        # a password in a URL (tracking.uri's database, data.root's server) is no one's
        # business in the UI
        params = {k: redacted(v) if isinstance(v, str) else v for k, v in params.items()}
        if ds_config is not None and "deepspeed.zero_stage" in params:
            # the stage the run used, given by deepspeed.zero_stage, its file, or the default
            from pretrain.deepspeed_json import zero_stage
            params["deepspeed.zero_stage"] = str(zero_stage(ds_config))
        state = RunState(uri=uri, experiment=t.experiment, run_id=run_id,
                         copied_from=copied_run if original is not None else None,
                         start_time=int(time.time() * 1000),
                         run_name=t.run_name or Path(output_dir).resolve().name,
                         params=params, tags=tags)
    tracker = MlflowTracker(track_dir, state, flush_every_s=t.flush_every_s,
                            close_timeout_s=t.close_timeout_s, earlier=replaced)
    # a resumed job's config (when it changed a setting) and DeepSpeed config go next to the
    # first ones
    prefix = "" if resumed_at is None else f"resume_step_{resumed_at:08d}/"
    config_text = redacted(to_yaml(cfg))
    if earlier is None or changed:  # a run this job made (its first), or one it changed
        tracker.log_artifact_bytes(prefix + "config.yaml", config_text.encode())
    if ds_config is not None:
        tracker.log_artifact_bytes(prefix + "deepspeed_config.json",
                                   json.dumps(ds_config, indent=1, default=str).encode())
    tracker.log_artifact_bytes(prefix + "environment.json",
                               json.dumps(environment(), indent=1).encode())
    tracker.seconds_setup += time.perf_counter() - t0
    log.info("tracking to MLflow at %s (experiment '%s'%s)", redacted(uri), state.experiment,
             f", run {state.run_id}" if state.run_id else "")
    return tracker


def _copied_from(state: Optional[RunState], output_dir) -> Optional[str]:
    """The output_dir this one was copied from (``cp -a run run2``, to branch a run off at a
    checkpoint), where that one still holds the same MLflow run: both would log into it. None
    for the run's own output_dir, moved or mounted at another path."""
    there = state.tags.get("output_dir") if state is not None else None
    if not there:
        return None
    try:  # (the folders: a copy's files may be hard links to the original's, cp -al)
        if os.path.samefile(there, output_dir):
            return None
        return there if RunState.load(Path(there) / TRACKING_DIR).run_id == state.run_id \
            else None
    except (OSError, ValueError, TypeError):  # gone (moved here), unreadable: not a copy
        return None


def _follow_a_move(state: RunState, output_dir) -> None:
    """A run resumed in a folder other than the one its tag output_dir names (moved there, and
    not a copy: _copied_from) now lives here: the tag follows it, in tracking/run.json and in
    MLflow. Left naming the old place, a copy of this folder made later would not be told
    from it (the place gone: both logged into this run), and one copied back to the old
    place (``mv run old``, relaunched in old, ``cp -a old run``) would pass for the original
    while this folder, where the run went on, was taken for the copy."""
    there, here = state.tags.get("output_dir"), str(Path(output_dir).resolve())
    if not there or there == here:
        return
    with contextlib.suppress(OSError):
        if os.path.samefile(there, output_dir):  # the same folder by another path (a mount)
            return
    state.tags["output_dir"] = here
    log.info("output_dir %s holds the run that was in %s: its tag output_dir names this folder "
             "now", here, there)


def _nest_only_in_the_same_store(tags: dict, uri: str) -> None:
    """A parent run in another MLflow store than this run's (a pretraining logged to a team
    server, a fine-tune to a local database) is none this store can show: the link would
    point to nothing, without a word."""
    parent, there = tags.get("mlflow.parentRunId"), tags.get(PARENT_STORE)
    if parent and there and there != redacted(uri):
        del tags["mlflow.parentRunId"]
        log.warning("the pretraining run %s is in MLflow at %s, this run goes to %s: not nested "
                    "under it (its tag pretrain.run_id names it); tracking.uri=%s puts the two "
                    "together", parent, there, redacted(uri), there)


def _job_tags(world_size: int, hosts: Iterable[str]) -> dict:
    hosts = sorted(set(hosts))
    return {"world_size": str(world_size), "hosts": ",".join(hosts)[:4000],
            "num_hosts": str(len(hosts))}


def _resumed_job_tags(tags: Mapping[str, str], world_size: int, hosts: Iterable[str],
                      resumed_at: int) -> dict:
    """The ranks and hosts of the job now running the run (a requeued job may get other nodes,
    or fewer); where the number of ranks changed, ``world_size.history`` says from which step
    each ran (``8@0,4@1200``): throughput figures compare only within one stretch."""
    new = _job_tags(world_size, hosts)
    if tags.get("world_size") not in (None, new["world_size"]):
        history = tags.get("world_size.history") or f"{tags['world_size']}@0"
        new["world_size.history"] = f"{history},{world_size}@{resumed_at}"
    return new


def _set_aside(track_dir: Path) -> Optional[RunState]:
    """A fresh run in an output_dir that held another: keep the old spool if it still has
    undelivered records (upload_spool.py sends those too), else start clean. An earlier run
    whose job never ended it is marked FAILED (upload_spool.py ends it so) and returned when it
    exists in MLflow, for the new run's tracker to end it there."""
    import shutil
    held = lock(track_dir)
    if held is None:
        raise TrackingError(f"{track_dir} is in use by another process (a job still running "
                            f"there, or upload_spool.py); relaunch once it has ended")
    try:
        state = RunState.load(track_dir)
        abandoned = None
        if state.ended is None:  # its job was killed without a word, before any checkpoint
            state.ended = "FAILED"
            state.end_tags["stop.reason"] = ("its job died before its first checkpoint; the "
                                             "relaunch started a new run")
            state.save(track_dir)
            abandoned = state if state.run_id else None
        left = undelivered(track_dir)
        if left:
            aside = track_dir.with_name(f"{TRACKING_DIR}.{time.strftime('%Y%m%d-%H%M%S')}")
            log.warning("%s holds %d undelivered records of an earlier run; moved to %s",
                        track_dir, left, aside)
            track_dir.rename(aside)
        else:
            shutil.rmtree(track_dir)
    finally:
        held.close()
    return abandoned


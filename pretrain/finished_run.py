"""A run that finished: relaunched, it does nothing.

Once a run did its last step and its end (the stage's evaluations and exports) and ended its
MLflow run, rank 0 writes :data:`FINISHED` in output_dir: the step, the time, a digest of the
settings, the figures. A relaunch with the same settings (a requeue after the end, the same
command run again) then says so in one line and exits 0, where it would do the end again
(minutes of export at ViT-H, a whole test split) and reopen its MLflow run. A run whose end was
cut short (a signal, a crash) has no such file; a relaunch with other settings
(``tracking.register_as`` given now, say) removes it and does the end again with them, and so
does any relaunch that trains on: the file is only ever the last end's.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Optional

from pretrain.config import RunConfig
from pretrain.distributed import broadcast_from_0, rank_world
from pretrain.run_dir import HOW_LAUNCHED
from pretrain.run_info import flatten

log = logging.getLogger(__name__)

FINISHED = "finished.json"


def settings_digest(cfg: RunConfig) -> str:
    """What a run does, not how it was launched (a digest: tracking.uri may hold a password,
    which config.yaml keeps to itself). Paths are taken as ``check_same_run`` takes them: an
    existing file or folder by where it leads (a trailing slash, a relative spelling), one in
    output_dir relative to it (a run moved or copied elsewhere)."""
    root = os.path.realpath(cfg.output_dir)

    def as_set(value: str) -> str:
        if not value or not os.path.exists(value):
            return value
        value = os.path.realpath(value)
        inside = value == root or value.startswith(root + os.sep)
        return "<output_dir>" + value[len(root):] if inside else value
    flat = flatten(cfg.model_dump(mode="json"))
    kept = sorted((k, as_set(v)) for k, v in flat.items() if k not in HOW_LAUNCHED)
    return hashlib.sha256(json.dumps(kept).encode()).hexdigest()[:16]


def read_finished(out: Path) -> Optional[dict]:
    """:data:`FINISHED`'s record, None when there is none (or it cannot be read: the end is
    done again, no harm). Rank 0 reads; every rank gets it (collective)."""
    record = None
    if rank_world()[0] == 0:
        try:
            record = json.loads((out / FINISHED).read_text())
        except (OSError, ValueError):
            record = None
    return broadcast_from_0(record if isinstance(record, dict) else None)


def nothing_to_do(record: Optional[dict], cfg: RunConfig, step: int, steps: int) -> bool:
    """Whether a run resumed at ``step`` of ``steps`` has nothing to do: it finished there,
    its end done with these settings."""
    return (record is not None and record.get("step") == step and step >= steps
            and record.get("settings") == settings_digest(cfg))


def forget_finished(out: Path) -> None:
    """Rank 0, when a relaunch acts (trains, or does the end again): until its own end is done
    the run has not finished."""
    try:
        (out / FINISHED).unlink(missing_ok=True)
    except OSError as e:
        log.warning("could not remove %s (%s): a relaunch may take this run for finished "
                    "before its end is done; remove it by hand", out / FINISHED, e.strerror or e)


def mark_finished(out: Path, step: int, cfg: RunConfig, trained: dict, end: dict) -> None:
    """Rank 0, once the run's end is done and its MLflow run ended: :data:`FINISHED`, with the
    last logged figures (``trained``) and the end's own (``end``). A file that cannot be written
    costs only the end done again at a relaunch: a warning."""
    from pretrain.atomic_write import write_atomic

    def numbers(metrics: dict) -> dict:
        return {k: v for k, v in sorted(metrics.items()) if isinstance(v, (int, float))}
    record = {"step": step, "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "settings": settings_digest(cfg), "metrics": numbers(trained),
              "end_metrics": numbers(end)}
    try:
        write_atomic(out / FINISHED, json.dumps(record, indent=1) + "\n", durable=True)
    except OSError as e:
        log.warning("could not write %s (%s): a relaunch here does the run's end again",
                    out / FINISHED, e.strerror or e)


def finished_line(out: Path, record: dict) -> str:
    """What a relaunch of a finished run says, and how to make it do something."""
    from pretrain.mlflow_delivery import lacking
    from pretrain.spool import TRACKING_DIR, RunState, undelivered

    figures = "".join(f"; {k} {v:.4f}" for k, v in {**record.get("metrics", {}),
                                                    **record.get("end_metrics", {})}.items()
                      if k.endswith(("/top1", "/top5")))
    track = out / TRACKING_DIR
    try:
        state, records = RunState.load(track), undelivered(track)
        unsent = lacking(track, state, f"{records} metric records" if records else "")
    except (OSError, ValueError, TypeError):  # no tracking, or its files unreadable
        unsent = []
    return (f"the run in {out} finished: its {record['step']} steps and its end on "
            f"{record.get('finished', '?')}{figures}. Nothing to do: set train.total_steps "
            f"above {record['step']} to train on, set another output_dir for a new run, or "
            f"delete {out / FINISHED} to do its end (evaluations, exports) again (a relaunch "
            f"with other settings does it with those)" + (
                f"; MLflow still lacks {', '.join(unsent)}: `python launch/upload_spool.py "
                f"{out}` sends them" if unsent else ""))

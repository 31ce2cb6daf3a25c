"""The run that produced a model file: its ``output_dir`` (whose ``config.yaml`` gives the
settings the run evaluated it with, whose ``metrics.jsonl`` the figures it reported) and its
MLflow run (``output_dir/tracking/run.json``). :mod:`pretrain.model_files` finds the candidates
from where a file lies and what it carries; this module decides which of them is its run."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from pretrain.model_files import ModelFile

log = logging.getLogger(__name__)

RUN_CONFIG = "config.yaml"


def run_config_at(run_dir: Path) -> dict:
    """The config.yaml of the run whose output_dir run_dir is, as plain data ({} if none)."""
    import yaml
    try:
        data = yaml.safe_load((run_dir / RUN_CONFIG).read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def launch_dir(run_dir: Path, output_dir) -> Optional[Path]:
    """The folder a run was launched in, where its relative ``output_dir`` is how ``run_dir``
    ends (``runs/demo`` of ``/home/me/vitscale/runs/demo``); None where that cannot be told."""
    if not output_dir or os.path.isabs(output_dir):
        return None
    parts = [p for p in Path(output_dir).parts if p != "."]
    full = Path(os.path.abspath(run_dir))
    if not parts or ".." in parts or list(full.parts[-len(parts):]) != parts:
        return None
    return full.parents[len(parts) - 1]


def attach_run(mf: ModelFile, *candidates: Path) -> None:
    """The first candidate holding a run's config.yaml is the producing run's output_dir."""
    for d in candidates:
        cfg = run_config_at(d)
        if cfg:
            mf.run_dir = d
            mf.run_config = mf.run_config or cfg
            return


def same_run(folder: Path, folder_config: dict, config: dict, run_id: Optional[str]) -> bool:
    """Whether ``folder``, holding ``folder_config``, is the output_dir of the run whose config
    a file carries: the same MLflow run where both name one, else the same model, init, dataset
    and normalisation (what a run resumed there keeps; a run moved whole is still its run)."""
    if not folder_config:
        return False
    state = run_state(folder)
    if run_id and state is not None and state.run_id:
        return state.run_id == run_id
    data = [(c.get("data") or {}) for c in (folder_config, config)]
    return all(folder_config.get(k) == config.get(k) for k in ("model", "init")) and all(
        data[0].get(k) == data[1].get(k) for k in ("root", "normalize"))


def run_state(run_dir: Path):
    """The run's ``tracking/run.json`` (its MLflow run), or None."""
    from pretrain.spool import STATE, TRACKING_DIR, RunState

    if not (run_dir / TRACKING_DIR / STATE).is_file():
        return None
    try:
        return RunState.load(run_dir / TRACKING_DIR)
    except (OSError, ValueError, TypeError) as e:
        log.info("cannot read %s (%s)", run_dir / TRACKING_DIR / STATE,
                 (str(e).strip().splitlines() or [type(e).__name__])[0])
        return None


def find_source_run(mf: ModelFile) -> None:
    """The MLflow run the model came from and where it is: the run id the model carries, else
    its run_dir's; the address only where the run_dir's run is that run."""
    state = run_state(mf.run_dir) if mf.run_dir is not None else None
    if state is None:
        return
    if mf.source_run_id is None:
        mf.source_run_id = state.run_id
    if state.run_id and state.run_id == mf.source_run_id:
        mf.source_uri = state.uri

"""The fault suite: faults injected into real 2-rank DeepSpeed runs of the tiny demo, and what
must come out of each -- the same losses and samples as an uninterrupted run, a clear error, or
a counted skip; never a silent wrong result. ``tests/faulty_pretrain.py`` injects faults from
inside the ranks (SIGKILL at a step or mid-checkpoint, failing writes, NaN forward passes); the
rest are made from the outside (a full filesystem, damaged shards, a tracking server answering
HTTP 500, bad configuration). Each test adds its counts to the summary line printed at the end.

    python -m pytest -m faults                # this group (+ the tracking outage and untrusted-file tests)
    python -m pytest -m slow                  # the longer variants: more kills
"""
import contextlib
import errno
import io
import json
import math
import pickle
import random
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from mlflow import MlflowClient

from conftest import REPO, deepspeed_cmd, run_deepspeed, tiny_run_args
from pretrain.checkpoint import CheckpointStore
from pretrain.metrics import read_jsonl

pytestmark = pytest.mark.faults

FAULTY = REPO / "tests" / "faulty_pretrain.py"
STEPS, EVERY = 20, 5  # 16 samples a step: 1.25 epochs of the 256 training samples


def run_args(out, data, *extra):
    return tiny_run_args(out, data, f"train.total_steps={STEPS}", f"checkpoint.every_steps={EVERY}",
                         "eval.every_steps=10", f"debug.log_sample_keys={out / 'keys'}", *extra)


def faulty(out, data, *extra, faults=None, fails=False, env=None):
    """One 2-rank launch with ``faults`` injected; returns its combined output."""
    proc = run_deepspeed(2, *run_args(out, data, *extra), script=FAULTY, fails=fails,
                         env={"FAULTS": json.dumps(faults or {}), **(env or {})})
    return proc.stdout + proc.stderr


def resumed_at(text):
    return [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", text)]


def last_values(out, key="train/loss"):
    """{step: value} from metrics.jsonl; a step logged again after a resume keeps the later value."""
    return {r["step"]: r[key] for r in read_jsonl(out / "metrics.jsonl") if key in r}


def keys(out):
    return [(out / "keys" / f"rank{r}.txt").read_text().split() for r in (0, 1)]


def error_lines(text):
    return sorted({line for line in text.splitlines() if line.startswith("error: ")})


def compare_with(reference, out):
    """(samples lost, metrics lost) against the uninterrupted run; both must be 0, and every
    loss and held-out figure must be the same bit for bit (deterministic CPU kernels)."""
    ref_keys, got_keys = keys(reference), keys(out)
    lost = sum(len(set(a) - set(b)) for a, b in zip(ref_keys, got_keys))
    assert got_keys == ref_keys, "the consumed samples differ from the uninterrupted run's"
    missing = 0
    for key in ("train/loss", "eval/demo_val/top1"):
        want, got = last_values(reference, key), last_values(out, key)
        missing += len(set(want) - set(got))
        assert got == want, key  # exact: same samples, same order, same dropout draws
    return lost, missing


def mlflow_steps_lost(out, key="train/loss"):
    """Steps of ``key`` the run's MLflow run does not hold exactly once (the default store)."""
    import os
    run_id = json.loads((out / "tracking/run.json").read_text())["run_id"]
    history = MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_metric_history(run_id, key)
    steps = [m.step for m in history]
    assert sorted(steps) == sorted(set(steps)), f"{key}: a step twice in MLflow"
    return len(set(last_values(out, key)) - set(steps))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_data):
    out = tmp_path_factory.mktemp("reference") / "run"
    run_deepspeed(2, *run_args(out, tiny_data))
    return out


# --------------------------------------------------------------------------------------------
# 1 + 2. SIGKILL of one rank at random steps, and in the middle of writing a checkpoint
# --------------------------------------------------------------------------------------------
def kill_plan(seeds):
    """One kill per seed (a random rank, a random step after the first checkpoint), each in its
    own stretch of the run so every relaunch has something left to die in; plus one kill while
    checkpoint 10 is being written."""
    plan = [("kill_in_save", random.Random(-1).randrange(2), 10)]
    bounds = [EVERY + round(i * (STEPS - EVERY) / len(seeds)) for i in range(len(seeds) + 1)]
    for seed, lo, hi in zip(seeds, bounds, bounds[1:]):
        rng = random.Random(seed)
        plan.append(("kill", rng.randrange(2), rng.randrange(lo, hi)))
    return sorted(plan, key=lambda f: (f[2], f[0] == "kill"))


@pytest.mark.parametrize("seeds", [
    pytest.param((0, 1), id="2-kills"),
    pytest.param(tuple(range(2, 8)), id="6-kills", marks=pytest.mark.slow),
])
def test_sigkill_of_one_rank_anywhere_resumes_to_the_same_losses_and_samples(
        seeds, tmp_path, tiny_data, reference, fault_ledger):
    out = tmp_path / "run"
    plan = kill_plan(seeds)
    texts = []
    for kind, rank, step in plan:
        texts.append(faulty(out, tiny_data, faults={kind: [rank, step]}, fails=True))
        assert "exits with return code = -9" in texts[-1], texts[-1][-2000:]
        assert not (out / f"checkpoints/step_{STEPS:08d}/COMPLETE.json").exists()
        if kind == "kill_in_save":  # that rank's part never made it: no manifest
            assert not (out / f"checkpoints/step_{step:08d}/COMPLETE.json").exists()
    texts.append(faulty(out, tiny_data))
    resumed = [resumed_at(t) for t in texts[1:]]
    print(f"\nfaults (kind, rank, step): {plan}; the relaunches resumed at {resumed}")
    assert all(len(r) == 1 for r in resumed)  # every relaunch resumed from a checkpoint
    after_save_kill = texts[[k for k, _, _ in plan].index("kill_in_save") + 1]
    assert "step_00000010: no COMPLETE.json (a save was interrupted)" in after_save_kill
    assert resumed_at(after_save_kill) == [5]  # the one before the partial checkpoint
    samples_lost, metrics_lost = compare_with(reference, out)
    metrics_lost += mlflow_steps_lost(out)
    assert metrics_lost == 0
    fault_ledger.record(len(plan), len(plan), samples_lost, metrics_lost)


# --------------------------------------------------------------------------------------------
# 3. A full disk, and a failing write, while a checkpoint is written
# --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def small_filesystem(path: Path, size: str):
    """A real size-limited filesystem (tmpfs) at ``path`` when this machine lets us mount one
    (root in a container usually can); ``None`` otherwise, and the caller injects the error."""
    path.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        print(f"\nno tmpfs here ({mount.stderr.strip()}): injecting ENOSPC instead")
        yield None
        return
    try:
        yield lambda new_size: subprocess.run(
            ["mount", "-o", f"remount,size={new_size}", str(path)], check=True)
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_full_disk_stops_with_a_clear_error_and_the_relaunch_resumes(
        tmp_path, tiny_data, reference, fault_ledger):
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    # a checkpoint of the tiny run is ~1.8 MB: room for the first one, not for the second
    with small_filesystem(ckpts, "3m") as grow:
        faults = {} if grow else {"write_error": [1, 2 * EVERY, errno.ENOSPC]}
        text = faulty(out, tiny_data, faults=faults, fails=True)
        assert "exits with return code = 3" in text
        [line] = error_lines(text)  # the same one line from both ranks
        assert f"checkpoint {ckpts}/step_00000010 could not be written" in line
        assert f"{ckpts}/step_00000005 is intact" in line and "relaunch" in line
        if grow:
            assert "the disk holding it is full" in line
        assert "Traceback" not in text
        assert not (ckpts / "step_00000010").exists()  # the partial one is gone
        assert [c.step for c in CheckpointStore(ckpts).complete()] == [5]

        if grow:
            grow("64m")  # the operator frees space
        again = faulty(out, tiny_data)
    assert resumed_at(again) == [5]
    samples_lost, metrics_lost = compare_with(reference, out)
    fault_ledger.record(1, 1, samples_lost, metrics_lost + mlflow_steps_lost(out))


def test_a_failing_write_with_on_write_error_continue_trains_on_and_saves_later(
        tmp_path, tiny_data, reference, fault_ledger):
    out = tmp_path / "run"
    text = faulty(out, tiny_data, "checkpoint.on_write_error=continue",
                  faults={"write_error": [1, 2 * EVERY, errno.EIO]})
    assert "step_00000010 could not be written: rank 1: OSError: [Errno 5]" in text
    assert "training goes on and tries again at step 15" in text
    assert [c.step for c in CheckpointStore(out / "checkpoints").complete()] == [20, 15, 5]
    assert last_values(out, "checkpoint/failed_saves")[STEPS] == 1
    samples_lost, metrics_lost = compare_with(reference, out)  # the failure changed nothing
    fault_ledger.record(1, 1, samples_lost, metrics_lost)

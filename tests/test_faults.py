"""The fault suite: faults injected into real 2-rank runs of the tiny demo -- pretraining under
the DeepSpeed launcher; fine-tuning under torchrun and under Accelerate's DeepSpeed in
``test_faults_finetune.py``, which shares this file's helpers -- and what must come out of each: the same losses and samples as an uninterrupted run,
a clear error, or a counted skip; never a silent wrong result. ``tests/faulty_launch.py``
injects faults from inside the ranks (SIGKILL at a step or mid-checkpoint, failing or slow
writes, NaN forward passes); the rest are made from the outside (signals to the process group
or the launcher, a full filesystem, damaged shards, a tracking server answering HTTP 500). Each test adds its counts to the summary line printed at
the end: faults injected, and runs recovered -- relaunched, resumed and finished.

    python -m pytest -m "faults and not slow"   # the group (+ the outage, untrusted-file tests)
    python -m pytest -m slow                    # the longer variants: more kills
"""
import contextlib
import errno
import io
import json
import math
import os
import pickle
import random
import re
import shutil
import signal
import socket
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
import torch
from mlflow import MlflowClient

from conftest import (REPO, deepspeed_cmd, free_port, run_deepspeed, run_launcher,
                      tiny_run_args, wait_until)
from pretrain.checkpoint import CheckpointStore
from pretrain.metrics import read_jsonl

pytestmark = pytest.mark.faults

FAULTY = REPO / "tests" / "faulty_launch.py"
STEPS, EVERY = 20, 5  # 16 samples a step: 1.25 epochs of the 256 training samples


def run_args(out, data, *extra):
    # MLflow's system metrics cost each launch seconds; the tracking tests keep them on.
    # Stochastic depth on: its masks come from torch's global generator, which a resume must
    # leave exactly where an uninterrupted run has it (making a loader iterator took a draw).
    return tiny_run_args(out, data, f"train.total_steps={STEPS}", f"checkpoint.every_steps={EVERY}",
                         "eval.every_steps=10", f"debug.log_sample_keys={out / 'keys'}",
                         "tracking.system_metrics=false", "model.drop_path_rate=0.2", *extra)


def faulty(out, data, *extra, faults=None, fails=False, env=None):
    """One 2-rank launch with ``faults`` injected; returns its combined output."""
    proc = run_deepspeed(2, *run_args(out, data, *extra), script=FAULTY, fails=fails,
                         env={"FAULTS": json.dumps(faults or {}), **(env or {})})
    return proc.stdout + proc.stderr


def resumed_at(text):
    return [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", text)]


def last_values(out, key="train/loss"):
    """{step: value} from metrics.jsonl; a step logged again after a resume keeps its last value."""
    return {r["step"]: r[key] for r in read_jsonl(out / "metrics.jsonl") if key in r}


def keys(out):
    return [(out / "keys" / f"rank{r}.txt").read_text().split() for r in (0, 1)]


def error_lines(text):
    return sorted({line for line in text.splitlines() if line.startswith("error: ")})


def compare_with(reference, out, evals=("eval/demo_val/top1",)):
    """(samples lost, metrics lost) against the uninterrupted run; both must be 0, and every
    loss and held-out figure must be the same bit for bit (deterministic CPU kernels)."""
    ref_keys, got_keys = keys(reference), keys(out)
    lost = sum(len(set(a) - set(b)) for a, b in zip(ref_keys, got_keys))
    assert got_keys == ref_keys, "the consumed samples differ from the uninterrupted run's"
    missing = 0
    for key in ("train/loss", *evals):
        want, got = last_values(reference, key), last_values(out, key)
        assert want, f"the reference run logged no {key}"
        missing += len(set(want) - set(got))
        assert got == want, key  # exact: same samples, same order, same dropout draws
    return lost, missing


def mlflow_steps_lost(out, key="train/loss"):
    """Steps of ``key`` the run's MLflow run does not hold exactly once (the default store)."""
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


def test_only_the_newest_keep_last_checkpoints_are_kept(reference):
    # checkpoint.keep_last=3 (the default) of the four saves at steps 5, 10, 15 and 20
    ckpts = reference / "checkpoints"
    assert [c.step for c in CheckpointStore(ckpts).complete()] == [20, 15, 10]
    # the default command's ZeRO-1 run on two ranks (test_zero_stage_trains_on_two_ranks[1] is
    # a slow variant): its stage and world size in every manifest, which resume relies on
    assert {(c.zero_stage, c.world_size) for c in CheckpointStore(ckpts).complete()} == {(1, 2)}
    assert sorted(d.name for d in ckpts.iterdir() if d.name.startswith("step_")) == [
        "step_00000010", "step_00000015", "step_00000020"]


def test_a_finished_run_relaunched_on_fewer_ranks_does_nothing_or_only_its_end(
        reference, tmp_path, tiny_data):
    """A run relaunched after its last step and its end (a requeue after the finish, the same
    command again) does nothing: its MLflow run is left as it ended, not reopened. With other
    settings (as without its finished.json: an end cut short) the relaunch trains nothing and
    does the end again; on another world size its checkpoint is not converted to DeepSpeed's universal layout first
    (a checkpoint-sized copy left behind, minutes at ViT-H), and the MLflow run it wrote to is
    the one it reopens."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    # the reference's run, as if made here: a copy whose original still holds its MLflow run
    # would branch off into a run of its own (pretrain/tracking.py)
    state = json.loads((out / "tracking/run.json").read_text())
    state["tags"]["output_dir"] = str(out)
    (out / "tracking/run.json").write_text(json.dumps(state))
    losses = last_values(out)
    run_id = state["run_id"]
    ended = MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_run(run_id)
    finished = json.loads((out / "finished.json").read_text())
    assert finished["step"] == STEPS and finished["metrics"]["train/loss"] == losses[STEPS]
    plan = run_launcher("pretrain.py", "--dry-run", "--world-size", "1",
                        *run_args(out, tiny_data))
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert f"resume: nothing to do, the run in {out} finished at step {STEPS} on " \
           f"{finished['finished']}" in plan.stdout, plan.stdout[-2000:]
    proc = run_deepspeed(1, *run_args(out, tiny_data))
    text = proc.stdout + proc.stderr
    assert f"the run in {out} finished: its {STEPS} steps and its end on " \
           f"{finished['finished']}" in text and "Nothing to do" in text, text[-3000:]
    assert "resumed from" not in text and "tracking to MLflow" not in text, text[-3000:]
    again = MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_run(run_id)
    assert (again.info.end_time, again.data.tags) == (ended.info.end_time, ended.data.tags)

    other = run_args(out, tiny_data, "log.every_steps=4")  # the end is done again with these
    plan = run_launcher("pretrain.py", "--dry-run", "--world-size", "1", *other)
    assert f"resume: from {out}/checkpoints/step_{STEPS:08d} at step {STEPS}: the run has " \
           f"trained its {STEPS} steps, nothing to train" in plan.stdout, plan.stdout[-2000:]
    proc = run_deepspeed(1, *other)
    text = proc.stdout + proc.stderr
    assert f"the run in {out} finished at step {STEPS} with other settings than this " \
           f"relaunch's: its end (evaluations, exports) is done again with these" in text
    assert f"resumed from {out}/checkpoints/step_{STEPS:08d} at step {STEPS}" in text, text[-3000:]
    assert f"the run finished its {STEPS} steps before: nothing to train" in text
    assert "universal" not in text, text[-3000:]
    assert not list((out / "checkpoints").glob("*_universal")), "converted a finished run"
    assert last_values(out) == losses
    assert json.loads((out / "tracking/run.json").read_text())["run_id"] == run_id
    assert MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_run(run_id).info.status == \
        "FINISHED"
    now = json.loads((out / "finished.json").read_text())
    assert now["step"] == STEPS and now["settings"] != finished["settings"]
    # the last step's figures are the run's still; the end's are this end's (pretraining's
    # adds none)
    assert now["metrics"] == finished["metrics"] and now["end_metrics"] == {}

    # a relaunch that trains on has not finished until its own end: killed on the way, the
    # next relaunch must not take it for finished
    faulty(out, tiny_data, f"train.total_steps={STEPS + 5}", faults={"kill": [1, STEPS + 2]},
           fails=True)
    assert not (out / "finished.json").exists()


def test_a_checkpoint_two_ranks_cannot_resume_is_refused_in_one_line(reference, tmp_path,
                                                                       tiny_data):
    """Every rank reads the same manifest and refuses alike: rank 0 alone prints the line."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    proc = run_deepspeed(2, *run_args(out, tiny_data, "deepspeed.config=zero3.json",
                                      f"train.total_steps={STEPS + 2}"), fails=True)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2
    assert error_lines(text) == [
        f"error: {out}/checkpoints/step_{STEPS:08d} cannot be resumed by this job (ZeRO stage "
        f"changed (1 -> 3); DeepSpeed converts a checkpoint between ZeRO-1 and ZeRO-2 only): "
        f"relaunch as it was written (ZeRO-1, 2 ranks, train.precision=fp32), or set "
        f"checkpoint.resume=false to start a new run there (this one is moved aside)"]
    assert text.count("cannot be resumed by this job") == 1, text[-3000:]


def test_a_conversion_rank_0_fails_ends_the_others_at_once_not_after_the_barriers_timeout(
        reference, tmp_path, tiny_data):
    """A resume in bf16 needs the fp32 checkpoint converted; rank 0 converts while rank 1
    waits, and a file where the converted copy goes fails the conversion. Rank 1 leaves at
    once and quietly (it said "a collective failed ... another rank's process is gone ... the
    OOM killer say", wrong); rank 0 says why."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    (out / f"checkpoints/step_{STEPS:08d}_universal").write_text("in the way")
    started = time.monotonic()
    proc = run_deepspeed(2, *run_args(out, tiny_data, "train.precision=bf16",
                                      f"train.total_steps={STEPS + 2}"), fails=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert time.monotonic() - started < 200, "rank 1 waited out a timeout"
    assert f"to a universal checkpoint failed" in text, text[-3000:]
    assert "rank 0 failed" not in text and text.count("Traceback") == 1, text[-3000:]
    assert "another rank's process is gone" not in text, text[-3000:]


@pytest.mark.slow
def test_a_conversion_longer_than_the_process_groups_timeout_is_waited_for(
        reference, tmp_path, tiny_data):
    """Rank 0's conversion takes longer than the process group's timeout (1 minute here, 10 by
    default: a ViT-H's optimizer state takes longer): rank 1 waited in a barrier and crashed at
    the timeout; it waits for the conversion now, and the run resumes. Slow: it waits."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    text = faulty(out, tiny_data, "train.precision=bf16", f"train.total_steps={STEPS + 2}",
                  faults={"slow_convert": 75}, env={"DEEPSPEED_TIMEOUT": "1"})
    assert f"converted to {out}/checkpoints/step_{STEPS:08d}_universal in " in text, text[-3000:]
    assert f"step {STEPS + 2}/{STEPS + 2}" in text, text[-3000:]


# --------------------------------------------------------------------------------------------
# 1 + 2. SIGKILL of one rank at random steps, and in the middle of writing a checkpoint
# --------------------------------------------------------------------------------------------
def kill_plan(seeds):
    """One kill per seed (a random rank, a random step after the first checkpoint), each in its
    own stretch of the run so every relaunch has something left to die in; plus one kill while
    checkpoint 10 is being written."""
    plan = [("kill_in_save", random.Random(sum(seeds)).randrange(2), 10)]
    bounds = [EVERY + round(i * (STEPS - EVERY) / len(seeds)) for i in range(len(seeds) + 1)]
    for seed, lo, hi in zip(seeds, bounds, bounds[1:]):
        rng = random.Random(seed)
        plan.append(("kill", rng.randrange(2), rng.randrange(lo, hi)))
    return sorted(plan, key=lambda f: (f[2], f[0] == "kill"))


@pytest.mark.parametrize("seeds", [
    pytest.param((0,), id="1-kill"),
    pytest.param(tuple(range(2, 8)), id="6-kills", marks=pytest.mark.slow),
])
def test_sigkill_of_one_rank_anywhere_resumes_to_the_same_losses_and_samples(
        seeds, tmp_path, tiny_data, reference, fault_ledger):
    out = tmp_path / "run"
    plan = kill_plan(seeds)
    texts = []
    for kind, rank, step in plan:
        texts.append(faulty(out, tiny_data, faults={kind: [rank, step]}, fails=True))
        # DeepSpeed's launcher names the first failed rank it polls: the killed one (-9), or
        # the survivor when its one-line exit (1) came first
        assert re.search(r"exits with return code = (-9|1)\b", texts[-1]), texts[-1][-2000:]
        # the rank that lived on says why it ends in one line, not with the collective's
        # traceback (every surviving rank printed one)
        assert "Traceback" not in texts[-1] and re.search(
            r"error: (rank \d: a collective failed, .*: another rank's process is gone; |"
            r"SIGTERM received while another rank is gone)", texts[-1]), texts[-1][-3000:]
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
    fault_ledger.record(len(plan), 1, samples_lost, metrics_lost)  # resumed and finished


def test_a_step_saved_again_after_a_killed_save_holds_only_the_new_saves_files(
        tmp_path, tiny_data):
    """Rank 0 killed as it writes checkpoint 10 leaves rank 1's part of it; the relaunch on one
    rank saves step 10 again. Only that save's files are in it (rank 1's old optimizer shard
    was listed in its manifest, and a relaunch on two ranks failed converting it)."""
    out = tmp_path / "run"
    faulty(out, tiny_data, faults={"kill_in_save": [0, 10]}, fails=True)
    step_10 = out / "checkpoints" / f"step_{10:08d}"
    assert list(step_10.glob("zero_pp_rank_1_*"))  # the killed save's part
    proc = run_deepspeed(1, *run_args(out, tiny_data, "train.total_steps=10"))
    assert resumed_at(proc.stdout + proc.stderr) == [5]
    listed = json.loads((step_10 / "COMPLETE.json").read_text())["files"]
    assert not [f for f in listed if "rank_1" in f] and not list(step_10.glob("*rank_1_*"))
    again = faulty(out, tiny_data)  # two ranks: the one-rank checkpoint converted
    assert resumed_at(again) == [10], again[-3000:]


# --------------------------------------------------------------------------------------------
# 3. A full disk, and a failing write, while a checkpoint is written
# --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def small_filesystem(path: Path, size: str):
    """A real size-limited filesystem (tmpfs) at ``path`` when this machine lets us mount one
    (root in a container usually can); ``None`` otherwise, and the caller injects the error."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                               capture_output=True, text=True)
        why = mount.stderr.strip() if mount.returncode else None
    except FileNotFoundError:
        why = "no mount command"
    if why is not None:
        print(f"\nno tmpfs here ({why}): injecting ENOSPC instead")
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


def test_a_checkpoint_stopped_by_a_file_size_limit_is_not_blamed_on_a_full_disk(tmp_path,
                                                                                 tiny_data):
    """A quota or ``ulimit -f`` on a disk with room: torch's writer loses the cause ("unexpected
    pos ..."), and the line said the GiB free there and "Free space": it names the limit now."""
    import resource
    limit = 512 * 1024  # the model's file fits, the optimizer state's does not

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    proc = subprocess.run([sys.executable, str(REPO / "launch/pretrain.py"),
                           *run_args(tmp_path / "run", tiny_data, "tracking.enabled=false")],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          preexec_fn=limited)
    assert proc.returncode == 3, proc.stderr[-3000:]
    [line] = error_lines(proc.stdout + proc.stderr)
    assert f"step_{EVERY:08d} could not be written: " in line and "GiB free there, so a quota, " \
        "the inodes (`df -i`) or a file-size limit may have stopped it (`ulimit -f`: 0.5 MiB " \
        "here)" in line, line
    assert line.endswith("Free space or inodes, raise the quota or the limit, or move "
                         "output_dir, then relaunch: it resumes from the newest complete "
                         "checkpoint"), line


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
    fault_ledger.record(1, 0, samples_lost, metrics_lost)  # never stopped: nothing to resume


# --------------------------------------------------------------------------------------------
# 4. Bad data: garbage, empty and mislabelled samples, a truncated and a missing shard
# --------------------------------------------------------------------------------------------
def _descendants(pid: int) -> list:
    """(process, parent pid, command line) of each process below ``pid`` still there."""
    import psutil
    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            out.append((p, p.ppid(), p.cmdline()))
        except psutil.Error:  # ended meanwhile
            pass
    return out


def test_a_rank_stuck_on_a_hung_filesystem_shows_where_and_ends_and_the_relaunch_resumes(
        tmp_path, tiny_data, reference, fault_ledger):
    """The held-out shards hang when opened (FIFOs nobody writes: a hung NFS mount or object
    store behaves the same), so both ranks' eval loaders at step 10 wait forever. The stall
    watchdog writes the stacks and ends the ranks; `kill -QUIT` on a rank meanwhile shows its
    stacks and ends nothing. With the files back, a relaunch resumes from step 5 exactly."""
    import psutil
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    held_out = sorted(data.glob("tiny-validation-*.tar"))
    for f in held_out:
        shutil.move(f, tmp_path / f.name)
        os.mkfifo(f)
    out, log = tmp_path / "run", tmp_path / "stalled.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen(deepspeed_cmd(2, *run_args(out, data, "train.stall_timeout_s=10")),
                                cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, text=True)
        try:
            wait_until(lambda: 2 * EVERY in last_values(out) if (out / "metrics.jsonl").exists()
                       else False, proc, "step 10, whose held-out evaluation hangs")
            # rank 0, not a process it forked: a loader worker has its command line too, and
            # its own name only once it has started (the held-out loader forks at this step)
            found = [(p, ppid) for p, ppid, cmd in _descendants(proc.pid)
                     if "--local_rank=0" in cmd]
            ranks = [p for p, ppid in found if ppid not in {q.pid for q, _ in found}]
            assert len(ranks) == 1, [p.cmdline() for p in ranks]
            ranks[0].send_signal(signal.SIGQUIT)
            proc.wait(timeout=120)
        finally:
            proc.kill()
    text = log.read_text()
    before, stalled, after = text.partition("] stalled: no batch read, step finished or "
                                            "checkpoint written in ")
    assert stalled, text[-3000:]
    assert "in train\n" in before  # the SIGQUIT dump of rank 0: its main thread is in train()
    assert "in open_shard\n" in after  # the loader worker's stack: stuck opening a shard
    assert re.search(r"\[rank\d\] stalled: rank \d made no progress \(no batch read, step "
                     r"finished or checkpoint written\) in \d+ s, over train.stall_timeout_s=10; "
                     r"its stacks are above. Ending it \(exit code 5\): relaunch the same "
                     r"command to resume from the newest complete checkpoint", after), text[-3000:]
    assert "exits with return code = 5" in text
    workers = [int(pid) for pid in re.findall(r"the stacks of its loader worker (\d+):", text)]
    assert workers and not [pid for pid in workers if psutil.pid_exists(pid)
                            and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert [c.step for c in CheckpointStore(out / "checkpoints").complete()] == [EVERY]
    # the MLflow run does not show RUNNING for a job that is gone: FAILED, saying why (rank 0's
    # own stall, or the launcher's SIGTERM after rank 1 ended first on its stall)
    run = mlflow_run(out)
    assert run.info.status == "FAILED", run.info
    assert re.fullmatch(r"stalled: rank 0 made no progress .* over train.stall_timeout_s=10"
                        r"(; .*)?|"
                        r"SIGTERM received while another rank is gone: no checkpoint can be "
                        r"written", run.data.tags["failure"]), run.data.tags

    for f in held_out:  # the filesystem is back
        f.unlink()
        shutil.move(tmp_path / f.name, f)
    again = faulty(out, data)
    assert resumed_at(again) == [EVERY]
    assert mlflow_run(out).info.status == "FINISHED"  # the same run, resumed to its end
    samples_lost, metrics_lost = compare_with(reference, out)
    fault_ledger.record(1, 1, samples_lost, metrics_lost)


def test_a_stop_the_batch_script_passed_on_while_the_ranks_started_is_not_lost(tmp_path,
                                                                              tiny_data):
    """slurm_job.sh passes the time limit's SIGUSR1 on to a step whose ranks are still
    importing (they inherited it ignored) or not started yet: they trained on to the hard limit.
    The script writes the stop into the job's status file too; the ranks read it once their
    handlers are in place, stop after their first step with a complete checkpoint, exit 4."""
    out, status = tmp_path / "run", tmp_path / "job-status"
    # what the script wrote as it passed SIGUSR1 (10) on, 20 s ago: the grace period counts
    # from then, not from the rank's read
    status.write_text(f"stop 10 {int(time.time()) - 20}\n")
    proc = run_deepspeed(2, *run_args(out, tiny_data, "tracking.enabled=false"), fails=True,
                         env={"VITSCALE_JOB_STATUS": str(status)})
    assert proc.returncode == 4, proc.stderr[-3000:]
    [step] = re.findall(r"stopped: SIGUSR1 received: stopped after step (\d+) with a complete "
                        r"checkpoint", proc.stdout + proc.stderr)
    assert int(step) <= 2 and (out / f"checkpoints/step_{int(step):08d}/COMPLETE.json").is_file()
    [since] = re.findall(r"SIGUSR1: checkpoint written in \S+ s, (\S+) s after the signal",
                         proc.stdout + proc.stderr)
    assert float(since) >= 20, since
    assert status.read_text().splitlines()[-2:] == [f"checkpoint {step}", "exit 4"]
    # a file without the line (a job the script did not stop) changes nothing
    status.write_text("")
    done = run_deepspeed(2, *run_args(tmp_path / "run2", tiny_data, "tracking.enabled=false",
                                      "train.total_steps=3"),
                         env={"VITSCALE_JOB_STATUS": str(status)})
    assert done.returncode == 0 and "exit 0" in status.read_text(), done.stderr[-3000:]


def test_a_frozen_rank_is_named_by_the_rank_that_waited_for_it(tmp_path, tiny_data):
    """Rank 1 freezes after step 7 (SIGSTOP: every thread of it stops, as on a frozen node).
    Rank 0 waits for it in a collective until its own stall watchdog ends it; its stacks show
    only that it waits. Its error names the frozen rank, its host and pid, and the job's status
    file says 5 for the batch script. Then the test ends the frozen process (the node is
    rebooted)."""
    import psutil
    out, log, status = tmp_path / "run", tmp_path / "frozen.log", tmp_path / "job-status"
    named = re.compile(r"rank 1 \(on (\S+), pid (\d+)\) stopped answering \d+\+ s ago: "
                       r"its process is frozen or gone \(a hung node, a kill\), look there first")
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            deepspeed_cmd(2, *run_args(out, tiny_data, "train.stall_timeout_s=10",
                                       "tracking.enabled=false"), script=FAULTY),
            cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "FAULTS": json.dumps({"freeze": [1, 7]}),
                 "VITSCALE_JOB_STATUS": str(status)})
        try:
            wait_until(lambda: named.search(log.read_text()), proc, "rank 0 naming rank 1")
            host, pid = named.search(log.read_text()).groups()
            assert psutil.Process(int(pid)).status() == psutil.STATUS_STOPPED
            os.kill(int(pid), signal.SIGKILL)
            proc.wait(timeout=120)
        finally:
            proc.kill()
    text = log.read_text()
    assert host == socket.gethostname()
    assert re.search(r"\[rank0\] stalled: no batch read, step finished or checkpoint written",
                     text), text[-3000:]
    assert re.search(r"stalled: rank 0 made no progress .* over train.stall_timeout_s=10; its "
                     r"stacks are above; rank 1 \(on \S+, pid \d+\) stopped answering",
                     text), text[-3000:]
    assert "exit 5" in status.read_text().splitlines(), status.read_text()


def _rewrite(shard: Path, change) -> list[str]:
    """Rewrite a tar through ``change(member_name, bytes) -> bytes``; returns its sample keys."""
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(shard, "w") as tar:
        for m, data in members:
            data = change(m.name, data)
            m.size = len(data)
            tar.addfile(m, io.BytesIO(data))
    return list(dict.fromkeys(m.name.rsplit(".", 1)[0] for m, _ in members))


def damaged_copy(src: Path, dst: Path, marker: Path) -> tuple[set, set]:
    """The tiny shards with one fault of each kind; returns (every train key, spoiled keys).
    One sample also carries a ``.pyd`` member whose unpickling would create ``marker``."""
    shutil.copytree(src, dst)
    names = json.loads((dst / "_info.json").read_text())["splits"]["train"]["filenames"]
    everything, spoiled = set(), set()

    def first_sample(suffix, new):
        def change(name, data, first=[]):  # noqa: B006 -- remembers the first key it saw
            first.append(first[0] if first else name.rsplit(".", 1)[0])
            return new if name == f"{first[0]}.{suffix}" else data
        return change

    plan = {0: first_sample("jpg", b"\xff\xd8 these are not the bytes of an image"),
            1: first_sample("jpg", b""),  # a zero-byte member
            3: first_sample("cls", b"three")}  # a label that is not an integer
    for i, name in enumerate(names):
        shard_keys = _rewrite(dst / name, plan.get(i, lambda n, d: d))
        everything |= set(shard_keys)
        if i in plan:
            spoiled.add(shard_keys[0])
        elif i == 2:  # truncated inside the 9th sample's last member: it and all after are gone
            with tarfile.open(dst / name) as tar:
                cut = [m for m in tar.getmembers() if m.name == f"{shard_keys[8]}.json"][0]
            with open(dst / name, "r+b") as f:
                f.truncate(cut.offset_data + 10)
            spoiled |= set(shard_keys[8:])
        elif i == 4:
            (dst / name).unlink()
            spoiled |= set(shard_keys)
        elif i == 5:
            payload = pickle.dumps(_CreatesFile(str(marker)))
            with tarfile.open(dst / name, "a") as tar:  # a member the loader must never unpickle
                info = tarfile.TarInfo(f"{shard_keys[0]}.pyd")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    return everything, spoiled


class _CreatesFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def test_bad_data_is_skipped_and_counted_and_a_missing_shard_stops_the_start(
        tmp_path, tiny_data, fault_ledger):
    data, marker = tmp_path / "damaged", tmp_path / "unpickled"
    everything, spoiled = damaged_copy(tiny_data, data, marker)
    assert len(spoiled) == 3 + 8 + 16

    # one process is enough to be refused (every rank checks the same list of shards)
    refused = run_launcher("pretrain.py", *run_args(tmp_path / "refused", data))
    assert refused.returncode == 2, refused.stderr[-3000:]
    [line] = error_lines(refused.stderr)
    assert line == (f"error: 1 of 16 'train' shard files are missing (tiny-train-000004.tar, 16 "
                    f"samples) in {data}; restore them, or set data.missing_shards=skip to go "
                    f"on without them")
    assert not (tmp_path / "refused" / "checkpoints").exists()  # refused before any work

    out = tmp_path / "run"
    text = faulty(out, data, "data.missing_shards=skip")
    assert "data.missing_shards=skip: their samples are skipped and counted" in text
    consumed = set(keys(out)[0]) | set(keys(out)[1])
    assert not consumed & spoiled  # nothing damaged was trained on
    assert consumed == everything - spoiled  # and every intact sample was (the run is > 1 epoch)
    skipped = last_values(out, "data/skipped_samples")[STEPS]
    assert len(spoiled) <= skipped <= 2 * len(spoiled)  # epoch 0 in full, part of epoch 1
    # by cause, summed over both ranks, and in the end-of-run line
    causes = {c: int(last_values(out, f"data/skipped/{c}").get(STEPS, 0)) for c in
              ("undecodable", "empty", "bad_label", "truncated_shard", "missing_shard")}
    # empty: the zero-byte image, and the stray .pyd member, a sample of its own with no image
    for cause, once in (("undecodable", 1), ("empty", 2), ("bad_label", 1),
                        ("truncated_shard", 8), ("missing_shard", 16)):
        assert once <= causes[cause] <= 2 * once, causes
    assert sum(causes.values()) == skipped
    assert (f"data: {int(skipped)} sample(s) skipped over all ranks: {causes['undecodable']} "
            f"undecodable, {causes['empty']} empty, {causes['bad_label']} bad label, "
            f"{causes['truncated_shard']} truncated shard, {causes['missing_shard']} missing "
            f"shard") in text
    # every rank names the samples it skipped itself
    naming = set(re.findall(r"\[rank(\d)\] (?:skipping sample|shard .* sample\(s\) lost)", text))
    assert naming == {"0", "1"}, text[-3000:]
    assert math.isfinite(last_values(out)[STEPS])
    assert not marker.exists()  # shard contents are never unpickled
    fault_ledger.record(6, 0)  # tolerated, not resumed


# --------------------------------------------------------------------------------------------
# 5. A tracking server that answers HTTP 500
# --------------------------------------------------------------------------------------------
class FlakyProxy(ThreadingHTTPServer):
    """An HTTP front for the real MLflow server that answers 500 to everything while
    ``failing``, and forwards requests once it is not."""

    def __init__(self, upstream: str):
        self.upstream, self.failing, self.failures = upstream, True, 0
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.uri = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _ProxyHandler(BaseHTTPRequestHandler):
    def _relay(self):
        server: FlakyProxy = self.server
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if server.failing:
            server.failures += 1
            status, kind, data = 500, "application/json", b'{"error_code": "INTERNAL_ERROR"}'
        else:
            req = urllib.request.Request(server.upstream + self.path, data=body or None,
                                         method=self.command)
            if self.headers.get("Content-Type"):
                req.add_header("Content-Type", self.headers["Content-Type"])
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    status, kind, data = r.status, r.headers.get("Content-Type"), r.read()
            except urllib.error.HTTPError as e:
                status, kind, data = e.code, e.headers.get("Content-Type"), e.read()
        self.send_response(status)
        self.send_header("Content-Type", kind or "application/octet-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _relay

    def log_message(self, *args):
        """Quiet: the test reads the run's log, not the proxy's."""


def test_a_tracking_server_answering_500_leaves_training_untouched_and_loses_nothing(
        tmp_path, tiny_data, reference, mlflow_server, fault_ledger):
    proxy = FlakyProxy(mlflow_server.uri)
    out, exp = tmp_path / "run", "http500"
    cmd = deepspeed_cmd(2, *run_args(out, tiny_data, f"tracking.experiment={exp}",
                                     "tracking.flush_every_s=0.2", "tracking.system_metrics=true",
                                     "tracking.system_metrics_every_s=0.3"))
    with open(tmp_path / "run.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "MLFLOW_TRACKING_URI": proxy.uri})
        deadline = time.time() + 300

        def sampled():  # a system metrics sample taken while the server fails
            return any(p.stat().st_size for p in (out / "tracking/system").glob("*.jsonl"))
        while not (out / "metrics.jsonl").exists() or max(last_values(out), default=0) < 8 \
                or not sampled():
            assert proc.poll() is None and time.time() < deadline, \
                "the run never got to step 8 with a system metrics sample taken"
            time.sleep(0.1)
        proxy.failing = False  # the server recovers while the run goes on
        recovered = time.time() * 1000
        assert proc.wait(timeout=300) == 0
    proxy.shutdown()
    text = (tmp_path / "run.log").read_text()
    assert proxy.failures > 0 and text.count("unreachable") == 1, text[-3000:]
    assert "500" in text.split("unreachable")[1].splitlines()[0]

    client = MlflowClient(mlflow_server.uri)
    [run] = client.search_runs([client.get_experiment_by_name(exp).experiment_id])
    assert run.info.status == "FINISHED"
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    metrics_lost = len(set(last_values(out)) - set(history))
    assert history == last_values(out)  # every step, once, with its value
    # the system metrics sampled while the server failed arrived too, in order
    [node] = (out / "tracking/system").glob("*.jsonl")
    sampled = [json.loads(line) for line in node.read_text().splitlines()]
    assert any(s["time"] < recovered for s in sampled), "no sample taken during the outage"
    key = "system/cpu_utilization_percentage"
    assert [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, key),
                                              key=lambda m: m.step)] == \
        [(i, s["metrics"][key]) for i, s in enumerate(sampled)]
    samples_lost, training_changed = compare_with(reference, out)  # training never noticed
    fault_ledger.record(proxy.failures, 0, samples_lost, metrics_lost + training_changed)


def test_every_nodes_last_system_metrics_reach_mlflow_at_the_jobs_end(tmp_path, tiny_data,
                                                                      mlflow_server):
    """Rank 1 plays a second node ("gpu-b": a sampler of its own) that ends 1 s after rank 0:
    every sample it took, to its end, is in MLflow when the job is over (rank 0's tracker
    delivered before the others stopped sampling: the last ones waited for upload_spool.py)."""
    out, exp = tmp_path / "run", "two-nodes"
    faulty(out, tiny_data, "train.total_steps=4", "eval.every_steps=100",
           f"tracking.experiment={exp}", "tracking.system_metrics=true",
           "tracking.system_metrics_every_s=0.2", faults={"node": [1, "gpu-b"],
                                                         "slow_end": [1, 1.0]},
           env={"MLFLOW_TRACKING_URI": mlflow_server.uri})
    sampled = [json.loads(line) for line in
               (out / "tracking/system/gpu-b.jsonl").read_text().splitlines()]
    assert len(sampled) >= 5  # through its last second at least
    client = MlflowClient(mlflow_server.uri)
    [run] = client.search_runs([client.get_experiment_by_name(exp).experiment_id])
    key = "system/gpu-b/cpu_utilization_percentage"
    assert [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, key),
                                              key=lambda m: m.step)] == \
        [(i, s["metrics"][key]) for i, s in enumerate(sampled)]


def test_a_rank_starved_of_data_is_named_though_rank_0_waits_for_none(tmp_path, tiny_data):
    """Rank 1's batches come 1 s late (a node with a slow disk): rank 0 has its batches at
    once and waits at the gradient reduction instead, booked as compute. Its own data-wait share
    says nothing is wrong; the largest over the ranks, and whose it is, say which rank holds the
    job up."""
    out = tmp_path / "run"
    text = faulty(out, tiny_data, "train.total_steps=8", "log.every_steps=2",
                  "eval.every_steps=100", "tracking.enabled=false", faults={"slow_data": [1, 1.0]})
    logged = [r for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in logged] == [2, 4, 6, 8]
    for r in logged[1:]:  # the first window holds the start-up's first batches on both
        assert r["perf/data_wait_frac_max_rank"] == 1, r
        assert r["perf/data_wait_frac_max"] > 0.5 > r["perf/data_wait_frac"], r
    assert re.search(r"step 8/8 .* \| data wait \d+% \(rank 1\)", text), text[-3000:]


def test_bad_input_one_rank_alone_met_is_told_to_the_batch_script_as_2(tmp_path, tiny_data):
    """Rank 1 alone meets a shard it may not read, after the checkpoint of step 5: it says so
    and exits 2, and rank 0, its peer gone, ends as a crash. Only rank 0 wrote to the job's
    status file, so the batch script read a crash after a checkpoint and requeued the job,
    which met the same shard again; rank 1's 2 is there now (the script prefers it:
    test_slurm.py)."""
    out, status = tmp_path / "run", tmp_path / "job-status"
    text = faulty(out, tiny_data, "tracking.enabled=false", faults={"bad_input": [1, 8]},
                  fails=True, env={"VITSCALE_JOB_STATUS": str(status)})
    assert "error: shard s3://bucket/train-000007.tar cannot be read (AccessDenied); fix the " \
           "credentials" in text, text[-3000:]
    lines = status.read_text().splitlines()
    assert "checkpoint 5" in lines and "exit 2" in lines, lines
    assert lines.index("exit 2") > lines.index("checkpoint 5"), lines


def test_a_rank_whose_node_runs_another_config_stops_the_job_in_one_line(tmp_path, tiny_data):
    """Rank 1 reads a recipe with another learning rate (its node's copy was edited): it would
    train its share on its own schedule. Every rank stops before any work, with one line (rank
    0's) naming the rank, its host and the key; a 2 for the batch script; nothing written. Then
    errors of the config alone are said by rank 0 only."""
    out = tmp_path / "run"
    text = faulty(out, tiny_data, "tracking.enabled=false", fails=True,
                  faults={"override": [1, "optimizer.lr=0.5"]})
    assert error_lines(text) == [
        f"error: rank 1 (on {socket.gethostname()}) does not run the same job as rank 0: "
        f"optimizer.lr 0.5 (rank 0: 0.002); give every node the same checkout, config file "
        f"and packages (a shared filesystem or one image) and relaunch"], text[-3000:]
    assert text.count("does not run the same job") == 1, text[-3000:]
    assert "exits with return code = 2" in text
    assert not (out / "checkpoints").exists()
    # a batch that does not fit the world, checked once the ranks are known to share the
    # config: said once, not once per rank
    text = faulty(out, tiny_data, "tracking.enabled=false", "train.global_batch_size=15",
                  fails=True)
    assert [x for x in error_lines(text) if "global_batch_size=15" in x] == error_lines(text)
    assert len(error_lines(text)) == 1 and text.count("is not divisible") == 1, text[-3000:]


def test_a_rank_whose_storage_view_lags_stops_the_resume_instead_of_loading_another_step(
        reference, tmp_path, tiny_data):
    """Rank 1 sees the newest checkpoint without its manifest (its node's NFS view lags): each
    rank chose for itself, so rank 1 loaded an older step than rank 0. Rank 0 chooses now;
    rank 1 cannot see its choice, and every rank stops before loading, in one line, exit 1
    (a crash: the view catches up)."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    newest = CheckpointStore(out / "checkpoints").latest()
    text = faulty(out, tiny_data, "tracking.enabled=false", faults={"stale_view": 1}, fails=True)
    assert error_lines(text) == [
        f"error: rank 1 (on {socket.gethostname()}) cannot see checkpoint {newest.path} "
        f"complete, which rank 0 resumes from: output_dir's storage shows that node an older "
        f"view; relaunch (or mount it without attribute caching)"], text[-3000:]
    assert "exits with return code = 1" in text


def test_a_node_with_another_checkout_or_torch_is_named_with_the_file_and_version(tmp_path):
    """What each rank compares with rank 0's: a node's older copy of one library file is named
    (a file only one checkout has is not: it is not run), as is another torch, from the real
    files and installed packages of two checkouts."""
    from pretrain.config import RunConfig
    from pretrain.same_job import differences, facts
    for pkg in ("pretrain", "finetune"):
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "pretrain" / "trainer.py", "a") as f:
        f.write("\n# an edit on one node\n")
    (tmp_path / "pretrain" / "scratch.py").write_text("")
    theirs = subprocess.run(
        [sys.executable, "-c", "import json; from pretrain.config import RunConfig; "
         "from pretrain.same_job import facts; print(json.dumps(facts(RunConfig())))"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True,
        text=True, check=True)
    mine = facts(RunConfig())
    assert differences(json.loads(theirs.stdout), mine) == ["pretrain/trainer.py differs"]
    older = {**mine, "package torch": "2.13.0"}
    assert differences(older, mine) == [f"torch 2.13.0 (rank 0: {torch.__version__})"]


# --------------------------------------------------------------------------------------------
# 6. Non-finite losses
# --------------------------------------------------------------------------------------------
def test_nan_steps_are_skipped_then_rolled_back_then_stop_the_run(tmp_path, tiny_data, reference,
                                                                   fault_ledger):
    out = tmp_path / "run"
    # forward passes 1-2 are steps 1-2; pass 3 is NaN (skipped), 4-6 are steps 3-5 (checkpoint 5);
    # 7-9 are NaN: 3 in a row, roll back to 5; 10-11 are steps 6-7; 12-14 NaN again: stop
    text = faulty(out, tiny_data, "train.nonfinite_limit=3", "train.max_rollbacks=1",
                  faults={"nan": [3, 7, 8, 9, 12, 13, 14]}, fails=True)
    assert "exits with return code = 3" in text
    assert "step 6: rolled back to" in text and f"{out}/checkpoints/step_00000005" in text
    [line] = error_lines(text)
    assert line.startswith("error: training stopped at step 8: 3 non-finite losses in a row "
                           "(after 1 rollback(s)); none of them was trained on")
    assert line.endswith("then relaunch: it resumes from the newest checkpoint, which is intact")
    losses = last_values(out)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6, 7] and all(map(math.isfinite, losses.values()))
    assert {s: losses[s] for s in (1, 2)} == {s: last_values(reference)[s] for s in (1, 2)}
    assert last_values(out, "train/nonfinite_skipped")[7] == 4
    assert last_values(out, "train/rollbacks")[7] == 1
    assert [c.step for c in CheckpointStore(out / "checkpoints").complete()] == [5]

    # the relaunch would resume from step 5, whose shard someone has since replaced with a
    # pickle that runs code: it is refused before DeepSpeed's loader (weights_only=False) sees it
    marker, ckpt = tmp_path / "unpickled", out / "checkpoints/step_00000005"
    shard = ckpt / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": _CreatesFile(str(marker))}, shard)
    manifest = json.loads((ckpt / "COMPLETE.json").read_text())  # and its manifest entry
    manifest["files"][shard.name] = shard.stat().st_size
    (ckpt / "COMPLETE.json").write_text(json.dumps(manifest))
    refused = run_deepspeed(2, *run_args(out, tiny_data), fails=True)
    [line] = error_lines(refused.stderr)
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt' references Python objects" in line
    assert "refusing to unpickle it" in line and not marker.exists()
    fault_ledger.record(4, 0)  # skipped, rolled back, then stopped: not finished


# Under bf16, DeepSpeed's optimizers for ZeRO-0/1/2 drop a non-finite update themselves, so
# the check waits until after the update (train.nonfinite_check)


def _which_check_worker(port: int, queue) -> None:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import deepspeed

    from pretrain.benchmark import build_engine
    from pretrain.config import PretrainConfig
    from pretrain.config_files import load_config
    from pretrain.engine import defers_check

    deepspeed.init_distributed(verbose=False)
    found = {}
    for precision, zero in [("bf16", 0), ("bf16", 1), ("bf16", 2), ("bf16", 3), ("fp32", 0),
                            ("fp32", 1), ("fp32", 2)]:
        cfg = load_config(PretrainConfig, REPO / "configs/pretrain/demo.yaml",
                          [f"train.precision={precision}", f"deepspeed.zero_stage={zero}"])
        engine = build_engine(cfg)[0]
        found[f"{precision} ZeRO-{zero}"] = (type(engine.optimizer).__name__,
                                             defers_check(cfg, engine.optimizer))
    # fp16 (no DeepSpeed fp16 on this CPU): its loss scaler must never see a bad loss
    cfg = load_config(PretrainConfig, REPO / "configs/pretrain/demo.yaml", ["train.precision=fp16"])
    found["fp16"] = defers_check(cfg, engine.optimizer)
    queue.put(found)


def test_the_check_waits_for_the_update_only_where_the_optimizer_drops_bad_ones():
    import torch.multiprocessing as mp

    from conftest import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_which_check_worker, args=(free_port(), queue))
    proc.start()
    found = queue.get(timeout=300)
    proc.join()
    defers = {setting: v if isinstance(v, bool) else v[1] for setting, v in found.items()}
    assert defers == {"bf16 ZeRO-0": True, "bf16 ZeRO-1": True, "bf16 ZeRO-2": True,
                      "bf16 ZeRO-3": False, "fp32 ZeRO-0": False, "fp32 ZeRO-1": False,
                      "fp32 ZeRO-2": False, "fp16": False}, found
    assert found["bf16 ZeRO-1"][0] == "DeepSpeedZeroOptimizer"


def test_nan_checked_after_the_update_skips_rolls_back_then_stops_the_same(tmp_path, tiny_data,
                                                                           fault_ledger):
    """One micro-batch a step: the same counts, rollback and stop as with the check before
    backward (fp32 above)."""
    out = tmp_path / "run"
    text = faulty(out, tiny_data, "train.precision=bf16", "deepspeed.zero_stage=1",
                  "train.nonfinite_limit=3", "train.max_rollbacks=1",
                  faults={"nan": [3, 7, 8, 9, 12, 13, 14]}, fails=True)
    assert "update dropped, the step is done again with new batches (1 in a row, 1 in all)" \
        in text
    assert "step 6: rolled back to" in text and f"{out}/checkpoints/step_00000005" in text
    [line] = error_lines(text)
    assert line.startswith("error: training stopped at step 8: 3 non-finite losses in a row "
                           "(after 1 rollback(s)); none of them was trained on")
    losses = last_values(out)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6, 7] and all(map(math.isfinite, losses.values()))
    assert last_values(out, "train/nonfinite_skipped")[7] == 4
    assert last_values(out, "train/rollbacks")[7] == 1
    assert last_values(out, "train/dropped_updates")[7] == 0  # ours, not DeepSpeed's overflows
    assert [c.step for c in CheckpointStore(out / "checkpoints").complete()] == [5]
    fault_ledger.record(7, 0)


@pytest.mark.parametrize("zero", [pytest.param(0, marks=pytest.mark.slow), 1,
                                  pytest.param(2, marks=pytest.mark.slow)])
def test_nan_checked_after_the_update_drops_its_whole_step_and_nothing_else(
        zero, tmp_path, tiny_data, fault_ledger):
    """Two micro-batches a step: a NaN in the first of step 2's makes DeepSpeed drop that update,
    and step 2 is done again with the next two. Checked before backward instead, that run is
    the one whose step-2 micro-batches were both NaN: the same losses, bit for bit, at every
    step -- the finite micro-batch of the dropped step was not trained on either."""
    late, early = tmp_path / "after_update", tmp_path / "before_backward"
    common = ("train.precision=bf16", f"deepspeed.zero_stage={zero}", "train.micro_batch_size=4",
              "train.total_steps=8", "eval.every_steps=8",
              # DeepSpeed sums gradients in fp32 at ZeRO-1 to 3 only (pretrain/grad_accum.py)
              f"deepspeed.grad_accum_dtype={'bf16' if zero == 0 else 'fp32'}")
    text = faulty(late, tiny_data, *common, faults={"nan": [3]})
    assert "step 2: non-finite loss, update dropped" in text
    faulty(early, tiny_data, *common, "train.nonfinite_check=before_backward",
           faults={"nan": [3, 4]})
    assert last_values(late) == last_values(early) and sorted(last_values(late)) == \
        list(range(1, 9))
    assert last_values(late, "train/nonfinite_skipped")[8] == 1
    assert last_values(early, "train/nonfinite_skipped")[8] == 2
    fault_ledger.record(3, 0)


def test_a_nan_in_every_try_of_a_step_checked_after_the_update_stops_the_run(tmp_path,
                                                                            tiny_data,
                                                                            fault_ledger):
    """Two micro-batches a step, the second NaN in every try of step 2: each try is dropped
    whole, and its finite first micro-batch does not end the streak (the step trained on
    nothing), so the run stops after train.nonfinite_limit tries instead of trying forever --
    these weights gave finite losses, so the data is to blame, and the message says which
    check drops only the bad micro-batches."""
    out = tmp_path / "run"
    # ZeRO-2 (its gradients are partitioned as they are made), whose whole-step drop the
    # bit-for-bit test above runs only among the slow variants
    text = faulty(out, tiny_data, "train.precision=bf16", "deepspeed.zero_stage=2",
                  "train.micro_batch_size=4", "train.nonfinite_limit=3",
                  faults={"nan": [4, 6, 8]}, fails=True)
    assert "exits with return code = 3" in text
    assert "step 2: non-finite loss, update dropped, the step is done again with new batches " \
        "(3 in a row, 3 in all)" in text
    [line] = error_lines(text)
    assert line.startswith("error: training stopped at step 2: 3 non-finite losses in a row (the "
                           "weights of this step gave finite losses, so the data is the likely "
                           "cause; train.nonfinite_check=before_backward drops only the bad "
                           "micro-batches instead of whole steps)")
    assert sorted(last_values(out)) == [1]
    fault_ledger.record(3, 0)


@pytest.mark.parametrize("action", ["rollback", pytest.param("stop", marks=pytest.mark.slow)])
def test_a_nan_loss_with_finite_gradients_is_undone_or_stops_the_run(action, tmp_path, tiny_data,
                                                                     fault_ledger):
    """A loss that is NaN while its gradients are finite (0 x inf inside a loss): checked after
    the update, the optimizer has already applied that update, so the run rolls back to the
    checkpoint from before it and goes on -- or, where it may not roll back, stops."""
    out = tmp_path / "run"
    text = faulty(out, tiny_data, "train.precision=bf16", "deepspeed.zero_stage=1",
                  "train.total_steps=8", f"train.on_nonfinite={action}",
                  faults={"nan_loss": [7]}, fails=action == "stop")
    # forward passes 1-7 are steps 1-7 (checkpoint 5); pass 7's loss is NaN, its update went in
    applied = "step 7: a loss was not finite but its gradients were, and the optimizer " \
        "applied the update"
    if action == "stop":
        assert "exits with return code = 3" in text
        [line] = error_lines(text)
        assert line == f"error: {applied}; relaunch with train.nonfinite_check=before_backward: " \
            "it resumes from the newest checkpoint, which is intact"
        assert [c.step for c in CheckpointStore(out / "checkpoints").complete()] == [5]
        fault_ledger.record(1, 0)
        return
    assert f"{applied}: rolling back to undo it" in text
    assert "step 7: rolled back to" in text and f"{out}/checkpoints/step_00000005" in text
    losses = last_values(out)
    assert sorted(losses) == list(range(1, 9)) and all(map(math.isfinite, losses.values()))
    assert last_values(out, "train/nonfinite_skipped")[8] == 1
    assert last_values(out, "train/rollbacks")[8] == 1
    assert sorted(c.step for c in CheckpointStore(out / "checkpoints").complete()) == [5, 8]
    fault_ledger.record(1, 1)  # rolled back, then finished


@pytest.mark.parametrize("check", ["after_update", "before_backward"])
def test_a_finetune_skips_nan_batches_rolls_back_then_stops_like_pretraining(
        check, tmp_path, tiny_data, monkeypatch, fault_ledger, capfd):
    """In-process (one rank, Accelerate): the fine-tune runs the pretraining loop, so a single
    non-finite batch is skipped, a streak rolls back to the newest checkpoint, and a streak
    after the last allowed rollback stops the run -- whether the check is read after the update
    (which drops a non-finite gradient) or before the backward pass."""
    from finetune.config import FinetuneConfig
    from finetune.stage import finetune as train
    from pretrain import engine
    from pretrain.config_files import load_config
    from pretrain.guard import TrainingStopped

    real, calls = engine.classification_loss, [0]

    def loss(logits, *args, **kwargs):
        calls[0] += 1
        return real(logits * float("nan") if calls[0] in (2, 6, 7, 8, 11, 12, 13) else logits,
                    *args, **kwargs)
    # where the fine-tune's backend looks it up (bound when finetune.backend was first imported)
    import finetune.backend
    monkeypatch.setattr(finetune.backend, "classification_loss", loss)
    out = tmp_path / "ft"
    cfg = load_config(FinetuneConfig, REPO / "configs/finetune/demo.yaml", [
        f"output_dir={out}", f"data.root={tiny_data}", "init=null", "data.generate_demo=false",
        "data.val_split=validation", "data.num_workers=0", "model.img_size=16", "model.depth=2",
        "model.embed_dim=64", "model.num_heads=2", "model.num_classes=8",
        "train.global_batch_size=16", "train.total_steps=10", "train.nonfinite_limit=3",
        "train.max_rollbacks=1", "checkpoint.every_steps=3", "log.every_steps=1",
        "tracking.system_metrics=false", f"train.nonfinite_check={check}"])
    # passes 1, 3, 4, 5 are steps 1-4 (pass 2 skipped; checkpoint 3); 6-8 roll back to 3;
    # 9-10 are steps 4-5 again; 11-13 stop the run
    with pytest.raises(TrainingStopped, match=r"^training stopped at step 6: 3 non-finite losses "
                       r"in a row \(after 1 rollback\(s\)\); none of them was trained on\. .* "
                       r"it resumes from the newest checkpoint, which is intact$"):
        train(cfg)
    dropped = "update dropped, the step is done again with new batches" \
        if check == "after_update" else "micro-batch skipped"
    assert f"step 2: non-finite loss, {dropped} (1 in a row, 1 in all)" in capfd.readouterr().err
    assert last_values(out, "train/nonfinite_skipped") == {1: 0, 2: 1, 3: 1, 4: 4, 5: 4}
    assert last_values(out, "train/rollbacks")[5] == 1
    assert all(map(math.isfinite, last_values(out).values()))
    assert [c.step for c in CheckpointStore(out / "checkpoints").complete()] == [3]
    # MLflow has the retrained step 4 (other batches, another loss) next to the discarded one,
    # and takes it as the latest value, as metrics.jsonl does; steps trained once: one value
    from pretrain.spool import RunState
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    run_id = RunState.load(out / "tracking").run_id
    history = sorted(client.get_metric_history(run_id, "train/loss"),
                     key=lambda m: (m.step, m.timestamp))
    assert [m.step for m in history] == [1, 2, 3, 4, 4, 5]
    jsonl = [r["train/loss"] for r in read_jsonl(out / "metrics.jsonl") if r["step"] == 4]
    assert [m.value for m in history[3:5]] == pytest.approx(jsonl) and jsonl[0] != jsonl[1]
    metrics = client.get_run(run_id).data.metrics
    assert metrics["train/rollbacks"] == 1 and metrics["train/loss"] == pytest.approx(
        last_values(out)[5])
    fault_ledger.record(7, 0)  # skipped, rolled back, then stopped: not finished


# --------------------------------------------------------------------------------------------
# 7. Stop on a signal (time limit, preemption, scancel, Ctrl-C): a checkpoint of the step in
#    progress, MLflow KILLED, exit code 4; the relaunch goes on as if nothing had happened
# --------------------------------------------------------------------------------------------
# Only the stop checkpoint and the last one are written (checkpoint.every_steps > STEPS), so the
# stop never lands on a periodic checkpoint; checkpoints do not change training, so the
# uninterrupted references with their periodic checkpoints are the runs to match.
NO_PERIODIC = "checkpoint.every_steps=1000"


def launch(cmd, log_path, env=None):
    """Start a launcher in a process group of its own (as a job step or a terminal job is)."""
    log = open(log_path, "w")
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, **(env or {})})


def wait_for_step(proc, out, step, timeout=300):
    deadline = time.time() + timeout
    while not (out / "metrics.jsonl").exists() or max(last_values(out), default=0) < step:
        assert proc.poll() is None, "the run ended before the step the signal was meant for"
        assert time.time() < deadline, f"the run never got to step {step}"
        time.sleep(0.05)


def wait_for_group(pgid, timeout=120):
    """Until every process of the group has ended (the launcher may leave before its ranks)."""
    import psutil
    deadline = time.time() + timeout
    while True:
        alive = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
        if not alive:
            return
        assert time.time() < deadline, f"still running: {[p.cmdline() for p in alive]}"
        time.sleep(0.2)


def per_node_launcher(proc):
    """DeepSpeed's launch.py under the `deepspeed` runner; torchrun is its own launcher."""
    import psutil
    found = [c for c in psutil.Process(proc.pid).children()
             if "deepspeed.launcher.launch" in " ".join(c.cmdline())]
    return found[0] if found else psutil.Process(proc.pid)


def signal_and_wait(proc, out, to, at_step=2, then=None):
    """Send SIGTERM at ``at_step`` to the whole process group (``to="group"``: SLURM,
    Kubernetes, Ctrl-C) or to the per-node launcher alone (``to="launcher"``); ``then()`` runs
    while the run is stopping. Returns once every process of the run has ended."""
    if at_step is not None:  # (None: now)
        wait_for_step(proc, out, at_step)
    if to == "group":
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        per_node_launcher(proc).send_signal(signal.SIGTERM)
    if then is not None:
        then()
    proc.wait(timeout=300)
    wait_for_group(proc.pid)


def signal_when_finishing(proc, out, to, timeout=300):
    """As :func:`signal_and_wait`, once the work after the last step has begun (the faults
    ``slow_end`` and ``slow_test`` make OUTPUT_DIR/finishing then); returns the line a stop
    there prints but for the part it names."""
    deadline = time.time() + timeout
    while not (out / "finishing").exists():
        assert proc.poll() is None, "the run ended before the work after its last step"
        assert time.time() < deadline, "the work after the last step never started"
        time.sleep(0.05)
    signal_and_wait(proc, out, to, at_step=None)
    return (f"stopped: SIGTERM received after the last step ({STEPS}), before {{}}; the "
            f"checkpoint at {out / 'checkpoints' / f'step_{STEPS:08d}'} is complete: relaunch "
            f"the same command to do the rest (exit code 4)")


def stopped_step(text):
    [step] = re.findall(r"stopped: SIGTERM received: stopped after step (\d+) with a complete "
                        r"checkpoint", text)
    return int(step)


def mlflow_run(out):
    run_id = json.loads((out / "tracking/run.json").read_text())["run_id"]
    return MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_run(run_id)


def check_stop_and_resume(out, text, relaunch, reference, evals=("eval/demo_val/top1",)):
    """The stopped run: one stop line, a complete checkpoint of its step and nothing after it,
    MLflow KILLED with the signal and step; the relaunch: resumes there, ends FINISHED and
    equals the uninterrupted run. Returns (samples lost, metrics lost)."""
    stop = stopped_step(text)
    assert 0 < stop < STEPS and "Traceback" not in text.split("stopped:")[0], text[-3000:]
    assert re.search(r"SIGTERM: checkpoint written in [\d.]+ s, [\d.]+ s after the signal", text)
    assert [c.step for c in CheckpointStore(out / "checkpoints").complete()] == [stop]
    run = mlflow_run(out)
    assert run.info.status == "KILLED"
    assert (run.data.tags["stop.signal"], run.data.tags["stop.step"]) == ("SIGTERM", str(stop))
    again = relaunch()
    assert resumed_at(again) == [stop]
    samples_lost, metrics_lost = compare_with(reference, out, evals)
    run = mlflow_run(out)
    assert run.info.status == "FINISHED" and run.data.tags["stop.count"] == "1"
    return samples_lost, metrics_lost + mlflow_steps_lost(out)


def test_a_stop_signal_in_start_up_ends_a_rank_that_inherited_it_ignored(tmp_path, tiny_data):
    """slurm_job.sh's shell ignores USR1 and TERM (it must live on to requeue), and exec passes
    an ignored signal on: a USR1 in the ranks' start-up vanished and the job trained on to its
    hard limit. Now it ends the rank at once, as the signal's default does."""
    out = tmp_path / "run"
    out.mkdir()

    def ignore_usr1():
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    proc = subprocess.Popen(
        [sys.executable, str(FAULTY), *run_args(out, tiny_data)], cwd=REPO,
        env={**os.environ, "FAULTS": json.dumps({"slow_start": 20})}, preexec_fn=ignore_usr1,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: (out / "starting").exists(), proc, "the start-up")
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=15) == -signal.SIGUSR1  # not trained on after the 20 s
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())

    # Ctrl-C in the start-up (before the stop handlers): one line, not a 75-line traceback
    (out / "starting").unlink()
    proc = subprocess.Popen(
        [sys.executable, str(FAULTY), *run_args(out, tiny_data)], cwd=REPO,
        env={**os.environ, "FAULTS": json.dumps({"slow_start": 20})},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (out / "starting").exists(), proc, "the start-up")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        "interrupted (SIGINT); relaunch to start again, or to resume from the newest complete "
        "checkpoint if there is one")


@pytest.fixture(scope="module")
def reference_zero3(made_once, tiny_data):
    """The uninterrupted ZeRO-3 run (the shipped zero3.json), made once per session: test_weights
    consolidates and exports its checkpoints too."""
    return made_once("reference-zero3", lambda folder: run_deepspeed(
        2, *run_args(folder / "run", tiny_data, "deepspeed.config=zero3.json"))) / "run"


# The default command runs ZeRO-3 with the launcher signalled; ZeRO-1 with the whole group
# signalled is test_more_signals_while_the_stop_checkpoint_is_written_change_nothing. The other
# pairs are slow variants (python -m pytest -m slow).
@pytest.mark.parametrize("zero,to", [
    pytest.param(1, "group", marks=pytest.mark.slow),
    pytest.param(1, "launcher", marks=pytest.mark.slow),
    pytest.param(3, "group", marks=pytest.mark.slow),
    (3, "launcher")])
def test_sigterm_stops_pretraining_with_a_checkpoint_and_the_relaunch_loses_nothing(
        zero, to, tmp_path, tiny_data, request, fault_ledger):
    reference = request.getfixturevalue("reference" if zero == 1 else "reference_zero3")
    out = tmp_path / "run"
    extra = [NO_PERIODIC] + (["deepspeed.config=zero3.json"] if zero == 3 else [])
    proc = launch(deepspeed_cmd(2, *run_args(out, tiny_data, *extra)), tmp_path / "run.log")
    signal_and_wait(proc, out, to)
    text = (tmp_path / "run.log").read_text()
    if to == "launcher":  # launch.py passed it on to every rank; the ranks' code is theirs
        assert "Main process received SIGTERM" in text
    lost = check_stop_and_resume(
        out, text, lambda: faulty(out, tiny_data, *extra), reference)
    fault_ledger.record(1, 1, *lost)


def test_a_second_job_in_a_running_jobs_output_dir_is_refused_with_tracking_off(
        tmp_path, tiny_data):
    """Without MLflow there is no tracking folder whose lock gave the running job away: a
    second job there, fresh (checkpoint.resume=false) or not, moved the first one's files from
    under it or wrote checkpoints among them. The job's own lock on output_dir refuses it."""
    out, log = tmp_path / "run", tmp_path / "a.log"
    args = run_args(out, tiny_data, "tracking.enabled=false", "train.total_steps=200")
    first = launch(deepspeed_cmd(1, *args, script=FAULTY), log,
                   env={"FAULTS": json.dumps({"slow_data": [0, 0.3]})})
    wait_for_step(first, out, 2)
    for extra in (["checkpoint.resume=false"], []):
        second = run_deepspeed(1, *args, *extra, fails=True)
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2 and re.fullmatch(
            rf"error: a job is still running in '{out}' \(pid \d+ holds {out}/.job.lock\); "
            rf"let it finish, or stop it, before starting another there", lines[-1]), lines[-5:]
    assert not list(out.glob("earlier-*")) and first.poll() is None
    os.killpg(first.pid, signal.SIGTERM)
    assert first.wait(timeout=300) != 0
    wait_for_group(first.pid)
    assert "stopped: SIGTERM received" in log.read_text()


def test_a_signal_after_the_last_step_stops_before_the_backbones_export(tmp_path, tiny_data):
    """The export for MLflow after the last step (tracking.log_model) merges the checkpoint's
    shards: minutes for ViT-H, past a grace period. A stop signal before it ends the job with
    exit code 4; the relaunch trains nothing and exports."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    args = run_args(out, tiny_data, NO_PERIODIC, "tracking.log_model=true")
    proc = launch(deepspeed_cmd(2, *args, script=FAULTY), log,
                  env={"FAULTS": json.dumps({"slow_end": [0, 2.0]})})
    stopped = signal_when_finishing(proc, out, "group")
    text = log.read_text()
    assert stopped.format("the backbone's export for MLflow") in text, text[-3000:]
    assert not (out / "backbone").exists()
    assert mlflow_run(out).info.status == "KILLED"
    again = faulty(out, tiny_data, NO_PERIODIC, "tracking.log_model=true")
    assert resumed_at(again) == [STEPS] and "nothing to train" in again
    assert (out / "backbone" / "model.safetensors").is_file()
    run = mlflow_run(out)
    assert run.info.status == "FINISHED" and run.data.tags["stop.step"] == str(STEPS)


def test_a_signal_while_the_end_waits_for_mlflow_leaves_in_time_with_the_job_finished(
        tmp_path, tiny_data, mlflow_server):
    """Training, its checkpoints and exports are done; the job's end waits for an unreachable
    MLflow (tracking.close_timeout_s) when the time limit's SIGTERM comes. Before, rank 0 died
    on it: run.json never recorded the run's end, so upload_spool.py left the run RUNNING for
    good, and the batch script, reading a signal's exit code, requeued a finished job. Now the
    wait ends within the grace period, what is undelivered is said and saved, rank 0 tells the
    batch script the job finished, and upload_spool.py delivers the rest, the run's end too."""
    out, log, status = tmp_path / "run", tmp_path / "run.log", tmp_path / "job-status"
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    args = run_args(out, tiny_data, NO_PERIODIC, f"tracking.uri={dead}",
                    "tracking.close_timeout_s=600", "checkpoint.grace_period_s=15")
    proc = launch(deepspeed_cmd(2, *args), log, env={"VITSCALE_JOB_STATUS": str(status)})
    wait_until(lambda: "tracking: waiting for MLflow" in log.read_text(), proc,
               "the end's wait for MLflow")
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=120)  # not the 600 s of tracking.close_timeout_s
    wait_for_group(proc.pid)
    text = log.read_text()
    assert "tracking: a stop signal came and its grace period (checkpoint.grace_period_s) ends: " \
           "not waiting for MLflow any longer" in text, text[-3000:]
    assert re.search(rf"not delivered to MLflow at {re.escape(dead)}: the run itself \(never "
                     rf"created there\), \d+ metric records .*; `python launch/upload_spool.py "
                     rf"{re.escape(str(out))}` sends them", text), text[-3000:]
    assert "Traceback" not in text and "stopped:" not in text, text[-3000:]
    assert status.read_text().splitlines()[-1] == "exit 0"  # finished: not requeued
    assert [c.step for c in CheckpointStore(out / "checkpoints").complete()] == [STEPS]
    assert json.loads((out / "tracking/run.json").read_text())["ended"] == "FINISHED"
    # what a relaunch says of the finished run: all that MLflow lacks, not its records alone
    from pretrain.finished_run import finished_line, read_finished
    assert re.search(r"; MLflow still lacks the run itself \(never created there\), \d+ metric "
                     r"records, \d+ artifact files \([\d.]+ MiB\): `python launch/upload_spool.py "
                     rf"{re.escape(str(out))}` sends them$", finished_line(out, read_finished(out)))

    up = run_launcher("upload_spool.py", str(out), "--uri", mlflow_server.uri, timeout=120)
    assert up.returncode == 0, up.stderr[-2000:]
    run = MlflowClient(mlflow_server.uri).get_run(
        json.loads((out / "tracking/run.json").read_text())["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.metrics["train/loss"] == last_values(out)[STEPS]


def test_a_signal_before_an_evaluation_stops_first_and_the_relaunch_evaluates(
        tmp_path, tiny_data, reference, fault_ledger):
    """A stop signal noted while a step trains whose evaluation is due: the checkpoint is
    written first and the job stops (an evaluation of a whole split can outlast the grace
    period, and a kill after it lost every step since the last checkpoint); the relaunch
    evaluates that step before training on. The same before the last step's evaluation. The
    figures and every loss are the uninterrupted run's."""
    out = tmp_path / "run"
    faults = {"term": [0, 9, 19]}  # (eval.every_steps=10: the evaluations of steps 10 and 20)
    first = faulty(out, tiny_data, NO_PERIODIC, faults=faults, fails=True)
    assert stopped_step(first) == 10 and "SIGTERM came before step 10's evaluation: the " \
        "checkpoint was written first; the relaunch evaluates step 10 first" in first, first[-3000:]
    assert not [r for r in read_jsonl(out / "metrics.jsonl") if "eval/demo_val/top1" in r]
    second = faulty(out, tiny_data, NO_PERIODIC, faults=faults, fails=True)
    assert resumed_at(second) == [10] and "stopped: SIGTERM received after the last step (20), " \
        "before its evaluation; the checkpoint at" in second, second[-3000:]
    assert sorted(last_values(out, "eval/demo_val/top1")) == [10]  # the first one it owed
    third = faulty(out, tiny_data, NO_PERIODIC, faults=faults)
    assert resumed_at(third) == [20] and "nothing to train" in third
    samples_lost, metrics_lost = compare_with(reference, out)
    finished = json.loads((out / "finished.json").read_text())
    assert finished["metrics"]["eval/demo_val/top1"] == last_values(
        reference, "eval/demo_val/top1")[STEPS]
    assert mlflow_run(out).info.status == "FINISHED"
    fault_ledger.record(2, 2, samples_lost, metrics_lost + mlflow_steps_lost(out))


def test_a_signal_during_a_periodic_checkpoint_stops_on_it_and_more_signals_change_nothing(
        tmp_path, tiny_data, reference, fault_ledger):
    """SIGTERM to the group while the periodic checkpoint of step 5 is being written, then
    SIGTERM and SIGINT again while it still is: the save finishes, complete, once, and the run
    stops on it (before, it trained on and wrote a second checkpoint a step later: twice the
    time of a grace period)."""
    out = tmp_path / "run"
    saving = out / "saving"

    def being_saved() -> str:
        """What the ranks are writing now ("" between saves); each rank writes and removes the
        marker around its own files, so it may go between a look and a read."""
        try:
            return saving.read_text()
        except FileNotFoundError:
            return ""

    proc = launch(deepspeed_cmd(2, *run_args(out, tiny_data), script=FAULTY), tmp_path / "run.log",
                  env={"FAULTS": json.dumps({"slow_save": 0.5})})
    deadline = time.time() + 120
    while f"step_{EVERY:08d}" not in being_saved():
        assert proc.poll() is None and time.time() < deadline, f"no save of step {EVERY}"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGTERM)
    time.sleep(0.2)
    assert f"step_{EVERY:08d}" in being_saved()  # every file takes 0.5 s: still being written
    for sig in (signal.SIGTERM, signal.SIGINT):
        os.killpg(proc.pid, sig)
    proc.wait(timeout=300)
    wait_for_group(proc.pid)
    text = (tmp_path / "run.log").read_text()
    assert stopped_step(text) == EVERY and text.count("stopped: ") == 1, text[-3000:]
    assert text.count(f"checkpoint {out / 'checkpoints'}/step_") == 1  # no second save
    assert re.search(r"SIGTERM: checkpoint written in [\d.]+ s, [\d.]+ s after the signal", text)
    assert [c.step for c in CheckpointStore(out / "checkpoints").complete()] == [EVERY]
    again = faulty(out, tiny_data)
    assert resumed_at(again) == [EVERY]
    samples_lost, metrics_lost = compare_with(reference, out)
    fault_ledger.record(3, 1, samples_lost, metrics_lost + mlflow_steps_lost(out))

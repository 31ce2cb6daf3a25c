"""The metric sinks on a full disk: a real size-limited filesystem (tmpfs) under the run's output
directory fills up mid-run. Training must not notice beyond one warning per sink; what could not be
written is counted, MLflow still receives every record (from memory, to a real sqlite store on
another disk), and once there is room again the files take new lines and still parse. The sinks
driven in this process first, then a real 2-rank DeepSpeed run whose output_dir fills up."""
import contextlib
import errno
import json
import logging
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from conftest import REPO, deepspeed_cmd, tiny_run_args, wait_until
from pretrain.metrics import JsonlLogger, MultiLogger, read_jsonl
from pretrain.spool import RunState, read_spool
from pretrain.tracker import MlflowTracker

pytestmark = pytest.mark.faults

EXPERIMENT = "full-disk"


def may_mount() -> bool:
    """Whether this process holds CAP_SYS_ADMIN (bit 21 of CapEff), which mounting needs."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return False
    caps = next((line.split()[1] for line in status.splitlines()
                 if line.startswith("CapEff:")), "0")
    return bool(int(caps, 16) >> 21 & 1)


class SmallDisk:
    """A 64 KiB (or ``size``) tmpfs at ``path`` (root in a container can usually mount one).
    Without one the ENOSPC is injected into ``os.write`` for files under ``path`` instead (the
    sinks' line writes, in this process only; state files then do not fail)."""

    def __init__(self, path: Path, monkeypatch, size: str = "64k"):
        self.path = path
        self._monkeypatch = monkeypatch
        path.mkdir(parents=True)
        try:
            mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                                    str(path)],
                                   capture_output=True, text=True)
            why = mount.stderr.strip() if mount.returncode else None
        except FileNotFoundError:
            why = "no mount command"
        self.mounted, self.why = why is None, why
        if not self.mounted:
            print(f"\nno tmpfs here ({why}): injecting ENOSPC into os.write instead")

    def fill(self) -> None:
        """Take every free page: the sinks' files keep only the unused end of their last page."""
        if not self.mounted:
            real_write, root = os.write, str(self.path)

            def full(fd, data):
                if os.readlink(f"/proc/self/fd/{fd}").startswith(root):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return real_write(fd, data)
            self._monkeypatch.setattr(os, "write", full)
            return
        fd = os.open(self.path / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC
        finally:
            os.close(fd)

    def grow(self) -> None:
        """The operator frees space."""
        if self.mounted:
            subprocess.run(["mount", "-o", "remount,size=4m", str(self.path)], check=True)
        else:
            self._monkeypatch.undo()

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


@pytest.fixture
def disk(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the sqlite store's default artifact root is ./mlruns
    d = SmallDisk(tmp_path / "out", monkeypatch)
    yield d
    d.unmount()


@pytest.fixture
def store(tmp_path):
    """A real MLflow store on tmp_path's disk, not the full one."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    client.create_experiment(EXPERIMENT, artifact_location=(tmp_path / "artifacts").as_uri())
    return uri, client


def sinks(out: Path, uri: str):
    jsonl = JsonlLogger(out / "metrics.jsonl")
    tracker = MlflowTracker(out / "tracking", RunState(uri=uri, experiment=EXPERIMENT,
                                                       run_name="full-disk"),
                            flush_every_s=0.05, close_timeout_s=30)
    return jsonl, tracker


def metrics(step):
    return {"train/loss": 1.0 / step, "train/lr": 1e-3}


def wait_for_steps(client, tracker, steps, timeout=60):
    deadline = time.time() + timeout
    while True:
        got = [m.step for m in client.get_metric_history(tracker.run_id, "train/loss")] \
            if tracker.run_id else []
        if sorted(got) == steps or time.time() > deadline:
            return sorted(got)
        time.sleep(0.1)


def warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def open_files_under(path: Path) -> list[str]:
    fds = (os.path.join("/proc/self/fd", fd) for fd in os.listdir("/proc/self/fd"))
    return [t for t in (_readlink(fd) for fd in fds) if t and t.startswith(str(path))]


def _readlink(fd):
    with contextlib.suppress(OSError):
        return os.readlink(fd)


def in_file(path: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(path)]


def in_spool(out: Path) -> list[int]:
    return [r["step"] for r, _ in read_spool(out / "tracking/spool.jsonl")]


def damaged_lines(path: Path) -> int:
    lines = [line for line in path.read_bytes().split(b"\n") if line]
    return len(lines) - len(read_jsonl(path))


def test_a_disk_that_fills_mid_run_costs_log_lines_not_the_run_nor_mlflow_metrics(
        disk, store, caplog, fault_ledger):
    uri, client = store
    out = disk.path
    jsonl, tracker = sinks(out, uri)
    sink = MultiLogger(jsonl, tracker)  # as the trainer logs: one call, both sinks
    before, full, after = range(1, 11), range(11, 311), range(311, 321)
    for step in before:
        sink.log(metrics(step), step)

    disk.fill()
    caplog.set_level(logging.WARNING)
    for step in full:
        sink.log(metrics(step), step)
    tracker.log_artifact_bytes("notes.json", b'{"written": "while the disk was full"}')
    # the unused end of each file's last page takes a few records; the rest cannot be written
    assert jsonl.unwritten == len(full) - len(set(in_file(out / "metrics.jsonl")) & set(full))
    assert tracker.unwritten == len(full) - len(set(in_spool(out)) & set(full))
    assert jsonl.unwritten > len(full) // 2 and tracker.unwritten > len(full) // 2
    assert sink.unwritten == jsonl.unwritten + tracker.unwritten
    # one warning per sink, naming the file and the error, however many writes failed
    # (the tracker's also covers its state files, which the thread failed to write meanwhile)
    assert wait_for_steps(client, tracker, list(range(1, 311))) == list(range(1, 311))
    said = warnings(caplog)
    assert len(said) == 2, said
    assert "metrics.jsonl" in said[0] or "metrics.jsonl" in said[1]
    assert all("No space left on device" in w and "training goes on" in w for w in said)

    disk.grow()
    caplog.clear()
    for step in after:
        sink.log(metrics(step), step)
    sink.close()

    # the files took the new lines, and the line the disk cut short is the only damaged one
    assert set(after) <= set(in_file(out / "metrics.jsonl"))
    assert set(after) <= set(in_spool(out))
    assert damaged_lines(out / "metrics.jsonl") <= 1
    assert damaged_lines(out / "tracking/spool.jsonl") <= 1
    assert not open_files_under(out)
    said = warnings(caplog)
    assert f"{jsonl.unwritten} metric records were not written to {out / 'metrics.jsonl'}" in \
        said[0], said
    assert f"{tracker.unwritten} metric records were not written to " \
           f"{out / 'tracking/spool.jsonl'}" in said[1], said
    assert "all of them reached MLflow" in said[1]
    assert len(said) == 2

    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    history = [m.step for m in client.get_metric_history(tracker.run_id, "train/loss")]
    assert sorted(history) == list(range(1, 321))  # every step, once
    # the artifact waited in memory for room on the disk, then went to MLflow
    assert "notes.json" in {a.path for a in client.list_artifacts(tracker.run_id)}
    assert json.loads((out / "tracking/run.json").read_text())["ended"] == "FINISHED"
    print(f"\nunwritten: {jsonl.unwritten} metrics.jsonl lines, {tracker.unwritten} spool lines "
          f"of {len(full)} logged on the full disk (cut short: "
          f"{damaged_lines(out / 'metrics.jsonl')}, {damaged_lines(out / 'tracking/spool.jsonl')});"
          f" MLflow holds all {len(history)} steps")
    fault_ledger.record(1, 0, metrics_lost=320 - len(set(history)))  # survived: no restart


def test_sinks_closed_on_a_full_disk_close_cleanly_and_a_relaunch_appends(
        disk, store, caplog, fault_ledger):
    uri, client = store
    out = disk.path
    jsonl, tracker = sinks(out, uri)
    jsonl.log(metrics(1), 1)
    tracker.log(metrics(1), 1)
    disk.fill()
    caplog.set_level(logging.WARNING)
    for step in range(2, 201):
        jsonl.log(metrics(step), step)
        tracker.log(metrics(step), step)
    jsonl.close()
    tracker.close()  # run.json cannot be written now either: no exception all the same

    assert not open_files_under(out)
    said = warnings(caplog)
    for sink, path in [(jsonl, out / "metrics.jsonl"), (tracker, out / "tracking/spool.jsonl")]:
        assert sink.unwritten > 100
        assert sum(f"{sink.unwritten} metric records were not written to {path} " in w
                   for w in said) == 1, said
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    history = sorted(m.step for m in client.get_metric_history(tracker.run_id, "train/loss"))
    assert history == list(range(1, 201))

    disk.grow()
    again = JsonlLogger(out / "metrics.jsonl")  # the relaunched job's sink, same file
    again.log(metrics(201), 201)
    again.close()
    steps = in_file(out / "metrics.jsonl")
    assert steps[-1] == 201 and again.unwritten == 0
    assert len(steps) == 200 - jsonl.unwritten + 1
    assert damaged_lines(out / "metrics.jsonl") <= 1
    # the relaunch is a sink re-opened in this process, not a resumed run
    fault_ledger.record(1, 0, metrics_lost=200 - len(set(history)))



# --------------------------------------------------------------------------------------------
# The same in a real run: 2 DeepSpeed CPU ranks of the tiny demo, output_dir on a small tmpfs
# --------------------------------------------------------------------------------------------
RUN_STEPS, EVAL_EVERY = 40, 10


@pytest.fixture
def run_disks(tmp_path, monkeypatch):
    """``tmp_path/run`` on a 1 MiB tmpfs (config, metrics.jsonl, the MLflow spool and state
    files), its ``checkpoints`` on a 64 MiB tmpfs mounted inside it: the checkpoints keep working
    while the small one is full. Unmounted inner first, then outer, whatever the test did."""
    disk = SmallDisk(tmp_path / "run", monkeypatch, size="1m")
    if not disk.mounted:  # a launched run's writes cannot be monkeypatched from here
        # the ranks are other processes: their writes cannot be failed from here, and a fake
        # full disk inside them would not test what a real one does. Skipped only where this
        # process provably may not mount (no CAP_SYS_ADMIN); with it, a failed mount fails
        if may_mount():
            pytest.fail(f"mounting a tmpfs failed although this process has CAP_SYS_ADMIN: "
                        f"{disk.why}")
        pytest.skip("cannot mount a tmpfs here (needs CAP_SYS_ADMIN, which this suite's CI "
                    "has): the ranks' own writes must hit a real full disk")
    ckpts = disk.path / "checkpoints"
    ckpts.mkdir()
    inner = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(ckpts)],
                           capture_output=True, text=True)
    try:
        assert inner.returncode == 0, inner.stderr
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(ckpts)], capture_output=True)
        disk.unmount()


def printed_step(log: Path) -> int:
    """The last ``step N/RUN_STEPS`` progress line rank 0 printed (0 before the first). Rank 0
    prints it after writing that step's records: what it shows is in the files, or not."""
    found = re.findall(rf"^step (\d+)/{RUN_STEPS} ", log.read_text(errors="replace"), re.M)
    return int(found[-1]) if found else 0


def block_full(path: Path) -> bool:
    """On a disk with no free block, a file takes no more bytes once its last block is full."""
    size = path.stat().st_size
    return size > 0 and size % os.statvfs(path).f_bsize == 0


def test_a_real_run_whose_output_disk_fills_trains_on_and_counts_the_lines_it_lost(
        tmp_path, tiny_data, store, run_disks, fault_ledger):
    """The issue's case as a user meets it: a 2-rank DeepSpeed pretraining whose output_dir
    fills up after a few steps, stays full for several, then the operator makes room. MLflow is
    a sqlite store on another disk. The run must finish as if nothing happened, say so once per
    sink, log how many records the files are missing, and MLflow must have every step."""
    uri, client = store
    disk = run_disks
    out = disk.path
    jsonl, spool = out / "metrics.jsonl", out / "tracking/spool.jsonl"
    log_path = tmp_path / "run.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            deepspeed_cmd(2, *tiny_run_args(
                out, tiny_data, f"train.total_steps={RUN_STEPS}",
                f"eval.every_steps={EVAL_EVERY}", f"checkpoint.every_steps={EVAL_EVERY}",
                f"tracking.uri={uri}", f"tracking.experiment={EXPERIMENT}",
                "tracking.system_metrics=false", "tracking.flush_every_s=0.2")),
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: printed_step(log_path) >= 3, proc, "step 3")
        # (read before: a step the run prints while the disk fills may already lose its record)
        filled_at = printed_step(log_path)
        disk.fill()
        # the files' last blocks take a few more lines; then neither sink can write
        wait_until(lambda: "cannot write metrics to" in log_path.read_text() and block_full(spool),
                 proc, "both sink files to run out of room")
        failing_from = printed_step(log_path)
        wait_until(lambda: printed_step(log_path) >= failing_from + 5, proc,
                 "5 more steps on the full disk")
        disk.grow()  # the operator makes room
        grown_at = printed_step(log_path)
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log_path.read_text(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert printed_step(log_path) == RUN_STEPS
    assert grown_at + 2 < RUN_STEPS, "the run outpaced the test: no step after room was back"
    # the checkpoints' own disk never filled: every one of them is there
    assert (out / f"checkpoints/step_{RUN_STEPS:08d}/COMPLETE.json").is_file()

    # one warning per sink while the disk is full, however many steps it lasts -- the tracker's
    # names the first of its files that failed (the spool, or its delivery cursor) -- and one
    # count per sink file at the end
    assert text.count(f"cannot write metrics to {jsonl} ([Errno 28] No space left on device); "
                      f"training goes on") == 1, text[-3000:]
    said = re.findall(rf"cannot write ({re.escape(str(out / 'tracking'))}/\S+) \(\[Errno 28\] "
                      r"No space left on device\); training goes on, metrics still go to MLflow "
                      r"from memory", text)
    assert len(said) == 1, text[-3000:]
    [lines_lost] = re.findall(rf"(\d+) metric records were not written to {re.escape(str(jsonl))} "
                              r"\(\[Errno 28\] No space left on device\)\n", text)
    [spooled_lost] = re.findall(rf"(\d+) metric records were not written to "
                                rf"{re.escape(str(spool))} \(\[Errno 28\] No space left on "
                                r"device\); all of them reached MLflow\n", text)
    lines_lost, spooled_lost = int(lines_lost), int(spooled_lost)
    assert text.count("No space left on device") == 4, text[-3000:]  # those, nothing else
    assert "not delivered to MLflow" not in text

    # MLflow: every step once, although both files lost some
    run = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])
    assert len(run) == 1
    run = run[0]
    assert run.info.status == "FINISHED"
    history = {key: sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
               for key in ("train/loss", "eval/demo_val/top1", "log/unwritten_records")}
    assert history["train/loss"] == list(range(1, RUN_STEPS + 1))
    evals = list(range(EVAL_EVERY, RUN_STEPS + 1, EVAL_EVERY))
    assert history["eval/demo_val/top1"] == evals
    logged = RUN_STEPS + len(evals)  # the trainer's log calls: a train line a step + the evals

    # what the files miss is what the run counted and logged, once room was back
    records = read_jsonl(jsonl)
    spooled = [r for r, _ in read_spool(spool)]
    assert lines_lost == logged - len(records) > 0
    assert spooled_lost == logged - len(spooled) > 0
    unwritten = lines_lost + spooled_lost
    later = [r for r in records if r["step"] > grown_at + 1 and "train/loss" in r]
    assert [r["step"] for r in later] == list(range(grown_at + 2, RUN_STEPS + 1))
    assert all(r["log/unwritten_records"] == unwritten for r in later), later
    # counted from the first record that did not fit on, at every step: in MLflow too
    counted = history["log/unwritten_records"]
    assert counted == list(range(counted[0], RUN_STEPS + 1)) and counted[0] > filled_at + 1
    assert run.data.metrics["log/unwritten_records"] == unwritten
    assert [r["step"] for r, _ in read_spool(spool) if r["step"] > grown_at + 1
            and "train/loss" in r["metrics"]] == list(range(grown_at + 2, RUN_STEPS + 1))
    # only records logged while the disk was full are missing; the files parse but for at most
    # the one line the disk cut short
    train_steps = [r["step"] for r in records if "train/loss" in r]
    assert set(range(1, RUN_STEPS + 1)) - set(train_steps) <= set(range(filled_at + 1,
                                                                        grown_at + 2))
    assert damaged_lines(jsonl) <= 1 and damaged_lines(spool) <= 1
    print(f"\ndisk filled at step {filled_at}, both files full from step {failing_from}, room "
          f"again at step {grown_at}: {lines_lost} records missing from metrics.jsonl (steps "
          f"{sorted(set(range(1, RUN_STEPS + 1)) - set(train_steps))}), {spooled_lost} from the "
          f"spool (cut short: {damaged_lines(jsonl)}, {damaged_lines(spool)}); "
          f"log/unwritten_records={unwritten}; MLflow holds all {len(history['train/loss'])} "
          f"steps; the tracker first failed on {said[0]}")
    # a fault survived without a restart
    fault_ledger.record(1, 0, metrics_lost=RUN_STEPS - len(set(history["train/loss"])))

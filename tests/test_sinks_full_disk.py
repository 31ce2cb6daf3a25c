"""The metric sinks on a full disk: a real size-limited filesystem (tmpfs) under the run's output
directory fills up mid-run. Training must not notice beyond one warning per sink; what could not be
written is counted, MLflow still receives every record (from memory, to a real sqlite store on
another disk), and once there is room again the files take new lines and still parse."""
import contextlib
import errno
import json
import logging
import os
import subprocess
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from pretrain.metrics import JsonlLogger, MultiLogger, read_jsonl
from pretrain.spool import RunState, read_spool
from pretrain.tracking import MlflowTracker

pytestmark = pytest.mark.faults

EXPERIMENT = "full-disk"


class SmallDisk:
    """A 64 KiB tmpfs at ``path`` (root in a container can usually mount one). Without one the
    ENOSPC is injected into ``os.write`` for files under ``path`` instead (the sinks' line
    writes; state files then do not fail)."""

    def __init__(self, path: Path, monkeypatch):
        self.path = path
        self._monkeypatch = monkeypatch
        path.mkdir(parents=True)
        try:
            mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)],
                                   capture_output=True, text=True)
            why = mount.stderr.strip() if mount.returncode else None
        except FileNotFoundError:
            why = "no mount command"
        self.mounted = why is None
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
                            system_metrics=False, flush_every_s=0.05, close_timeout_s=30)
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
    fault_ledger.record(1, 1, metrics_lost=320 - len(set(history)))


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
    fault_ledger.record(1, 1, metrics_lost=200 - len(set(history)))

"""MLflow tracking for real: a real `mlflow server` (sqlite store, served artifacts), the tiny
pretraining on 2 DeepSpeed ranks, queried afterwards with MlflowClient. One server serves the
whole file; each test uses its own experiment so "exactly one run" means something."""
import contextlib
import http.client
import http.server
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from conftest import (REPO, deepspeed_cmd, free_port, run_deepspeed, run_launcher, sqlite_store,
                      tiny_run_args, wait_until)
from pretrain.metrics import read_jsonl
from test_model_registry import assert_logged_model

STEPS = 40


@pytest.fixture
def client(mlflow_server, monkeypatch):
    # launched jobs find the server the way cluster jobs do: through the environment
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    return MlflowClient(mlflow_server.uri)


def the_run(client, experiment):
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id]) if exp else []
    assert len(runs) == 1, f"{len(runs)} runs in experiment {experiment}"
    return runs[0]


def steps_of(client, run_id, key="train/loss"):
    return [m.step for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def last_values(out):
    """metrics.jsonl as {key: {step: value}}; a step logged twice (before a kill and after the
    resume) counts with its later value."""
    table = {}
    for r in read_jsonl(out / "metrics.jsonl"):
        for k, v in r.items():
            if k not in ("step", "time"):
                table.setdefault(k, {})[r["step"]] = v
    return table


def launch(tmp_path, name, args):
    log = open(tmp_path / f"{name}.log", "w")
    proc = subprocess.Popen(deepspeed_cmd(2, *args), cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    return proc, tmp_path / f"{name}.log"


def report_tracking_time(text):
    """The trainer's closing note on time spent in tracking calls (printed for the record)."""
    found = re.findall(r"tracking: \d+ log calls took .*", text)
    assert found, "the tracker's timing note is missing"
    print("\n" + "\n".join(found))


@pytest.mark.faults
def test_a_run_is_tracked_once_and_no_metric_is_lost_over_a_server_outage(
        tmp_path, tiny_data, client, mlflow_server, fault_ledger):
    """... and its backbone, asked for with tracking.register_as, is registered at the end."""
    out, exp = tmp_path / "run", "outage"
    proc, log_path = launch(tmp_path, "outage", tiny_run_args(
        out, tiny_data, f"train.total_steps={STEPS}", "eval.every_steps=20",
        "checkpoint.every_steps=20", "optimizer.lr=3e-3", f"tracking.experiment={exp}",
        "tracking.flush_every_s=0.2", "tracking.register_as=tiny-backbone"))
    try:
        # the server goes down once the run exists and has metrics in it
        def delivered():
            e = client.get_experiment_by_name(exp)
            runs = client.search_runs([e.experiment_id]) if e else []
            return runs and client.get_metric_history(runs[0].info.run_id, "train/loss")
        wait_until(delivered, proc, "the first metrics reached MLflow")
        mlflow_server.stop()
        # training goes on without the server: the jsonl sink sees steps MLflow cannot
        jsonl = out / "metrics.jsonl"
        wait_until(lambda: max((r["step"] for r in read_jsonl(jsonl)), default=0) >= 10,
                   proc, "training went on during the outage")
        mlflow_server.start()  # same port, same store
        proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if mlflow_server.proc.poll() is not None:  # the other tests need it back
            mlflow_server.start()
    text = log_path.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert text.count("unreachable") == 1, text[-3000:]  # one warning, not one per step
    # the end's export of the backbone is said while it runs, once (rank 0)
    assert text.count(f"exporting the backbone to {out / 'backbone'} for MLflow") == 1, \
        text[-3000:]

    run = the_run(client, exp)
    rid = run.info.run_id
    assert run.info.status == "FINISHED"
    params = run.data.params
    # the launcher's built-in demo recipe under the tiny overrides
    assert params["model.name"] == "vit_tiny_patch16_224" and params["optimizer.lr"] == "0.003"
    assert params["train.total_steps"] == str(STEPS) and params["model.depth"] == "2"
    assert params["deepspeed.zero_stage"] == "1"  # the stage run, where the config left it unset
    # keys left unset are logged as the run resolved them: the model name's MLP ratio, the
    # batch layout for 2 ranks (16 = 2 x 8 x 1)
    assert (params["model.mlp_ratio"], params["train.micro_batch_size"],
            params["train.grad_accum_steps"]) == ("4.0", "8", "1")
    tags = run.data.tags
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    assert (tags["stage"], tags["model"], tags["dataset"]) == ("pretrain",
                                                               "vit_tiny_patch16_224", "tiny")
    assert tags["git.commit"] == commit and tags["git.dirty"] in ("true", "false")
    assert tags["world_size"] == "2" and tags["hosts"] == socket.gethostname()
    # the UI's Source and User columns (blank for runs made through the client)
    import getpass
    assert tags["mlflow.source.name"].endswith("launch/pretrain.py")
    assert (tags["mlflow.source.type"], tags["mlflow.user"]) == ("LOCAL", getpass.getuser())

    # every value the trainer logged is in MLflow, once, at its step
    logged = last_values(out)
    assert sorted(logged["train/loss"]) == list(range(1, STEPS + 1))
    fault_ledger.record(1, 0, metrics_lost=len(set(logged["train/loss"]) - set(steps_of(client, rid))))
    for key in ["train/loss", "train/lr", "train/grad_norm", "perf/images_per_sec",
                "perf/tflops", "perf/data_wait_frac", "data/skipped_samples",
                "eval/demo_val/top1", "eval/demo_val/top5"]:
        history = {m.step: m.value for m in client.get_metric_history(rid, key)}
        assert len(history) == len(client.get_metric_history(rid, key)), f"{key}: a step twice"
        assert history == pytest.approx(logged[key], rel=1e-6), key
    assert steps_of(client, rid, "eval/demo_val/top1") == [20, 40]

    files = {a.path for a in client.list_artifacts(rid)}
    assert {"config.yaml", "deepspeed_config.json", "environment.json",
            "train_samples.png"} <= files
    local = client.download_artifacts(rid, "", str(tmp_path / "artifacts"))
    from pretrain.config import PretrainConfig
    from pretrain.config_files import load_config
    assert load_config(PretrainConfig, f"{local}/config.yaml").optimizer.lr == pytest.approx(3e-3)
    ds = json.loads(open(f"{local}/deepspeed_config.json").read())
    assert ds["train_batch_size"] == 16
    assert "mlflow" in json.loads(open(f"{local}/environment.json").read())["packages"]
    from PIL import Image
    with Image.open(f"{local}/train_samples.png") as png:  # 8 samples of 16 px, tiled
        assert png.width >= 3 * 16 and png.height >= 3 * 16
    from test_model_registry import assert_backbone_registered
    assert_backbone_registered(mlflow_server.uri, "tiny-backbone", rid, out, tmp_path)
    report_tracking_time(text)


def test_sigkill_and_resume_continue_the_same_run_without_gap_or_repeat(
        tmp_path, tiny_data, client):
    out, exp = tmp_path / "run", "resume"
    args = tiny_run_args(out, tiny_data, f"train.total_steps={STEPS}", "eval.every_steps=20",
                         "checkpoint.every_steps=8", f"tracking.experiment={exp}",
                         "tracking.flush_every_s=0.2", "tracking.system_metrics_every_s=0.5")
    proc, log_path = launch(tmp_path, "killed", args)
    ckpts = out / "checkpoints"

    def newest_checkpoint():
        done = [int(p.parent.name.split("_")[1]) for p in ckpts.glob("step_*/COMPLETE.json")]
        return max(done, default=0)

    def mlflow_ahead_of_checkpoint():
        # kill only when MLflow holds steps after the newest checkpoint: the resumed job then
        # re-runs steps MLflow already has, which is what must not show up twice
        c = newest_checkpoint()
        state = out / "tracking/run.json"
        rid = json.loads(state.read_text())["run_id"] if state.exists() else None
        return c >= 8 and rid and max(steps_of(client, rid), default=0) > c
    try:
        wait_until(mlflow_ahead_of_checkpoint, proc, "MLflow got ahead of a checkpoint")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole node goes down at once
        proc.wait()
    rid = the_run(client, exp).info.run_id
    before = steps_of(client, rid)
    assert not (ckpts / f"step_{STEPS:08d}/COMPLETE.json").exists()

    again = run_deepspeed(2, *args)  # the same command, relaunched
    text = again.stdout + again.stderr
    resumed_at = int(text.split("at step ")[1].split()[0])
    # Usually MLflow holds steps past resumed_at here (the kill waits for that), but a checkpoint
    # can complete between that check and the kill; the overlap case is pinned down
    # deterministically by test_a_resumed_job_sends_only_steps_mlflow_does_not_hold.
    print(f"\nMLflow held steps up to {max(before)}; resumed at {resumed_at}")
    assert f"run {rid}" in text  # attached to the run the checkpoint names

    run = the_run(client, exp)  # still exactly one run
    assert run.info.run_id == rid and run.info.status == "FINISHED"
    assert steps_of(client, rid) == list(range(1, STEPS + 1))  # no gap, no repeat
    assert steps_of(client, rid, "train/lr") == list(range(1, STEPS + 1))
    assert steps_of(client, rid, "eval/demo_val/top1") == [20, 40]
    # the system metrics are on by default
    assert "system/cpu_utilization_percentage" in run.data.metrics
    # the resume is exact, so the killed job's values for steps it re-ran stand for both
    mlflow_loss = {m.step: m.value for m in client.get_metric_history(rid, "train/loss")}
    assert mlflow_loss == pytest.approx(last_values(out)["train/loss"], rel=1e-5)
    report_tracking_time(text)


def test_a_finetune_that_never_reached_the_server_is_uploaded_afterwards_with_lineage(
        tmp_path, client, mlflow_server, caplog, monkeypatch):
    """In-process (one rank, no DeepSpeed): the fine-tune stage's call, a server that is down
    for the whole job, then the documented upload command."""
    from finetune.config import FinetuneConfig
    from pretrain.config_files import load_config
    from pretrain.spool import undelivered
    from pretrain.run_info import lineage_tags
    from pretrain.tracking import start_tracking

    exp = "lineage"
    # the tracker fails fast by setting these when unset; keep that out of the other tests
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
    pre = client.create_run(client.create_experiment(exp), run_name="pretrain").info.run_id
    out = tmp_path / "ft"
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = load_config(FinetuneConfig, None, [
        f"tracking.uri={dead}", f"tracking.experiment={exp}", "tracking.flush_every_s=0.05",
        "tracking.close_timeout_s=3", "tracking.system_metrics=false", "data.root=cifar10"])
    caplog.set_level(logging.INFO, logger="pretrain.tracking")
    started = int(time.time() * 1000)
    tracker = start_tracking(cfg, "finetune", out, 0, world_size=1, hosts=["node0"],
                             extra_tags=lineage_tags(pre, "/ckpt/step_00000008", 8))
    for step in range(1, 6):
        tracker.log({"train/loss": 1.0 / step, "eval/cifar10_dev/top1": 0.1 * step}, step)
        time.sleep(0.05)  # let the thread try (and fail) while the job "trains"
    # its model, to be registered: the registration waits for the upload too
    from pretrain.export import from_model
    from pretrain.timm_folder import write_timm_folder
    from test_timm_folder import random_model
    tracker.log_model(write_timm_folder(from_model(random_model(), source="ft"), tmp_path / "best",
                                        head=True, normalize="imagenet"), register_as="late")
    # (its address is not known yet: said so, not as a "<run id>" placeholder)
    assert f"MLflow model of {tmp_path / 'best'}: the run's 'model' once the run reaches " \
           f"MLflow, to be registered as 'late'" in caplog.text
    tracker.close()
    ended = int(time.time() * 1000)
    time.sleep(1.0)  # the upload comes later: the run's times must be the job's, not its own
    # the job's end waits for the server a while: said, with what it waits for
    assert re.search(r"tracking: waiting for MLflow to take \d+ pending records \(up to 3 s\)",
                     caplog.text), caplog.text[-2000:]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("unreachable" in r.getMessage() for r in warnings) == 1
    assert tracker.run_id is None and undelivered(out / "tracking") == 5
    # everything left for the upload is said: not only the metrics
    assert re.search(
        rf"not delivered to MLflow at {re.escape(dead)}: the run itself \(never created there\), "
        rf"5 metric records \(5 of them in {re.escape(str(out / 'tracking/spool.jsonl'))}\), "
        rf"[1-9]\d* artifact files \(\d+\.\d MiB\), the registration as 'late'; `python "
        rf"launch/upload_spool.py {re.escape(str(out))}` sends them", caplog.text), caplog.text

    up = run_launcher("upload_spool.py", str(out), "--uri", mlflow_server.uri, timeout=120)
    assert up.returncode == 0, up.stderr[-2000:]
    assert "5 records" in up.stdout
    # what it sends, said before it sends it (a model's files can take minutes)
    assert re.search(r"tracking: sending 5 records and [1-9]\d* artifact files \(\d+\.\d "
                     r"MiB\) to run ", up.stderr), up.stderr[-2000:]
    again = run_launcher("upload_spool.py", str(out), "--uri", mlflow_server.uri, timeout=120)
    assert again.returncode == 0 and "0 records" in again.stdout  # nothing is sent twice

    runs = client.search_runs([client.get_experiment_by_name(exp).experiment_id],
                              filter_string=f"tags.`pretrain.run_id` = '{pre}'")
    assert len(runs) == 1
    ft = runs[0]
    assert ft.info.status == "FINISHED" and ft.data.tags["stage"] == "finetune"
    # the run started and ended with its job (UI's Duration), not at its delivery
    assert started <= ft.info.start_time <= ft.info.end_time <= ended
    assert ft.data.tags["mlflow.parentRunId"] == pre  # nested under the pretraining run
    assert ft.data.tags["pretrain.step"] == "8"
    assert ft.data.tags["pretrain.checkpoint"] == "/ckpt/step_00000008"
    assert ft.data.params["optimizer.name"] == "sgd"
    # AdamW's settings, which SGD never reads, are not params to compare
    assert ft.data.params["optimizer.momentum"] == "0.9" and "optimizer.betas" not in \
        ft.data.params and "optimizer.eps" not in ft.data.params
    assert steps_of(client, ft.info.run_id) == [1, 2, 3, 4, 5]
    assert "config.yaml" in {a.path for a in client.list_artifacts(ft.info.run_id)}
    (version,) = client.search_model_versions("name = 'late'")
    model = assert_logged_model(client, ft.info.run_id, "late")
    assert version.run_id == ft.info.run_id and version.source == f"models:/{model.model_id}"
    assert model.tags["pretrain.run_id"] == pre  # what it was fine-tuned from, on the model too

    # sent to another store too: all of it, into a run of its own there (the metrics and the
    # registration went into the first store's run; before, the new run got params only)
    other = sqlite_store(tmp_path / "other", exp)
    copy = run_launcher("upload_spool.py", str(out), "--uri", other, timeout=120)
    assert copy.returncode == 0 and "5 records" in copy.stdout, copy.stderr[-2000:]
    there = MlflowClient(other)
    [run] = there.search_runs([there.get_experiment_by_name(exp).experiment_id])
    assert run.info.run_id != ft.info.run_id and run.info.status == "FINISHED"
    assert steps_of(there, run.info.run_id) == [1, 2, 3, 4, 5]
    (version,) = there.search_model_versions("name = 'late'")
    assert version.run_id == run.info.run_id
    assert_logged_model(there, run.info.run_id, "late")  # a model of its own there too
    assert steps_of(client, ft.info.run_id) == [1, 2, 3, 4, 5]  # the first store's as it was

    missing = run_launcher("upload_spool.py", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
    typo = run_launcher("upload_spool.py", str(out), "--uri", "htps://127.0.0.1:5001")
    assert typo.returncode == 2 and typo.stderr.strip().splitlines() == [
        "error: --uri=htps://127.0.0.1:5001: 'htps' is no MLflow tracking store; write "
        "http(s)://HOST:PORT for a server, sqlite:///PATH.db, or a database URL (postgresql://, "
        "mysql://, mssql://)"]


def test_every_node_s_system_metrics_reach_the_run_after_an_outage_and_continue_on_resume(
        tmp_path, client, mlflow_server, monkeypatch):
    """In-process: rank 0's job on this host and, beside it, the sampler the first rank of a
    second node runs (host "gpu-b", writing into the shared output_dir). The server is away for
    the whole first job: every sample of both nodes arrives with the upload; a resumed job's
    samples follow on, step by step, sent by its tracker."""
    from pretrain.config import PretrainConfig
    from pretrain.config_files import load_config
    from pretrain.system_metrics import NodeSampler, prefix_for
    from pretrain.tracking import start_tracking

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
    here, out, exp = socket.gethostname(), tmp_path / "run", "system-metrics"
    hosts = [here, here, "gpu-b", "gpu-b"]  # every rank's host
    settings = [f"tracking.experiment={exp}", "tracking.flush_every_s=0.05",
                "tracking.system_metrics_every_s=0.1", "tracking.close_timeout_s=1"]

    def job(uri, run_id=None, resumed_at=None):
        cfg = load_config(PretrainConfig, None, [f"tracking.uri={uri}", *settings])
        tracker = start_tracking(cfg, "pretrain", out, 0, world_size=4, hosts=hosts,
                                 run_id=run_id, resumed_at=resumed_at)
        other = NodeSampler(out / "tracking", out, 0.1, prefix_for("gpu-b", hosts), "gpu-b")
        for step in range(1, 5):
            tracker.log({"train/loss": 1.0 / step}, step)
            time.sleep(0.2)
        other.close()
        tracker.close()
        return tracker

    def samples(host):
        lines = (out / "tracking/system" / f"{host}.jsonl").read_text().splitlines()
        return [json.loads(line)["metrics"][f"system/{host}/cpu_utilization_percentage"]
                for line in lines]

    def history(rid, host):
        return [(m.step, m.value) for m in sorted(client.get_metric_history(
            rid, f"system/{host}/cpu_utilization_percentage"), key=lambda m: m.step)]

    first = job(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    assert first.run_id is None
    before = {h: samples(h) for h in (here, "gpu-b")}
    assert all(len(v) >= 2 for v in before.values()), before
    up = run_launcher("upload_spool.py", str(out), "--uri", mlflow_server.uri, timeout=120)
    assert up.returncode == 0, up.stderr[-2000:]
    assert f"4 records, {sum(map(len, before.values()))} system metric samples" in up.stdout
    rid = the_run(client, exp).info.run_id
    for host, values in before.items():  # every sample, in order, numbered from 0
        assert history(rid, host) == list(enumerate(values))
    run = client.get_run(rid)
    assert f"system/{here}/output_dir_available_megabytes" in run.data.metrics
    assert not any(k.startswith("system/") and k.count("/") == 1 for k in run.data.metrics)

    job(mlflow_server.uri, run_id=rid, resumed_at=4)  # the relaunch, the server up
    for host in (here, "gpu-b"):
        values = samples(host)
        assert len(values) > len(before[host])
        assert history(rid, host) == list(enumerate(values))  # followed on: no gap, no repeat


def test_system_samples_reach_mlflow_once_though_their_cursor_cannot_be_written(tmp_path):
    """The tracker's thread sends a node's new samples at every flush; where the file saying
    how far it got cannot be written (a full disk), and for a later job that finds that file
    behind (a crash between the send and the write), what MLflow holds is not sent again."""
    from pretrain.mlflow_delivery import Remote
    from pretrain.spool import RunState
    from pretrain.system_metrics import NodeSampler

    track, uri, key = tmp_path / "tracking", sqlite_store(tmp_path, "x"), \
        "system/cpu_utilization_percentage"
    sampler = NodeSampler(track, tmp_path, every_s=3600, host="gpu-a")  # samples when asked
    for _ in range(3):
        sampler.sample()
        time.sleep(0.01)
    sampler.close()
    times = [json.loads(line)["time"] for line in
             (track / "system/gpu-a.jsonl").read_text().splitlines()]
    cursor = track / "system/gpu-a.delivered"
    cursor.mkdir()  # cannot be written, as on a full disk
    failed = []
    remote = Remote(track, RunState(uri=uri, experiment="x"),
                    on_write_error=lambda path, e: failed.append(path))
    remote.connect()
    assert [remote.send_system() for _ in range(3)] == [3, 0, 0]  # three flushes
    assert failed == [cursor]  # (the rest of the job's state was written)

    def history():
        return [(m.step, m.timestamp) for m in sorted(
            MlflowClient(uri).get_metric_history(remote.state.run_id, key), key=lambda m: m.step)]
    assert history() == list(enumerate(times))
    cursor.rmdir()  # the next job finds no cursor: it reads the samples from the start
    with open(track / "system/gpu-a.jsonl", "a") as f:  # and its own first sample after them
        f.write(json.dumps({"time": times[-1] + 10_000, "metrics": {key: 1.0}}) + "\n")
    again = Remote(track, RunState(uri=uri, experiment="x", run_id=remote.state.run_id))
    again.connect()
    assert again.send_system() == 4  # 4 read, the 3 MLflow holds skipped
    assert history() == list(enumerate(times + [times[-1] + 10_000]))


def test_tracking_uri_precedence_and_default(tmp_path, monkeypatch, caplog):
    """Config beats MLFLOW_TRACKING_URI beats the default, which is the store a plain `mlflow ui`
    started in the launch directory reads (MLflow's own default, resolved there)."""
    import mlflow

    from pretrain.tracking_store import resolve_uri

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_uri(None) == f"sqlite:///{tmp_path}/mlflow.db" == mlflow.get_tracking_uri()
    (tmp_path / "mlruns/1").mkdir(parents=True)
    (tmp_path / "mlruns/1/meta.yaml").write_text("name: x\n")
    # an existing file store: this MLflow refuses to open one (so would `mlflow ui` there)
    # unless allowed, so runs go to sqlite, with a warning that says how to see them
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with caplog.at_level(logging.WARNING, logger="pretrain.tracking"):
        assert resolve_uri(None) == f"sqlite:///{tmp_path}/mlflow.db"
    assert f"mlflow ui --backend-store-uri sqlite:///{tmp_path}/mlflow.db" in caplog.text
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # allowed: the file store wins
    assert resolve_uri(None) == (tmp_path / "mlruns").as_uri() == mlflow.get_tracking_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://env:5000")
    assert resolve_uri(None) == "http://env:5000"
    assert resolve_uri("http://config:5000") == "http://config:5000"
    # a relative sqlite path is the launch directory's: kept absolute for resumes from elsewhere
    assert resolve_uri("sqlite:///runs/mlflow.db") == f"sqlite:///{tmp_path}/runs/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
    assert resolve_uri(None) == f"sqlite:///{tmp_path}/mlflow.db"


def test_a_resumed_job_sends_only_steps_mlflow_does_not_hold(tmp_path, client, mlflow_server,
                                                             monkeypatch):
    """In-process and deterministic: the killed job delivered steps 1-6 (checkpoint at 4) and
    left nothing in its spool, so only MLflow itself can say which steps to skip."""
    from pretrain.config import PretrainConfig
    from pretrain.config_files import load_config
    from pretrain.tracking import start_tracking

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
    exp, out = "resume-unit", tmp_path / "run"
    cfg = load_config(PretrainConfig, None, [
        f"tracking.uri={mlflow_server.uri}", f"tracking.experiment={exp}",
        "tracking.flush_every_s=0.05", "tracking.system_metrics=false", "train.total_steps=9"])
    first = start_tracking(cfg, "pretrain", out, 0, world_size=1, hosts=["node0"])
    for step in range(1, 7):
        first.log({"train/loss": float(step)}, step)
    first.close()
    rid = first.run_id
    # requeued onto two nodes of 4 ranks each
    second = start_tracking(cfg, "pretrain", out, 0, world_size=8, hosts=["node3", "node1"] * 4,
                            run_id=rid, resumed_at=4, changed=["optimizer.lr: 0.001 -> 0.0005"])
    for step in range(5, 10):
        second.log({"train/loss": 10.0 + step}, step)
    second.close()
    history = sorted((m.step, m.value) for m in client.get_metric_history(rid, "train/loss"))
    # steps 5 and 6 keep the first job's values; 7-9 come from the resumed one
    assert history == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0), (6, 6.0),
                       (7, 17.0), (8, 18.0), (9, 19.0)]
    run = the_run(client, exp)
    assert run.info.status == "FINISHED"
    # the tags say what ran the run last, and from which step each number of ranks ran it
    tags = run.data.tags
    assert (tags["world_size"], tags["hosts"], tags["num_hosts"]) == ("8", "node1,node3", "2")
    assert tags["world_size.history"] == "1@0,8@4" and tags["jobs"] == "2"
    # the params are the start's (MLflow's cannot change): what the relaunch changed is a tag,
    # and its config an artifact beside the first
    assert run.data.params["optimizer.lr"] == "0.001"
    assert tags["config.changed"] == "from step 4: optimizer.lr: 0.001 -> 0.0005"
    assert tags["config.now.optimizer.lr"] == "0.0005"  # beside the param, in Compare
    assert {"config.yaml", "resume_step_00000004"} <= {a.path for a in client.list_artifacts(rid)}
    # the same settings again: nothing to say; a run name given now renames the run
    cfg = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(
        update={"run_name": "renamed"})})
    assert the_run(client, exp).info.run_name == "run"  # (the output_dir's name)
    third = start_tracking(cfg, "pretrain", out, 0, world_size=8, hosts=["node3", "node1"] * 4,
                           run_id=rid, resumed_at=9)
    third.close()
    assert client.get_run(rid).info.run_name == "renamed"
    client.set_tag(rid, "mlflow.runName", "as-the-ui-renamed-it")  # later, by hand: it stays
    fourth = start_tracking(cfg, "pretrain", out, 0, world_size=8, hosts=["node3", "node1"] * 4,
                            run_id=rid, resumed_at=9)
    fourth.close()
    assert client.get_run(rid).info.run_name == "as-the-ui-renamed-it"
    assert [a.path for a in client.list_artifacts(rid, "resume_step_00000009")] == [
        "resume_step_00000009/environment.json"]  # the job's machines, as each job's
    assert client.get_run(rid).data.tags["config.changed"] == tags["config.changed"]
    assert client.get_run(rid).data.tags["jobs"] == "4"


def test_a_run_deleted_in_mlflow_goes_on_in_a_new_run_that_gets_all_of_it(
        tmp_path, client, mlflow_server, caplog):
    """Someone deletes the run in the UI while its job trains (or before the job is resumed):
    MLflow keeps it, deleted, and refuses every record for it. The tracker starts a new run
    and sends it everything: the steps the deleted run had, the later ones, the artifacts, the
    system samples, each once. Before, every flush warned that MLflow "rejected" its metrics and
    dropped them (they were not sent again later either), and a resumed job was refused its
    run for good."""
    from pretrain.config import PretrainConfig
    from pretrain.config_files import load_config
    from pretrain.spool import RunState
    from pretrain.system_metrics import NodeSampler
    from pretrain.tracker import MlflowTracker
    from pretrain.tracking import start_tracking

    exp, track, key = "deleted", tmp_path / "tracking", "system/cpu_utilization_percentage"
    sampler = NodeSampler(track, tmp_path, every_s=3600, host="gpu-a")  # samples when asked

    def active_run():
        runs = client.search_runs([client.get_experiment_by_name(exp).experiment_id],
                                  filter_string="attributes.status != 'FAILED'")
        assert len(runs) == 1, [r.info.run_id for r in runs]
        return runs[0]

    def train(tracker, steps, then=None):
        for step in steps:
            tracker.log({"train/loss": 1.0 / step}, step)
            sampler.sample()
            time.sleep(0.01)  # samples are told apart by their time
        if then:
            deadline = time.time() + 60
            while steps_of(client, tracker.run_id or "none") != list(range(1, steps[-1] + 1)):
                assert time.time() < deadline, "the tracker never delivered"
                time.sleep(0.05)
            then(tracker.run_id)

    with caplog.at_level(logging.WARNING):
        tracker = MlflowTracker(track, RunState(uri=mlflow_server.uri, experiment=exp),
                                flush_every_s=0.05, close_timeout_s=30)
        tracker.log_artifact_bytes("notes.txt", b"kept")
        train(tracker, range(1, 4), then=client.delete_run)  # in MLflow, then deleted
        first = tracker.run_id
        train(tracker, range(4, 7))
        tracker.close()
        run = active_run()
        assert run.info.run_id != first and run.info.status == "FINISHED"
        assert client.get_run(first).info.lifecycle_stage == "deleted"  # left as the user left it
        assert steps_of(client, run.info.run_id) == [1, 2, 3, 4, 5, 6]
        assert "notes.txt" in {a.path for a in client.list_artifacts(run.info.run_id)}
        assert steps_of(client, run.info.run_id, key) == [0, 1, 2, 3, 4, 5]  # 6 samples
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert said == [f"MLflow run {first} was deleted from the store at {mlflow_server.uri}; "
                        f"a new run gets everything this run logged"], said

        # relaunched from a checkpoint written before the deletion, which names the deleted
        # run: the job goes on in the run that replaced it, not in a third one
        cfg = load_config(PretrainConfig, None, [
            f"tracking.uri={mlflow_server.uri}", f"tracking.experiment={exp}",
            "tracking.system_metrics=false", "tracking.flush_every_s=0.05"])
        tracker = start_tracking(cfg, "pretrain", tmp_path, 0, world_size=1, run_id=first,
                                 resumed_at=3)
        train(tracker, range(7, 8))
        tracker.close()
        assert active_run().info.run_id == run.info.run_id
        assert steps_of(client, run.info.run_id) == list(range(1, 8))

        # deleted after that job: the next relaunch (from the same checkpoint) does as the
        # job did, its spool read from where the last job's delivery had got to
        client.delete_run(run.info.run_id)
        tracker = start_tracking(cfg, "pretrain", tmp_path, 0, world_size=1, run_id=first,
                                 resumed_at=3)
        train(tracker, range(8, 9))
        client.restore_run(first)  # restored by its user meanwhile: deleted while RUNNING
        tracker.close()
    sampler.close()
    again = active_run()  # the one run not FAILED: the restored one does not show RUNNING
    assert again.info.run_id not in (first, run.info.run_id)
    assert steps_of(client, again.info.run_id) == list(range(1, 9))
    restored = client.get_run(first)
    assert restored.info.status == "FAILED" and \
        restored.data.tags["stop.superseded_by"] == again.info.run_id
    assert steps_of(client, again.info.run_id, key) == list(range(8))
    assert "notes.txt" in {a.path for a in client.list_artifacts(again.info.run_id)}
    assert not [r for r in caplog.records if "rejected" in r.getMessage()]


class _Proxy(http.server.BaseHTTPRequestHandler):
    """A reverse proxy in front of the MLflow server; while ``server.away`` it answers every
    request with its own HTML 404 page, as an ingress does while its backend is gone, and so
    it answers the paths holding ``server.missing``, as a server without them does."""
    protocol_version = "HTTP/1.1"

    def _forward(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        hold = getattr(self.server, "hold", None)  # (path part, event): such requests wait
        if hold and hold[0] in self.path and not hold[1].is_set():
            self.server.held.set()
            hold[1].wait(60)
        missing = getattr(self.server, "missing", None)
        if self.server.away or missing and missing in self.path:
            status, headers, data = 404, [("Content-Type", "text/html")], \
                b"<html><body><h1>404 Not Found</h1></body></html>"
        else:
            conn = http.client.HTTPConnection(*self.server.upstream, timeout=30)
            conn.request(self.command, self.path, body, {
                k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")})
            answer = conn.getresponse()
            status, data = answer.status, answer.read()
            headers = [(k, v) for k, v in answer.getheaders()
                       if k.lower() not in ("transfer-encoding", "connection", "content-length")]
            conn.close()
        if hasattr(self.server, "answered"):  # (method, path) in the order they were answered
            self.server.answered.append((self.command, self.path))
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

    def log_message(self, *args):  # the test's output is the assertions', not a request log
        pass


@contextlib.contextmanager
def proxy_in_front(mlflow_server, hold: str | None = None, **attrs):
    """A :class:`_Proxy` in front of the session's server, serving until the block ends;
    ``hold``: a path part whose requests wait until ``proxy.hold[1]`` is set (``proxy.held``
    is, once one waits; set at the end in any case); ``attrs``: ``away``, ``missing``,
    ``answered`` (see :class:`_Proxy`)."""
    from urllib.parse import urlparse
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Proxy)
    up = urlparse(mlflow_server.uri)
    proxy.upstream, proxy.away = (up.hostname, up.port), False
    if hold:
        proxy.hold, proxy.held = (hold, threading.Event()), threading.Event()
    for k, v in attrs.items():
        setattr(proxy, k, v)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        yield proxy
    finally:
        if hold:
            proxy.hold[1].set()
        proxy.shutdown()


def test_a_proxys_404_while_the_server_is_away_is_an_outage_not_a_run_gone(
        tmp_path, client, mlflow_server, caplog):
    """An ingress answers 404 pages while its MLflow backend restarts: at the job's start the
    run is not refused for good (no run, no delivery for the rest of the job); mid-job it is
    not taken for deleted (a second run with everything sent again) nor are the metrics
    dropped as rejected; they wait, and reach the one run once it is back."""
    from pretrain.spool import RunState
    from pretrain.tracker import MlflowTracker

    exp = "behind-a-proxy"
    with proxy_in_front(mlflow_server) as proxy:
        with caplog.at_level(logging.WARNING):
            proxy.away = True  # from the job's start: the run is not created, nor refused
            tracker = MlflowTracker(tmp_path / "tracking", RunState(
                uri=f"http://127.0.0.1:{proxy.server_address[1]}", experiment=exp),
                flush_every_s=0.05, close_timeout_s=30)
            tracker.log({"train/loss": 1.0}, 1)
            time.sleep(1.0)
            proxy.away = False
            deadline = time.time() + 60
            while steps_of(client, tracker.run_id or "none") != [1]:
                assert time.time() < deadline, "the tracker never delivered"
                time.sleep(0.05)
            proxy.away = True
            for step in (2, 3):
                tracker.log({"train/loss": 1.0 / step}, step)
            time.sleep(1.0)  # a score of failed attempts
            proxy.away = False
            tracker.log({"train/loss": 0.25}, 4)
            tracker.close()
    run = the_run(client, exp)
    assert run.info.run_id == tracker.run_id and run.info.status == "FINISHED"
    assert steps_of(client, run.info.run_id) == [1, 2, 3, 4]
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 2 and all("unreachable" in m and "404" in m for m in said), said


def test_files_written_again_while_the_first_ones_upload_reach_mlflow_as_written_last(
        tmp_path, client, mlflow_server):
    """A relaunched fine-tune logs its model again while the thread still uploads the first
    package (a ViT's weights take minutes to send), and a relaunched job writes an artifact
    again under the same name: the run ends with the files as they were written last, every
    one of them, not with what was in flight when they were replaced; and the new package is
    registered once all of its files are up, not while they are on their way."""
    import mlflow
    from mlflow.entities import LoggedModelStatus

    from pretrain.export import from_model
    from pretrain.spool import ARTIFACTS, RunState
    from pretrain.timm_folder import write_timm_folder
    from pretrain.tracker import MlflowTracker
    from test_timm_folder import random_model

    folders = [write_timm_folder(from_model(random_model(), source="ft"), tmp_path / name,
                                 head=True, normalize="imagenet") for name in ("first", "second")]
    exp = "written-again"
    with proxy_in_front(mlflow_server, hold="/models/m-", answered=[]) as proxy:  # (its files)
        tracker = MlflowTracker(tmp_path / "tracking", RunState(
            uri=f"http://127.0.0.1:{proxy.server_address[1]}", experiment=exp),
            flush_every_s=0.05, close_timeout_s=60)
        tracker.log_artifact_bytes("notes.json", b'{"job": 1}')
        deadline = time.time() + 60
        while "notes.json" not in tracker.state.uploaded:
            assert time.time() < deadline, "the first notes.json was never uploaded"
            time.sleep(0.05)
        tracker.log_artifact_bytes("notes.json", b'{"job": 2}')
        tracker.log_model(folders[0])
        assert proxy.held.wait(60), "the first package's upload never started"
        tracker.log_model(folders[1], register_as="written-again")  # while the first uploads
        proxy.hold[1].set()
        tracker.close()
    run = the_run(client, exp)
    assert run.info.status == "FINISHED"
    got = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "got")))
    assert (got / "notes.json").read_bytes() == b'{"job": 2}'
    # the first package, replaced half-way, is a FAILED logged model; the second one READY
    first, second = sorted(client.search_logged_models([run.info.experiment_id]),
                           key=lambda m: m.creation_timestamp)
    assert (first.status, second.status) == (LoggedModelStatus.FAILED, LoggedModelStatus.READY)
    got = Path(mlflow.artifacts.download_artifacts(f"models:/{second.model_id}",
                                                   dst_path=str(tmp_path / "got-model"),
                                                   tracking_uri=mlflow_server.uri))
    written = tmp_path / "tracking" / ARTIFACTS / "model"
    files = sorted(p.relative_to(written) for p in written.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(got) for p in got.rglob("*")
                           if p.is_file() and p.name != "registered_model_meta")
    assert [f for f in files if (got / f).read_bytes() != (written / f).read_bytes()] == []
    (version,) = client.search_model_versions("name = 'written-again'")
    assert version.source == f"models:/{second.model_id}"
    registered = [i for i, (_, path) in enumerate(proxy.answered)
                  if "model-versions/create" in path]
    uploads = [i for i, (method, path) in enumerate(proxy.answered)
               if method == "PUT" and f"/models/{second.model_id}/" in path]
    assert len(registered) == 1 and uploads and max(uploads) < registered[0], proxy.answered


def test_a_logged_model_deleted_while_its_package_uploads_gets_the_package_again(
        tmp_path, client, mlflow_server, caplog):
    """The run's logged model is deleted (in the UI, say) while its files upload: the store
    refuses the rest, which is no outage (retried for ever, it left the run RUNNING and the
    registration undone); the package goes to a new logged model, READY and registered, and
    the run ends FINISHED."""
    from mlflow.entities import LoggedModelStatus

    from pretrain.export import from_model
    from pretrain.spool import RunState
    from pretrain.timm_folder import write_timm_folder
    from pretrain.tracker import MlflowTracker
    from test_timm_folder import random_model

    folder = write_timm_folder(from_model(random_model(), source="ft"), tmp_path / "best",
                               head=True, normalize="imagenet")
    exp = "deleted-model"
    with proxy_in_front(mlflow_server, hold="/models/m-") as proxy:  # (its files)
        with caplog.at_level(logging.WARNING):
            tracker = MlflowTracker(tmp_path / "tracking", RunState(
                uri=f"http://127.0.0.1:{proxy.server_address[1]}", experiment=exp),
                flush_every_s=0.05, close_timeout_s=60)
            tracker.log_model(folder, register_as="deleted-then-sent")
            assert proxy.held.wait(60), "the package's upload never started"
            exp_id = client.get_experiment_by_name(exp).experiment_id
            (first,) = client.search_logged_models([exp_id])
            client.delete_logged_model(first.model_id)
            proxy.hold[1].set()
            tracker.close()
    run = the_run(client, exp)
    assert run.info.status == "FINISHED"
    (model,) = client.search_logged_models([exp_id])
    assert model.model_id != first.model_id and model.status == LoggedModelStatus.READY
    (version,) = client.search_model_versions("name = 'deleted-then-sent'")
    assert version.source == f"models:/{model.model_id}"
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and said[0].startswith(
        "MLflow refused the logged model of 'model' (") and said[0].endswith(
        "its package is sent again to a new logged model"), said


def test_a_package_an_earlier_version_began_as_run_artifacts_stays_one_and_orphans_fail(
        tmp_path):
    """A package whose upload this program's version before logged models began among the
    run's artifacts is finished there (split in two, neither place could load it); a logged
    model a crash left PENDING, made but not yet in run.json, ends FAILED when the package
    that went to another one is finished."""
    from mlflow.entities import LoggedModelStatus

    from pretrain.export import from_model
    from pretrain.mlflow_delivery import Remote
    from pretrain.model_registry import package
    from pretrain.spool import ARTIFACTS, RunState
    from pretrain.timm_folder import write_timm_folder
    from test_timm_folder import random_model

    uri = sqlite_store(tmp_path, "packages")
    folder = write_timm_folder(from_model(random_model(), source="ft"), tmp_path / "best",
                               head=True, normalize="imagenet")
    remotes = []
    for name in ("begun", "orphaned"):
        track = tmp_path / name
        package(folder, track / ARTIFACTS / "model")
        # a relaunch changed a setting: the run's params keep the start's (MLflow's cannot
        # change), its tag config.now.<key> the new value, which the weights were trained with
        remote = Remote(track, RunState(uri=uri, experiment="packages", params={
            "train.total_steps": "60"}, tags={"config.now.train.total_steps": "90"}))
        run_id = remote.connect()
        remote.state.models = [{"path": "model", "register_as": name, "version": None,
                                "tags": {"step": "7"}}]
        if name == "begun":  # the MLmodel file went up as the run's artifact
            remote.client.log_artifact(run_id, str(track / ARTIFACTS / "model/MLmodel"), "model")
            remote.state.uploaded.append("model/MLmodel")
        else:  # the crash came between the logged model's creation and its record
            orphan = remote.client.create_logged_model(
                remote.client.get_run(run_id).info.experiment_id, name="model",
                source_run_id=run_id).model_id
        remote.upload_artifacts()
        assert remote.finish_models() == 1
        remotes.append(remote)
    begun, orphaned = remotes
    c = begun.client
    assert begun.state.models[0]["model_id"] is None
    assert c.get_model_version("begun", "1").source == f"runs:/{begun.state.run_id}/model"
    got = Path(c.download_artifacts(begun.state.run_id, "model", str(tmp_path / "got")))
    written = tmp_path / "begun" / ARTIFACTS / "model"
    assert sorted(p.relative_to(got) for p in got.rglob("*") if p.is_file()) == sorted(
        p.relative_to(written) for p in written.rglob("*") if p.is_file())
    assert c.get_logged_model(orphan).status == LoggedModelStatus.FAILED
    model = c.get_logged_model(orphaned.state.models[0]["model_id"])
    assert model.status == LoggedModelStatus.READY
    assert model.params["train.total_steps"] == "90"


def test_the_same_weights_logged_again_go_to_the_same_logged_model(tmp_path):
    """A finished fine-tune relaunched to add ``tracking.register_as`` exports the same weights
    again: they are registered from the logged model they are already in, not a second one
    alike beside it in the Models tab; other weights (another step) get a new one."""
    from mlflow.entities import LoggedModelStatus

    from pretrain.export import from_model
    from pretrain.spool import RunState
    from pretrain.timm_folder import write_timm_folder
    from pretrain.tracker import MlflowTracker
    from test_timm_folder import random_model

    uri = sqlite_store(tmp_path, "again")
    folder = write_timm_folder(from_model(random_model(), source="ft"), tmp_path / "best",
                               head=True, normalize="imagenet")
    tracker = MlflowTracker(tmp_path / "tracking", RunState(uri=uri, experiment="again"),
                            flush_every_s=0.05, close_timeout_s=60)
    about = {"export": "best", "step": "5", "eval/dev/top1": "0.5"}

    def ready() -> None:
        deadline = time.time() + 60
        while not tracker.state.models[-1].get("ready"):
            assert time.time() < deadline, "the package never became READY"
            time.sleep(0.05)
    tracker.log_model(folder, about=about)
    ready()
    tracker.log_model(folder, register_as="again", about=dict(about))
    ready()
    tracker.log_model(folder, about={**about, "step": "8"})
    tracker.close()
    c = MlflowClient(uri)
    exp_id = c.get_experiment_by_name("again").experiment_id
    models = sorted(c.search_logged_models([exp_id]), key=lambda m: m.creation_timestamp)
    assert [(m.tags["step"], m.status) for m in models] == [
        ("5", LoggedModelStatus.READY), ("8", LoggedModelStatus.READY)]
    (version,) = c.search_model_versions("name = 'again'")
    assert version.source == models[0].artifact_location


def test_a_server_before_mlflow_3_keeps_the_model_among_the_runs_artifacts(
        tmp_path, client, mlflow_server, caplog):
    """A server without logged models (MLflow 2 answers their requests with its 404 page): the
    model is the run's artifact ``model/``, registered from ``runs:/<run id>/model``, as
    before MLflow 3, and no outage is reported."""
    from pretrain.export import from_model
    from pretrain.spool import RunState
    from pretrain.timm_folder import write_timm_folder
    from pretrain.tracker import MlflowTracker
    from test_timm_folder import random_model

    folder = write_timm_folder(from_model(random_model(), source="ft"), tmp_path / "best",
                               head=True, normalize="imagenet")
    exp = "mlflow-2-server"
    with proxy_in_front(mlflow_server, missing="/logged-models") as proxy:
        with caplog.at_level(logging.INFO, logger="pretrain"):
            tracker = MlflowTracker(tmp_path / "tracking", RunState(
                uri=f"http://127.0.0.1:{proxy.server_address[1]}", experiment=exp),
                flush_every_s=0.05, close_timeout_s=60)
            tracker.log_model(folder, register_as="older-server")
            tracker.close()
    run = the_run(client, exp)
    assert run.info.status == "FINISHED"
    (version,) = client.search_model_versions("name = 'older-server'")
    assert version.source == f"runs:/{run.info.run_id}/model"
    assert "model/MLmodel" in {a.path for a in client.list_artifacts(run.info.run_id, "model")}
    assert not client.search_logged_models([run.info.experiment_id])
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert f"the model is the run's artifact runs:/{run.info.run_id}/model" in caplog.text


def test_a_failure_of_the_tracking_code_itself_is_not_reported_as_an_outage(
        tmp_path, monkeypatch, caplog):
    """A bug in the delivery reads otherwise as "MLflow unreachable" for the whole run."""
    from pretrain.config import PretrainConfig
    from pretrain.config_files import load_config
    from pretrain.tracking import start_tracking

    # a bad constant in the delivery code: its params batches raise TypeError there
    monkeypatch.setattr("pretrain.mlflow_delivery.MAX_PARAMS_PER_BATCH", None)
    cfg = load_config(PretrainConfig, None, [
        f"tracking.uri={sqlite_store(tmp_path)}", "tracking.system_metrics=false",
        "tracking.flush_every_s=0.05", "tracking.close_timeout_s=0.5"])
    with caplog.at_level(logging.INFO, logger="pretrain.tracking"):
        tracker = start_tracking(cfg, "pretrain", tmp_path / "run", 0, world_size=1)
        tracker.log({"train/loss": 1.0}, 1)
        tracker.close()
    errors = [r for r in caplog.records if "error of this program" in r.getMessage()]
    assert len(errors) == 1 and errors[0].exc_info[0] is TypeError
    assert not [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert read_jsonl(tmp_path / "run/tracking/spool.jsonl")[0]["metrics"] == {"train/loss": 1.0}


def test_the_end_after_a_stop_signals_grace_period_still_gives_a_healthy_store_its_records(
        tmp_path, caplog):
    """A stop checkpoint that took all of the grace period: the end still waits a moment, which
    a store that answers needs to take the last records and the run's end (it gave up at once,
    and the run showed RUNNING until upload_spool.py)."""
    from mlflow import MlflowClient

    from pretrain.config import PretrainConfig
    from pretrain.config_files import load_config
    from pretrain.tracking import start_tracking

    uri = sqlite_store(tmp_path)
    cfg = load_config(PretrainConfig, None, [
        f"tracking.uri={uri}", "tracking.system_metrics=false", "tracking.flush_every_s=30"])
    tracker = start_tracking(cfg, "pretrain", tmp_path / "run", 0, world_size=1)
    assert tracker.settled_run_id() is not None
    tracker.leave_by = lambda: time.monotonic() - 100  # the grace period is over
    tracker.log({"train/loss": 0.5}, 7)  # (the thread sends it at its close, not before)
    with caplog.at_level(logging.WARNING, logger="pretrain.tracking"):
        tracker.close("KILLED", tags={"stop.signal": "SIGTERM", "stop.step": "7"})
    assert "not delivered" not in caplog.text, caplog.text
    run = MlflowClient(uri).get_run(tracker.run_id)
    assert run.info.status == "KILLED" and run.data.metrics["train/loss"] == 0.5


def test_a_server_lost_before_the_end_is_said_to_lack_the_runs_end(
        tmp_path, client, mlflow_server, monkeypatch, caplog):
    """The run exists, the server goes away: its status (RUNNING in the UI until then) and its
    last records are what upload_spool.py must send."""
    from pretrain.config import PretrainConfig
    from pretrain.config_files import load_config
    from pretrain.tracking import start_tracking

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    out = tmp_path / "run"
    cfg = load_config(PretrainConfig, None, [
        f"tracking.uri={mlflow_server.uri}", "tracking.experiment=lost-at-the-end",
        "tracking.flush_every_s=0.05", "tracking.system_metrics=false",
        "tracking.close_timeout_s=1"])
    tracker = start_tracking(cfg, "pretrain", out, 0, world_size=1, hosts=["node0"])
    try:
        assert tracker.settled_run_id() is not None
        mlflow_server.stop()
        tracker.log({"train/loss": 1.0}, 1)
        with caplog.at_level(logging.WARNING, logger="pretrain.tracking"):
            tracker.close()
    finally:
        mlflow_server.start()
    assert re.search(r"not delivered to MLflow at .*: 1 metric records \(1 of them in .*\), the "
                     r"run's end \(status FINISHED and its tags\); `python "
                     r"launch/upload_spool.py .*` sends them", caplog.text), caplog.text
    assert client.get_run(tracker.run_id).info.status == "RUNNING"
    up = run_launcher("upload_spool.py", str(out), timeout=120)
    assert up.returncode == 0, up.stderr[-2000:]
    assert client.get_run(tracker.run_id).info.status == "FINISHED"


def test_failures_raised_by_mlflow_or_a_missing_package_are_not_called_bugs():
    """A proxy answering 200 with a JSON null makes MLflow's parser raise TypeError: an outage,
    retried; a store's missing package (psycopg2, boto3) is its own case, with its fix."""
    from mlflow.protos.service_pb2 import GetRun
    from mlflow.utils.proto_json_utils import parse_dict

    from pretrain.mlflow_delivery import failure_kind
    with pytest.raises(TypeError) as parsed:
        parse_dict(None, GetRun.Response())
    assert failure_kind(parsed.value) == "outage"
    with pytest.raises(ImportError) as missing:
        import psycopg2_not_installed_here  # noqa: F401
    assert failure_kind(missing.value) == "missing module"


KILLED_BEFORE_ITS_FIRST_CHECKPOINT = """
import os, signal, sys, time
from pretrain.config import PretrainConfig
from pretrain.config_files import load_config
from pretrain.tracking import start_tracking
uri, exp, out, steps = sys.argv[1:]
cfg = load_config(PretrainConfig, None, [f"tracking.uri={uri}", f"tracking.experiment={exp}",
                  "tracking.flush_every_s=0.05", "tracking.system_metrics=false"])
tracker = start_tracking(cfg, "pretrain", out, 0, world_size=1, hosts=["node0"])
for step in range(1, 4):
    tracker.log({"train/loss": 1.0 / step}, step)
while steps == "delivered" and (tracker._outbox or tracker._pending):
    time.sleep(0.05)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_run_of_a_job_killed_before_its_first_checkpoint_ends_failed_on_the_relaunch(
        tmp_path, client, mlflow_server, monkeypatch):
    """A job SIGKILLed (the OOM killer, a lost node) before any checkpoint cannot end its
    MLflow run; its relaunch starts a new run. The old one must not show RUNNING forever: the
    relaunch ends it FAILED, saying why and which run replaced it -- also when the old records
    never reached the server and wait in a spool set aside for upload_spool.py."""
    from pretrain.config import PretrainConfig
    from pretrain.config_files import load_config
    from pretrain.mlflow_delivery import upload_spool
    from pretrain.spool import TrackingError, lock
    from pretrain.tracking import start_tracking

    def killed_job(exp, out, uri, steps):
        proc = subprocess.run([sys.executable, "-c", KILLED_BEFORE_ITS_FIRST_CHECKPOINT, uri,
                               exp, str(out), steps], cwd=REPO, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]

    def relaunch(exp, out):
        cfg = load_config(PretrainConfig, None, [
            f"tracking.uri={mlflow_server.uri}", f"tracking.experiment={exp}",
            "tracking.flush_every_s=0.05", "tracking.system_metrics=false"])
        tracker = start_tracking(cfg, "pretrain", out, 0, world_size=1, hosts=["node0"])
        tracker.log({"train/loss": 0.5}, 1)
        tracker.close()
        return tracker.run_id

    exp, out = "killed-early", tmp_path / "run"
    killed_job(exp, out, mlflow_server.uri, "delivered")
    [old] = client.search_runs([client.get_experiment_by_name(exp).experiment_id])
    assert old.info.status == "RUNNING" and steps_of(client, old.info.run_id) == [1, 2, 3]
    # while upload_spool.py (or another job) holds the tracking dir, nothing there is touched
    held = lock(out / "tracking")
    with pytest.raises(TrackingError, match="in use by another process .* relaunch once"):
        relaunch(exp, out)
    held.close()
    new_id = relaunch(exp, out)
    runs = {r.info.run_id: r for r in client.search_runs(
        [client.get_experiment_by_name(exp).experiment_id])}
    assert set(runs) == {old.info.run_id, new_id}
    assert runs[new_id].info.status == "FINISHED"
    ended = runs[old.info.run_id]
    assert ended.info.status == "FAILED"
    assert ended.data.tags["stop.superseded_by"] == new_id
    assert "died before its first checkpoint" in ended.data.tags["stop.reason"]

    # the server was unreachable for the killed job: its run is made and ended by the upload
    exp, out = "killed-offline", tmp_path / "offline"
    killed_job(exp, out, f"http://127.0.0.1:{free_port()}", "spooled")
    new_id = relaunch(exp, out)
    [aside] = out.glob("tracking.*")
    upload_spool(out, uri=mlflow_server.uri)
    runs = {r.info.run_id: r for r in client.search_runs(
        [client.get_experiment_by_name(exp).experiment_id])}
    assert len(runs) == 2 and runs.pop(new_id).info.status == "FINISHED"
    [uploaded] = runs.values()
    assert uploaded.info.status == "FAILED" and steps_of(client, uploaded.info.run_id) == [1, 2, 3]
    assert "died before its first checkpoint" in uploaded.data.tags["stop.reason"]


def test_a_disabled_tracker_takes_every_call_the_mlflow_tracker_takes(tmp_path):
    """Ranks != 0 and tracking.enabled=false get NoTracking: a call the trainer makes on the
    real tracker must not crash a run there."""
    import inspect

    from pretrain.config import PretrainConfig
    from pretrain.config_files import load_config
    from pretrain.tracker import MlflowTracker, NoTracking
    from pretrain.tracking import start_tracking

    def public(cls):
        return {name: inspect.signature(member) if callable(member) else type(member)
                for name, member in inspect.getmembers(cls) if not name.startswith("_")}
    assert public(NoTracking).keys() == public(MlflowTracker).keys()
    for name, signature in public(MlflowTracker).items():
        if isinstance(signature, inspect.Signature):
            assert public(NoTracking)[name] == signature, name

    cfg = load_config(PretrainConfig, None, ["tracking.enabled=false"])
    tracker = start_tracking(cfg, "pretrain", tmp_path / "run", 0, world_size=1)
    assert isinstance(tracker, NoTracking)
    tracker.log({"train/loss": 1.0}, 1)
    tracker.log_artifact_bytes("per_class_top1.json", b"{}")
    tracker.log_sample_grid(None)
    tracker.close("KILLED", tags={"stop.signal": "SIGTERM"})
    assert tracker.run_id is None and tracker.unwritten == 0
    assert not (tmp_path / "run").exists()


def test_tracking_keys_given_with_tracking_disabled_are_said_to_do_nothing(tmp_path, caplog):
    """They were taken without a word; rank 0 says it once, and nothing set, nothing said."""
    from pretrain.config import PretrainConfig
    from pretrain.config_files import load_config
    from pretrain.tracking import start_tracking
    cfg = load_config(PretrainConfig, None, ["tracking.enabled=false", "tracking.experiment=x",
                                             "tracking.uri=sqlite:////nowhere/mlflow.db"])
    with caplog.at_level(logging.WARNING, logger="pretrain.tracking"):
        for rank in (1, 0):
            start_tracking(cfg, "pretrain", tmp_path / "run", rank, world_size=1)
        start_tracking(load_config(PretrainConfig, None, ["tracking.enabled=false"]),
                       "pretrain", tmp_path / "run", 0, world_size=1)
    assert [r.getMessage() for r in caplog.records] == [
        "tracking.experiment, tracking.uri do nothing: tracking.enabled=false (metrics.jsonl "
        "only)"]


def test_a_run_stopped_by_signals_and_resumed_reads_as_one_finished_run_with_its_stops(
        tmp_path, client, mlflow_server, monkeypatch):
    """Two signal stops (KILLED, with the trainer's tags) and two relaunches that resume into
    the same MLflow run: one run, FINISHED, each step once, the stops counted in its tags."""
    from pretrain.config import PretrainConfig
    from pretrain.config_files import load_config
    from pretrain.tracking import start_tracking

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
    exp, out = "stopped", tmp_path / "run"
    cfg = load_config(PretrainConfig, None, [
        f"tracking.uri={mlflow_server.uri}", f"tracking.experiment={exp}",
        "tracking.flush_every_s=0.05", "tracking.system_metrics=false", "train.total_steps=12"])
    rid, resumed_at = None, None
    for first, last, stop in [(1, 4, "SIGTERM"), (5, 8, "SIGUSR1"), (9, 12, None)]:
        tracker = start_tracking(cfg, "pretrain", out, 0, world_size=1, hosts=["node0"],
                                 run_id=rid, resumed_at=resumed_at)
        if rid is not None:  # the relaunch re-opened the stopped run
            deadline = time.time() + 60
            while client.get_run(rid).info.status != "RUNNING":
                assert time.time() < deadline, "the resumed run was not marked RUNNING"
                time.sleep(0.05)
        for step in range(first, last + 1):
            tracker.log({"train/loss": 1.0 / step}, step)
        if stop:
            tracker.close("KILLED", tags={"stop.signal": stop, "stop.step": str(last)})
            rid, resumed_at = tracker.run_id, last
            run = client.get_run(rid)
            assert run.info.status == "KILLED"
            assert run.data.tags["stop.signal"] == stop and run.data.tags["stop.step"] == str(last)
        else:
            tracker.close()

    run = the_run(client, exp)
    assert run.info.run_id == rid and run.info.status == "FINISHED"
    tags = run.data.tags
    assert (tags["stop.count"], tags["stop.signal"], tags["stop.step"]) == ("2", "SIGUSR1", "8")
    assert steps_of(client, rid) == list(range(1, 13))


def test_stop_tags_of_a_run_that_never_reached_the_server_are_set_by_the_upload(
        tmp_path, client, mlflow_server, monkeypatch, caplog):
    from pretrain.config import PretrainConfig
    from pretrain.config_files import load_config
    from pretrain.mlflow_delivery import upload_spool
    from pretrain.tracking import start_tracking

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
    exp, out = "stopped-offline", tmp_path / "run"
    dead = f"http://mlflow:s3cret@127.0.0.1:{free_port()}"  # a password in it, too
    caplog.set_level(logging.INFO, logger="pretrain.tracking")
    cfg = load_config(PretrainConfig, None, [
        f"tracking.uri={dead}", f"tracking.experiment={exp}",
        "tracking.flush_every_s=0.05", "tracking.close_timeout_s=0.5",
        "tracking.system_metrics=false"])
    tracker = start_tracking(cfg, "pretrain", out, 0, world_size=1, hosts=["node0"])
    for step in range(1, 4):
        tracker.log({"train/loss": 1.0 / step}, step)
    tracker.close("KILLED", tags={"stop.signal": "SIGTERM", "stop.step": "3"})
    assert tracker.run_id is None

    upload_spool(out, uri=mlflow_server.uri)
    run = the_run(client, exp)
    assert run.info.status == "KILLED"
    assert {k: run.data.tags[k] for k in ("stop.signal", "stop.step", "stop.count")} == \
        {"stop.signal": "SIGTERM", "stop.step": "3", "stop.count": "1"}
    assert steps_of(client, run.info.run_id) == [1, 2, 3]
    # the password is in neither the params, the config artifact nor the log (how a run is
    # tracked is no param of it: Compare would list it among the differences)
    assert not [k for k in run.data.params if k.startswith(("tracking.", "debug."))]
    assert "s3cret" not in str(run.data.params)
    config = client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))
    assert "mlflow:***@127.0.0.1" in Path(config).read_text()
    assert "s3cret" not in Path(config).read_text()
    assert "unreachable" in caplog.text and "s3cret" not in caplog.text


def test_experiments_are_marked_for_mlflow_3s_machine_learning_view(
        tmp_path, client, mlflow_server, monkeypatch):
    """MLflow 3's UI opens an experiment without mlflow.experimentKind in its GenAI view, where
    training runs do not show. New and existing experiments get the tag; a kind someone chose
    for an experiment stays."""
    from pretrain.spool import RunState
    from pretrain.tracker import MlflowTracker

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
    client.create_experiment("kind-existing")
    client.create_experiment("kind-chosen", tags={"mlflow.experimentKind": "genai_development"})
    for name in ("kind-new", "kind-existing", "kind-chosen"):
        tracker = MlflowTracker(tmp_path / name, RunState(uri=mlflow_server.uri, experiment=name),
                                flush_every_s=0.05)
        tracker.log({"train/loss": 1.0}, 1)
        tracker.close()
        assert tracker.run_id is not None
    kind = {name: client.get_experiment_by_name(name).tags.get("mlflow.experimentKind")
            for name in ("kind-new", "kind-existing", "kind-chosen")}
    assert kind == {"kind-new": "custom_model_development",
                    "kind-existing": "custom_model_development",
                    "kind-chosen": "genai_development"}


def test_a_file_store_this_mlflow_refuses_is_reported_with_the_fix(tmp_path, monkeypatch, caplog):
    from pretrain.spool import RunState
    from pretrain.tracker import MlflowTracker

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    uri = (tmp_path / "mlruns").as_uri()
    with caplog.at_level(logging.WARNING, logger="pretrain.tracking"):
        tracker = MlflowTracker(tmp_path / "tracking", RunState(uri=uri, experiment="x"),
                                flush_every_s=0.05)
        tracker.log({"train/loss": 1.0}, 1)
        tracker.close()
    assert tracker.run_id is None
    assert (f"MLflow at {uri} refused the run (this MLflow refuses file stores: set "
            f"tracking.uri=sqlite:///<dir>/mlflow.db") in caplog.text
    # the metric is kept for upload_spool.py
    assert '"train/loss": 1.0' in (tmp_path / "tracking" / "spool.jsonl").read_text()


def test_a_file_store_this_mlflow_refuses_stops_both_stages_at_the_start(tmp_path, monkeypatch):
    """Given as tracking.uri (or MLFLOW_TRACKING_URI), a file store this MLflow refuses ends
    the start in one line with the fix, before anything is trained: found by the tracker's
    first delivery instead, the run trained on with its metrics in the spool alone, after a
    line "tracking to MLflow at file://..." that read as success."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    store = tmp_path / "mlruns"
    fix = (f"is a file store, which this MLflow refuses: set {{}}=sqlite:///{tmp_path}/mlflow.db "
           f"(`mlflow migrate-filestore` moves runs already there), or set "
           f"MLFLOW_ALLOW_FILE_STORE=true")
    finetune = ("finetune.py", "--config", "configs/finetune/demo.yaml")
    cases = [(("pretrain.py",), "tracking.uri", "--dry-run"),
             (("pretrain.py",), "tracking.uri", f"output_dir={tmp_path / 'run'}"),
             (finetune, "MLFLOW_TRACKING_URI", f"output_dir={tmp_path / 'run'}")]
    for launcher, key, run in cases:
        uri = store.as_uri() if key == "tracking.uri" else str(store)
        how, env = ([f"{key}={uri}"], {}) if key == "tracking.uri" else ([], {key: uri})
        proc = run_launcher(*launcher, *how, run, env=env)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1] == f"error: {key}={uri} " + fix.format(key)
        assert not (tmp_path / "run").exists() and not store.exists()
    # allowed, the same store is taken: the dry-run passes
    proc = run_launcher("pretrain.py", "--dry-run", f"tracking.uri={store.as_uri()}",
                        env={"MLFLOW_ALLOW_FILE_STORE": "true"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    # a server's address without http:// is a path to MLflow: said so, not "a file store"
    from pretrain.config import TrackingConfig
    from pretrain.spool import TrackingError
    from pretrain.tracking_store import check_store
    for uri, said in (("10.0.0.5:5000", "tracking.uri=10.0.0.5:5000 is read as a file store "
                       "path; for a tracking server write tracking.uri=http://10.0.0.5:5000"),
                      ("http://[::1:5000", "tracking.uri=http://[::1:5000: Invalid IPv6 URL"),
                      # a typo: the run trained on with its metrics in the spool alone
                      ("htps://mlflow.example.org", "tracking.uri=htps://mlflow.example.org: "
                       "'htps' is no MLflow tracking store; write http(s)://HOST:PORT for a "
                       "server, sqlite:///PATH.db, or a database URL (postgresql://, mysql://, "
                       "mssql://)")):
        with pytest.raises(TrackingError) as refused:
            check_store(TrackingConfig(uri=uri))
        assert str(refused.value) == said
    for uri in ("https://mlflow.example.org", "postgresql+psycopg2://u:p@db/mlflow",
                f"sqlite:///{tmp_path}/mlflow.db", "databricks"):
        check_store(TrackingConfig(uri=uri))  # what MLflow opens passes


def test_a_finetune_is_nested_only_under_a_pretraining_run_of_its_own_store(
        tmp_path, monkeypatch, caplog):
    """A pretraining logged to one store (a team server) and its fine-tune to another (a local
    database): the fine-tune's parent link pointed to a run that store does not have, without a
    word. Now it names the pretraining's store, says so once, and nests only in the same one."""
    from finetune.config import FinetuneConfig
    from finetune.stage import FinetuneStage
    from pretrain.config_files import load_config
    from pretrain.spool import RunState
    from pretrain.tracking import start_tracking

    monkeypatch.chdir(tmp_path)
    pre = tmp_path / "runs/pre"
    (pre / "tracking").mkdir(parents=True)
    server = "http://10.0.0.5:5000"  # the pretraining's, in the first case (never contacted)
    here = f"sqlite:///{tmp_path}/mlflow.db"
    for init, there, nested in ((pre, server, False),
                                (f"{pre}/checkpoints/step_00000008/", here, True)):
        RunState(uri=there, experiment="vit", run_id="abc123").save(pre / "tracking")
        cfg = load_config(FinetuneConfig, None, [
            f"init={init}", f"tracking.uri={here}", "tracking.experiment=vit",
            "tracking.flush_every_s=0.05", "tracking.close_timeout_s=1",
            "tracking.system_metrics=false", "data.root=cifar10"])
        stage = FinetuneStage(cfg)
        stage.lineage = {"pretrain_run_id": "abc123", "path": f"{pre}/checkpoints/step_00000008",
                         "step": 8}
        tags = stage.tracking_tags()
        assert tags["pretrain.tracking_uri"] == there and tags["pretrain.run_id"] == "abc123"
        caplog.clear()
        out = tmp_path / f"ft-{nested}"
        tracker = start_tracking(cfg, "finetune", out, 0, world_size=1, extra_tags=tags)
        tracker.close()
        saved = RunState.load(out / "tracking").tags
        assert ("mlflow.parentRunId" in saved) == nested and saved["pretrain.run_id"] == "abc123"
        said = [r.getMessage() for r in caplog.records if "not nested" in r.getMessage()]
        assert said == ([] if nested else [
            f"the pretraining run abc123 is in MLflow at {server}, this run goes to {here}: not "
            f"nested under it (its tag pretrain.run_id names it); tracking.uri={server} puts the "
            f"two together"])


def test_a_copied_output_dir_gets_an_mlflow_run_of_its_own_and_a_moved_one_keeps_its(
        tmp_path, tiny_data):
    """``cp -a run branch`` and a relaunch there with other settings (to branch the run off at
    its checkpoint): the copy's tracking/run.json names the original's MLflow run, and both
    logged into it (the branch's steps and settings mixed into the original's record). The
    copy now gets a run of its own; a moved output_dir is still the same run."""
    import shutil

    from pretrain.spool import RunState
    uri = sqlite_store(tmp_path / "store")
    client = MlflowClient(uri)

    def run(out, steps):
        done = run_launcher("pretrain.py", *tiny_run_args(
            out, tiny_data, f"train.total_steps={steps}", "tracking.system_metrics=false",
            f"tracking.uri={uri}"))
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stderr, RunState.load(out / "tracking").run_id

    _, original = run(tmp_path / "first", 4)
    before = client.get_run(original)
    shutil.copytree(tmp_path / "first", tmp_path / "branch")
    text, branch = run(tmp_path / "branch", 8)
    assert branch != original and f"holds a copy of the run in {tmp_path / 'first'}" in text, \
        text[-3000:]
    tags = client.get_run(branch).data.tags
    assert (tags["copied_from"], tags["copied_at_step"]) == (original, "4")
    assert steps_of(client, branch) == [5, 6, 7, 8]
    after = client.get_run(original)  # untouched by the branch
    assert after.info.end_time == before.info.end_time and after.data.tags == before.data.tags
    assert steps_of(client, original) == [1, 2, 3, 4]
    # a copy killed before its first checkpoint (the one it resumes from still names the
    # original's run) stays in a run of its own when relaunched
    shutil.copytree(tmp_path / "first", tmp_path / "crashed")
    killed = subprocess.run(
        [sys.executable, str(REPO / "tests/faulty_launch.py"), *tiny_run_args(
            tmp_path / "crashed", tiny_data, "train.total_steps=8",
            "tracking.system_metrics=false", f"tracking.uri={uri}")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "FAULTS": json.dumps({"kill": [0, 6]})})
    assert killed.returncode != 0, killed.stderr[-3000:]
    _, crashed = run(tmp_path / "crashed", 8)
    assert crashed not in (original, branch) and steps_of(client, original) == [1, 2, 3, 4]
    # a copy made of hard links (cp -al: checkpoints are large) shares every file with the
    # original: what the run appends to becomes its own first
    subprocess.run(["cp", "-al", str(tmp_path / "first"), str(tmp_path / "linked")], check=True)
    metrics = (tmp_path / "first/metrics.jsonl").read_bytes()
    _, linked = run(tmp_path / "linked", 8)
    assert linked != original and (tmp_path / "first/metrics.jsonl").read_bytes() == metrics
    assert steps_of(client, original) == [1, 2, 3, 4]
    (tmp_path / "first").rename(tmp_path / "moved")
    text, moved = run(tmp_path / "moved", 8)
    assert moved == original and "a copy" not in text, text[-3000:]
    assert steps_of(client, original) == [1, 2, 3, 4, 5, 6, 7, 8]
    # the run is where it went on: its tag output_dir follows it, so a copy put back at the old
    # place (mv run old, relaunched in old, cp -a old run) is the copy, not the moved folder
    assert client.get_run(original).data.tags["output_dir"] == str(tmp_path / "moved")
    shutil.copytree(tmp_path / "moved", tmp_path / "first")
    text, back = run(tmp_path / "first", 12)
    assert back != original and f"holds a copy of the run in {tmp_path / 'moved'}" in text
    assert steps_of(client, original) == [1, 2, 3, 4, 5, 6, 7, 8]
    _, moved = run(tmp_path / "moved", 12)
    assert moved == original and steps_of(client, original) == list(range(1, 13))

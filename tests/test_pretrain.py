"""Pretraining for real: DeepSpeed ranks on the CPU (gloo), ZeRO stages, resume onto another world
size, and the multi-node launcher path. Kills, failing writes and bad data: test_faults.py."""
import contextlib
import gc
import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_deepspeed, run_launcher, spawn_ranks, tiny_run_args
from pretrain.checkpoint import CheckpointStore
from pretrain.metrics import read_jsonl


def losses(out):
    return {r["step"]: r["train/loss"] for r in read_jsonl(out / "metrics.jsonl")
            if "train/loss" in r}


def keys(out, rank):
    return (out / "keys" / f"rank{rank}.txt").read_text().split()


# Slow variants: the default command trains each stage on two ranks through the launcher
# anyway -- ZeRO-1 in the fault suite's reference run, whose checkpoints and manifests it checks;
# ZeRO-2 with the shipped zero2.json in test_two_nodes_through_the_deepspeed_launcher; ZeRO-3
# with the shipped zero3.json in the fault suite's SIGTERM test, whose run test_weights
# consolidates (stage 3 on 2 ranks)
@pytest.mark.parametrize("stage,how", [
    pytest.param(1, "deepspeed.zero_stage=1", marks=pytest.mark.slow),
    pytest.param(2, "deepspeed.config=zero2.json", marks=pytest.mark.slow),
    pytest.param(3, "deepspeed.config=zero3.json", marks=pytest.mark.slow),
])
def test_zero_stage_trains_on_two_ranks(stage, how, tmp_path, tiny_data):
    out = tmp_path / "run"
    run_deepspeed(2, *tiny_run_args(out, tiny_data, how, "train.total_steps=6",
                                    "optimizer.lr=3e-3"))
    loss = losses(out)
    assert sorted(loss) == [1, 2, 3, 4, 5, 6]
    assert all(torch.isfinite(torch.tensor(v)) for v in loss.values())
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir())
    assert ckpts == ["step_00000004", "step_00000006"]
    manifest = json.loads((out / "checkpoints/step_00000006/COMPLETE.json").read_text())
    assert manifest["world_size"] == 2 and manifest["zero_stage"] == stage
    assert (out / "config.yaml").is_file()


def _zero3_init_worker(rank, world, port, queue):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed

    from pretrain.config import PretrainConfig
    from pretrain.config_files import load_config
    from pretrain.deepspeed_json import deepspeed_config
    from pretrain.engine import build_model

    deepspeed.init_distributed(verbose=False)
    cfg = load_config(PretrainConfig, REPO / "configs/pretrain/demo.yaml",
                      ["deepspeed.zero_stage=3", "model.head_bias_init=-10",
                       "model.embed_dim=128", "model.num_heads=2"])
    model = build_model(cfg, deepspeed_config(cfg, micro=32, accum=1, world=world))
    pos = model.backbone.pos_embed
    local = pos.ds_tensor.numel()  # this rank's shard of the position embedding
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        stats = {"pos_std": pos.float().std().item(), "pos_numel": pos.numel(),
                 "qkv_std": model.backbone.blocks[0].attn.qkv.weight.float().std().item(),
                 "head_absmax": model.head.weight.abs().max().item(),
                 "head_bias": model.head.bias.float().mean().item(), "local": local}
    queue.put((rank, stats))


def test_zero3_initialisation_really_happens():
    results = spawn_ranks(_zero3_init_worker, 2, timeout=120)
    assert results[0] == results[1] | {"local": results[0]["local"]}  # same weights everywhere
    stats = results[0]
    assert stats["local"] < stats["pos_numel"]  # really partitioned
    assert stats["pos_std"] == pytest.approx(0.02, abs=0.002)  # timm's trunc-normal, not 0
    # timm's ViT init (trunc-normal 0.02), not nn.Linear's default (std ~ 1/sqrt(3 * 128))
    assert stats["qkv_std"] == pytest.approx(0.02, abs=0.002)
    assert stats["head_absmax"] == 0.0 and stats["head_bias"] == pytest.approx(-10.0)


def _engine_worker(rank, world, port, timed_file, queue):
    """The trainer's DeepSpeed backend built for a few configs: whether (and how) its module is
    compiled, and how often DeepSpeed waited for the device in 5 steps."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from deepspeed.accelerator import get_accelerator

    from pretrain.benchmark import synthetic_batches
    from pretrain.config import PretrainConfig
    from pretrain.config_files import load_config
    from pretrain.data.device_batch import prepare_batch
    from pretrain.engine import DeepSpeedBackend

    accelerator, waits = get_accelerator(), []
    own = accelerator.synchronize
    accelerator.synchronize = lambda *a, **k: (waits.append(1), own(*a, **k))[1]

    def backend(*sets):
        cfg = load_config(PretrainConfig, REPO / "configs/pretrain/demo.yaml", sets)
        made = DeepSpeedBackend(cfg)
        made.build(cfg, micro=4, accum=1, resume=None, store=None)
        return made, cfg

    found = {}
    for name, sets in {"eager": [], "compiled": ["train.compile=true"],
                       "autotuned": ["train.compile=true",
                                     "train.compile_mode=max-autotune-no-cudagraphs"]}.items():
        compiled = backend(*sets)[0].engine.module._compiled_call_impl
        found[name] = None if compiled is None else \
            compiled.get_compiler_config()["max_autotune"]
    for name, sets in {"waits": [], "waits_timed": [f"deepspeed.config={timed_file}"]}.items():
        made, cfg = backend(*sets)
        # The engines built above, freed only by the cycle collector at a moment of its choosing,
        # wait for the device as they go (DeepSpeed's destroy()): not a wait of these steps.
        gc.collect()
        waits.clear()
        for batch in synthetic_batches(4, 32, cfg.model.num_classes, made.device, count=5):
            made.train_micro_batch(*prepare_batch(batch, made.device), cfg, None, last=True)
        found[name] = len(waits)
    queue.put((rank, found))


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    timed = tmp_path_factory.mktemp("ds") / "timed.json"
    timed.write_text(json.dumps({"zero_optimization": {"stage": 1},
                                 "timers": {"throughput": {"enabled": True}}}))
    return spawn_ranks(_engine_worker, 1, str(timed), timeout=180)[0]


def test_train_compile_and_its_mode_reach_the_pretraining_engine(engines):
    """The trainer's DeepSpeed engine is compiled, with Inductor's matmul autotuning when
    train.compile_mode asks for it (compiling itself happens at the first forward, not run)."""
    assert {k: engines[k] for k in ("eager", "compiled", "autotuned")} == \
        {"eager": None, "compiled": False, "autotuned": True}


def test_deepspeed_waits_for_the_device_for_no_timer_of_its_own(engines):
    """DeepSpeed's throughput timer would wait for the device at every forward and step, for
    figures it never prints here; off, unless a DeepSpeed file turns it on (then two waits per
    step from its third on)."""
    assert (engines["waits"], engines["waits_timed"]) == (0, 6)


def _all_keys(shards):
    import tarfile

    from pretrain.data.info import read_info

    info = read_info(shards)
    found = set()
    for name in info.split("train").filenames:
        with tarfile.open(shards / name) as tar:
            found |= {m.name.split(".")[0] for m in tar.getmembers()}
    return found


def test_resume_from_two_ranks_onto_one_skips_a_broken_checkpoint_and_loses_no_sample(
        tmp_path, tiny_data):
    out = tmp_path / "run"
    common = [f"debug.log_sample_keys={out / 'keys'}", "eval.every_steps=100"]
    run_deepspeed(2, *tiny_run_args(out, tiny_data, "train.total_steps=8", *common))
    lost = sorted((out / "checkpoints/step_00000008").glob("*rank_1_*"))[0]
    lost.unlink()  # one rank's shard of the newest checkpoint never made it to storage

    # forward passes 1-4 are steps 5-8 (a checkpoint of this world size at 8), 5-7 give NaN
    # losses: the rollback loads step 8, a plain checkpoint, in a job that resumed from a
    # universal one (DeepSpeed kept reading the universal layout and raised)
    proc = run_deepspeed(1, *tiny_run_args(out, tiny_data, "train.total_steps=20",
                                           "train.nonfinite_limit=3", *common),
                         script=REPO / "tests" / "faulty_launch.py",
                         env={"FAULTS": json.dumps({"nan": [5, 6, 7]})})
    text = proc.stdout + proc.stderr
    assert f"skipping checkpoint {out}/checkpoints/step_00000008: file {lost.name} is missing" \
        in text
    assert f"resumed from {out}/checkpoints/step_00000004 at step 4" in text
    # the world size changed: converted first, and how long that took is said
    assert re.search(re.escape(f"converted to {out}/checkpoints/step_00000004_universal in ")
                     + r"\d+\.\d s", text), text[-3000:]
    assert "different layout" in text  # the loader says how it re-dealt the epoch
    assert f"rolled back to {out}/checkpoints/step_00000008" in text
    assert sorted(losses(out)) == list(range(1, 21))
    seen = keys(out, 0) + keys(out, 1)
    assert _all_keys(tiny_data) <= set(seen)  # every sample of epoch 0 was trained on


def test_two_nodes_through_the_deepspeed_launcher(tmp_path, tiny_data):
    """2 nodes x 1 rank on this machine: each 'node' runs its own launcher, as on a cluster
    without ssh between nodes (SLURM starts one per node the same way); ZeRO-2 from the
    shipped configs/deepspeed/zero2.json."""
    import sys

    from conftest import free_port

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    out, port = tmp_path / "run", str(free_port())
    args = tiny_run_args(out, tiny_data, "train.total_steps=8", "deepspeed.config=zero2.json")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile),
         "--no_ssh", "--node_rank", str(node), "--master_addr", "127.0.0.1",
         "--master_port", port, str(REPO / "launch/pretrain.py"), *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)]
    logs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert "global batch 16 = 2 ranks x 8 x 1 accumulation" in logs[0]
    assert sorted(losses(out)) == list(range(1, 9))
    evals = [r for r in read_jsonl(out / "metrics.jsonl") if "eval/demo_val/top1" in r]
    assert [r["step"] for r in evals] == [4, 8]
    assert all(map(math.isfinite, losses(out).values()))
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir())
    assert ckpts == ["step_00000004", "step_00000008"]
    manifest = json.loads((out / "checkpoints/step_00000008/COMPLETE.json").read_text())
    assert (manifest["world_size"], manifest["zero_stage"]) == (2, 2)
    assert (out / "config.yaml").is_file()


@pytest.mark.slow
def test_a_node_that_never_comes_is_waited_for_aloud_then_named_in_one_line(tmp_path, tiny_data):
    """Node 1 of 2 never starts. Node 0 says every 30 s that it is still waiting, and at the end
    of the rendezvous timeout (DEEPSPEED_TIMEOUT, 1 minute here) its ranks stop with one line
    from the node's first (not a store's traceback per rank), exit code 1. Slow: it waits."""
    import socket
    import sys

    from conftest import free_port

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=2\nnode1 slots=2\n")
    port = str(free_port())
    proc = subprocess.run(
        [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile),
         "--no_ssh", "--node_rank", "0", "--master_addr", "127.0.0.1", "--master_port", port,
         str(REPO / "launch/pretrain.py"),
         *tiny_run_args(tmp_path / "run", tiny_data, "tracking.enabled=false")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "DEEPSPEED_TIMEOUT": "1"})
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-3000:]
    assert f"[rank0] still waiting at 127.0.0.1:{port} for the other ranks of a world of 4 " \
           f"(30 s)" in text, text[-3000:]
    errors = [x for x in text.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: rank 0 (on {socket.gethostname()}) could not meet the other ranks of a world "
        f"of 4 at 127.0.0.1:{port} ("), errors
    assert errors[0].endswith("): a node did not start, or cannot reach that address (a "
                              "firewall, NCCL_SOCKET_IFNAME naming another network); the wait "
                              "is DEEPSPEED_TIMEOUT=1 (minutes)"), errors
    assert "Traceback" not in text, text[-3000:]


def test_two_nodes_that_do_not_share_the_output_dir_are_refused_before_training(
        tmp_path, tiny_data):
    """The same two 'nodes', each resolving a relative output_dir in its own working directory,
    as a node-local scratch path would: checkpoints split between them would not resume. Both
    ranks stop at the start, rank 0 with one line that says so; neither leaves a folder
    behind."""
    import socket
    import sys

    from conftest import free_port

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    port, host = str(free_port()), socket.gethostname()
    args = tiny_run_args(Path("run"), tiny_data, "train.total_steps=8", "tracking.enabled=false")
    procs = []
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile),
             "--no_ssh", "--node_rank", str(node), "--master_addr", "127.0.0.1",
             "--master_port", port, str(REPO / "launch/pretrain.py"), *args],
            cwd=tmp_path / f"node{node}", stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True))
    logs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], logs[0][-3000:] + logs[1][-3000:]
    line = (f"error: output_dir 'run' is not one folder that every rank sees: 1 of 2 ranks (on "
            f"{host}) do not find the file rank 0 (on {host}) wrote there; every rank writes "
            f"and reads checkpoints there, so give an absolute path on storage every node "
            f"mounts (NFS, Lustre, a parallel file system)")
    # said once, by rank 0 (node 0's launcher): the ranks agreed on it
    assert [x for x in logs[0].splitlines() if x.startswith("error: ")] == [line], logs[0][-3000:]
    assert not [x for x in logs[1].splitlines() if x.startswith("error: ")], logs[1][-3000:]
    assert "step 1" not in logs[0] + logs[1]
    assert not (tmp_path / "node0/run").exists() and not (tmp_path / "node1/run").exists()


def test_a_relaunch_with_another_model_is_refused_and_resume_false_sets_the_old_run_aside(
        tmp_path, tiny_data):
    out = tmp_path / "run"

    def launch(*extra):
        return run_launcher("pretrain.py", *tiny_run_args(out, tiny_data, "eval.every_steps=100",
                                                          "tracking.system_metrics=false", *extra))

    first = launch("train.total_steps=8")
    assert first.returncode == 0, first.stderr[-3000:]
    written = re.escape(f"checkpoint {out}/checkpoints/step_00000008 (written in ")
    assert re.search(written + r"\d+\.\d s\)", first.stderr), first.stderr[-3000:]
    first_losses = losses(out)

    # the same output_dir with another model: refused, nothing touched
    other = launch("train.total_steps=6", "model.depth=3")
    assert other.returncode == 2
    assert other.stderr.strip().splitlines()[-1] == (
        f"error: output_dir '{out}' holds a run with another model.depth (2 there, 3 now); "
        f"pick a new output_dir, or set checkpoint.resume=false to start a new run there (the "
        f"earlier one is moved into '{out}/earlier-<time>/')")
    assert [c.step for c in CheckpointStore(out / "checkpoints").complete()] == [8, 4]
    # another MLflow experiment: a run cannot move there, so it is refused, not ignored
    elsewhere = launch("train.total_steps=9", "tracking.experiment=elsewhere")
    assert elsewhere.returncode == 2 and elsewhere.stderr.strip().splitlines()[-1].startswith(
        f"error: output_dir '{out}' holds a run tracked in MLflow experiment 'vitscale' "
        f"('elsewhere' now), and an MLflow run cannot move to another experiment: keep "
        f"tracking.experiment=vitscale"), elsewhere.stderr[-2000:]
    assert [c.step for c in CheckpointStore(out / "checkpoints").complete()] == [8, 4]

    # checkpoint.resume=false: a new run; the earlier one moved aside whole, nothing overwritten;
    # what no run writes (a user's notes and code, output_dir=. in a project) stays where it is
    (out / "notes.txt").write_text("lr sweep\n")
    (out / "my_code").mkdir()
    fresh = launch("train.total_steps=6", "model.depth=3", "checkpoint.resume=false")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    [aside] = out.glob("earlier-*")
    assert f"the earlier run there (checkpoints, config.yaml, finished.json, metrics.jsonl, " \
           f"tracking) was moved " \
           f"to {aside}, nothing of it deleted; left in place, as no run writes them: my_code, " \
           f"notes.txt" in fresh.stderr
    assert (out / "notes.txt").read_text() == "lr sweep\n" and (out / "my_code").is_dir()
    assert [c.step for c in CheckpointStore(aside / "checkpoints").complete()] == [8, 4]
    assert losses(aside) == first_losses and "depth: 2" in (aside / "config.yaml").read_text()
    assert [c.step for c in CheckpointStore(out / "checkpoints").complete()] == [6, 4]
    assert sorted(losses(out)) == list(range(1, 7))
    assert "depth: 3" in (out / "config.yaml").read_text()
    # the earlier run's MLflow run names where its files are now, not the folder the new one
    # took over (in its run.json too, which upload_spool.py would send from there)
    from mlflow import MlflowClient
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    earlier, new = (json.loads((d / "tracking/run.json").read_text()) for d in (aside, out))
    assert earlier["tags"]["output_dir"] == str(aside.resolve())
    assert client.get_run(earlier["run_id"]).data.tags["output_dir"] == str(aside.resolve())
    assert client.get_run(new["run_id"]).data.tags["output_dir"] == str(out.resolve())

    # a relaunch continues the new run, not the earlier one's newer step 8; the settings it
    # changes (more steps, a lower learning rate) are said, and kept next to the start's
    again = launch("train.total_steps=10", "model.depth=3", "optimizer.lr=0.0005",
                   "optimizer.weight_decay=0.3", "optimizer.grad_clip=0.25")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {out}/checkpoints/step_00000006 at step 6" in again.stderr
    assert sorted(losses(out)) == list(range(1, 11))
    kept = out / "config.resume_step_00000006.yaml"
    assert f"resumed with settings other than the ones it trained with until now: " \
           f"optimizer.grad_clip: 1.0 " \
           f"-> 0.25; optimizer.lr: 0.002 -> 0.0005; optimizer.weight_decay: 0.05 -> 0.3; " \
           f"train.total_steps: 6 -> 10; they apply from step 6 on (this relaunch's config: " \
           f"{kept})" in again.stderr, again.stderr[-3000:]
    assert "lr: 0.0005" in kept.read_text() and "lr: 0.002" in (out / "config.yaml").read_text()
    # and they did: the optimizer that trained steps 7-10 decayed with 0.3 (none on norms and
    # biases) and clipped at 0.25, where loading step 6's state put the saved 0.05 and 1.0 back
    assert optimizer_settings(out / "checkpoints/step_00000010") == ([0.3, 0.0], 0.25)

    # another optimizer cannot load this one's state: refused in one line, nothing touched
    other = launch("train.total_steps=12", "model.depth=3", "optimizer.name=sgd")
    assert other.returncode == 2
    assert other.stderr.strip().splitlines()[-1] == (
        f"error: output_dir '{out}' holds a run whose checkpoints need optimizer.name adamw "
        f"(now sgd): they hold its optimizer state and weights in that form; keep "
        f"optimizer.name adamw, pick a new output_dir, or set checkpoint.resume=false to start "
        f"a new run there (the earlier one is moved into '{out}/earlier-<time>/')")
    assert [c.step for c in CheckpointStore(out / "checkpoints").complete()] == [10, 8, 6]

    # another precision: DeepSpeed's files of step 10 are named for the one that wrote them (a
    # traceback on a missing file): read through the universal copy (ZeRO-1 -> 2 alone would
    # need none: the two write the same files)
    layout = launch("train.total_steps=12", "model.depth=3", "deepspeed.zero_stage=2",
                    "train.precision=bf16")
    assert layout.returncode == 0, layout.stderr[-3000:]
    assert f"precision changed (fp32 -> bf16): converting {out}/checkpoints/step_00000010 to " \
           f"DeepSpeed's universal checkpoint" in layout.stderr
    assert f"resumed from {out}/checkpoints/step_00000010 at step 10" in layout.stderr
    # the optimizer settings of config.yaml again: a change from what trained steps 7-10, said
    # and kept (compared with config.yaml alone, it went unsaid, the record left at 0.0005)
    assert "optimizer.grad_clip: 0.25 -> 1.0; optimizer.lr: 0.0005 -> 0.002; " \
           "optimizer.weight_decay: 0.3 -> 0.05; " in layout.stderr, layout.stderr[-3000:]
    assert "lr: 0.002" in (out / "config.resume_step_00000010.yaml").read_text()
    assert optimizer_settings(out / "checkpoints/step_00000012") == ([0.05, 0.0], 1.0)
    assert sorted(losses(out)) == list(range(1, 13))
    # what DeepSpeed cannot convert: ZeRO-3's files (or ZeRO-0's) from ZeRO-2's failed in it
    # with a bare AssertionError after the conversion; refused at the start in one line
    # (and its --dry-run says so first, options and overrides in any order)
    for dry in ([], ["--dry-run"]):
        zero3 = launch(*dry, "train.total_steps=14", "model.depth=3",
                       "deepspeed.zero_stage=3", "train.precision=bf16")
        assert zero3.returncode == 2
        assert zero3.stderr.strip().splitlines()[-1] == (
            f"error: {out}/checkpoints/step_00000012 cannot be resumed by this job (ZeRO stage "
            f"changed (2 -> 3); DeepSpeed converts a checkpoint between ZeRO-1 and ZeRO-2 "
            f"only): relaunch as it was written (ZeRO-2, 1 rank, train.precision=bf16), or set "
            f"checkpoint.resume=false to start a new run there (this one is moved aside)")
    assert not (out / "checkpoints/step_00000012_universal").exists()
    plan = launch("--dry-run", "train.total_steps=14", "--world-size", "2", "model.depth=3",
                  "deepspeed.zero_stage=2", "train.precision=bf16")
    assert plan.returncode == 0, plan.stderr[-3000:]
    [line] = [s for s in plan.stdout.splitlines() if s.startswith("resume: ")]
    assert line.startswith(f"resume: from {out}/checkpoints/step_00000012 at step 12 (2 steps "
                           f"left, 00:00:00 at the MFU above), converted "
                           f"to DeepSpeed's universal checkpoint first (world size changed "
                           f"(1 -> 2 ranks)); settings changed since: "), line
    assert "train.total_steps: 12 -> 14" in line, line  # (since the relaunch at step 10)
    # ZeRO-2 -> 1 needs no conversion: the two write the same files
    back = launch("train.total_steps=14", "model.depth=3", "deepspeed.zero_stage=1",
                  "train.precision=bf16")
    assert back.returncode == 0, back.stderr[-3000:]
    assert f"resumed from {out}/checkpoints/step_00000012 at step 12" in back.stderr
    assert "converting" not in back.stderr and sorted(losses(out)) == list(range(1, 15))
    # a manifest from before the precision was kept: DeepSpeed's file names tell bf16 apart
    from pretrain.checkpoint import Checkpoint
    from pretrain.checkpoint_layout import saved_precision
    step = {c.step: c for c in CheckpointStore(out / "checkpoints").complete()}
    assert (step[10].precision, step[12].precision) == ("fp32", "bf16")
    unkept = {n: Checkpoint(step[n].path, n, 1, step[n].zero_stage) for n in (10, 12)}
    assert saved_precision(unkept[12], "fp32") == "bf16"
    assert saved_precision(unkept[10], "bf16") == "fp32 or fp16"
    assert saved_precision(unkept[10], "fp32") == "fp32"  # fp16 and fp32 files look alike


def test_adams_step_count_goes_on_once_per_step_after_a_zero3_conversion(tmp_path, tiny_data):
    """DeepSpeed's ZeRO-3 load of a universal checkpoint gave all parameter groups one step
    counter, which Adam advanced once per group: two steps counted per step trained, and the
    bias correction wrong for the rest of the run (found resuming in another precision)."""
    out = tmp_path / "run"

    def launch(*extra):
        return run_launcher("pretrain.py", *tiny_run_args(
            out, tiny_data, "deepspeed.zero_stage=3", "checkpoint.every_steps=2",
            "eval.every_steps=100", "tracking.enabled=false", *extra))

    first = launch("train.total_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    again = launch("train.total_steps=4", "train.precision=bf16")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "precision changed (fp32 -> bf16): converting" in again.stderr
    [states] = (out / "checkpoints/step_00000004").glob("*optim_states.pt")
    saved = torch.load(states, map_location="cpu", weights_only=False)  # written by this test
    steps = [float(s["step"]) for s in saved["optimizer_state_dict"]["optimizer_state_dict"]
             ["state"].values()]
    assert len(steps) == 2 and steps == [4.0, 4.0]  # was [6.0, 6.0]


def test_an_sgd_run_requeued_on_fewer_ranks_keeps_its_momentum(tmp_path, tiny_data):
    """DeepSpeed's universal checkpoint, which carries a ZeRO run onto another world size,
    holds Adam's moments only: an SGD run requeued on fewer ranks was refused (before that, a
    KeyError 'exp_avg'). Its momentum now goes through the conversion: resumed from ZeRO-1's
    two ranks onto one, it trains on exactly as the same run without ZeRO, whose one model file
    holds the whole state and is read as written, step for step (a momentum lost in the
    conversion changes step 4's loss). ZeRO-3, whose load takes Adam's moments only, refuses."""
    def launch(out, world, stage, steps, fails=False):
        return run_deepspeed(world, *tiny_run_args(
            out, tiny_data, "optimizer.name=sgd", "optimizer.lr=0.05", "checkpoint.every_steps=2",
            "eval.every_steps=100", "tracking.enabled=false", f"deepspeed.zero_stage={stage}",
            f"train.total_steps={steps}"), fails=fails)

    for stage in (0, 1):
        out = tmp_path / f"zero{stage}"
        launch(out, 2, stage, 2)
        again = launch(out, 1, stage, 5)
        assert f"resumed from {out}/checkpoints/step_00000002 at step 2" in again.stderr
        assert ("world size changed (2 -> 1 ranks): converting" in again.stderr) == (stage == 1)
    assert losses(tmp_path / "zero1") == pytest.approx(losses(tmp_path / "zero0"), rel=1e-5)
    assert sorted(losses(tmp_path / "zero1")) == [1, 2, 3, 4, 5]
    assert not (tmp_path / "zero1/checkpoints/step_00000002_universal/sgd-as-adam").exists()

    # ZeRO-3, whose load of a converted checkpoint takes Adam's moments by name, refuses
    from pretrain.checkpoint import Checkpoint
    from pretrain.checkpoint_layout import conversion
    from pretrain.config import ConfigError
    zero3 = tmp_path / "zero3/step_00000002"
    zero3.mkdir(parents=True)
    (zero3 / "zero_pp_rank_0_mp_rank_00_optim_states.pt").touch()
    with pytest.raises(ConfigError, match=re.escape(
            f"{zero3} cannot be resumed by this job (world size changed (2 -> 1 ranks); "
            f"DeepSpeed's ZeRO-3 loads AdamW's state from a converted checkpoint, not SGD's "
            f"momentum): relaunch as it was written (ZeRO-3, 2 ranks, train.precision=fp32)")):
        conversion(Checkpoint(zero3, 2, 2, 3, "fp32"), 1, 3, "fp32", "sgd")
    assert conversion(Checkpoint(zero3, 2, 2, 3, "fp32"), 1, 3, "fp32", "adamw")

def optimizer_settings(step_dir: Path) -> tuple[list[float], float]:
    """The weight decay of each parameter group and the gradient clipping of the optimizer
    state a checkpoint holds (DeepSpeed's ZeRO optimizer saves its clip_grad)."""
    [states] = step_dir.glob("*optim_states.pt")  # one rank's: the groups are the same on all
    state = torch.load(states, map_location="cpu", weights_only=False)["optimizer_state_dict"]
    return ([g["weight_decay"] for g in state["base_optimizer_state"]["param_groups"]],
            state["clip_grad"])


def test_the_job_lock_ends_with_its_process_not_with_the_workers_it_forked(tmp_path):
    """A rank killed outright leaves loader workers that take seconds to notice (minutes in a
    retried read); they must not keep a requeued job out of its output_dir. And a holder on
    another node is named with its host, not judged dead by a look at this node's pids."""
    import sys

    from pretrain.file_lock import holder, try_lock
    from pretrain.run_dir import JOB_LOCK

    lock, child = tmp_path / JOB_LOCK, tmp_path / "child.pid"
    script = (f"import os, time, pathlib\n"
              f"from pretrain.file_lock import try_lock\n"
              f"held = try_lock(pathlib.Path({str(lock)!r}), children_hold=False)\n"
              f"if os.fork() == 0:\n"
              f"    pathlib.Path({str(child)!r}).write_text(str(os.getpid()))\n"
              f"    time.sleep(30)\n"
              f"    os._exit(0)\n"
              f"while not pathlib.Path({str(child)!r}).exists():\n"
              f"    time.sleep(0.01)\n"
              f"os._exit(9)  # as a SIGKILL: nothing closed by this process\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, timeout=60)
    assert done.returncode == 9
    pid = int(child.read_text())
    try:
        os.kill(pid, 0)  # the forked child lives on...
        held = try_lock(lock)  # ...and the lock is free
        assert held is not None
        held.close()
    finally:
        os.kill(pid, signal.SIGKILL)
    lock.write_text("123 gpu-node-7\n")
    assert holder(lock) == "pid 123 on gpu-node-7"


def test_a_requeued_job_waits_for_its_earlier_allocation_to_let_go_of_the_output_dir(
        tmp_path, monkeypatch, caplog):
    """A requeue (same SLURM job id, one restart more) can start while a cut-off node of the
    earlier allocation still holds the job lock on shared storage: it waits for it, where
    another job's lock is refused at once, as before."""
    import sys

    from pretrain.config import ConfigError
    from pretrain.run_dir import JOB_LOCK, hold_output_dir

    out = tmp_path / "run"
    out.mkdir()
    go = tmp_path / "release"

    def held_by(job: str, restarts: str, until_s: float) -> subprocess.Popen:
        script = (f"import pathlib, sys, time\n"
                  f"from pretrain.file_lock import try_lock\n"
                  f"held = try_lock(pathlib.Path({str(out / JOB_LOCK)!r}))\n"
                  f"print('held', flush=True)\n"
                  f"end = time.time() + {until_s}\n"
                  f"while time.time() < end and not pathlib.Path({str(go)!r}).exists():\n"
                  f"    time.sleep(0.05)\n")
        env = dict(os.environ, SLURM_JOB_ID=job, SLURM_RESTART_COUNT=restarts)
        proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "held\n"
        return proc

    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    monkeypatch.setenv("VITSCALE_REQUEUE_LOCK_WAIT_S", "60")
    # the earlier allocation lets go after 2 s: the requeue takes the folder
    old = held_by("77", "0", until_s=2)
    assert (out / JOB_LOCK).read_text().split()[2:] == ["slurm", "77.0"]
    with caplog.at_level(logging.WARNING, logger="pretrain.run_dir"):
        held = hold_output_dir(out)
    assert held is not None and old.wait(timeout=30) == 0
    assert "an earlier allocation of this job; waiting up to 60 s" in caplog.text
    assert (out / JOB_LOCK).read_text().split() == [str(os.getpid()), socket.gethostname(),
                                                    "slurm", "77.1"]
    held.close()
    @contextlib.contextmanager
    def holding(job: str, restarts: str):  # until the block ends
        other = held_by(job, restarts, until_s=60)
        try:
            yield other
        finally:
            go.touch()
            other.wait(timeout=30)
            go.unlink()

    # another job (or another step of this allocation) there: refused without waiting
    for job, restarts in (("78", "0"), ("77", "1")):
        with holding(job, restarts), pytest.raises(
                ConfigError, match=rf"^a job is still running in '{re.escape(str(out))}'"):
            hold_output_dir(out)
    # an earlier allocation that does not let go: said, after the wait, with what to do
    monkeypatch.setenv("VITSCALE_REQUEUE_LOCK_WAIT_S", "1")
    with holding("77", "0") as stuck:
        with pytest.raises(ConfigError, match=rf"^{re.escape(str(out / JOB_LOCK))} is still held "
                                              rf"\(pid {stuck.pid}\) after 1 s of waiting for an "
                                              rf"earlier allocation of this job; end its processes "
                                              rf"there .*requeue 77$"):
            hold_output_dir(out)
        monkeypatch.setenv("VITSCALE_REQUEUE_LOCK_WAIT_S", "5m")
        with pytest.raises(ConfigError, match=r"^VITSCALE_REQUEUE_LOCK_WAIT_S=5m is not a number "
                                              r"of seconds$"):
            hold_output_dir(out)


def _lock_waiting_worker(rank, world, port, out, wait_s, queue):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), SLURM_JOB_ID="77",
                      SLURM_RESTART_COUNT="1", VITSCALE_REQUEUE_LOCK_WAIT_S=str(wait_s))
    import torch.distributed as dist

    from pretrain.run_dir import hold_output_dir
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        held = hold_output_dir(Path(out))
        queue.put((rank, "held" if held is not None else "not rank 0"))
    except Exception as e:  # noqa: BLE001 -- what each rank says is the result
        queue.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


def test_every_rank_of_a_requeued_job_waits_for_the_lock_with_rank_0(tmp_path):
    """Rank 0 waits for the earlier allocation while the others wait on the job's store (a
    collective would time out first, at the process group's 10 minutes); a wait that ends
    without the lock ends every rank with the same line."""
    import sys

    from pretrain.run_dir import JOB_LOCK
    out = tmp_path / "run"
    out.mkdir()
    script = (f"import pathlib, sys, time\n"
              f"from pretrain.file_lock import try_lock\n"
              f"held = try_lock(pathlib.Path({str(out / JOB_LOCK)!r}))\n"
              f"print('held', flush=True)\n"
              f"time.sleep(float(sys.argv[1]))\n")
    env = dict(os.environ, SLURM_JOB_ID="77", SLURM_RESTART_COUNT="0")

    def earlier_allocation(for_s: float) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", script, str(for_s)], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "held\n"
        return proc

    old = earlier_allocation(4)
    assert spawn_ranks(_lock_waiting_worker, 2, str(out), 60, timeout=120) == {
        0: "held", 1: "not rank 0"}
    assert old.wait(timeout=30) == 0
    stuck = earlier_allocation(60)
    try:
        said = spawn_ranks(_lock_waiting_worker, 2, str(out), 1, timeout=120)
    finally:
        stuck.kill()
        stuck.wait(timeout=30)
    assert said[0] == said[1] and said[0].startswith(f"ConfigError: {out / JOB_LOCK} is still "
                                                     f"held (pid {stuck.pid})"), said


def test_resume_false_refuses_to_move_aside_what_the_new_run_reads(tmp_path):
    from pretrain.config import ConfigError
    from pretrain.run_dir import set_aside_earlier_run

    out = tmp_path / "ft"
    (out / "checkpoints").mkdir(parents=True)
    (out / "best.safetensors").write_bytes(b"weights of the earlier run")
    with pytest.raises(ConfigError, match=rf"^'{out}/best.safetensors', which this run reads, is "
                                          rf"\(inside\) the earlier run in '{out}'"):
        set_aside_earlier_run(out, [str(tmp_path / "data"), str(out / "best.safetensors")])
    with pytest.raises(ConfigError, match=rf"^'{out}', which this run reads, is"):
        set_aside_earlier_run(out, [str(out)])  # a fine-tune from the run it would replace
    assert sorted(p.name for p in out.iterdir()) == ["best.safetensors", "checkpoints"]
    # a job still running there (its tracker holds the lock): refused, nothing moved
    from pretrain.spool import lock
    (out / "tracking").mkdir()
    held = lock(out / "tracking")
    with pytest.raises(ConfigError, match=rf"^a job is still running in '{out}'"):
        set_aside_earlier_run(out)
    held.close()
    aside = set_aside_earlier_run(out)
    assert [p.name for p in out.iterdir()] == [aside.name] and aside.name.startswith("earlier-")
    assert (aside / "best.safetensors").read_bytes() == b"weights of the earlier run"
    # nothing of a run there (a folder of the user's own): nothing moved
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    assert set_aside_earlier_run(tmp_path / "mine") is None
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]

"""Shared test helpers: run a launcher the way a user does, from the repository root."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_launcher(script: str, *args: str, timeout: float = 300, env: dict | None = None,
                 cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``python launch/<script> args...`` as a subprocess; returns the finished process."""
    return subprocess.run([sys.executable, str(REPO / "launch" / script), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture
def repo() -> Path:
    return REPO


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_cmd(nprocs: int, *args: str) -> list[str]:
    """``deepspeed --num_gpus N launch/pretrain.py args`` (N CPU ranks on gloo here)."""
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nprocs),
            "--master_port", str(free_port()), str(REPO / "launch" / "pretrain.py"), *args]


def run_deepspeed(nprocs: int, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    proc = subprocess.run(deepspeed_cmd(nprocs, *args), cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def tiny_run_args(out: Path, data: Path, *extra: str) -> list[str]:
    """A small ViT with pre-logits on a prepared tiny dataset: seconds per run on the CPU."""
    return [f"output_dir={out}", f"data.root={data}", "data.generate_demo=false",
            "data.num_workers=1", "data.shuffle_buffer=50", "model.img_size=16",
            "model.patch_size=4", "model.depth=2", "model.embed_dim=64", "model.num_heads=2",
            "model.representation_size=64", "model.num_classes=8", "train.global_batch_size=16",
            "schedule.warmup_steps=2", "log.every_steps=1", "eval.every_steps=4",
            "checkpoint.every_steps=4", *extra]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """8 classes of procedural images in the raw ImageNet-21k layout, prepared into shards:
    256 train samples in 16 shards of 16, 64 held out."""
    from pretrain.data.shard_writer import prepare
    from pretrain.data.sources import load_synsets
    from pretrain.data.synthetic import write_synset_tars

    base = tmp_path_factory.mktemp("tiny")
    write_synset_tars(base / "raw", load_synsets("goog")[:8], 40, size=(24, 24))
    prepare("imagenet21k", str(base / "raw"), str(base / "shards"), name="tiny", shard_size=16,
            val_count=64, workers=1, progress=False)
    return base / "shards"

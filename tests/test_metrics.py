"""Metrics: the GPU peak table, the step timer's throughput/MFU arithmetic, the JSONL sink on
resume, and the rank-0-only console line."""
import io
import json
import logging

import pytest
import torch

from pretrain.config import ModelConfig
from pretrain.metrics import (ConsoleLogger, JsonlLogger, MetricsLogger, NullLogger, build_logger,
                              read_jsonl)
from pretrain.throughput import StepTimer, lookup_peak_tflops, peak_tflops
from pretrain.model import resolve_spec


class FakeClock:
    """Time that moves only when the test says so: exact arithmetic, no timed assertions."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


@pytest.mark.parametrize("name,tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA GH200 480GB", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0), ("NVIDIA A10G", 70.0), ("NVIDIA A10", 125.0),
    ("NVIDIA L40S", 362.0), ("NVIDIA L40", 181.0), ("NVIDIA L4", 121.0),
])
def test_peak_bf16_dense_tflops_by_device_name(name, tflops):
    assert lookup_peak_tflops(name) == tflops


def test_unknown_gpu_has_no_peak_and_the_config_value_wins(caplog):
    with caplog.at_level(logging.WARNING, logger="pretrain.throughput"):
        assert peak_tflops(device_name="Tesla V100-SXM2-16GB") is None
    assert "log.peak_tflops" in caplog.text
    assert peak_tflops(500.0, device_name="NVIDIA H100 80GB HBM3") == 500.0
    here = lookup_peak_tflops(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
    assert peak_tflops() == here  # on the CPU: None, MFU is not reported


def test_step_timer_splits_wait_and_compute_and_computes_mfu():
    flops = resolve_spec(ModelConfig(name="vit_large_patch16_224", representation_size=1024,
                                     num_classes=21843)).train_flops_per_image()
    clock = FakeClock()
    timer = StepTimer(flops, world_size=2, peak_tflops=989.0, cuda_sync=False, clock=clock)
    for _ in range(2):
        clock.advance(0.5)   # waiting for the batch
        timer.data_ready()
        clock.advance(1.5)   # forward, backward, optimizer step
        timer.step_done(images=64)
    clock.advance(30.0)      # a checkpoint: neither data wait nor compute
    timer.exclude_elapsed()
    perf = timer.summary()
    images_per_sec = 128 / 4.0
    per_device_tflops = images_per_sec * flops / 2 / 1e12
    assert perf["perf/images_per_sec"] == pytest.approx(images_per_sec)
    assert perf["perf/tflops"] == pytest.approx(per_device_tflops)
    assert perf["perf/mfu"] == pytest.approx(per_device_tflops / 989.0)
    assert perf["perf/data_wait_frac"] == pytest.approx(0.25)
    assert timer.summary() == {}  # a new window with no step in it yet
    # Without a known peak (CPU): TFLOP/s yes, MFU no.
    cpu = StepTimer(flops, cuda_sync=False, clock=clock)
    cpu.data_ready()
    clock.advance(1.0)
    cpu.step_done(images=8)
    assert set(cpu.summary()) == {"perf/images_per_sec", "perf/tflops", "perf/data_wait_frac"}


def test_with_gradient_accumulation_every_micro_batch_s_wait_counts():
    """4 micro-batches per update, each waiting 0.25 s for its data and computing 0.25 s: half
    the time is spent waiting (the first micro-batch's wait alone would say an eighth)."""
    clock = FakeClock()
    timer = StepTimer(1.0, cuda_sync=False, clock=clock)
    for _ in range(2):
        for _ in range(4):
            timer.fetching()
            clock.advance(0.25)
            timer.data_ready()
            clock.advance(0.25)
        timer.step_done(images=32)
    assert timer.summary()["perf/data_wait_frac"] == pytest.approx(0.5)


def test_step_done_without_data_ready_is_a_clear_error():
    with pytest.raises(RuntimeError, match="data_ready"):
        StepTimer(1.0, cuda_sync=False).step_done(images=1)


def test_jsonl_sink_appends_across_a_resume_and_survives_a_torn_line(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    first = JsonlLogger(path)
    assert isinstance(first, MetricsLogger)
    first.log({"train/loss": 2.5, "train/lr": torch.tensor(1e-3)}, step=1)
    first.log({"train/loss": 2.0}, step=2)
    # Flushed at once: readable before close, as a crash would leave it.
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]
    first.close()
    with open(path, "a") as f:
        f.write('{"step": 3, "train/lo')  # killed mid-write
    resumed = JsonlLogger(path)
    resumed.log({"train/loss": 1.5, "train/grad_norm": float("nan")}, step=3)
    resumed.close()
    records = read_jsonl(path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["train/lr"] == pytest.approx(1e-3)
    assert records[2]["train/loss"] == 1.5
    assert records[2]["train/grad_norm"] != records[2]["train/grad_norm"]  # NaN kept
    assert len(path.read_text().splitlines()) == 4  # the torn line stays on its own


def test_rank0_logs_to_file_and_console_other_ranks_log_nothing(tmp_path, capsys):
    other = build_logger(tmp_path / "r1", total_steps=100, rank=1)
    assert isinstance(other, NullLogger)
    other.log({"train/loss": 1.0}, step=10)
    assert not (tmp_path / "r1").exists() and capsys.readouterr().out == ""

    logger = build_logger(tmp_path / "r0", total_steps=100, rank=0)
    logger.log({"train/loss": 1.25, "train/lr": 1e-3, "perf/images_per_sec": 3210.4}, step=10)
    logger.log({"eval/i21k_val/top1": 0.125}, step=10)
    logger.close()
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "step 10/100 (10.0%) | loss 1.2500 | lr 1.00e-03 | 3,210 img/s"
    assert out[1] == "eval step 10/100 | i21k_val/top1 0.1250"
    assert [json.loads(line)["step"] for line in
            (tmp_path / "r0" / "metrics.jsonl").read_text().splitlines()] == [10, 10]


def test_progress_line_shows_mfu_and_eta_from_the_recent_step_rate():
    clock, stream = FakeClock(), io.StringIO()
    console = ConsoleLogger(total_steps=1000, stream=stream, clock=clock)
    console.log({"train/loss": 3.0, "perf/mfu": 0.412}, step=10)
    clock.advance(100.0)  # 10 s a step
    console.log({"train/loss": 2.0, "perf/mfu": 0.412}, step=20)
    first, second = stream.getvalue().splitlines()
    assert "ETA" not in first  # no rate yet
    assert second == "step 20/1000 (2.0%) | loss 2.0000 | MFU 41.2% | ETA 02:43:20"


def test_progress_line_names_a_data_wait_that_holds_the_job_up_and_the_rank_that_waits():
    stream = io.StringIO()
    console = ConsoleLogger(total_steps=100, stream=stream)
    console.log({"train/loss": 2.0, "perf/data_wait_frac": 0.01}, step=10)  # nothing to say
    console.log({"train/loss": 2.0, "perf/data_wait_frac": 0.2}, step=20)  # one rank: its own
    # rank 0 waits 1 %, rank 5 waits 31 %: every rank is held up by rank 5
    console.log({"train/loss": 2.0, "perf/data_wait_frac": 0.01, "perf/data_wait_frac_max": 0.31,
                 "perf/data_wait_frac_max_rank": 5}, step=30)
    lines = stream.getvalue().splitlines()
    assert "data wait" not in lines[0]
    assert " | data wait 20%" in lines[1] and "rank" not in lines[1]
    assert " | data wait 31% (rank 5)" in lines[2]


def test_a_write_that_takes_no_byte_is_a_failed_line_not_an_endless_retry(tmp_path, monkeypatch,
                                                                           caplog):
    """A file system at its limit may take no byte of a write without an error: the sink must
    count the line as lost and go on, not retry at once, forever, in the training thread."""
    import os

    sink = JsonlLogger(tmp_path / "metrics.jsonl")
    sink.log({"train/loss": 1.0}, 1)
    real_write, calls = os.write, []

    def takes_nothing(fd, data):
        calls.append(fd)
        assert len(calls) < 100, "the sink kept retrying a write that took no byte"
        return 0
    monkeypatch.setattr(os, "write", takes_nothing)
    with caplog.at_level(logging.WARNING, logger="pretrain.metrics"):
        sink.log({"train/loss": 2.0}, 2)
    assert sink.unwritten == 1 and len(calls) == 1
    assert "cannot write metrics to" in caplog.text and "no byte written" in caplog.text
    monkeypatch.setattr(os, "write", real_write)
    sink.log({"train/loss": 3.0}, 3)
    sink.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 3]

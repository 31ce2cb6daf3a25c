"""`benchmark.py train` and `benchmark.py overhead` end to end on a tiny ViT, through the real
DeepSpeed engine on the CPU. Figures are checked for consistency, never against a time."""
from __future__ import annotations

import datetime
import json
import shlex
import statistics
import subprocess

from conftest import REPO, run_launcher
from pretrain.bench_records import BEGIN, END

TINY = ["--model", "vit_tiny_patch16_224", "--image-size", "32", "--num-classes", "10"]


def _json(*args: str, timeout: float = 240) -> dict:
    done = run_launcher("benchmark.py", *args, "--json", timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout[-2000:]  # one JSON object and nothing else on stdout
    return json.loads(lines[0])


def test_train_reports_consistent_throughput_on_synthetic_input(tmp_path):
    measured = ["train", *TINY, "--batch", "4", "--precision", "fp32", "--zero", "2",
                "--steps", "2", "--warmup", "1"]
    records = tmp_path / "records.jsonl"
    today = lambda: datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")  # noqa: E731
    dates = {today()}
    r = _json(*measured, "--profile", str(tmp_path / "prof"), "--profile-steps", "1",
              "--record", str(records))
    dates.add(today())  # a run across midnight (UTC) is dated either day
    assert r["model"] == "vit_tiny_patch16_224" and r["image_size"] == 32
    assert r["arch_changes"] == {}  # timm's ViT-Ti as registered
    assert (r["batch_per_rank"], r["ranks"], r["zero_stage"]) == (4, 1, 2)
    assert (r["grad_accum_steps"], r["updates"]) == (1, 3)  # an update per step
    assert r["images_per_sec"] > 0 and r["step_time_ms_median"] > 0
    assert len(r["step_times_ms"]) == 2 and \
        abs(statistics.median(r["step_times_ms"]) - r["step_time_ms_median"]) < 0.01
    # TFLOP/s is images/s x the model's FLOPs per image (one rank)
    expected = r["images_per_sec"] * r["train_flops_per_image"] / 1e12
    assert abs(r["tflops_per_device"] - expected) <= 1e-9 + 1e-6 * expected
    # a CPU has no bf16 peak in the table: MFU is not made up (on a GPU it is TFLOP/s / peak)
    assert r["peak_tflops"] is None or not r["device"].startswith("CPU")
    assert r["mfu"] is None if r["peak_tflops"] is None else (
        abs(r["mfu"] - r["tflops_per_device"] / r["peak_tflops"]) <= 1e-3 * r["mfu"])
    # a share of the timed steps (the host's time between them: a loaded machine's pause
    # there is no failure, so no bound on it beyond being a share)
    assert r["data"] == "synthetic" and 0 <= r["data_wait_frac"] < 1
    assert r["peak_memory_gib"] > 0
    # the recipe's sigmoid loss on an untrained 10-class head: finite and positive
    assert r["final_loss"] == r["final_loss"] and r["final_loss"] > 0
    # --profile: a trace to open, and the profiled step's time split by kind of work
    trace = json.loads((tmp_path / "prof" / "trace_rank0.json").read_text())
    assert any("addmm" in e.get("name", "") or "linear" in e.get("name", "")
               for e in trace["traceEvents"])
    shares = r["profile"]["share"]
    assert shares["matmul"] > 0 and abs(sum(shares.values()) - 1) < 0.01, shares
    # DeepSpeed's step split into the optimizer's update and DeepSpeed's work around it
    # (ZeRO-2 flattens gradients, checks them and copies the weights back)
    assert shares["optimizer"] > 0 and shares["DeepSpeed bookkeeping"] > 0, shares
    assert r["profile"] == json.loads((tmp_path / "prof" / "breakdown_rank0.json").read_text())

    # --record: the result, with the command that measured it, the commit and the date
    [kept] = [json.loads(line) for line in records.read_text().splitlines()]
    assert {k: kept[k] for k in r} == r
    assert kept["command"] == "python launch/benchmark.py " + shlex.join(measured)
    head = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=REPO,
                          capture_output=True, text=True).stdout.strip()
    assert kept["commit"].split("+")[0] == head
    assert kept["date"] in dates

    # the README table made from the records, between its marker lines; a command measured
    # again keeps its row, with the newest figures
    again = {**kept, "images_per_sec": 1234.5}
    records.write_text(records.read_text() + json.dumps(again) + "\n")
    readme = tmp_path / "README.md"
    readme.write_text(f"# Perf\n\n{BEGIN}\nan old table\n{END}\n\nthe rest\n")
    done = run_launcher("benchmark.py", "table", str(records), "--readme", str(readme))
    assert done.returncode == 0, done.stderr[-2000:]
    text = readme.read_text()
    assert text.startswith(f"# Perf\n\n{BEGIN}\n| # |") and text.endswith(f"{END}\n\nthe rest\n")
    [row] = [line for line in text.splitlines() if line.startswith("| 1 | ") and "vit_" in line]
    assert row.startswith(f"| 1 | {r['device']} | vit_tiny_patch16_224 @32 | 4 × 1 | fp32, ZeRO-2, "
                          f"check before backward "
                          f"| synthetic | 1,234.5 | relative only | "
                          f"{r['step_time_ms_median']:,.1f} ms (2) | — | {kept['commit']} | ")
    assert f"1. `{kept['command']}`" in text and "an old table" not in text
    assert "Where a step's time goes" in text and "| 2 |" not in text
    # a README without the markers is refused, untouched
    plain = tmp_path / "PLAIN.md"
    plain.write_text("no markers\n")
    done = run_launcher("benchmark.py", "table", str(records), "--readme", str(plain))
    assert done.returncode == 2 and plain.read_text() == "no markers\n"
    assert done.stderr.startswith("error: ") and "benchmark-table: begin" in done.stderr


def test_train_two_ranks_fed_by_the_real_loader_accumulating(tiny_data):
    r = _json("train", "--model", "vit_tiny_patch16_224", "--image-size", "16",
              "--num-classes", "8", "--batch", "4", "--precision", "fp32", "--ranks", "2",
              "--steps", "2", "--warmup", "1", "--shards", str(tiny_data), "--workers", "1",
              "--accum", "2")
    assert r["ranks"] == 2 and r["data"] == "loader" and r["zero_stage"] == 1
    assert r["loader_workers"] == 1
    assert r["images_per_sec"] > 0 and 0 <= r["data_wait_frac"] <= 1
    # a step is one update of two micro-batches: 3 updates for the 6 micro-batches
    assert (r["batch_per_rank"], r["grad_accum_steps"], r["updates"]) == (4, 2, 3)
    assert r["grad_sum_dtype"] == "fp32"  # fp32 training: nothing else to sum in
    # per-device TFLOP/s: the global images/s shared by the two ranks
    expected = r["images_per_sec"] * r["train_flops_per_image"] / 2 / 1e12
    assert abs(r["tflops_per_device"] - expected) <= 1e-9 + 1e-6 * expected


def test_train_times_the_step_the_trainer_would_run_for_the_same_config():
    """A key the trainer's step reads is the benchmark's too: mixup/cutmix runs in the timed
    step (soft targets, another loss from the same weights and images), and train.compile
    compiles as --compile does. TORCHDYNAMO_DISABLE=1 leaves out the compilation itself
    (minutes on a CPU), not the engine's compile()."""
    # a head that is not zero-initialised: the loss then depends on the images and targets
    base = ["train", *TINY, "--batch", "4", "--precision", "fp32", "--steps", "1",
            "--warmup", "0", "--set", "model.head_zero_init=false", "--json"]
    done = run_launcher("benchmark.py", *base, "--set", "data.mixup_alpha=0")
    assert done.returncode == 0, done.stderr[-3000:]
    plain = json.loads(done.stdout)
    # nobody set optimizer.momentum: the config a rank gets says so, nothing to warn about
    assert "not used by optimizer" not in done.stderr, done.stderr[-3000:]
    # both keys in one run (compiling leaves the loss alone, so the loss changes by the mixup)
    mixed = run_launcher("benchmark.py", *base, "--set", "data.mixup_alpha=0.8",
                         "--set", "train.compile=true",
                         "--set", "train.compile_mode=max-autotune-no-cudagraphs",
                         env={"TORCHDYNAMO_DISABLE": "1"})
    assert mixed.returncode == 0, mixed.stderr[-3000:]
    mixed = json.loads(mixed.stdout)
    assert (plain["mixup"], mixed["mixup"]) == (False, True)
    assert mixed["final_loss"] != plain["final_loss"]
    assert (plain["compile"], plain["compile_mode"]) == (False, None)
    assert (mixed["compile"], mixed["compile_mode"]) == (True, "max-autotune-no-cudagraphs")


def test_overhead_compares_both_loops_from_the_same_start():
    done = run_launcher("benchmark.py", "overhead", *TINY, "--batch", "4", "--steps", "1",
                        "--repeats", "2", "--json", timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout)
    # both sides get the config as set: nobody set optimizer.momentum, nothing to warn about
    assert "not used by optimizer" not in done.stderr, done.stderr[-3000:]
    assert r["zero_stage"] == 2 and r["precision"] == "bf16" and r["threads"] == 1
    assert r["deepspeed_step_ms"] > 0 and r["plain_step_ms"] > 0
    assert abs(r["ratio"] - r["deepspeed_step_ms"] / r["plain_step_ms"]) < 1e-9
    # Same initial weights and batch: the first losses agree up to bf16 rounding, so the two
    # loops really train the same model.
    first = r["first_loss"]
    assert abs(first["deepspeed"] - first["plain"]) < 0.05 * abs(first["plain"])



def test_a_setting_the_trainer_refuses_is_one_line_from_the_benchmark_too():
    import torch
    odd = run_launcher("benchmark.py", "train", *TINY, "--batch", "3", "--set",
                       "data.mixup_alpha=0.2", "--steps", "1", "--warmup", "1")
    assert odd.returncode == 2 and "Traceback" not in odd.stderr, odd.stderr[-2000:]
    assert odd.stderr.strip().splitlines()[-1].startswith(
        "error: mixup/cutmix pair each image with another of its micro-batch, which is 3 here")

    fp16 = run_launcher("benchmark.py", "train", *TINY, "--batch", "4", "--precision", "fp16",
                        "--steps", "1", "--warmup", "1")
    if torch.cuda.is_available():  # fp16 trains on a GPU
        assert fp16.returncode == 0, fp16.stderr[-2000:]
        return
    assert fp16.returncode == 2 and "Traceback" not in fp16.stderr, fp16.stderr[-2000:]
    assert fp16.stderr.strip().splitlines()[-1] == (
        "error: train.precision=fp16 needs a GPU; use bf16 or fp32 on the CPU")

"""The benchmark CLI end to end on a few real photos (figures are not asserted: no timing tests)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pretrain.data.info import read_info

BENCHMARK = Path(__file__).resolve().parent.parent / "launch" / "benchmark.py"


def _run(*args: str) -> str:
    done = subprocess.run([sys.executable, str(BENCHMARK), *args], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_photos_then_loader_benchmark_prints_one_json_object(tmp_path):
    _run("photos", "--count", "40", "--shard-size", "10", "--out", str(tmp_path))
    split = read_info(tmp_path).split("train")
    assert split.num_samples == 40 and split.shard_lengths == [10, 10, 10, 10]

    out = _run("loader", "--shards", str(tmp_path), "--workers", "1", "--batches", "2",
               "--batch-size", "8", "--img-size", "64", "--shuffle-buffer", "8", "--json")
    result = json.loads(out)
    assert result["images_per_sec"] > 0 and result["reference_images_per_sec"] > 0
    assert abs(result["ratio"] - result["images_per_sec"] / result["reference_images_per_sec"]) < 0.01


def test_loader_benchmark_reads_a_shard_pattern_and_prints_a_table(tmp_path):
    _run("photos", "--count", "20", "--shard-size", "10", "--out", str(tmp_path))
    pattern = str(tmp_path / "photos-train-{000000..000001}.tar")
    out = _run("loader", "--shards", pattern, "--workers", "0", "--batches", "1",
               "--batch-size", "4", "--img-size", "32", "--shuffle-buffer", "4")
    assert "ratio" in out and "reference" in out


def test_loader_benchmark_times_each_jpeg_decoder_and_names_the_one_in_use(tmp_path):
    _run("photos", "--count", "16", "--shard-size", "8", "--out", str(tmp_path))
    out = _run("loader", "--shards", str(tmp_path), "--workers", "0", "--batches", "1",
               "--batch-size", "4", "--img-size", "32", "--shuffle-buffer", "4", "--decoders",
               "--decoder-photos", "120x90", "--decoder-count", "4", "--json")
    result = json.loads(out)
    assert result["decoder"].startswith("JPEG decoder: simplejpeg")
    rows = {row["decoder"]: row for row in result["decoder_benchmark"]["decoders"]}
    for name in ("PIL", "simplejpeg"):
        assert rows[name]["images_per_sec"] > 0 and rows[name]["mean_abs_diff_vs_pil"] < 2
    # unavailable candidates (say PyTurboJPEG without libturbojpeg) are listed, with why
    assert all(row["images_per_sec"] is not None or "unavailable" in row["notes"]
               for row in rows.values())
    assert result["decoder_benchmark"]["photo_size"] == "120x90"

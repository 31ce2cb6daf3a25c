"""The benchmark CLI end to end on a few real photos (figures are not asserted: no timing tests)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pretrain.data.info import read_info

REPO = Path(__file__).resolve().parent.parent
BENCHMARK = REPO / "launch" / "benchmark.py"


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


def test_bad_input_is_one_line_before_any_work_and_replaces_nothing(tmp_path):
    ph = tmp_path / "ph"
    _run("photos", "--count", "4", "--shard-size", "2", "--out", str(ph))
    info = (ph / "_info.json").read_text()
    mine = tmp_path / "a-file"
    mine.write_text("mine")
    (tmp_path / "a-folder").mkdir()
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"a": 1}\n')
    record = dict(command="python launch/benchmark.py train --batch 2", commit="abc", date="d",
                  device="CPU", model="vit_tiny_patch16_224", image_size=32, batch_per_rank=2,
                  ranks=1, precision="fp32", zero_stage=1, images_per_sec=1.0)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    kept = tmp_path / "kept.jsonl"
    kept.write_text(json.dumps(record) + "\n")
    cases = [
        (["photos", "--count", "4", "--out", str(ph)],
         f"error: --out {ph} already holds a dataset (_info.json), which this would replace; "
         f"name a new or empty folder"),
        (["photos", "--out", str(mine)], f"error: --out {mine} is a file; name a new or empty "
                                         f"folder"),
        (["loader", "--shards", str(ph), "--split", "nope"],
         f"error: --split nope: not a split of {ph} (its splits: train)"),
        (["loader", "--shards", str(ph), "--batches", "0"],
         "error: argument --batches: expected a whole number of at least 1, got '0'; see "
         "benchmark.py loader --help"),
        (["loader", "--shards", str(ph), "--decoders", "--decoder-quality", "500"],
         "error: --decoder-quality 500: a JPEG quality is 1 to 100"),
        (["train", "--batch", "2", "--warmup", "-1"],
         "error: argument --warmup: expected a whole number of at least 0, got '-1'; see "
         "benchmark.py train --help"),
        (["train", "--batch", "2", "--record", str(tmp_path / "a-folder")],
         f"error: --record {tmp_path / 'a-folder'} is a folder or under a file; name a .jsonl "
         f"file (made if missing, appended to if there)"),
        (["train", "--batch", "2", "--profile", str(mine)],
         f"error: --profile {mine} is a file; name a folder for the trace (made if missing)"),
        (["train", "--batch", "2", "--record", "/proc/bench.jsonl"],
         "error: cannot write /proc/bench.jsonl (No such file or directory); name a --record "
         "file or --profile folder that can be written"),
        (["train", "--batch", "2", "--profile", "/proc/trace"],
         "error: cannot write /proc/trace (No such file or directory); name a --record file or "
         "--profile folder that can be written"),
        (["train", "--batch", "2", "--workers", "4"],
         "error: --workers sets the loader's workers, which only --shards uses; add --shards DIR "
         "or drop --workers"),
        (["train", "--batch", "2", "--profile-steps", "5"],
         "error: --profile-steps needs --profile FOLDER (where the trace goes)"),
        # the config's own fixes ("set it to null in the file") cannot be made from here
        (["train", "--batch", "2", "--set", "train.epochs=1"],
         "error: --set train.epochs is the benchmark's to set: give --steps and --warmup"),
        (["train", "--batch", "2", "--set", "train.grad_accum_steps=4"],
         "error: --set train.grad_accum_steps is the benchmark's to set: give --accum"),
        # an option's bad value is named as the option, not as the config key it sets
        (["train", "--batch", "2", "--model", "vit_nope"],
         "error: --model: 'vit_nope' is not a timm model; see timm.list_models('vit_*')"),
        (["table", str(empty)], f"error: {empty} holds no records; write them with `benchmark.py "
                                f"train ... --record {empty}`"),
        (["overhead", "--repeats", "0"],
         "error: argument --repeats: expected a whole number of at least 1, got '0'; see "
         "benchmark.py overhead --help"),
        (["table", str(odd)], f"error: {odd}, line 1: not a record of `benchmark.py train "
                              f"--record` (it lacks command, commit, date, device, model, "
                              f"image_size, batch_per_rank, ranks, precision, zero_stage, "
                              f"images_per_sec)"),
        (["table", str(kept), "--readme", str(tmp_path / "NOPE.md")],
         f"error: --readme {tmp_path / 'NOPE.md'}: No such file or directory; name the README "
         f"that holds the table's marker lines"),
    ]
    for args, line in cases:
        done = subprocess.run([sys.executable, str(BENCHMARK), *args], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2 and "Traceback" not in done.stderr, (args, done.stderr)
        assert done.stderr.strip().splitlines()[-1] == line, args
    assert (ph / "_info.json").read_text() == info and mine.read_text() == "mine"


def test_train_with_a_recipe_measures_the_recipes_model():
    """--config RECIPE without --model: the recipe's model (it measured ViT-L/16's width with
    the recipe's depth and patch, under ViT-L/16's name)."""
    from pretrain.benchmark import bench_config
    from pretrain.config import PretrainConfig
    from pretrain.config_files import load_config

    demo = REPO / "configs/pretrain/demo.yaml"
    assert bench_config(None, 8, recipe=demo).model == load_config(PretrainConfig, demo).model
    assert bench_config(None, 8).model.name == "vit_large_patch16_224"  # no recipe: ViT-L/16


def test_the_table_names_a_models_architecture_overrides():
    """`--set model.depth=2` measures a 2-block model: its row must not read as the stock one."""
    from pretrain.bench_records import markdown
    from pretrain.benchmark import bench_config
    from pretrain.model import changed_from_stock, resolve_spec

    def spec(*overrides):
        return resolve_spec(bench_config("vit_tiny_patch16_224", 4, image_size=32,
                                         overrides=overrides).model)

    assert changed_from_stock(spec("model.depth=2", "model.mlp_ratio=2.5")) == \
        {"depth": 2, "mlp_ratio": 2.5}
    # the image size has its own place in the label; the stock model has no changes
    assert changed_from_stock(spec()) == {}
    r = dict(command="python launch/benchmark.py train ...", commit="0123456789",
             date="2026-11-28", device="CPU", model="vit_tiny_patch16_224", image_size=32,
             batch_per_rank=4, ranks=1, precision="fp32", zero_stage=1, images_per_sec=10.0,
             arch_changes={"depth": 2, "mlp_ratio": 2.5})
    assert "| CPU | vit_tiny_patch16_224 (depth 2, MLP ratio 2.5) @32 | 4 × 1 |" in markdown([r])
    # records from before the key, and stock models, keep the plain label
    assert "| CPU | vit_tiny_patch16_224 @32 | 4 × 1 |" in markdown([{**r, "arch_changes": {}}])
    r.pop("arch_changes")
    assert "| CPU | vit_tiny_patch16_224 @32 | 4 × 1 |" in markdown([r])


def test_a_record_names_the_commit_a_shipped_copy_says(monkeypatch):
    # a copy of the checkout sent to a GPU node may carry another commit's .git, or none
    from pretrain import bench_records
    monkeypatch.setenv("VITSCALE_COMMIT", "5de917dc3f")
    kept = bench_records.provenance(["train", "--batch", "2", "--record", "r.jsonl"])
    assert kept["commit"] == "5de917dc3f"
    assert kept["command"] == "python launch/benchmark.py train --batch 2"
    monkeypatch.delenv("VITSCALE_COMMIT")
    assert bench_records.provenance(["train"])["commit"] != "5de917dc3f"


def test_the_table_says_which_block_backward_a_gpu_row_ran():
    # rows 2 and 11 of the README differ only in train.block_kernels; a CPU, where the kernels
    # cannot run, and records from before the option say nothing
    from pretrain.bench_records import _options
    base = dict(precision="bf16", zero_stage=1, compile=True)
    assert _options({**base, "block_kernels": True}) == "bf16, ZeRO-1, compiled, block kernels"
    assert _options({**base, "block_kernels": False}) == \
        "bf16, ZeRO-1, compiled, timm's block backward"
    assert _options({**base, "block_kernels": None}) == _options(base) == "bf16, ZeRO-1, compiled"


def test_the_table_gives_the_mfu_at_the_median_step_beside_the_mean():
    # README row 13's record (H100, 16 micro-batches of 128 per update, 3 timed updates): the
    # window's mean gave 45.8 %; one update ran ~300 ms short, the median update gives 44.7 %
    from pretrain.bench_records import markdown, mfu_at_median
    r = dict(command="python launch/benchmark.py train ...", commit="9279c61da5",
             date="2026-11-27", device="NVIDIA H100 80GB HBM3", model="vit_huge_patch14_224",
             image_size=224, batch_per_rank=128, grad_accum_steps=16, ranks=1, precision="bf16",
             zero_stage=1, compile=True, block_kernels=True, steps=3,
             images_per_sec=451.39651764136363, mfu=0.4582156445035659, peak_tflops=989.0,
             train_flops_per_image=1003940559360.0, step_time_ms_median=4646.309266999992)
    assert abs(mfu_at_median(r) - 0.4474) < 1e-4
    row = markdown([r]).splitlines()[2]
    assert "| 451.4 | 45.8 % | 4,646.3 ms (3) | 44.7 % | 9279c61da5 |" in row, row
    # two ranks: the median step's images are the global batch, the MFU per device
    two = {**r, "ranks": 2, "images_per_sec": 2 * r["images_per_sec"]}
    assert abs(mfu_at_median(two) - mfu_at_median(r)) < 1e-12
    # a CPU row has no peak: no MFU of either kind
    assert mfu_at_median({**r, "mfu": None, "peak_tflops": None}) is None

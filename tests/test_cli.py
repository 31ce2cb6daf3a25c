"""The pretraining launcher as a user runs it: dry runs of the recipes and one-line errors."""
import json
import os
import re

import pytest
import yaml

from conftest import REPO, run_launcher, tiny_run_args
from finetune.config import FinetuneConfig
from pretrain.config import PretrainConfig
from pretrain.config_files import config_keys


def test_misspelled_key_is_one_line_naming_it_and_the_fix():
    proc = run_launcher("pretrain.py", "--config", "configs/pretrain/demo.yaml",
                        "optimizer.lr_rate=1", "--dry-run")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "error: unknown config key 'optimizer.lr_rate'; did you mean 'optimizer.lr'?"]
    assert proc.stdout == ""


def test_a_bad_command_line_under_a_launcher_is_said_once_per_node_not_once_per_rank(tmp_path):
    """Every rank of a node reads the same arguments and files: the node's first rank says
    it, the others exit with the same code (a line per GPU is 8 lines a node). Under torchrun,
    which turns it into 1, rank 0 tells the SLURM script the code (pretrain/job_status.py)."""
    import subprocess
    from conftest import REPO, deepspeed_cmd
    (tmp_path / "a-file").write_text("")  # where output_dir's folder would go
    for bad, line in (
            ("optimizer.lr_rate=1",
             "error: unknown config key 'optimizer.lr_rate'; did you mean 'optimizer.lr'?"),
            ("--bogus", "error: unrecognized arguments: --bogus; see pretrain.py --help"),
            # met at the start by each rank alike: agreed, and said by rank 0 alone
            (f"output_dir={tmp_path / 'a-file/run'}", f"error: output_dir "
             f"'{tmp_path / 'a-file/run'}' cannot be created (Not a directory); pick a folder "
             f"you can write to"),
            (f"data.root={tmp_path / 'nowhere'}", f"error: no _info.json or ")):
        extra = ["data.generate_demo=false", f"output_dir={tmp_path / 'out'}",
                 "tracking.enabled=false"] if bad.startswith("data.root") else []
        proc = subprocess.run(deepspeed_cmd(2, *extra, bad), cwd=REPO, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr[-2000:]
        if bad.startswith("data.root"):
            said = [t for t in (proc.stdout + proc.stderr).splitlines() if "error:" in t]
            assert len(said) == 1 and said[0].startswith(line), said
            continue
        said = [t for t in (proc.stdout + proc.stderr).splitlines() if "error:" in t]
        assert said == [line], proc.stdout[-2000:] + proc.stderr[-2000:]
    # the node's first rank starting late (a busy node) under torchrun, which ends every rank
    # within 0.1 s of one exiting: the others wait for its line instead of exiting first
    import json
    import sys
    from conftest import free_port
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
         str(free_port()), str(REPO / "tests/faulty_launch.py"), "optimizer.lr_rate=1"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "FAULTS": json.dumps({"late": [0, 1.0]}),
             "VITSCALE_JOB_STATUS": str(tmp_path / "job-status")})
    assert proc.returncode != 0
    assert (tmp_path / "job-status").read_text() == "exit 2\n"  # the code, not torchrun's 1
    said = [t for t in (proc.stdout + proc.stderr).splitlines() if t.startswith("error:")]
    assert said == ["error: unknown config key 'optimizer.lr_rate'; did you mean "
                    "'optimizer.lr'?"], proc.stdout[-2000:] + proc.stderr[-2000:]


# On one GPU the batch of 4096 is 32 (ViT-L/16) or 64 (ViT-H/14) micro-batches summed in fp32:
# ZeRO-1 holds bf16 params and grads (2 + 2 bytes), the fp32 gradient sums (4) and the fp32
# master weights, gradient partition and Adam moments (16): 24 bytes a parameter. Activations:
# 32.5 bytes per token, unit of width and block (pretrain/plan.py), x micro-batch.
@pytest.mark.parametrize("recipe,params,backbone,tflop,memory,micro,activations", [
    ("vit_l16_i21k.yaml", "326.7 M", "303.3 M", "0.369 TFLOP", "7.3 GiB", 128, "18.8 GiB"),
    ("vit_h14_i21k.yaml", "660.4 M", "630.8 M", "1.004 TFLOP", "14.8 GiB", 64, "20.4 GiB"),
])
def test_dry_run_of_the_i21k_recipes_prints_size_and_flops(recipe, params, backbone, tflop,
                                                           memory, micro, activations):
    proc = run_launcher("pretrain.py", "--config", f"configs/pretrain/{recipe}", "--dry-run",
                        "--local_rank=0")  # what the DeepSpeed launcher appends
    assert proc.returncode == 0, proc.stderr
    assert f"params: {params} (backbone {backbone}" in proc.stdout
    assert f"train FLOPs per image: {tflop}" in proc.stdout
    assert f"memory per GPU, ZeRO-1: {memory} of model states (params, grads, the fp32 " \
           f"gradient sums, optimizer) + about {activations} of activations (micro-batch " \
           f"{micro}) = " in proc.stdout
    resolved = yaml.safe_load(proc.stdout.split("\nmodel: vit_")[0])
    assert resolved["model"]["num_classes"] == 21843


H100_RECORDS = [r for r in map(json.loads, (REPO / "benchmarks/train.jsonl").open())
                if r["device"].startswith("NVIDIA H100") and r["model"] in (
                    "vit_large_patch16_224", "vit_huge_patch14_224")]


def test_the_plans_memory_per_gpu_bounds_every_peak_measured_on_an_h100():
    """The dry-run's memory per GPU (model states + activations) for each ViT-L/16 and ViT-H/14
    configuration measured on an H100 (launch/benchmark.py train, benchmarks/train.jsonl): never
    below the measured peak, at most 25 % above it -- so a plan that fits, fits."""
    from pretrain.config import PretrainConfig
    from pretrain.config_files import load_config
    from pretrain.plan import plan
    assert len(H100_RECORDS) >= 20
    checked = {}
    for r in H100_RECORDS:
        width = {"vit_large_patch16_224": 1024, "vit_huge_patch14_224": 1280}[r["model"]]
        batch = r["batch_per_rank"] * r.get("grad_accum_steps", 1) * r["ranks"]
        overrides = [  # what launch/benchmark.py train sets in the recipe
            f"model.name={r['model']}", f"model.representation_size={width}",
            f"train.micro_batch_size={r['batch_per_rank']}",
            f"train.global_batch_size={batch}",
            f"deepspeed.zero_stage={r['zero_stage']}", f"train.precision={r['precision']}",
            f"train.activation_checkpointing={str(r['activation_checkpointing']).lower()}"]
        if r["checkpointed_blocks"] is not None:
            overrides.append(f"train.checkpointed_blocks={r['checkpointed_blocks']}")
        key = tuple(overrides)
        if key not in checked:
            cfg = load_config(PretrainConfig, REPO / "configs/pretrain/vit_l16_i21k.yaml",
                              overrides)
            [line] = [s for s in plan(cfg, r["ranks"]).splitlines()
                      if s.startswith("memory per GPU")]
            checked[key] = float(re.search(r" = ([\d.]+) GiB of the GPU", line).group(1))
        assert 1.0 <= checked[key] / r["peak_memory_gib"] <= 1.25, (
            f"{r['command']}: measured {r['peak_memory_gib']:.1f} GiB, planned {checked[key]}")
    assert len(checked) >= 5  # L16 and H14, accumulating or not, ZeRO-1 and 3, recomputed


def test_dry_run_warns_when_the_plan_does_not_fit_the_gpu():
    args = ["pretrain.py", "--config", "configs/pretrain/vit_l16_i21k.yaml", "--dry-run"]
    proc = run_launcher(*args, "--world-size", "4", "train.micro_batch_size=1024")
    assert proc.returncode == 0, proc.stderr
    assert "warning: more than the GPU's memory: at most 522 image(s) a micro-batch fit; set " \
           "train.micro_batch_size" in proc.stdout
    proc = run_launcher(*args, "--gpu-memory", "6")  # 7.3 GiB of model states on one GPU
    assert "warning: more than the GPU's memory: the model states alone do not fit" in proc.stdout
    assert "of the GPU's 6 GiB (--gpu-memory)" in proc.stdout
    proc = run_launcher(*args)  # the recipe as shipped fits an H100
    assert "of the GPU's 79 GiB (--gpu-memory)" in proc.stdout and "warning:" not in proc.stdout
    # fp16 planned on a login node without GPUs: said, since a run there would stop at once
    import torch
    proc = run_launcher(*args, "train.precision=fp16")
    assert proc.returncode == 0, proc.stderr
    assert ("precision: fp16 needs GPUs, which this machine lacks: the plan is for the job's GPU "
            "nodes" in proc.stdout) == (not torch.cuda.is_available()), proc.stdout


def test_dry_run_rejects_a_batch_that_does_not_split_over_the_world():
    proc = run_launcher("pretrain.py", "--config", "configs/pretrain/vit_l16_i21k.yaml",
                        "--dry-run", "--world-size", "48")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "error: train.global_batch_size=4096 is not divisible by world size 48 x "
        "train.micro_batch_size 128; pick a train.global_batch_size that is a multiple of 6144"]
    # more ranks than the recipe's micro-batch allows: the micro-batch that fits is named
    proc = run_launcher("pretrain.py", "--config", "configs/pretrain/vit_l16_i21k.yaml",
                        "--dry-run", "--world-size", "64")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "error: train.global_batch_size=4096 is not divisible by world size 64 x "
        "train.micro_batch_size 128; set train.micro_batch_size=64 (4096 / 64 ranks = 64 per "
        "rank), or a train.global_batch_size that is a multiple of 8192"]


def test_print_config_shows_the_resolved_overrides():
    proc = run_launcher("pretrain.py", "--print-config", "optimizer.lr=2e-4", "seed=3")
    assert proc.returncode == 0, proc.stderr
    # overrides on both sides of an option: argparse took the first group only ("unrecognized
    # arguments: seed=3")
    mixed = run_launcher("pretrain.py", "optimizer.lr=2e-4", "--print-config", "seed=3")
    assert mixed.returncode == 0, mixed.stderr
    assert mixed.stdout == proc.stdout
    resolved = yaml.safe_load(proc.stdout)
    assert resolved["optimizer"]["lr"] == 2e-4 and resolved["seed"] == 3
    assert resolved["model"]["name"] == "vit_tiny_patch16_224"  # no --config: the demo recipe


def test_help_lists_every_config_key_with_its_default():
    proc = run_launcher("pretrain.py", "--help")
    assert proc.returncode == 0
    assert "optimizer.lr = 0.001" in proc.stdout and "--dry-run" in proc.stdout
    assert "model.representation_size = None" in proc.stdout


@pytest.mark.parametrize("script,schema", [("pretrain.py", PretrainConfig),
                                           ("finetune.py", FinetuneConfig)])
def test_help_explains_every_config_key_of_both_stages(script, schema):
    text = run_launcher(script, "--help").stdout.split("what a run gets):\n")[1]
    lines = {line.split(" = ")[0].strip(): line for line in text.splitlines() if " = " in line}
    assert set(lines) == set(config_keys(schema))
    # "key = default   [choices]   what it is": a key shown with its default alone is unexplained
    unexplained = [k for k, line in lines.items() if len(line.split("   ")) < 2
                   or line.split("   ")[-1].startswith("[")]
    assert unexplained == []


@pytest.mark.parametrize("flag,value", [
    ("--mfu", "0"), ("--mfu", "-1"), ("--mfu", "1.5"), ("--mfu", "nan"),
    ("--world-size", "0"), ("--world-size", "-2"), ("--samples", "-5"), ("--samples", "0"),
    ("--gpu-memory", "0"), ("--gpu-memory", "nan"),
])
def test_dry_run_refuses_an_impossible_plan_flag_in_one_line(flag, value):
    proc = run_launcher("pretrain.py", "--dry-run", flag, value)
    assert proc.returncode == 2
    assert proc.stdout == ""  # no plan with negative ranks, steps or MFU
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: argument {flag}: expected ")
    assert f"got '{value}'; see pretrain.py --help" in line
    assert {"--mfu": "(0, 1]", "--gpu-memory": "above 0"}.get(flag, "at least 1") in line


def test_plan_options_without_dry_run_are_refused_not_ignored():
    """A run's world is its launcher's: --world-size 4 on a plain start trained on one rank."""
    proc = run_launcher("finetune.py", "--config", "configs/finetune/demo.yaml", "--world-size",
                        "4")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "error: --world-size only shapes the --dry-run plan; add --dry-run, or drop it (a run's "
        "ranks are its launcher's)"]
    proc = run_launcher("pretrain.py", "--samples", "1000", "--mfu", "0.5")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: --mfu, --samples only shape the --dry-run plan; add --dry-run, or drop them")


def test_the_plans_parameter_counts_are_exact_below_a_tenth_of_a_million(tmp_path):
    """The demo fine-tune's head (192 x 10 + 10) and its dropped pre-logits read 0.0 M each."""
    from conftest import REPO
    proc = run_launcher("finetune.py", "--config", str(REPO / "configs/finetune/demo.yaml"),
                        "--dry-run", "init=null", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "params: 1.8 M (backbone 1.8 M, pre-logits 0, head 1,930)" in proc.stdout


def test_finetune_dry_run_refuses_a_world_of_no_ranks():
    proc = run_launcher("finetune.py", "--config", "configs/finetune/demo.yaml", "--dry-run",
                        "--world-size", "0")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "error: argument --world-size: expected a whole number of at least 1, got '0'; "
        "see finetune.py --help"]


@pytest.mark.parametrize("args,line", [
    (("evaluate.py", "runs/x/final", "--batch-size", "0"), "error: argument --batch-size: "
     "expected a whole number of at least 1, got '0'; see evaluate.py --help"),
    (("export.py", "runs/x"), "error: the following arguments are required: --out; see "
     "export.py --help"),
    (("upload_spool.py",), "error: the following arguments are required: output_dir; see "
     "upload_spool.py --help"),
    (("benchmark.py", "train", "--batch", "0"), "error: argument --batch: expected a whole "
     "number of at least 1, got '0'; see benchmark.py train --help"),
    (("finetune.py", "--print-config", "--dry-run"), "error: --print-config and --dry-run: "
     "give one (--dry-run prints the config too, then checks it and plans the run)"),
    # a config key given as an option is named with its fix
    (("finetune.py", "--init=runs/demo", "--dry-run"), "error: unrecognized arguments: "
     "--init=runs/demo (--init: config keys are set as key=value, with no dashes: init=...); "
     "see finetune.py --help"),
    (("pretrain.py", "--train.total-steps", "9", "--dry-run"), "error: unrecognized arguments: "
     "--train.total-steps (--train.total-steps: config keys are set as key=value, with no "
     "dashes: train.total_steps=...); see pretrain.py --help"),
])
def test_every_launchers_bad_arguments_are_one_line(args, line):
    """As the trainers' and prepare_data's: not argparse's usage block (six lines before)."""
    proc = run_launcher(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [line]


def test_finetune_dry_run_checks_the_init_as_the_run_would(tmp_path):
    """A typo in init= is found by the dry-run before sbatch, not by the job on the cluster."""
    proc = run_launcher("finetune.py", "--config", "configs/finetune/demo.yaml", "--dry-run",
                        f"init={tmp_path / 'runs/dmeo'}")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"error: init '{tmp_path / 'runs/dmeo'}' not found"]
    proc = run_launcher("finetune.py", "--config", "configs/finetune/demo.yaml", "--dry-run",
                        "init=None")  # YAML's null is null or ~: "None" is a path
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: init 'None' not found (no init, from scratch, is init=null)"]
    # the file is read and checked against the model, as the run's start does: an empty one
    # (a download that failed) is refused in one line, not with numpy's traceback
    (tmp_path / "vit.npz").write_bytes(b"")
    proc = run_launcher("finetune.py", "--config", "configs/finetune/demo.yaml", "--dry-run",
                        f"init={tmp_path / 'vit.npz'}")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: init '{tmp_path / 'vit.npz'}' is not a readable .npz (No data left in file)"]


def test_a_data_root_given_on_the_command_line_is_not_filled_with_the_demo(tmp_path):
    """The demo recipe (the default) with a mistyped path to one's shards: the run stops with
    the loader's line instead of generating the demo there, training on it and exiting 0."""
    typo = tmp_path / "shrads"
    for stage, config in (("pretrain.py", []),
                          ("finetune.py", ["--config", "configs/finetune/demo.yaml", "init=null"])):
        proc = run_launcher(stage, *config, f"data.root={typo}", f"output_dir={tmp_path / 'run'}",
                            "data.num_workers=0")
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1] == (
            f"error: no _info.json or info.json in '{typo}'; point data.root at a directory "
            f"written by launch/prepare_data.py")
        assert not typo.exists() and not (tmp_path / "run").exists()
    # the recipe's data.generate_demo still applies to its own data.root, and to one given
    # with data.generate_demo=true
    proc = run_launcher("pretrain.py", "--print-config", f"output_dir={tmp_path / 'run'}")
    assert "generate_demo: true" in proc.stdout, proc.stderr[-2000:]
    proc = run_launcher("pretrain.py", "--print-config", f"data.root={typo}",
                        "data.generate_demo=true")
    assert "generate_demo: true" in proc.stdout, proc.stderr[-2000:]


def test_the_demo_is_never_written_among_a_users_own_files(tmp_path):
    """data.generate_demo=true with data.root pointed at a folder of one's own images: the
    dry-run and the run refuse to generate the demo there, and say how to train on them."""
    mine = tmp_path / "mine"
    (mine / "cat").mkdir(parents=True)
    (mine / "cat/1.jpg").write_bytes(b"\xff\xd8")
    for extra in (["--dry-run"], [f"output_dir={tmp_path / 'run'}", "data.num_workers=0"]):
        proc = run_launcher("pretrain.py", f"data.root={mine}", "data.generate_demo=true", *extra)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1] == (
            f"error: data.root '{mine}' holds files but no prepared dataset, and "
            f"data.generate_demo=true would write the demo data there; to train on your images "
            f"prepare them (python launch/prepare_data.py imagefolder --src {mine} --out DIR) "
            f"and set data.root=DIR data.generate_demo=false")
    assert sorted(p.name for p in mine.rglob("*")) == ["1.jpg", "cat"]
    assert not (tmp_path / "run").exists()  # the refused start took its empty output_dir back
    (tmp_path / "kept").mkdir()  # ... but only one it made itself
    proc = run_launcher("pretrain.py", f"data.root={mine}", "data.generate_demo=true",
                        f"output_dir={tmp_path / 'kept'}")
    assert proc.returncode == 2 and (tmp_path / "kept").is_dir(), proc.stderr[-2000:]


def test_dry_run_refuses_a_world_size_variable_that_is_no_rank_count():
    proc = run_launcher("pretrain.py", "--dry-run", env={"WORLD_SIZE": "0"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "error: $WORLD_SIZE='0' is not a number of ranks; unset it or give --world-size N"]


def test_dry_run_plans_with_the_flags_given():
    proc = run_launcher("pretrain.py", "--dry-run", "--world-size", "2", "--mfu", "1",
                        "--samples", "6400", "train.global_batch_size=64")
    assert proc.returncode == 0, proc.stderr
    assert "batch: global 64 = 2 rank(s) x micro 32" in proc.stdout
    assert "steps per epoch: 100 (6,400 samples, --samples)" in proc.stdout
    assert "time to finish at 100% MFU of 989 TFLOP/s per GPU" in proc.stdout
    assert "on 2 GPU(s)" in proc.stdout
    # an epoch the batch does not divide: its steps are not rounded (the total is, once)
    from pretrain.config_files import load_config
    from pretrain.plan import plan
    text = plan(load_config(PretrainConfig, None, ["train.global_batch_size=64", "train.epochs=3",
                                                   "data.root=/cluster/shards/in21k"]),
                world=2, samples_per_epoch=6410)
    assert "steps: 301 = 3 epochs x 100.2 steps per epoch (6,410 samples, --samples)" in text


def test_dry_run_reads_the_data_it_will_train_on_and_says_why_when_it_cannot(tiny_data, tmp_path):
    import shutil
    import socket
    proc = run_launcher("pretrain.py", "--dry-run", f"data.root={tiny_data}",
                        "model.num_classes=8", "train.global_batch_size=32")
    assert proc.returncode == 0, proc.stderr
    assert f"data: {tiny_data}: 256 'train', 64 'validation' samples, 8 labels" in proc.stdout
    assert "steps per epoch: 8" in proc.stdout  # 256 / 32, from the info file
    assert "warning" not in proc.stdout  # (its list names more synsets than it uses)

    # a split the run would not find stops the plan as it would stop the run
    proc = run_launcher("finetune.py", "--config", "configs/finetune/demo.yaml", "--dry-run",
                        f"data.root={tiny_data}", "model.num_classes=8", "data.val_split=test",
                        "init=null")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "error: split 'test' not found in dataset 'tiny' (splits: train, validation); "
        "set data.train_split / data.val_split to one of them (data.val_split=null evaluates "
        "none)"]

    # a shard file gone: the run would stop at its start, so the plan stops with its line
    root = tmp_path / "shards"
    shutil.copytree(tiny_data, root)
    gone = sorted(root.glob("tiny-validation-*.tar"))[-1]
    gone.unlink()
    for script, extra in (("pretrain.py", []), ("finetune.py", [
            "--config", "configs/finetune/demo.yaml", "init=null", "data.val_split=validation"])):
        proc = run_launcher(script, *extra, "--dry-run", f"data.root={root}",
                            "model.num_classes=8")
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines() == [
            f"error: 1 of 4 'validation' shard files are missing ({gone.name}, 16 samples) in "
            f"{root}; restore them, or set data.missing_shards=skip to go on without them"]
    proc = run_launcher("pretrain.py", "--dry-run", f"data.root={root}", "model.num_classes=8",
                        "data.missing_shards=skip")
    assert proc.returncode == 0, proc.stderr[-2000:]
    shutil.copy(tiny_data / gone.name, gone)

    # an info file edited by hand into broken JSON: named, by the plan and by the run
    text = (root / "_info.json").read_text()
    (root / "_info.json").write_text(text.replace('"num_labels": 8', '"num_labels": 8,,'))
    proc = run_launcher("pretrain.py", "--dry-run", f"data.root={root}")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(f"error: {root}/_info.json is not valid JSON ("), proc.stderr
    for broken in ("[1, 2]", text.replace('"num_labels": 8', '"num_labels": 8,,')):
        (root / "_info.json").write_text(broken)
        proc = run_launcher("pretrain.py", *tiny_run_args(tmp_path / "run", root))
        assert proc.returncode == 2, proc.stderr[-2000:]
        [line] = proc.stderr.strip().splitlines()[-1:]
        assert line.startswith(f"error: {root}/_info.json ") and line.endswith(
            "; fix it, or write it again with launch/prepare_data.py"), proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr

    # no info file where the plan is made (the data may live on the cluster only): said, and
    # the plan goes on without the epoch size
    proc = run_launcher("pretrain.py", "--dry-run", f"data.root={tmp_path / 'elsewhere'}",
                        "data.generate_demo=false")
    assert proc.returncode == 0, proc.stderr
    assert f"data: not read here (no _info.json or info.json in '{tmp_path / 'elsewhere'}'" \
        in proc.stdout
    assert "steps: 300 (steps per epoch: unknown)" in proc.stdout

    # a remote root that does not answer: a few quick tries, not the run's ten with back-off
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections are refused
    proc = run_launcher("pretrain.py", "--dry-run", f"data.root=http://127.0.0.1:{port}/shards",
                        "data.generate_demo=false")
    assert proc.returncode == 0, proc.stderr
    assert f"data: not read here (http://127.0.0.1:{port}/shards/_info.json: nothing answered " \
           f"at http://127.0.0.1:{port} (3 tries in " in proc.stdout, proc.stdout
    assert f"; check the host and port in 'http://127.0.0.1:{port}/shards', or start that " \
           f"server)" in proc.stdout, proc.stdout


def test_dry_run_refuses_what_the_run_refuses_at_its_start(tiny_data, tmp_path):
    """Each passed the plan with exit code 0, and then stopped the job on the cluster."""
    partial = tmp_path / "cut-off"  # what a prepare_data.py cut off leaves: no info file yet
    (partial / ".prepare").mkdir(parents=True)
    (partial / ".prepare" / "config.json").write_text("{}")
    (partial / "in21k-train-000000.tar").write_bytes(b"")
    cases = [
        ([f"data.root={partial}", "data.generate_demo=false"],
         f"error: '{partial}' is a preparation launch/prepare_data.py has not finished "
         f"(.prepare/ is there, _info.json not yet); rerun the same prepare_data.py command to "
         f"finish it"),
        (["data.root=null", "data.generate_demo=false"],
         "error: data.root is not set; point it at a directory with _info.json"),
        (["train.activation_checkpointing=true", "train.checkpointed_blocks=9"],
         "error: config key 'train.checkpointed_blocks': 9 is more than the model's 4 blocks"),
        ([f"eval.fewshot_root={tiny_data}", "eval.fewshot_test_split=test"],
         "error: split 'test' not found in dataset 'tiny' (splits: train, validation); set "
         "eval.fewshot_train_split / eval.fewshot_test_split to one of them"),
        ([f"data.root={tiny_data}", "data.generate_demo=false", "data.num_workers=9",
          "--world-size", "2"],
         "error: split 'train' has 16 shards but world size 2 x 9 workers = 18 reader slots; "
         "lower data.num_workers to 8, write smaller shards (prepare_data.py --shard-size), or set "
         "data.resample=true (no exactly-once epochs)"),
    ]
    for overrides, line in cases:
        proc = run_launcher("pretrain.py", "--dry-run", *overrides)
        assert proc.returncode == 2 and proc.stdout == "", (overrides, proc.stdout[-2000:])
        assert proc.stderr.strip().splitlines() == [line]
    # the probe's data, read or not readable here, is said as the training data's is
    proc = run_launcher("pretrain.py", "--dry-run", f"eval.fewshot_root={tiny_data}",
                        "eval.fewshot_test_split=validation")
    assert proc.returncode == 0, proc.stderr
    assert f"few-shot probe: {tiny_data}: 256 'train', 64 'validation' samples" in proc.stdout
    proc = run_launcher("pretrain.py", "--dry-run", f"eval.fewshot_root={tmp_path / 'cluster'}")
    assert proc.returncode == 0, proc.stderr
    assert f"few-shot probe: not read here (no _info.json or info.json in " \
           f"'{tmp_path / 'cluster'}'; point eval.fewshot_root at" in proc.stdout


def test_help_documents_the_plan_flags_where_they_count():
    pretrain_help = " ".join(run_launcher("pretrain.py", "--help").stdout.split())  # unwrapped
    assert "--mfu F" in pretrain_help and "a fraction in (0, 1] (default 0.45)" in pretrain_help
    assert "steps and time to finish" in pretrain_help
    # the fine-tuning dry run has no memory or time estimate to tune
    finetune_help = " ".join(run_launcher("finetune.py", "--help").stdout.split())
    assert "--world-size N" in finetune_help
    assert "--mfu" not in finetune_help and "--samples" not in finetune_help
    assert "time to finish" not in finetune_help


@pytest.mark.parametrize("override,meant", [
    ("traning.precision=bf16", "train.precision"),
    ("optimiser.weight_decay=0.05", "optimizer.weight_decay"),
    ("optimiser.betas=[0.9,0.99]", "optimizer.betas"),
    ("traning.precison=bf16", "train.precision"),  # the key misspelled as well
])
def test_a_misspelled_section_suggests_the_key_under_the_closest_section(override, meant):
    proc = run_launcher("pretrain.py", "--dry-run", override)
    assert proc.returncode == 2 and proc.stdout == ""
    section = override.split(".")[0]
    assert proc.stderr.strip().splitlines() == [
        f"error: unknown config key '{section}'; did you mean '{meant}'?"]


def _undocumented_options(help_text: str) -> list[str]:
    """The arguments listed in an argparse --help without a help text of their own."""
    missing, lines, listing = [], help_text.splitlines(), False
    assert "options:" in lines, help_text  # else nothing below would be read
    for i, line in enumerate(lines):
        if not line.startswith(" "):  # a section header, or the blank line ending one
            listing = line in ("options:", "positional arguments:")
            continue
        if not listing or not line.startswith("  ") or line[2] == " ":
            continue  # not an argument, or the continuation of a help text
        if "  " in line.strip():  # the help text on the same line
            continue
        following = lines[i + 1] if i + 1 < len(lines) else ""
        if not (following.startswith("   ") and following.strip()):  # nor on the next line
            missing.append(line.strip())
    return missing


def test_every_benchmark_option_has_a_help_text():
    top = run_launcher("benchmark.py", "--help")
    assert top.returncode == 0, top.stderr
    commands = top.stdout.split("{", 1)[1].split("}", 1)[0].split(",")
    assert {"photos", "loader", "train", "table", "overhead"} <= set(commands)
    for command in commands:
        proc = run_launcher("benchmark.py", command, "--help")
        assert proc.returncode == 0, proc.stderr
        assert "--json" in proc.stdout or command in ("photos", "table")  # the parse saw options
        assert _undocumented_options(proc.stdout) == [], f"benchmark.py {command} --help"

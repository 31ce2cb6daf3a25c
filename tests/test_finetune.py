"""Fine-tuning for real: a pretraining run, then `torchrun` fine-tunes on two CPU ranks
(Accelerate, gloo) from it and from scratch with the same budget."""
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, free_port, run_deepspeed, run_launcher, tiny_run_args
from pretrain.metrics import read_jsonl
from pretrain.run_dir import JOB_LOCK


def finetune_args(out, data, init):
    return [f"output_dir={out}", f"data.root={data}", f"init={init}",
            "data.generate_demo=false", "data.num_workers=1", "data.shuffle_buffer=50",
            "data.dev_fraction=0.1", "model.img_size=24", "model.patch_size=4", "model.depth=2",
            "model.embed_dim=64", "model.num_heads=2", "model.num_classes=10",
            "train.global_batch_size=32", "train.total_steps=30", "optimizer.lr=0.03",
            "eval.every_steps=15", "log.every_steps=5"]


def torchrun(*args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), str(REPO / "launch/finetune.py"),
           "--config", str(REPO / "configs/finetune/demo.yaml"), *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_fine_tuning_a_pretrained_model_beats_training_from_scratch(tmp_path, tiny_data,
                                                                     tiny_cifar):
    pre = tmp_path / "pretrain"  # 16 px, patch 4: the fine-tune at 24 px resamples 4x4 -> 6x6
    run_deepspeed(2, *tiny_run_args(pre, tiny_data, "train.total_steps=60", "optimizer.lr=3e-3",
                                    "eval.every_steps=60", "checkpoint.every_steps=60"))
    results = {}
    for name, init in (("pretrained", pre), ("scratch", "null")):
        out = tmp_path / name
        proc = torchrun(*finetune_args(out, tiny_cifar, init))
        assert "global batch 32 = 2 ranks x 16 x 1 accumulation" in proc.stdout + proc.stderr
        assert "the dev split holds" not in proc.stderr  # 64 images: enough to choose on
        # the paper's transfer, said at the start (the log said nothing of it)
        said = [line for line in proc.stderr.splitlines() if "[rank0] init: " in line]
        assert said == ([] if init == "null" else [said[0]]) and all(
            re.search(r"init: backbone from .*/pretrain/checkpoints/step_00000060 \(deepspeed "
                      r"at step 60\); position embeddings resampled from 4x4 to 6x6; left out: "
                      r"pre_logits, head; new: head$", line) for line in said), said
        for noise in ("Setting accelerator to CPU", "Add type hints to the `predict` method"):
            assert noise not in proc.stdout + proc.stderr  # DeepSpeed's and MLflow's, mid-log
        final = [r for r in read_jsonl(out / "metrics.jsonl") if "eval/test/top1" in r][-1]
        results[name] = final["eval/test/top1"]
        card = json.loads((out / "final.json").read_text())
        assert card["resolution"] == 24 and card["metrics"]["eval/test/top1"] == results[name]
        assert (out / "best.safetensors").is_file() and (out / "final.safetensors").is_file()
        per_class = json.loads((out / "per_class_top1.json").read_text())
        assert len(per_class) == 10
        closing = [line for line in (proc.stdout + proc.stderr).splitlines()  # the last line:
                   if "[rank0] done:" in line][-1]                     # figures and files
        assert f"eval/test/top1 {results[name]:.4f};" in closing, closing
        assert f"{out} holds best/, best.json, best.safetensors, checkpoints/, config.yaml, " \
               f"final/, final.json, final.safetensors, finished.json, metrics.jsonl, " \
               f"per_class_top1.json" in closing
    assert card["init"]["format"] == "scratch"
    assert results["pretrained"] > 0.3  # chance is 0.1

    # a stage pointed at the other's run folder: refused as that, nothing there touched (but
    # the job lock, which the start held meanwhile)
    def files():
        return {p: p.stat().st_mtime_ns for p in (*pre.rglob("*"), *out.rglob("*"))
                if p.name != JOB_LOCK}
    before = files()
    for script, args, there, other in (
            ("finetune.py", ["--config", "configs/finetune/demo.yaml",
                             *finetune_args(pre, tiny_cifar, pre)], pre, "pretrain"),
            ("pretrain.py", tiny_run_args(out, tiny_data), out, "finetune")):
        proc = run_launcher(script, *args)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1] == (
            f"error: output_dir '{there}' holds a run of launch/{other}.py, not of "
            f"launch/{script}; give this run an output_dir of its own")
    assert files() == before
    assert results["pretrained"] > results["scratch"] + 0.05, results  # pretraining helps

    # lineage in MLflow (the suite's throwaway store): the fine-tune names its pretraining run
    from mlflow.tracking import MlflowClient
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    by_dir = {r.data.tags.get("output_dir"): r for r in runs}
    pretrain_run, tuned = by_dir[str(pre.resolve())], by_dir[str((tmp_path / "pretrained").resolve())]
    assert tuned.data.tags["stage"] == "finetune"
    assert tuned.data.tags["pretrain.run_id"] == pretrain_run.info.run_id
    assert tuned.data.tags["pretrain.step"] == "60"
    assert "eval/test/top1" in tuned.data.metrics

    # the model folder a user takes away: timm rebuilds it with no other argument, with the
    # run's logits, class names, eval transform and where it came from
    import timm
    import torch
    from pretrain.data.info import read_info
    from pretrain.model_files import load_model
    from pretrain.timm_folder import load_timm_folder, read_card

    out = tmp_path / "pretrained"
    vit, ours = load_timm_folder(out / "best"), load_model(out / "best.safetensors").model
    x = torch.randn(4, 3, 24, 24, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(vit(x), ours(x))
    assert vit.pretrained_cfg["label_names"] == read_info(tiny_cifar).classes
    data = timm.data.resolve_model_data_config(vit)
    assert data["input_size"] == (3, 24, 24) and data["crop_pct"] == 0.875
    assert tuple(data["mean"]) == tuple(data["std"]) == (0.5, 0.5, 0.5)  # data.normalize's
    best = json.loads((out / "best.json").read_text())
    meta = read_card(out / "best")
    assert meta["pipeline_tag"] == "image-classification" and meta["metrics"] == ["accuracy"]
    assert meta["vitscale"]["results"] == best["metrics"] and "eval/dev/top1" in best["metrics"]
    source = meta["vitscale"]["source"]
    assert source["step"] == best["step"] and source["tracking_run_id"] == tuned.info.run_id
    assert source["init"]["pretrain_run_id"] == pretrain_run.info.run_id


def test_a_fine_tune_head_wider_than_the_datasets_classes_is_refused(tmp_path, tiny_cifar,
                                                                    tiny_data):
    """12 outputs for 10 classes trained on as if right, and the exports lost the class names
    (their count no longer matched); the run and its dry-run now refuse it in one line."""
    args = ["--config", "configs/finetune/demo.yaml",
            *finetune_args(tmp_path / "ft", tiny_cifar, "null"), "model.num_classes=12"]
    for extra in (["--dry-run"], []):
        proc = run_launcher("finetune.py", *args, *extra)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1] == (
            f"error: '{tiny_cifar}' has 10 classes but model.num_classes is 12: the head's other "
            f"2 outputs would never be a right answer, and the exports would not know the class "
            f"names; set model.num_classes=10")
    assert not (tmp_path / "ft").exists()
    # a pretraining head may be wider than the labels used (a subset of ImageNet-21k's synsets,
    # whose list the head follows: not a word), or than a dataset's classes (warned about)
    proc = run_launcher("pretrain.py", "--dry-run", f"data.root={tiny_data}",
                        "model.num_classes=10")
    assert proc.returncode == 0 and "samples, 8 labels" in proc.stdout, proc.stderr[-2000:]
    assert "warning" not in proc.stdout
    proc = run_launcher("pretrain.py", "--dry-run", f"data.root={tiny_cifar}",
                        "model.num_classes=12", "data.val_split=test")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"10 labels\nwarning: model.num_classes is 12 but '{tiny_cifar}' has 10 classes: " \
           f"the head's other 2 outputs are never a right answer; set model.num_classes=10" \
        in proc.stdout


def test_a_dev_split_too_small_to_choose_on_is_said_once(tmp_path, tiny_cifar):
    """2 % of 640 images: best.safetensors chosen on a dozen images is noise; the log says so
    at the first dev evaluation, once."""
    import re
    proc = run_launcher("finetune.py", "--config", "configs/finetune/demo.yaml",
                        *finetune_args(tmp_path / "ft", tiny_cifar, "null"),
                        "data.dev_fraction=0.02", "train.total_steps=4", "eval.every_steps=2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = re.findall(r"the dev split holds (\d+) images \(data.dev_fraction=0.02 of 'train'\): "
                      r"best.safetensors is chosen on a top-1 that moves in steps of (\d+) %",
                      proc.stderr)
    assert len(said) == 1, proc.stderr[-3000:]
    images, step = map(int, said[0])
    assert 5 < images < 25 and step == round(100 / images)


def test_eval_keys_without_a_split_to_act_on_are_said_to_do_nothing(tmp_path, tiny_cifar):
    """No reported split and no dev split: eval.val_name and eval.every_steps name nothing;
    eval.val_name was taken without a word."""
    proc = run_launcher("finetune.py", "--config", "configs/finetune/demo.yaml",
                        *finetune_args(tmp_path / "ft", tiny_cifar, "null"),
                        "data.val_split=null", "data.dev_fraction=0", "eval.val_name=reported",
                        "train.total_steps=2", "eval.every_steps=1", "eval.max_samples=5",
                        "eval.batch_size=7")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "eval.val_name=reported does nothing: data.val_split=null: no split is evaluated " \
           "after the last step" in proc.stderr, proc.stderr[-3000:]
    assert "eval.max_samples=5, eval.batch_size=7 do nothing: data.val_split=null and " \
           "data.dev_fraction=0: no split is evaluated" in proc.stderr
    assert "eval.every_steps=1 evaluates nothing: the fine-tune's periodic evaluation (and its " \
           "best export) is on the dev split, and data.dev_fraction=0 holds none out; no split " \
           "is evaluated" in proc.stderr
    assert not (tmp_path / "ft" / "best").exists() and (tmp_path / "ft" / "final").is_dir()


def test_the_demo_set_asked_for_another_class_count_is_refused_before_it_is_made(tmp_path):
    """It logged "generating ... 20 classes", wrote 10, then refused the 20-class head."""
    from pretrain.data.sources import PrepareError
    from pretrain.demo import ensure_demo_data
    with pytest.raises(PrepareError, match=r"^data.generate_demo makes a 10-class CIFAR-10-"
                                           r"format set, and model.num_classes is 20; set "
                                           r"model.num_classes=10, or data.generate_demo=false"):
        ensure_demo_data(tmp_path / "demo", 20, layout="cifar10")
    assert not list(tmp_path.iterdir())


def test_a_dev_fraction_that_holds_out_no_image_is_refused_at_the_start(tmp_path, tiny_cifar):
    """0.01 % of 640 images: the run trained, then died at its first dev evaluation with a
    traceback and exit code 1 (a crash, which a batch script requeues)."""
    for extra in ([], ["--dry-run"]):
        proc = run_launcher("finetune.py", "--config", "configs/finetune/demo.yaml",
                            *finetune_args(tmp_path / "ft", tiny_cifar, "null"),
                            "data.dev_fraction=0.0001", *extra)
        assert proc.returncode == 2, (extra, proc.stderr[-2000:])
        assert proc.stderr.strip().splitlines()[-1] == (
            f"error: data.dev_fraction=0.0001 holds out no image of the 640 in split 'train' of "
            f"{tiny_cifar}; raise it to at least 0.039 (about 25 images; the paper holds out "
            f"1 % of ImageNet's train, 2 % of CIFAR's)"), extra
        assert not (tmp_path / "ft" / "checkpoints").exists()
    # a split too small for 25: half of it, and the count that half is (it said 25)
    from pretrain.data.eval_loader import held_out
    from pretrain.data.shards import LoaderError, ShardSet
    with pytest.raises(LoaderError, match=r"of the 8 in split 'train' of data; raise it to at "
                                          r"least 0.5 \(about 4 images;"):
        held_out(ShardSet(urls=["data/a.tar"], lengths=[8]), 0.02, "train", "data")


def test_with_polyak_averaging_the_figures_and_exports_are_the_average(tmp_path, tiny_cifar):
    """A decay so close to 1 that the average stays where it started (timm's EMA starts from
    the weights after the first updates): the exported head barely moved, the trained one did."""
    from safetensors.torch import load_file

    heads = {}
    for name, extra in (("plain", []), ("ema", ["train.ema_decay=0.99999999"])):
        out = tmp_path / name
        proc = subprocess.run(
            [sys.executable, str(REPO / "launch/finetune.py"), "--config",
             str(REPO / "configs/finetune/demo.yaml"), *finetune_args(out, tiny_cifar, "null"),
             "train.total_steps=8", "eval.every_steps=4", *extra],
            cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        heads[name] = load_file(str(out / "final.safetensors"))["head.weight"].abs().max().item()
        card = json.loads((out / "final.json").read_text())
        assert card["ema_decay"] == (0.99999999 if name == "ema" else None)
    assert heads["ema"] < 0.3 * heads["plain"], heads


def test_a_finetune_applies_activation_checkpointing_and_runs_without_tracking(tmp_path,
                                                                             tiny_cifar):
    """Keys the fine-tune once accepted and ignored or crashed on: the ViT-H recipes'
    ``train.activation_checkpointing`` reaches the model, ``tracking.enabled=false`` trains,
    evaluates and exports to the end, ``eval.val_name`` names the reported figure and the
    ``eval.fewshot_*`` keys run the few-shot probe, as in pretraining."""
    from finetune.backend import AccelerateBackend
    from finetune.config import FinetuneConfig
    from finetune.stage import finetune
    from pretrain.config_files import load_config

    out = tmp_path / "ft"
    cfg = load_config(FinetuneConfig, REPO / "configs/finetune/demo.yaml", [
        *finetune_args(out, tiny_cifar, "null"), "data.num_workers=0", "train.total_steps=4",
        "eval.every_steps=2", "train.activation_checkpointing=true", "tracking.enabled=false",
        "eval.val_name=cifar_test", f"eval.fewshot_root={tiny_cifar}", "eval.fewshot_shots=[1,2]",
        "eval.fewshot_every_steps=3"])
    backend = AccelerateBackend(cfg)
    backend.build(cfg, micro=32, accum=1, resume=None, store=None)
    assert backend.module.backbone.grad_checkpointing
    assert not load_config(FinetuneConfig, REPO / "configs/finetune/demo.yaml", []
                           ).train.activation_checkpointing  # the default leaves it off

    metrics = finetune(cfg)
    assert "eval/cifar_test/top1" in metrics and "eval/test/top1" not in metrics
    key = f"eval/fewshot_{tiny_cifar.name}/2shot"
    probe = [r for r in read_jsonl(out / "metrics.jsonl") if key in r]
    assert [r["step"] for r in probe] == [3, 4]  # every 3 steps, and after the last
    assert (out / "final.safetensors").is_file() and (out / "best.safetensors").is_file()
    assert (out / "checkpoints/step_00000004/COMPLETE.json").is_file()
    assert not (out / "tracking").exists()


def test_polyak_averaging_under_a_sharding_accelerate_config_is_refused_in_one_line(monkeypatch):
    """The EMA is a whole copy of the model per rank: under FSDP or ZeRO-3 (GPU-only configs,
    so the sharding is stood in for here) it would average shards, and export them."""
    from finetune.backend import AccelerateBackend
    from finetune.config import FinetuneConfig
    from pretrain.config import ConfigError
    from pretrain.config_files import load_config

    cfg = load_config(FinetuneConfig, REPO / "configs/finetune/demo.yaml",
                      ["init=null", "data.generate_demo=false", "train.ema_decay=0.9"])
    backend = AccelerateBackend(cfg)
    assert not backend._sharded()  # DDP on the CPU: the average is allowed
    monkeypatch.setattr(AccelerateBackend, "_sharded", lambda self: True)
    with pytest.raises(ConfigError, match="train.ema_decay needs every rank to hold the whole"):
        backend.build(cfg, micro=8, accum=1, resume=None, store=None)


def test_accelerates_own_accumulation_outside_deepspeed_is_refused(monkeypatch):
    """ACCELERATE_GRADIENT_ACCUMULATION_STEPS (set by a job script, or left over from a
    DeepSpeed launch's environment) made Accelerate divide each loss a second time: the grad
    norm fell 4x at 4, without a word. Under DeepSpeed its config is checked against the run's."""
    from finetune import launch_options
    from pretrain.config import ConfigError
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    with pytest.raises(ConfigError, match=r"^the launcher asks Accelerate to accumulate "
                                          r"gradients over 4 micro-batches \(its "
                                          r"ACCELERATE_GRADIENT_ACCUMULATION_STEPS\), which "
                                          r"would scale every update down by 4.*set "
                                          r"train.grad_accum_steps=4 and launch without it$"):
        launch_options.check("fp32", on_gpu=False)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    launch_options.check("fp32", on_gpu=False)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")
    launch_options.check("fp32", on_gpu=False)


@pytest.mark.parametrize("option,refusal", [
    (["--mixed_precision", "bf16"], "the launcher asks for mixed precision bf16 (accelerate "
     "launch --mixed_precision or its config file), but the run's precision comes from "
     "train.precision, which is fp32; set train.precision=bf16, or launch with "
     "--mixed_precision no"),
    (["--dynamo_backend", "inductor"], "the launcher asks Accelerate to compile the model "
     "(dynamo_backend=inductor), which would rename its tensors _orig_mod.* in checkpoints and "
     "exports; set train.compile=true instead"),
    (["--use_fsdp"], "the launcher asks for FSDP, which Accelerate runs on GPUs only (here it "
     "would train under DDP, unsharded)"),
], ids=["mixed-precision", "dynamo", "fsdp-on-cpu"])
def test_a_launcher_option_the_fine_tune_would_not_honour_stops_it_at_start(
        option, refusal, tmp_path, tiny_cifar):
    """`accelerate launch` options that the run would ignore (another precision than
    train.precision; FSDP, which Accelerate runs on GPUs only) or that would break it at its
    last step (Accelerate's compile renames the tensors, and the exports failed after training)
    end the run before it starts, in one line; --dry-run says the same."""
    out = tmp_path / "ft"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1",
           "--num_machines", "1", *option, str(REPO / "launch/finetune.py"),
           "--config", str(REPO / "configs/finetune/demo.yaml"),
           *finetune_args(out, tiny_cifar, "null")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith(f"error: {refusal}")
    assert not out.exists()  # nothing written: no config, no checkpoint, no tracking
    dry = subprocess.run(cmd + ["--dry-run"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert f"error: {refusal}" in dry.stderr, dry.stderr[-3000:]


def test_an_accelerate_deepspeed_config_takes_the_runs_batch_layout_and_clipping():
    """Accelerate's DeepSpeed config, checked as it would be filled (tests/test_faults.py runs a
    fine-tune under it). Its "auto" values become the run's; a different fixed value is refused, since DeepSpeed
    would otherwise step, divide the loss and clip by the file's numbers."""
    from finetune.accelerate_deepspeed import fill_deepspeed_values
    from pretrain.config import ConfigError

    ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
          "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 2}}
    fill_deepspeed_values(ds, micro=16, accum=4, world=8, grad_clip=1.0, precision="fp32")
    assert ds == {"train_batch_size": 512, "train_micro_batch_size_per_gpu": 16,
                  "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
                  "bf16": {"enabled": False}, "fp16": {"enabled": False},
                  "zero_optimization": {"stage": 2},
                  # it would wait for the GPU at every forward and step
                  "timers": {"throughput": {"enabled": False}}}
    # the same again: accepted
    fill_deepspeed_values(ds, micro=16, accum=4, world=8, grad_clip=1.0, precision="fp32")
    ds = {"zero_optimization": {"stage": 2}, "timers": {"throughput": {"enabled": True}}}
    fill_deepspeed_values(ds, micro=16, accum=1, world=2, grad_clip=None, precision="fp32")
    assert ds["gradient_clipping"] == 0.0  # optimizer.grad_clip=null: DeepSpeed does not clip
    assert ds["timers"] == {"throughput": {"enabled": True}}  # the file's own choice
    # what `accelerate config` writes by default, under a run that accumulates 4 micro-batches
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 2}}
    with pytest.raises(ConfigError, match=r"has gradient_accumulation_steps=1 \(from its file or "
                                          r"Accelerate's default\), but this run's "
                                          r"train.grad_accum_steps gives 4; set "
                                          r"gradient_accumulation_steps to \"auto\""):
        fill_deepspeed_values(ds, micro=16, accum=4, world=8, grad_clip=1.0, precision="fp32")


@pytest.mark.parametrize("precision,file,refused", [
    ("fp32", {"bf16": {"enabled": True}}, "bf16.enabled=True, but this run's train.precision "
                                          "is fp32"),
    ("bf16", {"bf16": {"enabled": False}}, "bf16.enabled=False, but this run's "
                                           "train.precision is bf16"),
    ("bf16", {"bf16": {"enabled": "auto"}}, None),
    ("bf16", {}, None),
    ("fp32", {"scheduler": {"type": "WarmupLR"}}, r"sets \['scheduler'\], which come from "
                                                   r"this config"),
    # as in pretraining's file: the launchers' own collector handling would turn it on again
    ("fp32", {"disable_python_gc": True}, r"^Accelerate's DeepSpeed config sets "
                                          r"disable_python_gc, but the launchers manage "
                                          r"Python's garbage collector themselves .*; remove "
                                          r"the key from that config$"),
])
def test_an_accelerate_deepspeed_config_computes_in_the_runs_precision(precision, file, refused):
    """Accelerate fills bf16/fp16 from train.precision where the file leaves them to it, and
    keeps a fixed value silently: the run would compute in the file's precision while its
    config, log and model card name another. Accelerate's own plugin fills the config first,
    as when the Accelerator is built."""
    from accelerate.utils import DeepSpeedPlugin

    from finetune.accelerate_deepspeed import fill_deepspeed_values
    from pretrain.config import ConfigError

    plugin = DeepSpeedPlugin(hf_ds_config={**file, "zero_optimization": {"stage": 2}})
    plugin.set_mixed_precision({"bf16": "bf16"}.get(precision, "no"))
    ds = plugin.deepspeed_config
    if refused:
        with pytest.raises(ConfigError, match=refused):
            fill_deepspeed_values(ds, micro=8, accum=1, world=1, grad_clip=1.0,
                                  precision=precision)
    else:
        fill_deepspeed_values(ds, micro=8, accum=1, world=1, grad_clip=1.0, precision=precision)
        assert ds["bf16"]["enabled"] is (precision == "bf16") and not ds["fp16"]["enabled"]


@pytest.mark.parametrize("stage,given,summed,refused", [
    (2, None, "fp32", None),
    (1, "auto", "fp32", None),
    (2, "bf16", None, None),  # the config's choice: DeepSpeed's own sums in the model's dtype
    (0, "bf16", None, None),
    (0, None, None, r"^Accelerate's DeepSpeed config: data_types.grad_accum_dtype=fp32 needs ZeRO "
                    r"stage 1-3: at ZeRO-0 DeepSpeed sums a step's 4 micro-batch gradients in "
                    r"bf16 only; set zero_optimization.stage=1, or "
                    r"data_types.grad_accum_dtype=bf16 to accept that$"),
    (2, "fp16", None, r"has data_types.grad_accum_dtype=fp16, but this run's train.precision is "
                      r"bf16; set it to \"fp32\" or \"auto\""),
])
def test_an_accelerate_deepspeed_config_sums_the_micro_batches_in_fp32(stage, given, summed,
                                                                        refused):
    """As pretraining does (pretrain/grad_accum.py): under bf16 the micro-batch gradients are
    summed in fp32 where the config leaves the dtype out or to "auto"; where DeepSpeed cannot
    (ZeRO-0), the run stops in one line naming both ways out."""
    from finetune.accelerate_deepspeed import fill_deepspeed_values
    from pretrain.config import ConfigError

    ds = {"zero_optimization": {"stage": stage}}
    if given:
        ds["data_types"] = {"grad_accum_dtype": given}
    if refused:
        with pytest.raises(ConfigError, match=refused):
            fill_deepspeed_values(ds, micro=8, accum=4, world=2, grad_clip=1.0, precision="bf16")
        return
    fill_deepspeed_values(ds, micro=8, accum=4, world=2, grad_clip=1.0, precision="bf16")
    assert ds.get("data_types", {}).get("grad_accum_dtype") == summed
    # one micro-batch per step, or fp32 training: nothing to sum in another dtype
    for accum, precision in ((1, "bf16"), (4, "fp32")):
        ds = {"zero_optimization": {"stage": stage}}
        fill_deepspeed_values(ds, micro=8, accum=accum, world=2, grad_clip=1.0,
                              precision=precision)
        assert "data_types" not in ds


def test_a_fine_tune_resumed_with_another_init_is_refused(tmp_path):
    """The checkpoint holds the weights the first init gave: resuming it under another init
    would train on while the log and the model card name the new one."""
    from finetune.config import FinetuneConfig
    from pretrain.checkpoint import Checkpoint
    from pretrain.config import ConfigError
    from pretrain.config_files import load_config, save_config
    from pretrain.run_dir import check_same_run

    out = tmp_path / "ft"
    out.mkdir()
    save_config(load_config(FinetuneConfig, None, ["init=runs/pretrain-a"]), out / "config.yaml")
    ckpt = Checkpoint(out / "checkpoints/step_00000010", 10, 1, 0)
    check_same_run(out, load_config(FinetuneConfig, None, ["init=runs/pretrain-a"]), ckpt)
    with pytest.raises(ConfigError, match=rf"^output_dir '{out}' holds a run with another init "
                                          r"\('runs/pretrain-a' there, 'runs/pretrain-b' now\)"):
        check_same_run(out, load_config(FinetuneConfig, None, ["init=runs/pretrain-b"]), ckpt)
    # the same folder written otherwise (tab completion's trailing slash, absolute or relative)
    # is the same init: the relaunch resumes
    run = tmp_path / "pretrain-a"
    run.mkdir()
    save_config(load_config(FinetuneConfig, None, [f"init={run}"]), out / "config.yaml")
    for same in (f"{run}/", os.path.relpath(run), f"{tmp_path}/./pretrain-a"):
        assert check_same_run(out, load_config(FinetuneConfig, None, [f"init={same}"]), ckpt) \
            == []


def test_a_relaunch_that_would_train_on_other_samples_is_refused_naming_the_key(tmp_path):
    """Another data.dev_fraction moves images between the dev split and training, another
    data.train_split trains on another split: the saved loader position is within other
    samples. The run refused it as "different shards ...; resume with the same data.root"
    (data.root had not changed), and --dry-run listed it as a setting the relaunch changes."""
    from finetune.config import FinetuneConfig
    from pretrain.checkpoint import Checkpoint
    from pretrain.config import ConfigError, PretrainConfig
    from pretrain.config_files import load_config, save_config
    from pretrain.run_dir import check_same_run

    ckpt = Checkpoint(tmp_path / "checkpoints/step_00000010", 10, 1, 0)
    for schema, key, was, now in ((FinetuneConfig, "data.dev_fraction", 0.02, 0.05),
                                  (FinetuneConfig, "data.train_split", "train", "trainval"),
                                  (PretrainConfig, "data.train_split", "train", "trainval")):
        save_config(load_config(schema, None, ["init=runs/p"] * (schema is FinetuneConfig) +
                                [f"{key}={was}"]), tmp_path / "config.yaml")
        cfg = load_config(schema, None, ["init=runs/p"] * (schema is FinetuneConfig) +
                          [f"{key}={now}"])
        with pytest.raises(ConfigError, match=rf"^output_dir '{tmp_path}' holds a run with "
                                              rf"another {key} \({was!r} there, {now!r} now\); "
                                              rf"pick a new output_dir"):
            check_same_run(tmp_path, cfg, ckpt)
    # what a relaunch may change is still listed, not refused
    assert check_same_run(tmp_path, load_config(PretrainConfig, None, ["optimizer.lr=0.01"]),
                          ckpt) == ["optimizer.lr: 0.001 -> 0.01"]


def test_a_relaunch_applies_new_optimizer_settings_and_refuses_to_add_an_ema(tmp_path,
                                                                          tiny_cifar):
    """Loading the checkpoint's optimizer state puts its saved settings back: the relaunch's
    weight decay and momentum, which the log says apply, must be the ones it trains with. An
    EMA switched on has no weights in the checkpoint to resume (a traceback, before)."""
    import torch

    out = tmp_path / "ft"

    def launch(*extra):
        return subprocess.run(
            [sys.executable, str(REPO / "launch/finetune.py"), "--config",
             str(REPO / "configs/finetune/demo.yaml"), *finetune_args(out, tiny_cifar, "null"),
             "data.num_workers=0", "eval.every_steps=100", "tracking.enabled=false",
             "checkpoint.every_steps=2", "data.dev_fraction=0", *extra],
            cwd=REPO, capture_output=True, text=True, timeout=300)

    first = launch("train.total_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    # (no dev split: the periodic evaluation has nothing to evaluate, which is said)
    assert "eval.every_steps=100 evaluates nothing: the fine-tune's periodic evaluation (and " \
           "its best export) is on the dev split, and data.dev_fraction=0 holds none out; " \
           "'test' is evaluated once, after the last step" in first.stderr
    # an evaluation of the step-2 final (launch/evaluate.py's folder next to it): the relaunch
    # replaces final, and the evaluation no longer passes for the new weights'
    (out / "final-eval-test").mkdir()
    (out / "final-eval-test/metrics.json").write_text(json.dumps({"step": 2, "top1": 0.5}))
    again = launch("train.total_steps=4", "optimizer.weight_decay=0.3", "optimizer.momentum=0.5")
    assert again.returncode == 0, again.stderr[-3000:]
    assert not (out / "final-eval-test").exists()
    assert json.loads((out / "final-step2-eval-test/metrics.json").read_text())["step"] == 2
    assert f"{out / 'final'}: replaced by the weights of step 4; its evaluations of the " \
           f"earlier ones were renamed after the weights they describe (nothing deleted): " \
           f"final-eval-test -> final-step2-eval-test" in again.stderr
    assert "optimizer.momentum: 0.9 -> 0.5; optimizer.weight_decay: 0.0 -> 0.3" in again.stderr
    groups = torch.load(out / "checkpoints/step_00000004/optimizer.bin",
                        weights_only=True)["param_groups"]
    assert [(g["weight_decay"], g["momentum"]) for g in groups] == [(0.3, 0.5), (0.0, 0.5)]

    ema = launch("train.total_steps=6", "train.ema_decay=0.9")
    assert ema.returncode == 2
    assert ema.stderr.strip().splitlines()[-1] == (
        f"error: output_dir '{out}' holds a run whose checkpoints need train.ema_decay null "
        f"(now set): they hold its optimizer state and weights in that form; keep "
        f"train.ema_decay null, pick a new output_dir, or set checkpoint.resume=false to start "
        f"a new run there (the earlier one is moved into '{out}/earlier-<time>/')")


def test_a_relaunch_under_another_accelerate_layout_is_converted_or_refused_in_one_line(
        tmp_path, tiny_cifar):
    """A fine-tune's relaunch under Accelerate's DeepSpeed config with another ZeRO stage,
    precision or world size, or without DeepSpeed, died inside DeepSpeed (a bare
    AssertionError, a missing file) after 130 lines of two ranks' tracebacks. Now what DeepSpeed
    can convert is converted, as in pretraining: another precision or world size of an AdamW
    run, its Adam state carried over; what it cannot is refused in one line with both ways out,
    the checkpoint untouched; ZeRO-1 and ZeRO-2 write the same files and resume each other."""
    import torch

    def launch(out, stage, *extra):
        env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
        if stage is not None:
            env.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE=str(stage))
        return subprocess.run(
            [sys.executable, str(REPO / "launch/finetune.py"), "--config",
             str(REPO / "configs/finetune/demo.yaml"), *finetune_args(out, tiny_cifar, "null"),
             "data.num_workers=0", "eval.every_steps=100", "tracking.enabled=false",
             "checkpoint.every_steps=2", "data.dev_fraction=0", *extra],
            cwd=REPO, capture_output=True, text=True, timeout=300, env=env)

    sgd = tmp_path / "sgd"  # the fine-tune's default optimizer, as the ViT paper's
    first = launch(sgd, 2, "train.total_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = sgd / "checkpoints/step_00000002"
    files = {p: p.stat().st_mtime_ns for p in ckpt.rglob("*")}
    for stage, extra, why in [
            (3, [], "ZeRO stage changed (2 -> 3); DeepSpeed converts a checkpoint between "
                    "ZeRO-1 and ZeRO-2 only"),
            (None, [], "written under Accelerate's DeepSpeed config, this job runs without "
                       "DeepSpeed or FSDP")]:
        refused = launch(sgd, stage, "train.total_steps=4", *extra)
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert refused.stderr.strip().splitlines()[-1] == (
            f"error: {ckpt} cannot be resumed by this job ({why}): relaunch as it was written "
            f"(under Accelerate's DeepSpeed config, ZeRO-2, 1 rank, train.precision=fp32), or "
            f"set checkpoint.resume=false to start a new run there (this one is moved aside)")
    assert {p: p.stat().st_mtime_ns for p in ckpt.rglob("*")} == files
    again = launch(sgd, 1, "train.total_steps=4")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {ckpt} at step 2" in again.stderr and "convert" not in again.stderr
    # another precision: converted, SGD's momentum with it (DeepSpeed's own conversion takes
    # Adam's moments only: this was refused before)
    bf16 = launch(sgd, 1, "train.total_steps=6", "train.precision=bf16")
    assert bf16.returncode == 0, bf16.stderr[-3000:]
    ckpt = sgd / "checkpoints/step_00000004"
    assert f"precision changed (fp32 -> bf16): converting {ckpt} to DeepSpeed's universal " \
           f"checkpoint" in bf16.stderr and f"resumed from {ckpt} at step 4" in bf16.stderr
    params = list((sgd / "checkpoints/step_00000004_universal/pytorch_model/zero").iterdir())
    assert params and all(sorted(f.name for f in p.iterdir()) == ["fp32.pt", "momentum_buffer.pt"]
                          for p in params if p.is_dir())
    head = torch.load(params[0].with_name("head.weight") / "momentum_buffer.pt",
                      weights_only=False)["param"]  # (written by this test's run)
    assert head.abs().sum() > 0

    adamw = tmp_path / "adamw"
    first = launch(adamw, 2, "train.total_steps=2", "optimizer.name=adamw")
    assert first.returncode == 0, first.stderr[-3000:]
    converted = launch(adamw, 2, "train.total_steps=4", "optimizer.name=adamw",
                       "train.precision=bf16")
    assert converted.returncode == 0, converted.stderr[-3000:]
    assert f"precision changed (fp32 -> bf16): converting {adamw}/checkpoints/step_00000002 " \
           f"to DeepSpeed's universal checkpoint" in converted.stderr
    assert f"resumed from {adamw}/checkpoints/step_00000002 at step 2" in converted.stderr
    # Adam's state came through the conversion: its step count goes on from 2 (fresh: 2 again)
    [states] = (adamw / "checkpoints/step_00000004/pytorch_model").glob("*optim_states.pt")
    saved = torch.load(states, map_location="cpu", weights_only=False)["optimizer_state_dict"]
    assert {float(s["step"]) for s in saved["base_optimizer_state"]["state"].values()} == {4.0}


def test_train_compile_reaches_the_fine_tune_model_and_leaves_its_keys_alone(tiny_cifar,
                                                                            tmp_path):
    """As in pretraining, train.compile compiles the model (in place: the state dict, hence the
    checkpoints and exports, keeps its keys). Compiling happens at the first forward, which
    this test does not run: minutes on a CPU."""
    from finetune.backend import AccelerateBackend
    from finetune.config import FinetuneConfig
    from pretrain.config_files import load_config

    def built(compile: bool, *sets: str):
        cfg = load_config(FinetuneConfig, REPO / "configs/finetune/demo.yaml", [
            *finetune_args(tmp_path / "ft", tiny_cifar, "null"), f"train.compile={compile}",
            *sets])
        backend = AccelerateBackend(cfg)
        backend.build(cfg, micro=8, accum=1, resume=None, store=None)
        return backend

    compiled, plain = built(True), built(False)
    assert compiled.module._compiled_call_impl is not None
    assert plain.module._compiled_call_impl is None
    # train.compile_mode reaches Inductor (its matmul autotuning on or off)
    tuned = built(True, "train.compile_mode=max-autotune-no-cudagraphs")
    assert tuned.module._compiled_call_impl.get_compiler_config()["max_autotune"] is True
    assert compiled.module._compiled_call_impl.get_compiler_config()["max_autotune"] is False
    assert list(compiled.accelerator.get_state_dict(compiled.model)) == \
        list(plain.accelerator.get_state_dict(plain.model))


def test_a_stopped_fine_tune_resumes_though_its_init_is_gone(tmp_path, tiny_cifar):
    """The checkpoint holds every weight: an init removed since (a pretraining checkpoint
    pruned by its run's keep_last, a purged scratch folder) no longer stops the relaunch with
    exit 2, which the SLURM scripts do not requeue; the dry-run agrees. A new run still needs
    its init."""
    import shutil
    base = finetune_args(tmp_path / "a", tiny_cifar, "null")
    first = run_launcher("finetune.py", "--config", "configs/finetune/demo.yaml", *base,
                         "train.total_steps=2", "eval.every_steps=2")
    assert first.returncode == 0, first.stderr[-2000:]
    init = tmp_path / "scratch" / "init.safetensors"
    init.parent.mkdir()
    shutil.copy(tmp_path / "a" / "final.safetensors", init)
    args = ["--config", "configs/finetune/demo.yaml",
            *finetune_args(tmp_path / "b", tiny_cifar, init), "eval.every_steps=2"]
    proc = run_launcher("finetune.py", *args, "train.total_steps=2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    shutil.rmtree(init.parent)
    plan = run_launcher("finetune.py", *args, "train.total_steps=4", "--dry-run")
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert f"resume: from {tmp_path / 'b/checkpoints/step_00000002'} at step 2" in plan.stdout
    proc = run_launcher("finetune.py", *args, "train.total_steps=4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["step"] for r in read_jsonl(tmp_path / "b" / "metrics.jsonl")
            if "eval/test/top1" in r] == [2, 4]
    proc = run_launcher("finetune.py", "--config", "configs/finetune/demo.yaml",
                        *finetune_args(tmp_path / "c", tiny_cifar, init))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
        f"error: init '{init}' not found"), proc.stderr[-2000:]
    # the demo fine-tune before the demo pretraining, from another folder: both said
    proc = run_launcher("finetune.py", "--config", str(REPO / "configs/finetune/demo.yaml"),
                        "--dry-run", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"error: init 'runs/demo' not found in {tmp_path}; the demo fine-tune starts from the "
        f"demo pretraining: run 'deepspeed launch/pretrain.py' first, or add init=null (from "
        f"scratch)"), proc.stderr[-2000:]
    # an unset shell variable (init=$INIT) is not a fine-tune from scratch
    proc = run_launcher("finetune.py", "--config", "configs/finetune/demo.yaml", "init=",
                        "--dry-run")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: override 'init=' has no value (an unset shell variable?); give one, or "
        "init=null to unset it"], proc.stderr


def test_a_fine_tune_that_keeps_its_pre_logits_says_its_exports_are_backbones(tmp_path,
                                                                            tiny_cifar):
    """timm's ViT has no pre-logits layer: the folders best/ and final/ of such a fine-tune
    hold the backbone alone. That was not said, and the backbone was logged and registered as
    the run's model, tagged with the classifier's figures."""
    from mlflow import MlflowClient

    from conftest import sqlite_store
    uri = sqlite_store(tmp_path / "store")
    args = ["--config", "configs/finetune/demo.yaml",
            *finetune_args(tmp_path / "ft", tiny_cifar, "null"), "model.representation_size=32"]
    proc = run_launcher("finetune.py", *args, "tracking.register_as=kept-pre-logits")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
        "error: tracking.register_as logs the timm folder best/, which holds no head when "
        "model.representation_size keeps a pre-logits layer"), proc.stderr[-2000:]
    proc = run_launcher("finetune.py", *args, "train.total_steps=2", "eval.every_steps=2",
                        "tracking.system_metrics=false", env={"MLFLOW_TRACKING_URI": uri})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("model.representation_size=32 keeps a pre-logits layer, which "
                             "timm's ViT has no place for: best/ and final/ will hold the "
                             "backbone without its head") == 1, proc.stderr[-3000:]
    assert json.loads((tmp_path / "ft/final/config.json").read_text())["num_classes"] == 0
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("vitscale").experiment_id])
    assert "model" not in {a.path for a in client.list_artifacts(run.info.run_id)}

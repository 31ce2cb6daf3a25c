"""The pretraining launcher as a user runs it: dry runs of the recipes and one-line errors."""
import pytest
import yaml

from conftest import run_launcher


def test_misspelled_key_is_one_line_naming_it_and_the_fix():
    proc = run_launcher("pretrain.py", "--config", "configs/pretrain/demo.yaml",
                        "optimizer.lr_rate=1", "--dry-run")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "error: unknown config key 'optimizer.lr_rate'; did you mean 'optimizer.lr'?"]
    assert proc.stdout == ""


@pytest.mark.parametrize("recipe,params,backbone,tflop", [
    ("vit_l16_i21k.yaml", "326.7 M", "303.3 M", "0.369 TFLOP"),
    ("vit_h14_i21k.yaml", "660.4 M", "630.8 M", "1.004 TFLOP"),
])
def test_dry_run_of_the_i21k_recipes_prints_size_and_flops(recipe, params, backbone, tflop):
    proc = run_launcher("pretrain.py", "--config", f"configs/pretrain/{recipe}", "--dry-run",
                        "--local_rank=0")  # what the DeepSpeed launcher appends
    assert proc.returncode == 0, proc.stderr
    assert f"params: {params} (backbone {backbone}" in proc.stdout
    assert f"train FLOPs per image: {tflop}" in proc.stdout
    resolved = yaml.safe_load(proc.stdout.split("\nmodel: vit_")[0])
    assert resolved["model"]["num_classes"] == 21843


def test_dry_run_rejects_a_batch_that_does_not_split_over_the_world():
    proc = run_launcher("pretrain.py", "--config", "configs/pretrain/vit_l16_i21k.yaml",
                        "--dry-run", "--world-size", "48")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "error: train.global_batch_size=4096 is not divisible by world size 48 x "
        "train.micro_batch_size 128; pick a multiple of 6144"]


def test_print_config_shows_the_resolved_overrides():
    proc = run_launcher("pretrain.py", "--print-config", "optimizer.lr=2e-4", "seed=3")
    assert proc.returncode == 0, proc.stderr
    resolved = yaml.safe_load(proc.stdout)
    assert resolved["optimizer"]["lr"] == 2e-4 and resolved["seed"] == 3
    assert resolved["model"]["name"] == "vit_tiny_patch16_224"  # no --config: the demo recipe


def test_help_lists_every_config_key_with_its_default():
    proc = run_launcher("pretrain.py", "--help")
    assert proc.returncode == 0
    assert "optimizer.lr = 0.001" in proc.stdout and "--dry-run" in proc.stdout
    assert "model.representation_size = None" in proc.stdout

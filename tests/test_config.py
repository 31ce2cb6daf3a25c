"""The typed config: recipes, dotted overrides, one-line errors with suggestions."""
import re

import pytest
import torch
import yaml

from finetune.config import FinetuneConfig
from pretrain.config import ConfigError, PretrainConfig, TrainConfig
from pretrain.config_files import config_keys, load_config, save_config

from conftest import REPO

RECIPES = sorted((REPO / "configs" / "pretrain").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads(recipe):
    cfg = load_config(PretrainConfig, recipe)
    assert cfg.model.name.startswith("vit_")


def test_keys_that_scripts_rely_on_exist():
    keys = set(config_keys(PretrainConfig))
    for key in ["optimizer.lr", "train.total_steps", "checkpoint.every_steps", "output_dir", "seed",
                "model.name", "model.drop_path_rate", "model.representation_size",
                "model.num_classes"]:
        assert key in keys


def test_overrides_are_typed_and_win_over_the_recipe():
    cfg = load_config(PretrainConfig, REPO / "configs/pretrain/vit_l16_i21k.yaml",
                      ["optimizer.lr=3e-4", "model.drop_path_rate=0.2", "data.crop_scale=[0.08,1]",
                       "model.representation_size=null"])
    assert cfg.optimizer.lr == pytest.approx(3e-4)  # YAML reads "3e-4" as text; still a float
    assert cfg.model.drop_path_rate == 0.2
    assert cfg.data.crop_scale == (0.08, 1.0)
    assert cfg.model.representation_size is None
    assert cfg.model.num_classes == 21843  # untouched keys keep the recipe's value


def test_recipe_inheritance():
    h = load_config(PretrainConfig, REPO / "configs/pretrain/vit_h14_i21k.yaml")
    assert h.model.name == "vit_huge_patch14_224" and h.model.representation_size == 1280
    assert h.optimizer.lr == 1e-3 and h.train.loss == "sigmoid"  # from the ViT-L recipe


@pytest.mark.parametrize("override,fragment", [
    ("optimizer.lr_rate=1", "unknown config key 'optimizer.lr_rate'; did you mean 'optimizer.lr'?"),
    ("lr=1", "unknown config key 'lr'; did you mean 'optimizer.lr'?"),
    ("model.drop_pth_rate=0.1", "did you mean 'model.drop_path_rate'?"),
    ("optimizer.lr=fast", "config key 'optimizer.lr'"),
    ("model.num_classes=1.5", "config key 'model.num_classes'"),
    ("model.drop_path_rate=1.5", "config key 'model.drop_path_rate'"),
    ("train.precision=fp8", "config key 'train.precision'"),
    ("seed.value=1", "'seed' is a value, not a section"),
    ("optimizer.lr", "not of the form key=value"),
    # timm would assert on the first and silently keep its default magnitude for the others
    ("data.randaugment=rnd-m15-n2", "data.randaugment='rnd-m15-n2' is not a timm RandAugment"),
    ("data.randaugment=rand-mX-n2", "data.randaugment='rand-mX-n2' is not a timm RandAugment"),
    ("data.randaugment=rand-m15n2", "e.g. 'rand-m15-n2'"),
    # timm takes p5 as an op probability of 5 and an unknown transform set as its default one
    ("data.randaugment=rand-m15-n2-p5", "data.randaugment='rand-m15-n2-p5' is not a timm"),
    ("data.randaugment=rand-m15-tbogus", "data.randaugment='rand-m15-tbogus' is not a timm"),
    # a pair given one value, or three, or none; a list given one value
    ("data.crop_scale=[0.5]", "config key 'data.crop_scale' takes 2 values, e.g. "
     "data.crop_scale=[0.05,1.0] (the default)"),
    ("optimizer.betas=[0.9,0.99,0.999]", "config key 'optimizer.betas' takes 2 values"),
    ("data.crop_scale=0.5", "config key 'data.crop_scale' takes 2 values"),
    ("checkpoint.stop_signals=SIGTERM", "config key 'checkpoint.stop_signals' takes a list, "
     "e.g. checkpoint.stop_signals=[SIGTERM,SIGINT,SIGUSR1] (the default)"),
    ("output_dir=''", "config key 'output_dir': an empty string is no value; give one (got "
     "'')"),
    ("tracking.experiment=''", "config key 'tracking.experiment': an empty string is no value"),
    # a templated recipe's 'init: ""' fine-tuned from scratch; 'val_split: ""' evaluated nothing
    ("data.val_split=''", "config key 'data.val_split': an empty string is no value; give one, "
     "or null for none (got '')"),
    ("eval.fewshot_root=' '", "config key 'eval.fewshot_root': an empty string is no value"),
    # YAML's infinities and NaN pass every bound: a traceback later, or a run of NaN losses
    ("train.epochs=.inf", "config key 'train.epochs': input should be a finite number (got inf)"),
    ("optimizer.lr=.inf", "config key 'optimizer.lr': input should be a finite number"),
    ("model.head_bias_init=.nan", "config key 'model.head_bias_init': input should be a finite"),
    # YAML's booleans were read as 1 and 0: checkpointed_blocks=true recomputed one block of all
    ("train.checkpointed_blocks=true", "config key 'train.checkpointed_blocks': takes a number, "
     "not a true/false (YAML reads true, false, yes, no, on and off as booleans) (got True)"),
    ("model.depth=yes", "config key 'model.depth': takes a number, not a true/false"),
    ("optimizer.lr=on", "config key 'optimizer.lr': takes a number, not a true/false"),
    ("train.max_rollbacks=no", "config key 'train.max_rollbacks': takes a number"),
    ("eval.fewshot_shots=[true,5]", "config key 'eval.fewshot_shots': takes a number"),
    ("optimizer.betas=[0.9,false]", "config key 'optimizer.betas': takes a number"),
])
def test_bad_values_name_the_key_in_one_line(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(PretrainConfig, REPO / "configs/pretrain/demo.yaml", [override])
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


def test_booleans_stay_booleans_and_a_recipes_boolean_number_is_refused_in_both_stages(tmp_path):
    from finetune.config import FinetuneConfig
    with pytest.raises(ConfigError, match=r"^config key 'init': an empty string is no value; "
                                          r"give one, or null for none \(got ''\)$"):
        load_config(FinetuneConfig, None, ["init=''"])
    cfg = load_config(PretrainConfig, None, ["model.head_zero_init=no", "data.resample=on"])
    assert (cfg.model.head_zero_init, cfg.data.resample) == (False, True)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  epochs: yes\n")
    for schema in (PretrainConfig, FinetuneConfig):
        with pytest.raises(ConfigError, match=rf"^config file '{recipe}': config key "
                                              rf"'train.epochs': takes a number, not a true"):
            load_config(schema, recipe)


def test_timm_randaugment_strings_are_accepted_in_both_stages():
    from finetune.config import FinetuneConfig
    for spec in ("rand-m15-n2", "rand-m9-mstd0.5-inc1", "rand-m7-n4-p0.5-mmax10",
                 "rand-m9-n2-p1", "rand-m9-n2-p.7", "rand-m9-n3-t3aw", "rand-m9-tweights"):
        for schema in (PretrainConfig, FinetuneConfig):
            assert load_config(schema, None, [f"data.randaugment={spec}"]).data.randaugment == spec


def test_total_steps_override_replaces_epochs_but_both_in_a_file_is_an_error(tmp_path):
    cfg = load_config(PretrainConfig, REPO / "configs/pretrain/vit_l16_i21k.yaml",
                      ["train.total_steps=1000"])
    assert cfg.train.total_steps == 1000 and cfg.train.epochs is None
    bad = tmp_path / "both.yaml"
    bad.write_text("train: {total_steps: 10, epochs: 2}\n")
    with pytest.raises(ConfigError, match=r"exactly one of train.total_steps \(10\) and "
                                          r"train.epochs \(2.0\)"):
        load_config(PretrainConfig, bad)
    # a recipe inheriting total_steps, setting epochs: the error says how to replace it
    mine = tmp_path / "mine.yaml"
    mine.write_text(f"inherit: {REPO / 'configs/pretrain/demo.yaml'}\ntrain: {{epochs: 10}}\n")
    with pytest.raises(ConfigError, match=r"set it to null in the file \(train: \{epochs: "
                                          r"10.0, total_steps: null\}\)"):
        load_config(PretrainConfig, mine)
    mine.write_text(f"inherit: {REPO / 'configs/pretrain/demo.yaml'}\n"
                    f"train: {{epochs: 10, total_steps: null}}\n")
    assert load_config(PretrainConfig, mine).train.epochs == 10
    # both on the command line: said so, not sent to a file the user did not write
    with pytest.raises(ConfigError, match=r"^train.total_steps=5 and train.epochs=2 are both "
                                          r"given on the command line; give one of "
                                          r"train.total_steps and train.epochs$"):
        load_config(PretrainConfig, None, ["train.epochs=2", "train.total_steps=5"])
    assert load_config(PretrainConfig, None, ["train.epochs=null", "train.total_steps=5"]) \
        .train.total_steps == 5
    again = ["train.total_steps=100", "train.epochs=2", "train.total_steps=200", "train.epochs=null"]
    assert load_config(PretrainConfig, None, again).train.total_steps == 200  # the last wins


def test_bad_files_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(PretrainConfig, tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(PretrainConfig, broken)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(PretrainConfig, listy)
    # a recipe copied out of configs/ whose parent stayed there; a folder given for a file
    copied = tmp_path / "mine.yaml"
    copied.write_text("inherit: vit_l16_i21k.yaml\ntrain: {total_steps: 5}\n")
    with pytest.raises(ConfigError, match=re.escape(
            f"config file '{tmp_path / 'vit_l16_i21k.yaml'}' not found: the inherit: line of "
            f"'{copied}' names it, relative to that file's folder")):
        load_config(PretrainConfig, copied)
    with pytest.raises(ConfigError, match=re.escape(
            f"config file '{REPO / 'configs/pretrain'}' is a directory; give one recipe file, "
            f"e.g. {REPO / 'configs/pretrain/demo.yaml'}")):
        load_config(PretrainConfig, REPO / "configs/pretrain")


@pytest.mark.parametrize("world,micro,accum,expect", [
    (8, None, None, (512, 1)),
    (8, 128, None, (128, 4)),
    (8, None, 2, (256, 2)),
    (8, 64, 8, (64, 8)),
])
def test_batch_layout(world, micro, accum, expect):
    train = TrainConfig(global_batch_size=4096, micro_batch_size=micro, grad_accum_steps=accum,
                        total_steps=1)
    assert train.batch_layout(world) == expect


@pytest.mark.parametrize("world,micro,accum", [(3, None, None), (8, 100, None), (8, 64, 4)])
def test_impossible_batch_layout_names_global_batch(world, micro, accum):
    train = TrainConfig(global_batch_size=4096, micro_batch_size=micro, grad_accum_steps=accum,
                        total_steps=1)
    with pytest.raises(ConfigError, match="train.global_batch_size=4096"):
        train.batch_layout(world)


def test_saved_config_reloads_identically(tmp_path):
    cfg = load_config(PretrainConfig, REPO / "configs/pretrain/vit_h14_i21k.yaml", ["seed=7"])
    path = save_config(cfg, tmp_path / "run" / "config.yaml")
    assert load_config(PretrainConfig, path) == cfg
    assert yaml.safe_load(path.read_text())["seed"] == 7


def test_a_config_of_the_other_stage_or_a_dotted_yaml_key_is_named_as_such(tmp_path):
    """What a newcomer meets: a saved pretraining config handed to the fine-tune (or the other
    way round), and 'optimizer.lr: 1e-3' written flat in a recipe. The error says which, not
    'unknown key ...; did you mean <the same key>?'."""
    pre = save_config(load_config(PretrainConfig, REPO / "configs/pretrain/demo.yaml"),
                      tmp_path / "pre/config.yaml")
    with pytest.raises(ConfigError) as e:
        load_config(FinetuneConfig, pre)
    assert str(e.value) == (f"config file '{pre}': "
                            "'deepspeed' is a key of launch/pretrain.py, not launch/finetune.py: "
                            "a config (or output_dir) of the other stage? Run it with "
                            "launch/pretrain.py, or give launch/finetune.py one of its own; "
                            "DeepSpeed in a fine-tune is Accelerate's config (accelerate launch "
                            "--config_file configs/accelerate/deepspeed_zero2.yaml "
                            "launch/finetune.py)")
    with pytest.raises(ConfigError, match=f"^config file '{REPO / 'configs/finetune/demo.yaml'}': "
                                          "'data.dev_fraction', 'init' are keys of "
                                          "launch/finetune.py, not launch/pretrain.py"):
        load_config(PretrainConfig, REPO / "configs/finetune/demo.yaml")
    # a pretraining recipe holds no key the fine-tune lacks: it is its missing init that tells
    with pytest.raises(ConfigError) as e:
        load_config(FinetuneConfig, REPO / "configs/pretrain/vit_l16_i21k.yaml")
    assert str(e.value) == (f"config file '{REPO / 'configs/pretrain/vit_l16_i21k.yaml'}' sets "
                            f"no init: a fine-tune starts from a pretraining run "
                            f"(init=runs/NAME) or from scratch (init=null); a pretraining "
                            f"recipe runs with launch/pretrain.py")
    assert load_config(FinetuneConfig, REPO / "configs/pretrain/vit_l16_i21k.yaml",
                       ["init=null"]).init is None  # said in an override: as meant
    flat = tmp_path / "flat.yaml"
    flat.write_text("optimizer.lr: 1.0e-3\n")
    with pytest.raises(ConfigError, match=rf"^config file '{flat}': config key 'optimizer.lr' is "
                                          r"written dotted in a YAML file; nest it there "
                                          r"\(optimizer: \{lr: ...\}\)"):
        load_config(PretrainConfig, flat)


def test_a_bad_key_or_value_in_a_recipe_names_the_file_that_sets_it(tmp_path):
    """A recipe inheriting another: the error names the file to fix, the inherited one where
    the key is there; a bad value given on the command line names no file."""
    (tmp_path / "base.yaml").write_text(f"inherit: {REPO / 'configs/pretrain/demo.yaml'}\n"
                                        "optimizer:\n  lrr: 1.0e-3\n")
    (tmp_path / "mine.yaml").write_text("inherit: base.yaml\ntrain:\n  total_steps: five\n")
    with pytest.raises(ConfigError) as e:
        load_config(PretrainConfig, tmp_path / "mine.yaml")
    assert str(e.value) == (f"config file '{tmp_path / 'base.yaml'}': unknown config key "
                            f"'optimizer.lrr'; did you mean 'optimizer.lr'? (+1 more problem)")
    (tmp_path / "base.yaml").write_text(f"inherit: {REPO / 'configs/pretrain/demo.yaml'}\n")
    with pytest.raises(ConfigError) as e:
        load_config(PretrainConfig, tmp_path / "mine.yaml")
    assert str(e.value) == (f"config file '{tmp_path / 'mine.yaml'}': config key "
                            f"'train.total_steps': input should be a valid integer, unable to "
                            f"parse string as an integer (got 'five')")
    with pytest.raises(ConfigError) as e:
        load_config(PretrainConfig, tmp_path / "mine.yaml", ["train.total_steps=six"])
    assert str(e.value).startswith("config key 'train.total_steps': input should be a valid "
                                   "integer")
    with pytest.raises(ConfigError, match=r"\(got '1e5'\); write it as 100000$"):
        load_config(PretrainConfig, tmp_path / "mine.yaml", ["train.total_steps=1e5"])
    # a section's own check reports the section: a bad value given on the command line is not
    # pinned on a recipe that merely has that section
    with pytest.raises(ConfigError) as e:
        load_config(PretrainConfig, tmp_path / "mine.yaml",
                    ["train.total_steps=5", "data.crop_scale=[1.0,0.5]"])
    assert not str(e.value).startswith("config file") and "crop_scale" in str(e.value)


def test_finetune_config_has_the_paper_transfer_defaults():
    cfg = load_config(FinetuneConfig, None, ["init=runs/pretrain", "data.dev_fraction=0.02"])
    assert (cfg.optimizer.name, cfg.optimizer.momentum, cfg.optimizer.weight_decay) == ("sgd", 0.9, 0.0)
    assert cfg.train.global_batch_size == 512 and cfg.train.total_steps == 20_000
    assert cfg.model.img_size == 384 and cfg.model.representation_size is None
    assert cfg.schedule.decay == "cosine"
    with pytest.raises(ConfigError, match="did you mean 'data.dev_fraction'"):
        load_config(FinetuneConfig, None, ["data.dev_frac=0.02"])
    # the reported figure is named after its split, and never after the dev split's series
    assert load_config(FinetuneConfig, None, []).eval.val_name is None
    with pytest.raises(ConfigError, match="eval.val_name=dev would mix the reported figure"):
        load_config(FinetuneConfig, None, ["eval.val_name=dev"])
    with pytest.raises(ConfigError, match="data.val_split=dev would report its figure as "
                                          "eval/dev/"):
        load_config(FinetuneConfig, None, ["data.val_split=dev"])
    assert load_config(FinetuneConfig, None, ["data.val_split=dev", "eval.val_name=heldout"])
    assert load_config(FinetuneConfig, None, ["data.val_split=dev", "data.dev_fraction=0"])
    # the reported figure is never taken on the data trained on, in either stage, nor the
    # probe's on the images its shots came from (pretraining logged both as held-out)
    for schema in (FinetuneConfig, PretrainConfig):
        with pytest.raises(ConfigError, match=r"^data.val_split=train is the split trained on: "
                                              r"its figure would be on training data, logged "
                                              r"as held-out; set data.val_split to a held-out "
                                              r"split, or null$"):
            load_config(schema, None, ["data.val_split=train"])
        with pytest.raises(ConfigError, match=r"^eval.fewshot_test_split=train is the split "
                                              r"the probe's shots come from"):
            load_config(schema, None, ["eval.fewshot_root=runs/c10", "data.val_split=null",
                                       "eval.fewshot_test_split=train"])


def test_setting_one_train_key_keeps_the_stages_other_train_defaults(tmp_path):
    """The stages' own train defaults (fine-tuning: batch 512, 20k steps; pretraining: 90
    epochs) stay when a recipe or an override sets another key of the section."""
    recipe = tmp_path / "fp32.yaml"
    recipe.write_text("train: {precision: fp32}\n")
    for cfg in (load_config(FinetuneConfig, None, ["train.precision=fp32"]),
                load_config(FinetuneConfig, recipe, ["init=null"])):  # (a recipe says its init)
        assert cfg.train.precision == "fp32"
        assert (cfg.train.global_batch_size, cfg.train.total_steps, cfg.train.epochs) == (
            512, 20_000, None)
    cfg = load_config(PretrainConfig, recipe)
    assert (cfg.train.global_batch_size, cfg.train.total_steps, cfg.train.epochs) == (
        4096, None, 90)
    # the run's length given the other way replaces the default one, in a file or an override
    recipe.write_text("train: {epochs: 3}\n")
    for cfg in (load_config(FinetuneConfig, recipe, ["init=null"]),
                load_config(FinetuneConfig, None, ["train.epochs=3"])):
        assert (cfg.train.global_batch_size, cfg.train.total_steps, cfg.train.epochs) == (
            512, None, 3)
    recipe.write_text("train: {total_steps: 7}\n")
    cfg = load_config(PretrainConfig, recipe)
    assert (cfg.train.total_steps, cfg.train.epochs) == (7, None)


# the unknown key is a slow variant: in-process tests check its line; what only this launch
# shows is a config refused while the command line is parsed (before the process group) ending
# the ranks with one line, the node's first rank's (test_cli.py), as the batch size refused once
# the process group is joined does with rank 0's in the default command
@pytest.mark.parametrize("override,message", [
    pytest.param("optimzer.lr=0.1", "unknown config key 'optimzer'; did you mean 'optimizer.lr'?",
                 marks=pytest.mark.slow),
    ("train.global_batch_size=15", "train.global_batch_size=15 is not divisible by world "
                                   "size 2; pick a multiple of 2"),
])
def test_a_bad_config_is_one_line_of_a_real_launch_before_any_work(
        override, message, tmp_path, tiny_data):
    from conftest import run_deepspeed, tiny_run_args
    out = tmp_path / "run"
    proc = run_deepspeed(2, *tiny_run_args(out, tiny_data, "train.total_steps=4", override),
                         fails=True)
    lines = sorted({line for line in proc.stderr.splitlines() if line.startswith("error: ")})
    assert lines == [f"error: {message}"]
    assert proc.stderr.count("error: ") == 1 and "Traceback" not in proc.stderr
    assert not (out / "checkpoints").exists()


@pytest.mark.parametrize("overrides,message", [
    (["model.num_classes=0"], r"model.num_classes('.* greater than 0| must be at least 1 to "
                              r"train)"),
    (["data.root=null", "data.generate_demo=true"], "data.generate_demo needs data.root"),
    (["optimizer.lr=1e-6", "schedule.min_lr=1e-5"],
     "schedule.min_lr=1e-05 is above optimizer.lr=1e-06: the learning rate would rise after "
     "the warmup"),
    # not a local folder named ./s3:/bucket/in21k beside the remote data trained on
    (["data.root=s3://bucket/in21k", "data.generate_demo=true"],
     "data.generate_demo writes the demo data to a local folder, but "
     "data.root='s3://bucket/in21k' is a URL; set data.generate_demo=false"),
    # MLflow would refuse every metric of each step that logs it
    (["eval.val_name=in21k+val"], r"eval.val_name='in21k\+val' cannot be part of an MLflow "
                                  r"metric name; use letters, digits"),
    # a mode for a model that is not compiled would do nothing
    (["train.compile_mode=max-autotune-no-cudagraphs"],
     "train.compile_mode=max-autotune-no-cudagraphs needs train.compile=true"),
])
def test_training_configs_refuse_what_cannot_train(overrides, message):
    for schema in (PretrainConfig, FinetuneConfig):
        with pytest.raises(ConfigError, match=message):
            load_config(schema, None, overrides)


def test_a_deepspeed_file_cannot_override_what_this_config_sets(tmp_path):
    from pretrain.deepspeed_json import deepspeed_config
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 1}, "gradient_clipping": 0.01, '
                  '"data_types": {"grad_accum_dtype": "bf16"}, '
                  '"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.5}}}')
    cfg = load_config(PretrainConfig, None, [f"deepspeed.config={ds}", "optimizer.grad_clip=null"])
    with pytest.raises(ConfigError, match=r"sets \['data_types', 'gradient_clipping', "
                                          r"'scheduler'\], which come from this config \(.*"
                                          r"deepspeed.grad_accum_dtype\); remove them from the "
                                          r"file"):
        deepspeed_config(cfg, micro=4, accum=1, world=1)
    ds.write_text('{"zero_optimization": {"stage": 1}}')  # ZeRO settings are the file's to give
    made = deepspeed_config(cfg, micro=4, accum=1, world=1)
    assert made["zero_optimization"] == {"stage": 1} and made["steps_per_print"] == 10 ** 9
    # DeepSpeed's own progress lines are not shown (its INFO log is off): refused, where the
    # setting was dropped without a word
    ds.write_text('{"steps_per_print": 5}')
    with pytest.raises(ConfigError, match=r"sets steps_per_print, but the run prints its own "
                                          r"progress line \(every log.every_steps\) instead of "
                                          r"DeepSpeed's; remove the key from the file"):
        deepspeed_config(cfg, micro=4, accum=1, world=1)
    # checkpoint settings: a relaunch on another layout keeps them beside the universal
    # checkpoint it loads
    ds.write_text('{"checkpoint": {"tag_validation": "Fail"}}')
    made = deepspeed_config(cfg, micro=4, accum=1, world=1)
    from pretrain.checkpoint_layout import load_universal
    load_universal(made)
    assert made["checkpoint"] == {"tag_validation": "Fail", "load_universal": True}


def test_the_zero_stage_is_the_deepspeed_files_and_a_different_one_given_too_is_refused(
        tmp_path):
    from pretrain.deepspeed_json import deepspeed_config, zero_stage

    def stage(*overrides):
        cfg = load_config(PretrainConfig, None, list(overrides))
        return zero_stage(deepspeed_config(cfg, micro=4, accum=1, world=1))
    assert stage() == 1 and stage("deepspeed.zero_stage=2") == 2
    assert stage("deepspeed.config=zero3.json") == 3
    assert stage("deepspeed.config=zero3.json", "deepspeed.zero_stage=3") == 3
    with pytest.raises(ConfigError, match=r"deepspeed.zero_stage=2 but deepspeed.config '.*zero3"
                                          r".json' runs ZeRO-3; drop deepspeed.zero_stage"):
        stage("deepspeed.config=zero3.json", "deepspeed.zero_stage=2")
    # a file that leaves the stage out runs the one given, or ZeRO-1 (not DeepSpeed's 0)
    bare = tmp_path / "bare.json"
    bare.write_text('{"zero_optimization": {"overlap_comm": true}}')
    assert stage(f"deepspeed.config={bare}") == 1
    assert stage(f"deepspeed.config={bare}", "deepspeed.zero_stage=2") == 2
    bare.write_text('{"zero_optimization": 2}')
    with pytest.raises(ConfigError, match="has a zero_optimization that is no JSON object"):
        stage(f"deepspeed.config={bare}")
    # the resolved config of such a run loads again as it was saved
    cfg = load_config(PretrainConfig, None, ["deepspeed.config=zero3.json"])
    again = PretrainConfig.model_validate(yaml.safe_load(cfg.to_yaml()))
    assert zero_stage(deepspeed_config(again, micro=4, accum=1, world=1)) == 3


def test_a_deepspeed_file_turning_off_pythons_garbage_collector_is_refused(tmp_path):
    from pretrain.deepspeed_json import deepspeed_config
    ds = tmp_path / "ds.json"
    ds.write_text('{"disable_python_gc": true}')
    cfg = load_config(PretrainConfig, None, [f"deepspeed.config={ds}"])
    with pytest.raises(ConfigError, match=r"sets disable_python_gc, but the launchers manage "
                                          r"Python's garbage collector themselves .*; remove"):
        deepspeed_config(cfg, micro=4, accum=1, world=1)
    ds.write_text('{"disable_python_gc": false}')  # DeepSpeed's default: nothing to refuse
    assert not deepspeed_config(cfg, micro=4, accum=1, world=1)["disable_python_gc"]


@pytest.mark.parametrize("text,message", [
    ('{"scheduler": {"type": "WarmupLR"}}', r"sets \['scheduler'\], which come from this config"),
    ('{"zero_optimization": {"stage": 1},}', r"cannot be read as JSON \(Expecting property name"),
    ('[1]', r"holds no JSON object; write the DeepSpeed config as"),
])
def test_a_bad_deepspeed_file_fails_a_run_before_its_demo_data_is_made(text, message, tmp_path):
    from conftest import run_launcher
    ds = tmp_path / "ds.json"
    ds.write_text(text)
    proc = run_launcher("pretrain.py", "--config", "configs/pretrain/demo.yaml",
                        f"output_dir={tmp_path / 'run'}", f"data.root={tmp_path / 'demo'}",
                        "data.generate_demo=true",
                        f"deepspeed.config={ds}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert re.match(rf"error: config key 'deepspeed.config': '{re.escape(str(ds))}' {message}",
                    proc.stderr.strip().splitlines()[-1]), proc.stderr[-2000:]
    assert not (tmp_path / "demo").exists()  # refused before the demo data is generated


def test_eval_keys_that_can_do_nothing_are_announced_once_by_rank_0(caplog):
    """Pretraining took them without a word (the fine-tune warned of its every_steps)."""
    import logging

    from finetune.config import FinetuneConfig
    from pretrain.stage import build_evaluators, fewshot_evaluators
    overrides = ["data.val_split=null", "eval.every_steps=5", "eval.batch_size=7",
                 "eval.fewshot_shots=[2]"]
    cfg = load_config(PretrainConfig, None, overrides)
    for rank in (1, 0):
        with caplog.at_level(logging.WARNING):
            assert build_evaluators(cfg, None, rank, 2, "cpu", None) == []
    assert [r.getMessage() for r in caplog.records] == [
        "eval.every_steps=5, eval.batch_size=7 do nothing: data.val_split=null: there is no "
        "held-out classification",
        "eval.fewshot_shots=(2,) does nothing: eval.fewshot_root is unset: there is no few-shot "
        "probe"]
    caplog.clear()  # the fine-tune's probe keys alike; nothing set, nothing said
    with caplog.at_level(logging.WARNING):
        assert fewshot_evaluators(load_config(FinetuneConfig, None, overrides), None, 0, 1) == []
        assert build_evaluators(load_config(PretrainConfig, None, ["data.val_split=null"]),
                                None, 0, 1, "cpu", None) == []
    assert [r.getMessage() for r in caplog.records] == [
        "eval.fewshot_shots=(2,) does nothing: eval.fewshot_root is unset: there is no few-shot "
        "probe"]


def test_a_warmup_as_long_as_the_run_is_announced(caplog):
    import logging

    import torch

    from pretrain.engine import build_scheduler
    cfg = load_config(PretrainConfig, None, ["schedule.warmup_steps=100", "train.total_steps=4"])
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with caplog.at_level(logging.WARNING):
        build_scheduler(opt, cfg, 4)
    assert "schedule.warmup_steps=100 is not shorter than the run's 4 steps" in caplog.text
    assert "no effect" not in caplog.text  # timm's own, on every rank, said no more
    assert logging.getLogger("timm.scheduler").level == logging.NOTSET  # and left as it was


def test_a_setting_of_the_other_optimizer_is_announced_as_unused(caplog):
    import logging

    from pretrain.engine import build_optimizer
    model = torch.nn.Linear(4, 2)
    for overrides, unused in [(["optimizer.betas=[0.9,0.95]"], "optimizer.betas"),
                              (["optimizer.name=adamw", "optimizer.momentum=0.8"],
                               "optimizer.momentum")]:
        caplog.clear()
        cfg = load_config(FinetuneConfig, None, overrides)
        with caplog.at_level(logging.WARNING, logger="pretrain.engine"):
            build_optimizer(model, cfg)
        assert f"{unused} not used by optimizer.name={cfg.optimizer.name}" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pretrain.engine"):
        build_optimizer(model, load_config(FinetuneConfig, None, ["optimizer.momentum=0.8"]))
    assert "not used" not in caplog.text


@pytest.mark.parametrize("overrides,message", [
    (["data.mixup_alpha=0.2", "train.global_batch_size=15"],
     "mixup/cutmix pair each image with another of its micro-batch, which is 15 here"),
    (["output_dir=/proc/no-such-run"], "output_dir '/proc/no-such-run' cannot be created"),
    (["debug.log_sample_keys=/proc/no-such-keys"],
     "debug.log_sample_keys '/proc/no-such-keys' cannot be created"),
    (["model.num_classes=4"], "'{data}' has labels up to 7 but model.num_classes is 4: set "
                              "model.num_classes=8"),  # not the 21843 synsets its classes list
    pytest.param(["train.precision=fp16"], "train.precision=fp16 needs a GPU; use bf16 or fp32 "
                 "on the CPU", marks=pytest.mark.skipif(torch.cuda.is_available(),
                                                        reason="fp16 trains on a GPU")),
])
def test_run_setup_errors_are_one_line_before_the_model_is_built(overrides, message, tiny_data,
                                                                 tmp_path):
    from conftest import run_launcher, tiny_run_args
    proc = run_launcher("pretrain.py", *tiny_run_args(tmp_path / "run", tiny_data, *overrides))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "error: " + message.format(data=tiny_data)), proc.stderr[-2000:]

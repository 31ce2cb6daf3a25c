"""Pretrained weights in and out: DeepSpeed ZeRO-3 checkpoints consolidated to fp32, the export
files (ours and timm's), timm state dicts and Google .npz checkpoints loaded into a ViTClassifier,
position embeddings resampled in 2-D, the head swap, and the errors for files that do not fit.

One real 2-rank ZeRO-3 pretraining run (fp32, so the module files hold no weights at all and
every tensor must come out of the partitioned optimizer shards) serves the whole module: the
fault suite's ZeRO-3 reference run, made once per session for both files."""
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from conftest import REPO, run_launcher
from finetune.weights import InitError, load_init, resample_pos_embed
from pretrain.config import PretrainConfig
from pretrain.checkpoint import CheckpointError
from pretrain.consolidate import consolidate
from pretrain.export import from_model, read_metadata, timm_kwargs
from pretrain.metrics import read_jsonl
from pretrain.model import create_model
from test_faults import reference_zero3  # noqa: F401 -- a fixture: the run, made once per session


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, reference_zero3):
    """The fault suite's 20-step ZeRO-3 run on 2 ranks (its newest checkpoint and held-out eval
    at step 20; made once for both files), exported by the CLI the way a user does it."""
    base = tmp_path_factory.mktemp("weights")
    out = reference_zero3
    full, timm_file = base / "full.safetensors", base / "timm_backbone.safetensors"
    proc = subprocess.run([sys.executable, str(REPO / "launch/export.py"), str(out), "--out",
                           str(full), "--timm-backbone", str(timm_file)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = PretrainConfig.model_validate(yaml.safe_load((out / "config.yaml").read_text()))
    return {"out": out, "base": base, "full": full, "timm": timm_file, "cfg": cfg,
            "cli": proc.stdout, "consolidated": consolidate(out)}


def fresh(cfg_model, **changes):
    model = create_model(cfg_model.model_copy(update=changes) if changes else cfg_model)
    return model.eval()


def fixed_input(img_size, n=3):
    return torch.randn(n, 3, img_size, img_size, generator=torch.Generator().manual_seed(0))


# --------------------------------------------------------------------------------------------
# Consolidation and export
# --------------------------------------------------------------------------------------------
def test_zero3_consolidation_reproduces_the_runs_own_held_out_accuracy(pretrained):
    from pretrain.evaluate import run_due
    from pretrain.stage import build_evaluators

    c, cfg = pretrained["consolidated"], pretrained["cfg"]
    assert (c.step, c.zero_stage, c.world_size) == (20, 3, 2)
    assert isinstance(c.tracking_run_id, str) and c.tracking_run_id  # the run tracked to MLflow
    assert c.source.endswith("checkpoints/step_00000020")
    assert all(v.dtype == torch.float32 for v in c.state_dict.values())
    model = fresh(cfg.model)
    load_init(model, pretrained["out"], with_head=True)
    # Evaluated in one process on the merged weights, the held-out metrics equal what the two
    # ZeRO-3 ranks logged at step 20: every shard landed in the right tensor, in the right place.
    evaluators = build_evaluators(cfg, model.spec, 0, 1, torch.device("cpu"), None)
    ours = run_due(evaluators, model, 20, force=True)
    logged = next(r for r in read_jsonl(pretrained["out"] / "metrics.jsonl")
                  if r["step"] == 20 and any(k.startswith("eval/") for k in r))
    assert ours and ours == {k: logged[k] for k in ours}
    assert "step 20, ZeRO-3, 2 ranks" in pretrained["cli"]


def test_full_export_carries_everything_and_the_config(pretrained):
    meta = read_metadata(pretrained["full"])
    from safetensors.torch import load_file
    tensors = load_file(pretrained["full"])
    assert {"pre_logits.fc.weight", "head.weight", "backbone.pos_embed"} <= set(tensors)
    assert meta["format"] == "vit-classifier/1" and meta["step"] == "20"
    assert meta["tracking_run_id"] == pretrained["consolidated"].tracking_run_id
    assert yaml.safe_load(meta["config"])["model"] == pretrained["cfg"].model.model_dump(
        mode="json")
    assert json.loads(meta["spec"])["representation_size"] == 64


def test_the_export_cli_never_replaces_what_is_there_unless_told(pretrained, tmp_path):
    def export(*args, run=pretrained["out"]):
        return subprocess.run([sys.executable, str(REPO / "launch/export.py"),
                               str(run), *map(str, args)], cwd=REPO,
                              capture_output=True, text=True, timeout=300)
    full, before = pretrained["full"], pretrained["full"].stat().st_mtime_ns
    proc = export("--out", full)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"error: '{full}' exists; pass --overwrite to replace it, or name another")
    assert full.stat().st_mtime_ns == before
    proc = export("--out", pretrained["base"] / "x.safetensors", "--timm-backbone", full)
    assert proc.returncode == 2 and f"'{full}' exists" in proc.stderr
    assert not (pretrained["base"] / "x.safetensors").exists()
    # a folder export into the run itself would turn the run into a timm folder (tried on a
    # copy: the fault suite reads the run from another test process)
    run = tmp_path / "run"
    shutil.copytree(pretrained["out"], run)
    proc = export("--out", run, run=run)
    assert proc.returncode == 2 and f"'{run}' holds the checkpoint read" in proc.stderr
    assert sorted(p.name for p in run.iterdir()) == sorted(
        p.name for p in pretrained["out"].iterdir())  # nothing written into it
    # nor, with --overwrite, into another run's folder (that run would become a timm folder
    # to whatever reads it), which is said without it too (it pointed to --overwrite, which
    # is then refused); an earlier export's folder is replaced
    for overwrite in ([], ["--overwrite"]):
        proc = export("--out", run, *overwrite)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
            f"error: '{run}' is no export folder (it holds checkpoints, config.yaml"), \
            proc.stderr[-2000:]
        assert proc.stderr.strip().endswith("--overwrite replaces an earlier export only: name "
                                            "a folder of its own")
    assert sorted(p.name for p in run.iterdir()) == sorted(
        p.name for p in pretrained["out"].iterdir())
    folder = tmp_path / "export"
    assert export("--out", folder).returncode == 0
    assert export("--out", folder, "--overwrite").returncode == 0
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json",
                                                        "model.safetensors"]
    for typo in ("typo.safetensor", "model.pt"):  # a file meant, a folder it would have been
        proc = export("--out", tmp_path / typo)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
            f"error: --out '{tmp_path / typo}' would be a folder (any name but "
            f"FILE.safetensors is); the single-file export is FILE.safetensors: name one, or a "
            f"folder")
        assert not (tmp_path / typo).exists()
    same = pretrained["base"] / "same.safetensors"
    proc = export("--out", same, "--timm-backbone", same)
    assert proc.returncode == 2 and "are the same file" in proc.stderr
    proc = export("--out", full, "--overwrite")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert full.stat().st_mtime_ns != before
    # what is read, said before the minutes a large ZeRO checkpoint takes; how long it took
    assert re.search(r"^reading \S+step_\d+ \(\d+\.\d\d GiB\)$", proc.stderr,
                     re.MULTILINE), proc.stderr[-2000:]
    assert re.search(r"; exported in \d+\.\d s\)$", proc.stdout, re.MULTILINE), proc.stdout


# launch/export.py as a user runs it on the output dir of a job still saving there, which
# prunes the checkpoint being read (its files go first, then its folder) at the first read
PRUNED_EXPORT = r'''
import runpy, shutil, sys
from pretrain import consolidate
read, pruned = consolidate._consolidate, []

def pruned_at_first_read(ckpt):
    if not pruned:
        pruned.append(ckpt)
        for f in sorted(ckpt.iterdir()):  # the files, not yet the folder
            shutil.rmtree(f) if f.is_dir() else f.unlink()
    return read(ckpt)

consolidate._consolidate = pruned_at_first_read
sys.argv = ["launch/export.py", *sys.argv[1:]]
sys.path.insert(0, "launch")  # as running the script puts its folder first
runpy.run_path("launch/export.py", run_name="__main__")
'''


def test_a_checkpoint_pruned_while_it_is_read_gives_way_to_the_newest_or_is_named(
        pretrained, tmp_path):
    from pretrain.checkpoint import CheckpointStore

    run = tmp_path / "run"
    shutil.copytree(pretrained["out"], run)
    steps = [c.path for c in CheckpointStore(run / "checkpoints").complete()]
    assert len(steps) >= 2
    proc = subprocess.run([sys.executable, "-c", PRUNED_EXPORT, str(run), "--out",
                           str(tmp_path / "x.safetensors")], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"checkpoint {steps[0]} was removed while it was read (pruned by the job saving " \
           f"there); reading {steps[1]} instead" in proc.stderr
    assert f"\ncheckpoint {steps[1]} (step " in "\n" + proc.stdout
    assert read_metadata(tmp_path / "x.safetensors")["source"] == str(steps[1])
    # a step named, pruned meanwhile: said in one line
    proc = subprocess.run([sys.executable, "-c", PRUNED_EXPORT, str(steps[1]), "--out",
                           str(tmp_path / "y.safetensors")], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"error: checkpoint '{steps[1]}' was removed while it was read (a job still saving "
        f"there prunes old steps: checkpoint.keep_last); name a newer step, or the output dir "
        f"for the newest"), proc.stderr[-2000:]


def test_the_export_cli_fails_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "launch/export.py"), str(tmp_path),
                           "--out", str(tmp_path / "x.safetensors")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: '{tmp_path}' holds no checkpoint: expected a pretraining output "
                      f"dir (with checkpoints/step_*/) or a DeepSpeed checkpoint dir "
                      f"(*_model_states.pt)"]
    assert "Traceback" not in proc.stderr
    ft = tmp_path / "ft"  # a fine-tune's output dir, killed before its exports
    (ft / "checkpoints/step_00000004").mkdir(parents=True)
    (ft / "config.yaml").write_text("init: runs/demo\n")
    proc = subprocess.run([sys.executable, str(REPO / "launch/export.py"), str(ft),
                           "--out", str(tmp_path / "x.safetensors")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"error: '{ft}' is a fine-tune's output dir; it writes its exports itself when it ends: "
        f"{ft / 'final.safetensors'} and {ft / 'final'}/ (timm folder), best.* likewise; "
        f"launch/export.py exports one of its checkpoints ({ft / 'checkpoints'}/step_N)")
    step = ft / "checkpoints/step_00000004"  # one of its checkpoints, cut short: not "no
    proc = subprocess.run([sys.executable, str(REPO / "launch/export.py"), str(step),  # ckpt"
                           "--out", str(tmp_path / "x.safetensors")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"error: checkpoint '{step}' is incomplete (no client_state.pt: a save was interrupted); "
        f"pick another step in {step.parent}")


def test_timm_loads_the_backbone_export_with_no_missing_or_unexpected_keys(pretrained, caplog):
    import timm
    from safetensors.torch import load_file

    c = pretrained["consolidated"]
    spec = c.spec
    meta = read_metadata(pretrained["timm"])
    assert meta["timm_model"] == spec.name and json.loads(meta["timm_kwargs"]) == timm_kwargs(spec)
    with caplog.at_level(logging.INFO, logger="timm"):
        vit = timm.create_model(spec.name, pretrained=True, num_classes=0,
                                pretrained_cfg_overlay=dict(file=str(pretrained["timm"])),
                                **timm_kwargs(spec)).eval()
    # timm loads non-strictly when num_classes differs from its default and only LOGS missing /
    # unexpected keys, so read its log as well as comparing key sets.
    assert f"Loading pretrained weights from file ({pretrained['timm']})" in caplog.text
    assert "Missing keys" not in caplog.text and "Unexpected keys" not in caplog.text
    assert set(load_file(pretrained["timm"])) == set(vit.state_dict())
    ours = fresh(pretrained["cfg"].model)
    load_init(ours, pretrained["full"], with_head=True)
    x = fixed_input(spec.img_size)
    with torch.no_grad():
        assert torch.equal(vit(x), ours.forward_features(x))


def test_timm_loads_a_stock_size_export_exactly_as_documented(tmp_path, caplog):
    """For a stock timm size no architecture arguments are needed: the issue's exact call."""
    import timm

    from pretrain.config import ModelConfig
    from pretrain.export import export_timm_backbone

    model = create_model(ModelConfig(name="vit_tiny_patch16_224", representation_size=192,
                                     num_classes=10)).eval()
    assert timm_kwargs(model.spec) == {}
    path = export_timm_backbone(from_model(model), tmp_path / "vit_tiny.safetensors")
    with caplog.at_level(logging.INFO, logger="timm"):
        vit = timm.create_model("vit_tiny_patch16_224", pretrained=True,
                                pretrained_cfg_overlay=dict(file=str(path)), num_classes=0)
    assert "Missing keys" not in caplog.text and "Unexpected keys" not in caplog.text
    x = fixed_input(224, n=1)
    with torch.no_grad():
        assert torch.equal(vit.eval()(x), model.forward_features(x))


@pytest.mark.parametrize("name", ["vit_medium_patch16_gap_256", "vit_base_patch16_reg4_gap_256"])
def test_a_backbone_of_an_average_pooling_name_loads_in_timm_as_printed(name, tmp_path, caplog):
    """Our backbone pools the class token whatever the name; timm's *_gap_* names do not, so
    the printed arguments say so (without them timm built another model and loaded it partly,
    with a log line only, or refused the position embedding)."""
    import timm

    from pretrain.config import ModelConfig
    from pretrain.export import export_timm_backbone

    model = create_model(ModelConfig(name=name, img_size=32, embed_dim=64, depth=2,
                                     num_heads=2, num_classes=10)).eval()
    kwargs = timm_kwargs(model.spec)
    assert (kwargs["class_token"], kwargs["global_pool"]) == (True, "token")
    path = export_timm_backbone(from_model(model), tmp_path / "bb.safetensors")
    with caplog.at_level(logging.INFO, logger="timm"):
        vit = timm.create_model(name, pretrained=True, num_classes=0,
                                pretrained_cfg_overlay=dict(file=str(path)), **kwargs).eval()
    assert "Missing keys" not in caplog.text and "Unexpected keys" not in caplog.text
    x = fixed_input(32, n=2)
    with torch.no_grad():
        assert torch.equal(vit(x), model.forward_features(x))


# --------------------------------------------------------------------------------------------
# Google .npz checkpoints, written here with the official key names and shapes
# --------------------------------------------------------------------------------------------
def google_arrays(sd, layout):
    """A ViTClassifier state dict as the official Flax files store it.

    vision_transformer (e.g. ViT-B_16.npz, imagenet21k): ``cls`` (1,1,D), ``embedding/kernel``
    (p,p,3,D) HWIO, ``Transformer/posembed_input/pos_embedding`` (1,1+N,D) with the class row,
    blocks ``Transformer/encoderblock_{i}/`` of LayerNorm_0, MultiHeadDotProductAttention_1
    (query/key/value kernel (D,H,D/H), bias (H,D/H); out kernel (H,D/H,D)), LayerNorm_2,
    MlpBlock_3/Dense_{0,1}; ``Transformer/encoder_norm``; ``pre_logits`` and ``head`` Dense
    kernels (in, out). big_vision: everything under ``params/``, ``pos_embedding`` (1,N,D) added
    before the class token is prepended (so ``cls`` absorbs the class position), and the block
    sub-modules numbered LayerNorm_0, MultiHeadDotProductAttention_0, LayerNorm_1, MlpBlock_0;
    with ``scan`` (big_vision's scanned encoder) one ``Transformer/encoderblock/`` whose arrays
    carry a leading depth axis.
    """
    def a(t):
        return t.detach().numpy().astype(np.float32)

    D = sd["backbone.cls_token"].shape[-1]
    heads = 2  # the tiny run's model.num_heads
    bv = layout.startswith("big_vision")
    p = "params/" if bv else ""
    attn, ln2, mlp = ("MultiHeadDotProductAttention_0", "LayerNorm_1", "MlpBlock_0") if bv \
        else ("MultiHeadDotProductAttention_1", "LayerNorm_2", "MlpBlock_3")
    pos, cls = a(sd["backbone.pos_embed"]), a(sd["backbone.cls_token"])
    w = {f"{p}embedding/kernel": a(sd["backbone.patch_embed.proj.weight"]).transpose(2, 3, 1, 0),
         f"{p}embedding/bias": a(sd["backbone.patch_embed.proj.bias"]),
         f"{p}Transformer/encoder_norm/scale": a(sd["backbone.norm.weight"]),
         f"{p}Transformer/encoder_norm/bias": a(sd["backbone.norm.bias"]),
         f"{p}pre_logits/kernel": a(sd["pre_logits.fc.weight"]).T,
         f"{p}pre_logits/bias": a(sd["pre_logits.fc.bias"]),
         f"{p}head/kernel": a(sd["head.weight"]).T, f"{p}head/bias": a(sd["head.bias"])}
    if bv:
        w[f"{p}cls"], w[f"{p}pos_embedding"] = cls + pos[:, :1], pos[:, 1:]
    else:
        w["cls"], w["Transformer/posembed_input/pos_embedding"] = cls, pos
    depth = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("backbone.blocks."))
    for i in range(depth):
        b, o = f"{p}Transformer/encoderblock_{i}/", f"backbone.blocks.{i}."
        qkv_w = a(sd[o + "attn.qkv.weight"]).reshape(3, D, D)  # (q|k|v, out, in)
        qkv_b = a(sd[o + "attn.qkv.bias"]).reshape(3, heads, D // heads)
        for j, n in enumerate(("query", "key", "value")):
            w[f"{b}{attn}/{n}/kernel"] = qkv_w[j].T.reshape(D, heads, D // heads)
            w[f"{b}{attn}/{n}/bias"] = qkv_b[j]
        w[f"{b}{attn}/out/kernel"] = a(sd[o + "attn.proj.weight"]).T.reshape(heads, D // heads, D)
        w[f"{b}{attn}/out/bias"] = a(sd[o + "attn.proj.bias"])
        for ln, ours in (("LayerNorm_0", "norm1"), (ln2, "norm2")):
            w[f"{b}{ln}/scale"], w[f"{b}{ln}/bias"] = a(sd[o + ours + ".weight"]), \
                a(sd[o + ours + ".bias"])
        for r in range(2):
            w[f"{b}{mlp}/Dense_{r}/kernel"] = a(sd[o + f"mlp.fc{r + 1}.weight"]).T
            w[f"{b}{mlp}/Dense_{r}/bias"] = a(sd[o + f"mlp.fc{r + 1}.bias"])
    if layout == "big_vision_scan":
        blocks = f"{p}Transformer/encoderblock_"
        rests = {k.split("/", 3)[3] for k in w if k.startswith(blocks)}
        for rest in rests:
            w[f"{p}Transformer/encoderblock/{rest}"] = np.stack(
                [w.pop(f"{blocks}{i}/{rest}") for i in range(depth)])
    return w


@pytest.fixture(scope="module")
def npz_files(pretrained):
    sd = pretrained["consolidated"].state_dict
    files = {}
    for layout in ("vision_transformer", "big_vision", "big_vision_scan"):
        files[layout] = pretrained["base"] / f"{layout}.npz"
        np.savez(files[layout], **google_arrays(sd, layout))
    return files


def test_the_written_npz_has_the_official_names_and_shapes(npz_files):
    with np.load(npz_files["vision_transformer"]) as w:
        shapes = {k: w[k].shape for k in w.files}
    # ViT-B_16.npz has the same names with D=768, 12 heads, 16x16 patches, 197 tokens, 21843
    # classes; here D=64, 2 heads, 4x4 patches, 17 tokens, 8 classes.
    assert shapes["embedding/kernel"] == (4, 4, 3, 64)
    assert shapes["Transformer/posembed_input/pos_embedding"] == (1, 17, 64)
    assert shapes["Transformer/encoderblock_1/MultiHeadDotProductAttention_1/query/kernel"] == \
        (64, 2, 32)
    assert shapes["Transformer/encoderblock_1/MultiHeadDotProductAttention_1/out/kernel"] == \
        (2, 32, 64)
    assert shapes["Transformer/encoderblock_0/MlpBlock_3/Dense_0/kernel"] == (64, 256)
    assert shapes["pre_logits/kernel"] == (64, 64) and shapes["head/kernel"] == (64, 8)
    # 10 outside the blocks; per block q/k/v/out kernel+bias, 2 LayerNorms, 2 Dense: 16
    assert len(shapes) == 10 + 2 * 16


@pytest.mark.parametrize("layout", ["vision_transformer", "big_vision", "big_vision_scan"])
def test_timm_reads_our_npz_like_an_official_one(npz_files, pretrained, layout):
    """timm's own .npz loader (written against the released files) agrees with ours on the
    backbone, so the test's files really are in the official layouts."""
    import timm

    spec = pretrained["consolidated"].spec
    vit = timm.create_model(spec.name, pretrained=False, num_classes=0, **timm_kwargs(spec),
                            no_embed_class=layout != "vision_transformer").eval()
    vit.load_pretrained(str(npz_files[layout]))
    ours = fresh(pretrained["cfg"].model)
    lineage = load_init(ours, npz_files[layout], with_head=True)
    assert lineage["layout"] == layout.removesuffix("_scan")
    x = fixed_input(spec.img_size)
    with torch.no_grad():
        torch.testing.assert_close(vit(x), ours.forward_features(x), rtol=0, atol=1e-6)


def test_a_fine_tune_normalising_otherwise_than_its_init_is_refused_at_the_start(
        pretrained, tiny_cifar, tmp_path):
    """The init learned on pixels in [-1, 1]; fed ImageNet-normalised ones, the fine-tune ran
    on, its loss merely starting higher. --dry-run and the run refuse it in one line."""
    args = ["--config", str(REPO / "configs/finetune/demo.yaml"), f"init={pretrained['out']}",
            f"output_dir={tmp_path / 'ft'}", "data.normalize=imagenet", "tracking.enabled=false",
            "data.generate_demo=false", f"data.root={tiny_cifar}", "data.num_workers=1",
            "model.num_classes=10"]
    line = (f"error: init '{pretrained['out']}' was trained on inputs normalised as "
            f"data.normalize=minus_one_one, but this fine-tune normalises them as imagenet; set "
            f"data.normalize=minus_one_one")
    for extra in (["--dry-run"], []):
        done = subprocess.run([sys.executable, str(REPO / "launch/finetune.py"), *args, *extra],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == line, \
            (extra, done.stderr[-2000:])
        assert not (tmp_path / "ft" / "checkpoints").exists()


# --------------------------------------------------------------------------------------------
# Every init format -> the same model
# --------------------------------------------------------------------------------------------
def test_every_init_format_gives_identical_features(pretrained, npz_files, tmp_path):
    from pretrain.export import timm_backbone_state

    c, cfg = pretrained["consolidated"], pretrained["cfg"]
    timm_pth = tmp_path / "timm_backbone.pth"  # timm state dicts also come as pickles
    torch.save({"state_dict": timm_backbone_state(c.state_dict)}, timm_pth)
    from pretrain.run_info import lineage_tags
    from pretrain.timm_folder import write_timm_folder
    folder = write_timm_folder(c, tmp_path / "timm-folder")  # export.py --out FOLDER
    inits = {"deepspeed (output dir)": pretrained["out"],
             "deepspeed (checkpoint dir)": pretrained["out"] / "checkpoints/step_00000020",
             "export": pretrained["full"], "timm": pretrained["timm"], "timm .pth": timm_pth,
             "timm folder": folder,
             "npz vision_transformer": npz_files["vision_transformer"],
             "npz big_vision": npz_files["big_vision"],
             "npz big_vision scanned": npz_files["big_vision_scan"]}
    npz_names = [n for n in inits if n.startswith("npz")]  # from elsewhere: no run, no step
    x = fixed_input(cfg.model.img_size)
    features, logits = {}, {}
    for name, init in inits.items():
        model = fresh(cfg.model)
        with_head = "timm" not in name  # timm backbone files have no pre-logits / head
        lineage = load_init(model, init, with_head=with_head)
        assert lineage["format"] == name.split()[0] and lineage["resolution"] == 16
        with torch.no_grad():
            features[name] = model.forward_features(x)
            if with_head:
                logits[name] = model(x)
                assert lineage["loaded"] == ["backbone", "pre_logits", "head"]
        # each says the normalisation it was trained with (export.py's timm backbone file in
        # its header; a timm state dict pickled elsewhere does not)
        if name == "timm .pth":
            load_init(fresh(cfg.model), init, normalize="imagenet")  # nothing to compare with
        else:
            with pytest.raises(InitError, match=rf"^init '{re.escape(str(init))}' was trained "
                                                rf"on inputs normalised as data.normalize="
                                                rf"minus_one_one, but this fine-tune normalises "
                                                rf"them as imagenet; set data.normalize="
                                                rf"minus_one_one$"):
                load_init(fresh(cfg.model), init, normalize="imagenet")
        tags = lineage_tags(lineage.get("pretrain_run_id"), init, lineage.get("step"))
        if name not in ("timm .pth", *npz_names):  # the lineage the fine-tune logs
            assert lineage["step"] == 20 and lineage["pretrain_run_id"] == c.tracking_run_id, name
            assert tags["pretrain.step"] == "20" and tags["mlflow.parentRunId"] == c.tracking_run_id
        else:  # no step is made up ("0" read as a run's first step)
            assert set(tags) == {"pretrain.checkpoint"}, name
    ref = features["deepspeed (output dir)"]
    assert ref.abs().sum() > 0
    for name, f in features.items():
        assert torch.equal(f, ref), name
    # pre_logits and head came along too (npz included): the whole classifier is identical
    for name, out in logits.items():
        assert torch.equal(out, logits["export"]), name
    assert logits["export"].abs().max() > 0  # the trained head, not the zero-initialised one


# --------------------------------------------------------------------------------------------
# Position embeddings and the head swap
# --------------------------------------------------------------------------------------------
def smooth_field(grid, dim, size, seed=0):
    """A smooth (dim, size, size) field on a ``grid``-cell image sampled at ``size`` cell
    centres, like a trained position embedding (low spatial frequencies, up to 1 cycle)."""
    g = torch.Generator().manual_seed(seed)
    fi, fj, ph = (torch.rand(dim, 1, 1, generator=g) for _ in range(3))
    centres = (torch.arange(size) + 0.5) * grid / size  # in units of the original cells
    i, j = torch.meshgrid(centres, centres, indexing="ij")
    return torch.sin(2 * math.pi * (fi * i / grid + fj * j / grid + ph))


def test_resampling_224_to_384_and_back_returns_the_original():
    d = 32
    cls = torch.randn(1, 1, d)
    grid14 = smooth_field(14, d, 14).permute(1, 2, 0).reshape(1, 196, d)
    pos = torch.cat([cls, grid14], dim=1)  # ViT-x/16 at 224: 1 + 14 x 14 tokens
    up = resample_pos_embed(pos, 24)  # 384 / 16
    assert up.shape == (1, 1 + 24 * 24, d)
    assert torch.equal(up[:, :1], cls)  # the class token's position is not interpolated
    # 2-D interpolation: the 24 x 24 table is the same field sampled at the new cell centres
    # (a 1-D resampling of the flattened sequence would not be).
    # Cells within two of the border lie outside the old cell centres (edge-clamped there).
    want = smooth_field(14, d, 24).permute(1, 2, 0)
    off = (up[0, 1:].reshape(24, 24, d) - want).abs()
    assert off[2:-2, 2:-2].max() < 0.01 and off.pow(2).mean().sqrt() < 0.02
    back = resample_pos_embed(up, 14)
    assert torch.equal(back[:, :1], cls)
    err = (back - pos)[:, 1:]
    assert err.abs().max() < 0.05 and err.pow(2).mean().sqrt() < 0.01  # field amplitude is 1


def test_fine_tune_model_at_a_new_resolution_gets_a_zero_head(pretrained):
    """The paper's transfer: pre-logits and head dropped, a zero-initialised head for the new
    classes, position embeddings resampled to the new grid (16 px -> 32 px: 4x4 -> 8x8)."""
    from finetune.config import FinetuneModelConfig

    cfg = pretrained["cfg"]
    arch = cfg.model.model_dump(include={"name", "patch_size", "embed_dim", "depth",
                                         "num_heads"})
    model = create_model(FinetuneModelConfig(**arch, img_size=32, num_classes=5)).eval()
    lineage = load_init(model, pretrained["out"])
    assert lineage["pos_embed_grid"] == [4, 8] and lineage["resolution"] == 16
    assert lineage["dropped"] == ["pre_logits", "head"] and lineage["loaded"] == ["backbone"]
    assert lineage["step"] == 20 and "pretrain_run_id" in lineage
    sd = pretrained["consolidated"].state_dict
    assert torch.equal(model.backbone.blocks[1].mlp.fc2.weight,
                       sd["backbone.blocks.1.mlp.fc2.weight"])
    assert torch.equal(model.backbone.pos_embed[:, :1], sd["backbone.pos_embed"][:, :1])
    with torch.no_grad():
        logits = model(fixed_input(32))
        assert model.forward_features(fixed_input(32)).abs().sum() > 0
    assert logits.shape == (3, 5) and torch.count_nonzero(logits) == 0

    # Same result through the other route: load the pretrained model whole, then swap the head.
    whole = fresh(cfg.model)
    load_init(whole, pretrained["full"], with_head=True)
    whole.swap_head(5)
    assert isinstance(whole.pre_logits, torch.nn.Identity)
    with torch.no_grad():
        assert torch.count_nonzero(whole(fixed_input(16))) == 0


# --------------------------------------------------------------------------------------------
# Files that do not fit, or that must not be unpickled
# --------------------------------------------------------------------------------------------
def test_a_checkpoint_of_another_architecture_fails_with_one_line_listing_tensors(pretrained,
                                                                                  npz_files,
                                                                                  tmp_path):
    model = fresh(pretrained["cfg"].model, embed_dim=128, depth=3)
    with pytest.raises(InitError) as e:
        load_init(model, pretrained["full"])
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"init '{pretrained['full']}' (width 64, depth 2, patch 4, 2 heads) "
                          f"does not match model "
                          f"vit_tiny_patch16_224 (width 128, depth 3, patch 4, 2 heads, 16px): "
                          f"cls_token [1, 1, 64] vs [1, 1, 128], pos_embed [1, 17, 64] vs "
                          f"[1, 17, 128], ")
    assert msg.endswith("(+37 more)")  # 43 backbone tensors differ or are missing; 6 shown
    narrower = fresh(pretrained["cfg"].model, depth=1)
    with pytest.raises(InitError, match=r"\(width 64, depth 2, patch 4, 2 heads\) does not match "
                       r"model vit_tiny_patch16_224 \(width 64, depth 1, .*: "
                       r"blocks\.1\.attn\.proj\.bias \[64\] not in the model, .* \(\+6 more\)$"):
        load_init(narrower, pretrained["timm"])

    # a fine-tune's --dry-run reads the init and says the same, before any data or model
    def dry_run(*model):
        return run_launcher("finetune.py", "--config", "configs/finetune/demo.yaml", "--dry-run",
                            f"init={pretrained['timm']}", "model.img_size=24", *model)
    refused = dry_run("model.embed_dim=64", "model.depth=1", "model.num_heads=2")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1].startswith(
        f"error: init '{pretrained['timm']}' (width 64, depth 2, patch 4, 2 heads) does not match "
        f"model vit_tiny_patch16_224 (width 64, depth 1, patch 4, 2 heads, 24px): "
        f"blocks.1.attn.proj.bias [64] not in the model"), refused.stderr[-2000:]
    fits = dry_run("model.embed_dim=64", "model.depth=2", "model.num_heads=2")
    assert fits.returncode == 0, fits.stderr[-2000:]
    # other heads, every shape the same: the pretrained attention would be cut up wrongly
    # without a word (it loaded, and the fine-tune trained on scrambled heads)
    from pretrain.timm_folder import write_timm_folder
    folder = write_timm_folder(pretrained["consolidated"], tmp_path / "timm-folder")
    for init in (pretrained["full"], pretrained["timm"], folder, *npz_files.values()):
        with pytest.raises(InitError, match=r"^init '.*' \(width 64, depth 2, patch 4, 2 heads\) "
                           r"does not match model vit_tiny_patch16_224 \(width 64, depth 2, "
                           r"patch 4, 4 heads, 16px\): 2 attention heads vs 4 \(set "
                           r"model.num_heads=2\)$"):
            load_init(fresh(pretrained["cfg"].model, num_heads=4), init)
    refused = dry_run("model.embed_dim=64", "model.depth=2", "model.num_heads=4")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].endswith(
        "2 attention heads vs 4 (set model.num_heads=2)"), refused.stderr[-2000:]


def test_a_fine_tune_files_step_and_run_come_from_its_model_card_and_a_npy_is_named(
        pretrained, tmp_path):
    from safetensors.torch import save_file

    from finetune.weights import read_init
    model = fresh(pretrained["cfg"].model)
    path = tmp_path / "final.safetensors"  # as a fine-tune writes it: the card holds the step
    save_file(model.state_dict(), str(path),
              metadata={"model_card": json.dumps({"step": 700, "tracking_run_id": "r1"})})
    src = read_init(path)
    assert (src.step, src.pretrain_run_id) == (700, "r1")
    np.save(tmp_path / "one.npy", np.zeros(3))
    (tmp_path / "one.npy").rename(tmp_path / "one.npz")
    with pytest.raises(InitError, match=r"holds one array \(a .npy file\), not the .npz archive"):
        read_init(tmp_path / "one.npz")


@pytest.mark.faults
def test_untrusted_files_are_never_unpickled(pretrained, tmp_path, fault_ledger):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    bad = tmp_path / "bad.pth"
    torch.save({"pos_embed": torch.zeros(1), "x": Evil()}, bad)
    with pytest.raises(InitError) as refused:
        load_init(fresh(pretrained["cfg"].model), bad)
    # named in our words: torch's own text ends in advice to load it unsafely, in ANSI bold
    assert str(refused.value) == (
        f"init '{bad}' references Python objects (posix.system), which are never unpickled "
        f"here; save its state_dict of tensors (safetensors or torch.save) and start from that")
    # one file of a DeepSpeed checkpoint: its folder is what to give
    [shard, *_] = sorted((pretrained["out"] / "checkpoints/step_00000020").glob(
        "*_model_states.pt"))
    with pytest.raises(InitError, match=f"is one file of a DeepSpeed checkpoint; give its folder: "
                                        f"init={shard.parent}$"):
        load_init(fresh(pretrained["cfg"].model), shard)
    # A DeepSpeed checkpoint dir with one tampered shard: DeepSpeed's loader would unpickle it
    # with weights_only=False, so it is screened first.
    ckpt = tmp_path / "step_copy"
    shutil.copytree(pretrained["out"] / "checkpoints/step_00000020", ckpt)
    (ckpt / "COMPLETE.json").unlink()
    torch.save({"optimizer_state_dict": Evil()}, ckpt / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        consolidate(ckpt)
    with pytest.raises(InitError, match="refusing to unpickle"):
        load_init(fresh(pretrained["cfg"].model), ckpt)
    assert not marker.exists()
    fault_ledger.record(2, 0)

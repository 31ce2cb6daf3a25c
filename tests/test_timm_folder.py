"""Model folders in timm's own layout: ``timm.create_model("local-dir:DIR", pretrained=True)``
with no other argument rebuilds our model, and timm's data config is the run's eval transform."""
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import REPO
from pretrain.config import ModelConfig
from pretrain.checkpoint import CheckpointError
from pretrain.export import from_model
from pretrain.model import create_model
from pretrain.timm_folder import data_config, load_timm_folder, write_timm_folder

ARCH = dict(name="vit_tiny_patch16_224", img_size=32, patch_size=4, depth=2, embed_dim=64,
            num_heads=2, num_classes=8)
CLASSES = [f"n{i:08d}" for i in range(8)]


def random_model(**overrides):
    torch.manual_seed(0)
    model = create_model(ModelConfig(**{**ARCH, **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():  # non-zero everywhere: a zero head would hide a bad load
            p.normal_(0, 0.05)
    return model


def dataset_root(tmp_path) -> Path:
    from pretrain.data.info import DatasetInfo, write_info
    root = tmp_path / "shards"
    root.mkdir()
    write_info(root, DatasetInfo(name="tiny", splits={}, classes=CLASSES))
    return root


def card_metadata(folder: Path) -> dict:
    text = (folder / "README.md").read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_backbone_folder_loads_in_timm_with_no_arguments(tmp_path):
    from safetensors.torch import load_file
    import timm

    model = random_model(representation_size=64)  # pre-logits: timm's ViT has no place for them
    folder = write_timm_folder(from_model(model, source="run/step_4", step=4), tmp_path / "bb",
                               normalize="minus_one_one", dataset=str(dataset_root(tmp_path)))
    vit = load_timm_folder(folder)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(vit(x), model.forward_features(x))
    assert set(load_file(folder / "model.safetensors")) == set(vit.state_dict())
    assert vit.num_classes == 0
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architecture"] == "vit_tiny_patch16_224" and cfg["num_classes"] == 0
    assert "label_names" not in cfg["pretrained_cfg"]  # no head: labels would mean nothing
    data = timm.data.resolve_model_data_config(vit)
    assert data["input_size"] == (3, 32, 32) and data["crop_pct"] == 0.875
    assert list(data["mean"]) == [0.5] * 3 and list(data["std"]) == [0.5] * 3
    meta = card_metadata(folder)
    assert meta["library_name"] == "timm" and meta["datasets"] == ["tiny"]
    assert meta["vitscale"]["source"] == {"checkpoint": "run/step_4", "step": 4}
    # given to evaluate.py (a fine-tune that kept its pre-logits writes final/ so): the whole
    # model beside it is named
    from pretrain.model_files import ModelFileError, load_model
    (tmp_path / "bb.safetensors").write_bytes(b"")
    with pytest.raises(ModelFileError, match=rf"is a backbone without a classifier head "
                                             rf"\(num_classes=0\), nothing to take top-1 of; "
                                             rf"evaluate {tmp_path}/bb.safetensors, beside it$"):
        load_model(folder)


def test_a_head_behind_pre_logits_is_refused_in_one_line(tmp_path):
    with pytest.raises(CheckpointError, match="pre-logits") as e:
        write_timm_folder(from_model(random_model(representation_size=64)), tmp_path / "x",
                          head=True)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("mode", ["minus_one_one", "imagenet"])
def test_timms_eval_transform_is_the_runs(mode):
    """Our eval transform is timm's, up to one level of uint8 rounding here and there."""
    import timm
    from PIL import Image
    from pretrain.data.device_batch import normalize
    from pretrain.data.transforms import EvalTransform

    yy, xx = np.mgrid[0:48, 0:64]
    pixels = np.stack([128 + 100 * np.sin(xx / 10.7), 128 + 100 * np.cos(yy / 9.6),
                       128 + 80 * np.sin((xx + yy) / 16.0)], -1).astype(np.uint8)
    img = Image.fromarray(pixels)
    png = io.BytesIO()
    img.save(png, format="PNG")
    ours = normalize(EvalTransform(32)(png.getvalue()).unsqueeze(0), mode)[0]

    def gap(crop_pct):
        theirs = timm.data.create_transform(**data_config(32, mode, crop_pct))(img)
        assert theirs.shape == ours.shape
        std = torch.tensor(data_config(32, mode)["std"]).view(3, 1, 1)
        return ((ours - theirs) * std).abs()  # in [0, 1] pixel units

    d = gap(0.875)
    assert d.mean() < 0.001 and d.max() <= 1.01 / 255, (d.mean(), d.max())  # rounding only
    assert gap(1.0).mean() > 4 * d.mean()  # the tolerance would catch a wrong crop


@pytest.mark.parametrize("decoder", ["PilDecoder", "SimpleJpegDecoder"])
def test_timms_eval_transform_is_the_runs_on_large_photos_too(decoder):
    """JPEGs at least twice the eval resize: a decode at reduced DCT scale (what training's
    crops use) gave up to 10/255 other pixels than timm's full PIL decode, and moved
    predictions; the eval transform decodes at full scale."""
    import timm
    from PIL import Image
    from pretrain.data import transforms
    from pretrain.data.device_batch import normalize
    from pretrain.data.synthetic import sample_photos

    for size, photo in ((224, (1200, 900)), (32, (600, 520))):
        for data in sample_photos(2, size=photo, seed=2):
            ours = normalize(transforms.EvalTransform(
                size, decoder=getattr(transforms, decoder)())(data).unsqueeze(0), "imagenet")[0]
            theirs = timm.data.create_transform(**data_config(size, "imagenet", 0.875))(
                Image.open(io.BytesIO(data)).convert("RGB"))
            std = torch.tensor(data_config(size, "imagenet")["std"]).view(3, 1, 1)
            d = ((ours - theirs) * std).abs()
            assert d.mean() < 0.0001 and d.max() <= 1.01 / 255, (size, d.mean(), d.max() * 255)


def deepspeed_checkpoint(tmp_path, model, normalize: str) -> Path:
    """``model`` as a stage-0 DeepSpeed checkpoint at step 4 (DeepSpeed's own ``latest``
    layout), written by hand, with the run config a pretraining keeps in it."""
    config = {"model": dict(ARCH, representation_size=model.spec.representation_size),
              "data": {"normalize": normalize, "root": str(dataset_root(tmp_path))}}
    ckpt = tmp_path / "ds"
    (ckpt / "global_step4").mkdir(parents=True)
    (ckpt / "latest").write_text("global_step4")
    torch.save({"module": model.state_dict(), "config": yaml.safe_dump(config), "step": 4},
               ckpt / "global_step4" / "mp_rank_00_model_states.pt")
    return ckpt


def test_a_pretraining_without_pre_logits_exports_its_head_into_the_folder(tmp_path):
    """Nothing stands between its head and the backbone: the folder held the backbone alone
    all the same (num_classes 0), which evaluate.py then refused."""
    import timm
    model = random_model(representation_size=None)
    ckpt = deepspeed_checkpoint(tmp_path, model, "minus_one_one")
    folder = tmp_path / "timm_out"
    proc = subprocess.run([sys.executable, str(REPO / "launch/export.py"), str(ckpt), "--out",
                           str(folder)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"wrote {folder}/ (timm layout, with its head)" in proc.stdout, proc.stdout
    vit = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    assert vit.pretrained_cfg["label_names"] == CLASSES
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(vit(x), model(x), atol=1e-6)


def test_a_run_launched_with_relative_paths_exports_its_class_names_from_anywhere(
        tmp_path, monkeypatch):
    """``output_dir=runs/x data.root=runs/data``: an export made from another folder than the
    launch folder found no dataset there, and the folder lost its label names."""
    launched = tmp_path / "project"
    (launched / "runs").mkdir(parents=True)
    root = dataset_root(launched / "runs")  # runs/shards
    step = launched / "runs" / "x" / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    config = yaml.safe_dump({"output_dir": "runs/x", "model": ARCH,
                             "data": {"root": str(root.relative_to(launched))}})
    monkeypatch.chdir(tmp_path)
    folder = write_timm_folder(from_model(random_model(representation_size=None),
                                          source=str(step), config_yaml=config),
                               tmp_path / "out", head=True)
    assert json.loads((folder / "config.json").read_text())["pretrained_cfg"][
        "label_names"] == CLASSES


def test_the_export_cli_writes_a_folder_from_a_checkpoint(tmp_path, caplog):
    """A stage-0 DeepSpeed checkpoint (DeepSpeed's own ``latest`` layout) written by hand."""
    model = random_model(representation_size=64)
    ckpt = deepspeed_checkpoint(tmp_path, model, "imagenet")
    folder = tmp_path / "timm_out"
    proc = subprocess.run([sys.executable, str(REPO / "launch/export.py"), str(ckpt), "--out",
                           str(folder), "--timm-backbone", str(tmp_path / "bb.safetensors")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"local-dir:{folder}" in proc.stdout and (tmp_path / "bb.safetensors").is_file()
    vit = load_timm_folder(folder)
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(vit(x), model.forward_features(x))
    assert tuple(vit.pretrained_cfg["mean"]) == (0.485, 0.456, 0.406)  # the run's data.normalize
    # the backbone file, loaded with the very call export.py prints: the same weights and the
    # same eval transform (timm's config of the name alone says 224 px, bicubic, crop 0.9)
    import timm
    call = re.search(r"^wrote .*bb\.safetensors; load it with (timm\.create_model\(.*\))$",
                     proc.stdout, re.M).group(1)
    from_file = eval(call, {"timm": timm}).eval()
    with torch.no_grad():
        assert torch.equal(from_file(x), model.forward_features(x))
    resolved = timm.data.resolve_model_data_config(from_file)
    assert resolved["input_size"] == (3, 32, 32) and resolved["interpolation"] == "bilinear"
    assert {k: tuple(v) if isinstance(v, list) else v for k, v in resolved.items()} == {
        k: tuple(v) if isinstance(v, list) else v
        for k, v in timm.data.resolve_model_data_config(vit).items()}
    # the folder is a fine-tune's init as it is: its backbone in, a new head
    from finetune.weights import InitError, load_init
    tuned = create_model(ModelConfig(**{**ARCH, "num_classes": 3})).eval()
    assert load_init(tuned, folder)["format"]
    with torch.no_grad():
        assert torch.equal(tuned.forward_features(x), model.forward_features(x))
    # a fine-tune that keeps a pre-logits layer the folder does not have: said at the start
    import logging

    from finetune.config import FinetuneConfig
    from finetune.stage import FinetuneStage
    from pretrain.config_files import load_config
    cfg = load_config(FinetuneConfig, None, [f"init={folder}", "model.representation_size=64",
                                             "data.normalize=imagenet",  # the folder's run's
                                             *(f"model.{k}={v}" for k, v in ARCH.items())])
    with caplog.at_level(logging.WARNING, logger="finetune"):
        FinetuneStage(cfg).init_weights(create_model(cfg.model))
    assert f"init '{folder}' has no pre-logits layer: model.representation_size=64 starts it " \
        f"from random weights" in caplog.text
    (tmp_path / "ft").mkdir()
    (tmp_path / "ft" / "final.safetensors").write_bytes(b"")
    with pytest.raises(InitError, match=r"is a fine-tune's output folder; start from one of its "
                                        r"files: init=.*final.safetensors"):
        load_init(tuned, tmp_path / "ft")
    # a folder that holds no checkpoint (a folder of images, say): refused by --dry-run too
    from finetune.weights import check_init
    (tmp_path / "photos" / "cat").mkdir(parents=True)
    with pytest.raises(InitError, match=r"holds no checkpoint: expected a pretraining output dir"):
        check_init(tmp_path / "photos")
    meta = card_metadata(folder)
    assert meta["datasets"] == ["tiny"] and meta["vitscale"]["source"]["step"] == 4

"""The fine-tune's best model as an MLflow model of its run, registered with
``tracking.register_as``: ``mlflow.pyfunc.load_model("models:/NAME/1").predict(images)`` gives
the classes (and scores) the project's own model gives, and loading it unpickles nothing."""
import io
import json
import os
import pickle
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import yaml

from conftest import REPO, sqlite_store


def raw_test_images(cifar_shards, n=64):
    """The generated CIFAR test images as the user has them: uint8 (N, 32, 32, 3), labels."""
    # our own generated file, written by the test fixture (not untrusted input)
    with open(cifar_shards.parent / "raw/cifar-10-batches-py/test_batch", "rb") as f:
        batch = pickle.load(f)
    images = np.asarray(batch["data"][:n], np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(images), list(batch["labels"][:n])


def project_logits(model, images, img_size, mode):
    """``model`` (in eval mode) behind our eval transform (the loader's), on the same pixels
    (PNG: lossless)."""
    from PIL import Image

    from pretrain.data.device_batch import normalize
    from pretrain.data.transforms import EvalTransform

    transform = EvalTransform(img_size)

    def png(a):
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, format="PNG")
        return buf.getvalue()
    x = torch.stack([transform(png(a)) for a in images])
    with torch.no_grad():
        return model(normalize(x, mode))


def test_the_finetunes_best_model_is_registered_and_predicts_the_projects_classes(
        tmp_path, tiny_cifar, monkeypatch):
    import mlflow
    from mlflow import MlflowClient
    from safetensors.torch import load_file

    from finetune.config import FinetuneConfig
    from finetune.stage import finetune
    from pretrain.config_files import load_config
    from pretrain.model import create_model
    from test_finetune import finetune_args

    uri = sqlite_store(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    out = tmp_path / "ft"
    cfg = load_config(FinetuneConfig, REPO / "configs/finetune/demo.yaml", [
        *finetune_args(out, tiny_cifar, "null"), "data.num_workers=0", "train.total_steps=8",
        "eval.every_steps=4", "tracking.system_metrics=false", "tracking.flush_every_s=0.1",
        "tracking.register_as=tiny-cifar"])
    finetune(cfg)

    client = MlflowClient(uri)
    run = client.search_runs([client.get_experiment_by_name("vitscale").experiment_id])[0]
    assert run.info.status == "FINISHED"
    (version,) = client.search_model_versions("name = 'tiny-cifar'")
    assert int(version.version) == 1 and version.run_id == run.info.run_id
    model = assert_logged_model(client, run.info.run_id, "tiny-cifar")
    assert version.source == model.artifact_location  # (a store the client opens itself)
    # which weights: their step and figures, on the version and the run
    best = json.loads((out / "best.json").read_text())
    assert version.tags == {"export": "best", "step": str(best["step"]),
                            **{k: f"{v:.6g}" for k, v in best["metrics"].items()}}
    assert "eval/dev/top1" in version.tags
    assert (run.data.tags["model.export"], run.data.tags["model.step"]) == (
        "best", str(best["step"]))
    assert version.description.startswith("best: the weights ")
    # best before the last step: the run's test figures are not this model's, and it says so
    from finetune.stage import FinetuneStage
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "best.json").write_text(json.dumps({**best, "step": 4}))
    about, text = FinetuneStage(cfg)._about(earlier, "best", 8, {"eval/test/top1": 0.5})
    assert about["step"] == 4 and text == (
        f"best: the weights at step 4 of 8, with the highest eval/dev/top1 "
        f"({best['metrics']['eval/dev/top1']:.4f}); the run's eval/test/top1 are of its final "
        f"weights (step 8); `python launch/evaluate.py {earlier / 'best'} --data {tiny_cifar} "
        f"--split test` gives this model's")
    # a model from code: the package holds the code file and safetensors, no pickle at all
    pkg = mlflow.artifacts.download_artifacts(f"runs:/{run.info.run_id}/model",
                                              dst_path=str(tmp_path / "pkg"))
    files = [f for f in Path(pkg).rglob("*") if f.is_file()]
    names = {f.name for f in files}
    assert {"MLmodel", "pyfunc_model.py", "model.safetensors", "config.json"} <= names
    assert not [f for f in files if f.suffix in (".pkl", ".pickle", ".pt", ".bin")]

    images, _ = raw_test_images(tiny_cifar)
    pred = mlflow.pyfunc.load_model("models:/tiny-cifar/1").predict(images)
    assert list(pred.columns) == ["class", "label", "score"] and len(pred) == len(images)

    model = create_model(cfg.model).eval()  # the project's own model, same best weights
    model.load_state_dict(load_file(str(out / "best.safetensors")))
    logits = project_logits(model, images, cfg.model.img_size, cfg.data.normalize)
    probs = logits.softmax(-1)
    assert pred["class"].tolist() == logits.argmax(-1).tolist()
    assert pred["score"].to_numpy() == pytest.approx(probs.max(-1).values.numpy(), abs=1e-4)
    classes = [f"class{c:03d}" for c in range(10)]  # the dataset's names, from its meta file
    assert pred["label"].tolist() == [classes[c] for c in pred["class"]]


def assert_logged_model(client, run_id: str, registered_as: str):
    """The run's model is an MLflow 3 logged model (the Models tab, the run's "Logged
    models"): READY, the run's output at its step, which weights they are in its tags, the
    run's params, and its registered version named on it. Returns it."""
    from mlflow.entities import LoggedModelStatus
    run = client.get_run(run_id)
    (model,) = client.search_logged_models([run.info.experiment_id],
                                           filter_string="name = 'model'")
    assert model.source_run_id == run_id and model.status == LoggedModelStatus.READY
    assert [(o.model_id, o.step) for o in run.outputs.model_outputs] == [
        (model.model_id, int(model.tags.get("step", 0)))]
    assert model.tags.get("export") == run.data.tags.get("model.export")
    assert model.params == run.data.params
    assert json.loads(model.tags["mlflow.modelVersions"]) == [
        {"name": registered_as, "version": 1}]
    assert "MLmodel" in {a.path for a in client.list_logged_model_artifacts(model.model_id)}
    return model


def assert_backbone_registered(uri: str, name: str, run_id: str, output_dir, tmp_path) -> None:
    """A pretraining run with ``tracking.register_as=NAME``: version 1 of NAME is its backbone,
    whose features are the project's model's on the same images (called by the tracking test's
    2-rank run, which has an MLflow outage in the middle: the registration waits it out)."""
    import mlflow
    from mlflow import MlflowClient

    from pretrain.config import PretrainConfig
    from pretrain.consolidate import consolidate
    from pretrain.model import create_model

    client = MlflowClient(uri)
    (version,) = client.search_model_versions(f"name = '{name}'")
    model = assert_logged_model(client, run_id, name)
    assert version.run_id == run_id and version.source == f"models:/{model.model_id}"
    images = np.random.default_rng(0).integers(0, 256, (6, 40, 52, 3), dtype=np.uint8)
    # the store for models:/ URIs, for this call only (mlflow.set_tracking_uri would outlive it)
    with mock.patch.dict(os.environ, {"MLFLOW_TRACKING_URI": uri}):
        features = mlflow.pyfunc.load_model(f"models:/{name}/1").predict(images)

    c = consolidate(output_dir)  # the newest checkpoint: the last step's weights
    cfg = PretrainConfig.model_validate(yaml.safe_load(c.config_yaml))
    model = create_model(cfg.model).eval()
    model.load_state_dict(c.state_dict)
    ours = project_logits(model.forward_features, images, c.spec.img_size, cfg.data.normalize)
    assert features.shape == (6, c.spec.embed_dim)
    # timm's pipeline (PIL) and ours (torch) round a few uint8 pixels differently
    np.testing.assert_allclose(features, ours.numpy(), atol=2e-2)

"""``launch/evaluate.py`` on a real fine-tune (tracked to a sqlite MLflow store): each kind of
MODEL gives the figure the run reported, the files and the MLflow evaluation run are there, and
timm's own pipeline on the exported folder agrees."""
import csv
import io
import json
import logging
import re
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO, free_port, run_launcher, sqlite_store
from pretrain.metrics import read_jsonl


@pytest.fixture(scope="module")
def ft(tmp_path_factory, tiny_cifar):
    """One short fine-tune from scratch with an EMA of the weights, tracked to its own store."""
    base = tmp_path_factory.mktemp("evalcmd")
    uri = sqlite_store(base)
    out = base / "ft"
    proc = run_launcher(
        "finetune.py", "--config", str(REPO / "configs/finetune/demo.yaml"), f"output_dir={out}",
        f"data.root={tiny_cifar}", "init=null", "data.generate_demo=false",
        "data.num_workers=1", "data.shuffle_buffer=50", "data.dev_fraction=0.1",
        "model.img_size=28", "model.patch_size=4", "model.depth=2", "model.embed_dim=64",
        "model.num_heads=2", "model.num_classes=10", "train.global_batch_size=32",
        "train.total_steps=24", "optimizer.lr=0.03", "train.ema_decay=0.8",
        "eval.every_steps=12", "log.every_steps=12", "tracking.system_metrics=false",
        "tracking.log_model=false", env={"MLFLOW_TRACKING_URI": uri}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    final = [r for r in read_jsonl(out / "metrics.jsonl") if "eval/test/top1" in r][-1]
    run_id = json.loads((out / "tracking/run.json").read_text())["run_id"]
    return SimpleNamespace(out=out, data=tiny_cifar, uri=uri, top1=final["eval/test/top1"],
                           step=final["step"], run_id=run_id, base=base)


def test_best_is_the_evaluation_with_the_highest_dev_top1(ft):
    evals = [r for r in read_jsonl(ft.out / "metrics.jsonl") if "eval/dev/top1" in r]
    assert [r["step"] for r in evals] == [12, 24]
    top = max(evals, key=lambda r: r["eval/dev/top1"])  # the first of equals: a tie keeps it
    card = json.loads((ft.out / "best.json").read_text())
    assert card["step"] == top["step"]
    assert card["metrics"]["eval/dev/top1"] == top["eval/dev/top1"]
    final = json.loads((ft.out / "final.json").read_text())
    assert final["step"] == 24


def test_a_tracking_uri_mlflow_cannot_use_is_refused_before_the_evaluation(ft):
    """As at a training run's start: found after the evaluation, it was a warning in MLflow's
    own words cut short, and upload_spool.py then failed on the same URI."""
    out = ft.base / "eval-bad-uri"
    proc = run_launcher("evaluate.py", str(ft.out / "final"), "--data", str(ft.data),
                        "--split", "test", "--out", str(out), "--tracking-uri", "127.0.0.1:5001")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: --tracking-uri=127.0.0.1:5001 is read as a file store path; for a tracking "
        "server write --tracking-uri=http://127.0.0.1:5001")
    assert not out.exists() and "top-1" not in proc.stdout


def test_the_folder_gives_the_runs_figure_files_and_an_mlflow_run_under_it(ft):
    from mlflow import MlflowClient

    out = ft.base / "eval-final"
    proc = run_launcher("evaluate.py", str(ft.out / "final"), "--data", str(ft.data),
                        "--split", "test", "--out", str(out), "--tracking-uri", ft.uri)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["kind"] == "timm folder" and metrics["samples"] == 200
    assert metrics["top1"] == pytest.approx(ft.top1, abs=1e-9)
    lines = proc.stdout.splitlines()
    assert any(line.startswith("top-1") and f"{100 * ft.top1:.2f} %" in line for line in lines)
    assert any(line.startswith("top-5") for line in lines)
    assert "per-class top-1 (10 classes):" in proc.stdout
    assert "class003" in proc.stdout  # the dataset's names, from the folder's label_names
    assert "eval/test/top1" in proc.stdout and ": the same" in proc.stdout
    assert not [line for line in proc.stderr.splitlines() if "warning" in line.lower()], \
        proc.stderr

    # the confusion matrix: rows are the per-class counts, the diagonal the per-class hits
    per_class = json.loads((out / "per_class_top1.json").read_text())
    rows = list(csv.reader(io.StringIO((out / "confusion_matrix.csv").read_text())))
    assert rows[0][1:] == [f"class{c:03d}" for c in range(10)]
    counts = [[int(v) for v in r[1:]] for r in rows[1:]]
    for c, (row, info) in enumerate(zip(counts, metrics["per_class"])):
        assert sum(row) == info["samples"] and row[c] == info["correct"]
        assert per_class[str(c)] == (row[c] / sum(row) if sum(row) else None)
    assert sum(map(sum, counts)) == 200
    assert sum(counts[c][c] for c in range(10)) / 200 == pytest.approx(ft.top1, abs=1e-9)
    assert (out / "confusion_matrix.png").read_bytes()[:4] == b"\x89PNG"

    # MLflow: an evaluation run nested under the fine-tune, in its experiment
    client = MlflowClient(ft.uri)
    source = client.get_run(ft.run_id)
    evals = client.search_runs([source.info.experiment_id], "tags.stage = 'evaluate'")
    assert len(evals) == 1
    run = evals[0]
    assert run.data.tags["mlflow.parentRunId"] == ft.run_id
    assert run.data.tags["eval.source_run_id"] == ft.run_id
    assert run.data.tags["model"] == "vit_tiny_patch16_224"
    assert run.data.metrics["eval/test/top1"] == pytest.approx(ft.top1, abs=1e-9)
    assert run.data.metrics["eval/test/top1"] == source.data.metrics["eval/test/top1"]
    assert run.data.params["data.split"] == "test" and run.data.params["eval.samples"] == "200"
    assert run.info.status == "FINISHED"
    assert {"confusion_matrix.png", "metrics.json", "per_class_top1.json",
            "confusion_matrix.csv"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    assert run.info.run_id in proc.stdout


def test_the_safetensors_file_and_the_checkpoint_give_the_same_figure(ft):
    from safetensors.torch import load_file

    from pretrain import evaluate_model, model_files

    for path, kind in ((ft.out / "final.safetensors", "safetensors file (fine-tune)"),
                       (ft.out, "fine-tune checkpoint (EMA weights)")):
        mf = model_files.load_model(path)
        assert mf.kind == kind and mf.step == ft.step and mf.source_run_id == ft.run_id
        ev = evaluate_model.evaluate(mf, str(ft.data), "test", workers=0)
        assert ev.top1 == pytest.approx(ft.top1, abs=1e-9), (path, ev.top1, ft.top1)
        assert ev.reported["value"] == ft.top1
    # the checkpoint was read as the EMA: the weights the run evaluated and exported
    final = load_file(str(ft.out / "final.safetensors"))
    assert all(torch.equal(final[k], v) for k, v in mf.model.state_dict().items())
    trained = load_file(str(mf.path / "model.safetensors"))  # the raw weights differ
    assert not torch.equal(trained["head.weight"], final["head.weight"])


def test_a_run_launched_with_relative_paths_is_matched_from_any_folder(ft, tmp_path,
                                                                        monkeypatch):
    """`output_dir=runs/x data.root=runs/data` (the demo's way): the run's figure and the
    training-split note came only when evaluate.py ran from the folder the run was launched
    in; from runs/ or with absolute paths they went missing without a word."""
    import os

    from pretrain import evaluate_model, model_files

    mf = model_files.load_model(ft.out)
    mf.run_config["output_dir"] = ft.out.name  # as launched from ft.out's parent
    mf.run_config["data"]["root"] = os.path.relpath(ft.data, ft.out.parent)
    monkeypatch.chdir(tmp_path)
    assert mf.trained_on == os.path.normpath(str(ft.out.parent / mf.run_config["data"]["root"]))
    ev = evaluate_model.evaluate(mf, str(ft.data), "test", workers=0)
    assert ev.reported["value"] == ft.top1
    ev = evaluate_model.evaluate(mf, str(ft.data), "train", workers=0)
    assert any("its figure there is a training accuracy" in n for n in ev.notes), ev.notes
    # the name its figures go to MLflow under: the run's own for its held-out split (a
    # pretraining's eval/i21k_val/top1 was eval/validation/top1 in its evaluations: two charts),
    # at a step the run did not evaluate too; a val_name the run did not log under (older
    # fine-tunes saved an unused one) is not taken
    mf.run_config.setdefault("eval", {})["val_name"] = "i21k_val"
    mf.step = 5
    ev = evaluate_model.evaluate(mf, str(ft.data), "test", workers=0)
    assert ev.reported is None and ev.figure_name == "test"
    records = read_jsonl(ft.out / "metrics.jsonl")
    with open(ft.out / "metrics.jsonl", "a") as f:  # as a run naming it cifar_test logs it
        f.write(json.dumps({"step": 24, "eval/cifar_test/top1": 0.5}) + "\n")
    try:
        mf.run_config["eval"]["val_name"] = "cifar_test"
        ev = evaluate_model.evaluate(mf, str(ft.data), "test", workers=0)
        assert ev.figure_name == "cifar_test"
        ev = evaluate_model.evaluate(mf, str(ev.mf.trained_on), "train", workers=0)
        assert ev.figure_name == "train"  # not its held-out split
    finally:
        (ft.out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    mf.step = ft.step
    # a run dir that does not end in its output_dir (moved since): taken from here, as before
    mf.run_config["output_dir"] = "elsewhere/ft"
    assert mf.trained_on == mf.run_config["data"]["root"]
    # ... and from here too where the launch folder's guess is another (a symlinked runs/)
    mf.run_config["output_dir"] = ft.out.name
    monkeypatch.chdir(ft.out.parent)
    mf.run_dir = tmp_path / "mnt" / "x" / ft.out.name  # as reached through another path
    assert mf.trained_on != os.path.normpath(str(ft.data)) and mf.trained_on_data(str(ft.data))


def test_a_checkpoint_evaluated_on_another_dataset_of_as_many_classes_gets_a_warning(
        ft, tmp_path):
    """A checkpoint keeps no class names: evaluated on another 10-class dataset, its figure
    came with no word that the labels may mean other classes. The names of the dataset its
    run trained on (still here) are compared now."""
    import shutil

    from pretrain import evaluate_model, model_files

    mf = model_files.load_model(ft.out)
    assert evaluate_model.evaluate(mf, str(ft.data), "test", workers=0).notes == []
    other = tmp_path / "other"
    shutil.copytree(ft.data, other)
    info = json.loads((other / "_info.json").read_text())
    info["classes"] = [f"kind{i}" for i in range(len(info["classes"]))]
    (other / "_info.json").write_text(json.dumps(info))
    ev = evaluate_model.evaluate(mf, str(other), "test", workers=0)
    assert ev.warnings == [
        f"the model's label names differ from {other}'s classes (class 0: "
        f"'{json.loads((ft.data / '_info.json').read_text())['classes'][0]}' vs 'kind0'); is it "
        f"the same dataset?"], ev.warnings
    # said with the figures (a note before the report scrolled away above the per-class rows)
    from pretrain import evaluation_report
    lines = evaluation_report.report_lines(ev, tmp_path / "out", [])
    assert lines[4] == f"        warning: {ev.warnings[0]}", lines[:6]


def test_export_writes_a_fine_tunes_checkpoint_as_the_fine_tune_exports_it(ft, tmp_path):
    """launch/export.py of one of a fine-tune's checkpoints (it refused them before): the
    weights the run exported for that step (the EMA's), its head, its eval preprocessing."""
    import timm
    from safetensors.torch import load_file

    step = ft.out / f"checkpoints/step_{ft.step:08d}"  # the last: the run's final export's
    proc = run_launcher("export.py", str(step), "--out", str(tmp_path / "ft_timm"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"checkpoint {step} (step {ft.step}, fine-tune checkpoint (EMA weights), tracking " \
           f"run {ft.run_id}; exported in" in proc.stdout, proc.stdout
    assert f"wrote {tmp_path / 'ft_timm'}/ (timm layout, with its head)" in proc.stdout
    ours, run = (json.loads((d / "config.json").read_text())
                 for d in (tmp_path / "ft_timm", ft.out / "final"))
    assert ours == run  # architecture, classes, label names, preprocessing
    exported, final = (load_file(str(d / "model.safetensors"))
                       for d in (tmp_path / "ft_timm", ft.out / "final"))
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[k], final[k]) for k in final)
    vit = timm.create_model(f"local-dir:{tmp_path / 'ft_timm'}", pretrained=True).eval()
    assert vit.num_classes == 10
    proc = run_launcher("export.py", str(step), "--out", str(tmp_path / "ft.safetensors"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    full, run_file = (load_file(str(f)) for f in (tmp_path / "ft.safetensors",
                                                   ft.out / "final.safetensors"))
    assert full.keys() == run_file.keys()
    assert all(torch.equal(full[k], run_file[k]) for k in run_file)
    # its checkpoints/ folder: the newest complete one, as for a pretraining's (it said
    # "export it with launch/export.py", to export.py)
    proc = run_launcher("export.py", str(ft.out / "checkpoints"), "--out",
                        str(tmp_path / "newest.safetensors"))
    assert proc.returncode == 0 and f"checkpoint {step} (step {ft.step}, " in proc.stdout, \
        proc.stderr[-2000:]


def test_exports_copied_out_of_the_run_still_name_the_run_they_came_from(ft, tmp_path):
    """Best and final exports travel (to a model store, another cluster): without the run's
    folder beside them, the files themselves must still say which MLflow run made them."""
    import shutil

    from finetune.weights import read_init
    from pretrain.model_files import load_model

    for name in ("final", "best"):
        card = json.loads((ft.out / f"{name}.json").read_text())
        assert card["tracking_run_id"] == ft.run_id, name
        shutil.copytree(ft.out / name, tmp_path / name)
        shutil.copy(ft.out / f"{name}.safetensors", tmp_path)
    hidden = ft.out.with_name("ft-elsewhere")
    ft.out.rename(hidden)  # the run's folder is out of reach, as on another machine
    try:
        for copied in ("final", "final.safetensors", "best", "best.safetensors"):
            mf = load_model(tmp_path / copied)
            assert mf.run_dir is None and mf.source_run_id == ft.run_id, copied
        # a fine-tune started from the copy records it as its source run
        assert read_init(tmp_path / "best.safetensors").pretrain_run_id == ft.run_id
        # the file alone, without its timm folder: it carries its architecture and config
        (tmp_path / "alone").mkdir()
        shutil.copy(tmp_path / "final.safetensors", tmp_path / "alone")
        alone = load_model(tmp_path / "alone" / "final.safetensors")
        folder = load_model(tmp_path / "final")  # what timm's config.json says of the run
        assert alone.run_dir is None and alone.source_run_id == ft.run_id and not alone.notes
        assert (alone.name, alone.img_size, alone.num_classes, alone.normalize) == (
            folder.name, folder.img_size, folder.num_classes, folder.normalize)
        from pretrain import evaluate_model
        ev = evaluate_model.evaluate(alone, str(ft.data), "test", workers=0)
        assert ev.top1 == pytest.approx(ft.top1, abs=1e-9)
    finally:
        hidden.rename(ft.out)
    # the run's folder where the run wrote it: a copy of the file finds it there, as a copy of
    # the timm folder does, with the figure it reported (and its MLflow store) for evaluate.py
    for copied in ("final", "final.safetensors", "alone/final.safetensors"):
        assert load_model(tmp_path / copied).run_dir == ft.out, copied
    # ... where that folder holds the file's MLflow run: another run there (the run moved
    # aside, a new one of the same recipe started) is not the file's
    state = (ft.out / "tracking/run.json").read_text()
    try:
        (ft.out / "tracking/run.json").write_text(json.dumps({**json.loads(state),
                                                              "run_id": "0" * 32}))
        assert load_model(tmp_path / "alone" / "final.safetensors").run_dir is None
    finally:
        (ft.out / "tracking/run.json").write_text(state)
    ev = evaluate_model.evaluate(load_model(tmp_path / "alone" / "final.safetensors"),
                                 str(ft.data), "test", workers=0)
    assert ev.reported == {"metric": "eval/test/top1", "step": ft.step, "value": ft.top1}


def test_a_file_copied_into_another_runs_folder_is_read_with_its_own_settings(ft, tmp_path):
    """The folder's config.yaml is another run's: with the same architecture but the other
    normalisation it would be evaluated with the wrong inputs, a figure silently off."""
    import shutil

    import yaml

    from pretrain import evaluate_model
    from pretrain.model_files import load_model

    other = tmp_path / "other-run"
    other.mkdir()
    config = yaml.safe_load((ft.out / "config.yaml").read_text())
    theirs = {"minus_one_one": "imagenet", "imagenet": "minus_one_one"}[config["data"]["normalize"]]
    config["data"]["normalize"], config["output_dir"] = theirs, str(other)
    (other / "config.yaml").write_text(yaml.safe_dump(config))
    shutil.copy(ft.out / "final.safetensors", other)
    at_home = load_model(ft.out / "final.safetensors")
    assert at_home.run_dir == ft.out and at_home.source_uri == ft.uri

    mf = load_model(other / "final.safetensors")
    assert mf.normalize == at_home.normalize != theirs
    assert mf.run_dir == ft.out and mf.source_run_id == ft.run_id  # its own run, still there
    ev = evaluate_model.evaluate(mf, str(ft.data), "test", workers=0)
    assert ev.top1 == pytest.approx(ft.top1, abs=1e-9) and ev.reported["value"] == ft.top1

    # the same settings but another MLflow run in that folder: still not the file's run
    config["data"]["normalize"] = at_home.normalize
    (other / "config.yaml").write_text(yaml.safe_dump(config))
    shutil.copytree(ft.out / "tracking", other / "tracking",
                    ignore=shutil.ignore_patterns("lock", "spool*", "artifacts"))
    state = json.loads((other / "tracking/run.json").read_text())
    (other / "tracking/run.json").write_text(json.dumps({**state, "run_id": "0" * 32}))
    assert load_model(other / "final.safetensors").run_dir == ft.out
    (other / "tracking/run.json").write_text(json.dumps(state))  # and with its own run id: its run
    assert load_model(other / "final.safetensors").run_dir == other


def test_an_evaluation_of_a_run_not_yet_in_mlflow_is_nested_once_both_are_uploaded(ft,
                                                                                   tmp_path):
    """The fine-tune ran with the server down (its run.json has no run id, its records are in
    its spool): the evaluation cannot name its parent yet, and must not stay un-nested after
    the documented uploads."""
    import shutil

    from mlflow import MlflowClient

    run = tmp_path / "ft"
    shutil.copytree(ft.out, run, ignore=shutil.ignore_patterns("checkpoints"))
    uri = sqlite_store(tmp_path)  # the server the job never reached
    state = json.loads((run / "tracking/run.json").read_text())
    (run / "tracking/run.json").write_text(json.dumps(
        {**state, "run_id": None, "uri": uri, "params_logged": False, "uploaded": []}))
    (run / "tracking/delivered").unlink()
    for card in ("final.json", "best.json"):  # as such a job writes them: no run id
        data = json.loads((run / card).read_text())
        (run / card).write_text(json.dumps({**data, "tracking_run_id": None}))
    shutil.rmtree(run / "final")  # the folder's README names the run too; evaluate the file
    from safetensors.torch import load_file, save_file

    from pretrain.export import read_metadata
    meta = read_metadata(ft.out / "final.safetensors")
    card = json.loads(meta["model_card"])
    save_file(load_file(str(ft.out / "final.safetensors")), str(run / "final.safetensors"),
              metadata={**meta, "model_card": json.dumps({**card, "tracking_run_id": None})})

    out, other = tmp_path / "eval", tmp_path / "eval-2"
    for folder in (other, out):
        proc = run_launcher("evaluate.py", str(run / "final.safetensors"), "--data",
                            str(ft.data), "--split", "test", "--out", str(folder),
                            "--tracking-uri", uri)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"`python launch/upload_spool.py {run}` sends it, then `python " \
           f"launch/upload_spool.py {out}` nests this one under it" in proc.stderr
    client = MlflowClient(uri)
    eval_id = json.loads((out / "tracking/run.json").read_text())["run_id"]
    assert "mlflow.parentRunId" not in client.get_run(eval_id).data.tags

    for folder in (run, out):
        up = run_launcher("upload_spool.py", str(folder), timeout=120)
        assert up.returncode == 0, up.stderr[-2000:]
    source_id = json.loads((run / "tracking/run.json").read_text())["run_id"]
    evaluation = client.get_run(eval_id)
    assert evaluation.data.tags["mlflow.parentRunId"] == source_id
    assert evaluation.data.tags["eval.source_run_id"] == source_id
    # in the source run's experiment, where the UI shows it under its parent
    assert evaluation.info.experiment_id == client.get_run(source_id).info.experiment_id

    # a new run started in that output_dir since (checkpoint.resume=false): not the parent
    state = json.loads((run / "tracking/run.json").read_text())
    (run / "tracking/run.json").write_text(json.dumps({**state, "start_time": 1}))
    up = run_launcher("upload_spool.py", str(other), timeout=120)
    assert up.returncode == 0, up.stderr[-2000:]
    assert f"not nested: {run} holds another run than the one that made the model" in up.stderr
    other_id = json.loads((other / "tracking/run.json").read_text())["run_id"]
    assert "mlflow.parentRunId" not in client.get_run(other_id).data.tags


@pytest.mark.parametrize("workers", [0, 2])
def test_a_long_split_shows_its_progress_with_a_rate_and_an_eta(ft, caplog, workers):
    """Images done count the split's images only: with 2 workers the loader pads each worker's
    batches to the same number (label -1), which are not images done."""
    from pretrain import evaluate_model, model_files
    from pretrain.config import DataConfig
    from pretrain.data.eval_loader import build_eval_loader

    mf = model_files.load_model(ft.out / "final")
    with caplog.at_level(logging.INFO, logger="pretrain.evaluate_model"):
        ev = evaluate_model.evaluate(mf, str(ft.data), "test", workers=workers, batch_size=16,
                                     progress_every_s=0)  # a line after every batch
    total = ev.samples
    lines = [r.getMessage() for r in caplog.records if r.name == "pretrain.evaluate_model"]
    assert len(lines) > 3 and " images/s, ETA " in lines[0]
    shown = [int(re.match(rf"test: ([\d,]+)/{total:,} images \(", line).group(1).replace(",", ""))
             for line in lines]
    # the real images of the batches scored so far, from the same loader; none once all are
    loader = build_eval_loader(DataConfig(root=str(ft.data), val_split="test",
                                          num_workers=workers), img_size=mf.img_size,
                               batch_size=16, split="test")
    done, expected = 0, []
    for batch in loader:
        done += int((batch.labels >= 0).sum())
        if 0 < done < total:
            expected.append(done)
    assert shown == expected and done == total


def test_timm_builds_the_logits_of_our_model_from_the_folder(ft):
    from pretrain.model_files import load_model

    theirs, ours = load_model(ft.out / "final"), load_model(ft.out / "final.safetensors")
    assert type(theirs.model).__name__ == "VisionTransformer"  # built by timm: local-dir:
    assert (theirs.normalize, theirs.img_size) == (ours.normalize, ours.img_size)
    x = torch.randn(4, 3, 28, 28)
    with torch.no_grad():
        assert torch.equal(theirs.model(x), ours.model(x))


def test_timms_own_eval_pipeline_on_the_folder_gives_the_same_figure(ft):
    """What a timm user does with the folder: its data config's transform on the decoded images
    of the split's shards. At the images' own scale (32 px, 87.5 % crop = the model's 28 px)
    neither pipeline resamples, so not even a near-tie prediction of this barely trained model
    can move; with a resize the pixels may differ in their last bits (at 24 px here, logits by
    up to 1e-3), which on the README's demo (48 px) moved none of 500 predictions."""
    import timm
    from PIL import Image

    from pretrain import evaluate_model
    from pretrain.data.info import read_info
    from pretrain.model_files import load_model
    from pretrain.timm_folder import load_timm_folder

    model = load_timm_folder(ft.out / "final")
    transform = timm.data.create_transform(**timm.data.resolve_model_data_config(model))
    images, labels = [], []
    for name in read_info(ft.data).splits["test"].filenames:
        with tarfile.open(ft.data / name) as tar:
            samples: dict = {}
            for m in tar.getmembers():
                key, ext = m.name.split(".", 1)
                samples.setdefault(key, {})[ext] = tar.extractfile(m).read()
        for s in samples.values():
            images.append(transform(Image.open(io.BytesIO(s["jpg"])).convert("RGB")))
            labels.append(int(s["cls"]))
    with torch.no_grad():
        pred = model(torch.stack(images)).argmax(dim=1)
    timm_top1 = (pred == torch.tensor(labels)).double().mean().item()
    ours = evaluate_model.evaluate(load_model(ft.out / "final"), str(ft.data), "test", workers=0)
    assert len(labels) == ours.samples == 200
    assert abs(timm_top1 - ours.top1) <= 0.001, (timm_top1, ours.top1)


def test_many_classes_print_the_worst_and_best_and_keep_the_matrix_sparse(tmp_path):
    """No model needed: the report of 30 classes, and 1500 classes' confusion matrix."""
    from pretrain.evaluate import ClassificationEvaluator
    from pretrain.evaluate_model import Evaluation
    from pretrain.evaluation_report import report_lines, write_outputs
    from pretrain.model_files import ModelFile

    assert not ClassificationEvaluator(list, normalize=None).track_confusion  # off by default
    for n in (30, 1500):
        mf = ModelFile(model=None, kind="test", path=tmp_path / "m", name="vit", img_size=8,
                       num_classes=n, normalize="minus_one_one")
        per_class = [{"class": c, "name": f"c{c}", "samples": 10, "correct": c % 11,
                      "top1": (c % 11) / 10} for c in range(n)]
        cells = torch.tensor([[c, c, c % 11] for c in range(n) if c % 11]
                             + [[c, (c + 1) % n, 10 - c % 11] for c in range(n)])
        ev = Evaluation(mf=mf, root="r", split="s", dataset="d", names=None, top1=0.5,
                        top5=0.9, per_class=per_class, cells=cells, device="cpu",
                        precision="fp32", batch_size=1)
        written = [p.name for p in write_outputs(ev, tmp_path / str(n))]
        text = "\n".join(report_lines(ev, tmp_path / str(n), []))
        assert " worst 5:" in text and " best 5:" in text and "metrics.json" in text
        assert len(text.splitlines()) < 25
    assert "confusion_matrix.png" not in written and "confusion_matrix.json" in written
    sparse = json.loads((tmp_path / "1500/confusion_matrix.json").read_text())
    assert sum(c[2] for c in sparse["cells (true, predicted, count)"]) == 15000


def test_bad_input_is_one_line_naming_the_fix(ft, tmp_path):
    from pretrain import evaluate_model, evaluation_report
    from pretrain.config import ConfigError
    from pretrain.data.info import DatasetInfo, SplitInfo, write_info
    from pretrain.model_files import load_model

    proc = run_launcher("evaluate.py", str(tmp_path / "nope"), "--data", str(ft.data),
                        "--split", "test", "--no-tracking", timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"error: MODEL '{tmp_path / 'nope'}' not found"]
    proc = run_launcher("evaluate.py", str(ft.out / "final"), "--data", str(ft.data),
                        "--split", "test", "--no-tracking", "--device", "gpu0", timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --device gpu0: not a torch device; use cpu, cuda or cuda:N"]
    # a place the results cannot go: said before the evaluation, not after it
    proc = run_launcher("evaluate.py", str(ft.out / "final"), "--data", str(ft.data),
                        "--split", "test", "--no-tracking", "--out", "/proc/results", timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --out '/proc/results' cannot be written (No such file or directory); name a "
        "folder with --out that can"], proc.stderr[-2000:]

    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "empty").mkdir()
    five = tmp_path / "five"
    five.mkdir()
    write_info(five, DatasetInfo("five", {"test": SplitInfo("test", 1, ["x.tar"], [1])},
                                 classes=[f"c{i}" for i in range(5)]))
    twelve = tmp_path / "twelve"  # lists 12 classes, as the demo's 21k list does, and uses them
    twelve.mkdir()
    write_info(twelve, DatasetInfo("twelve", {"test": SplitInfo("test", 1, ["x.tar"], [1])},
                                   classes=[f"c{i}" for i in range(12)],
                                   extra={"num_labels": 12}))
    held = tmp_path / "held"  # an earlier evaluation's figure file, not to be overwritten
    held.mkdir()
    (held / "metrics.json").write_text("{}")
    mf = load_model(ft.out / "final")
    cases = [
        lambda: load_model(tmp_path / "notes.txt"),  # none of the three
        lambda: load_model(tmp_path / "empty"),
        lambda: evaluate_model.evaluate(mf, str(ft.data), "validation"),  # no such split
        lambda: evaluate_model.evaluate(mf, str(five), "test"),  # 5 classes, not 10
        lambda: evaluate_model.evaluate(mf, str(tmp_path / "nowhere"), "test"),
        lambda: evaluation_report.output_dir("m", "test", str(held), False),
        lambda: evaluation_report.output_dir("m", "test", str(ft.out), True),  # the run's own
        lambda: evaluation_report.output_dir("m", "test", str(ft.out / "final"), True),
        lambda: evaluate_model.evaluate(mf, str(twelve), "test"),  # labels beyond the head
        lambda: evaluate_model.evaluate(mf, str(tmp_path / "empty"), "test"),  # raw, say
        lambda: evaluate_model.evaluate(mf, str(tmp_path / "notes.txt"), "test"),  # a shard
    ]
    messages = []
    for case in cases:
        with pytest.raises(ConfigError) as e:  # what the launchers print as one line, exit 2
            case()
        messages.append(str(e.value))
        assert "\n" not in str(e.value)
    assert "neither a model folder" in messages[0] and "checkpoint" in messages[1]
    assert messages[2].endswith("(its splits: test, train); pass one of those, or dev: the "
                                "share of the training split the fine-tune held out")
    assert "10 classes but" in messages[3] and "has 5" in messages[3]
    assert "--overwrite" in messages[5] and "training run's output dir" in messages[6]
    assert messages[7] == f"--out '{ft.out / 'final'}' is a model folder; name another folder " \
        f"(e.g. final-eval-test)"
    assert messages[8] == f"--data '{twelve}' has labels up to 11 but MODEL '{ft.out / 'final'}' " \
        f"has 10 classes; evaluate it on the dataset it was trained on"
    assert messages[9] == f"--data '{tmp_path / 'empty'}' holds no _info.json or " \
        f"info.json: point it at a folder written by launch/prepare_data.py (a folder " \
        f"of images is prepared first: launch/prepare_data.py imagefolder --src " \
        f"{tmp_path / 'empty'} ...)"
    assert messages[10] == f"--data '{tmp_path / 'notes.txt'}' is a file; point it at the " \
        f"folder holding the dataset (_info.json)"
    # a prefix on a web server: no prepare_data.py command to suggest (--src is a folder)
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(
        SimpleHTTPRequestHandler, directory=str(tmp_path / "empty")))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/data"
    try:
        with pytest.raises(ConfigError) as e:
            evaluate_model.evaluate(mf, url, "test")
    finally:
        server.shutdown()
        server.server_close()
    assert str(e.value) == f"--data '{url}' holds no _info.json or info.json: point it at a " \
        f"prefix written by launch/prepare_data.py"

    # timm folders from elsewhere: another eval transform, or no ViT at all
    import shutil

    import timm
    from safetensors.torch import save_file
    other = tmp_path / "other-crop"
    shutil.copytree(ft.out / "final", other)
    config = json.loads((other / "config.json").read_text())
    config["pretrained_cfg"]["crop_pct"] = 0.9
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"asks for crop_pct 0.9, bilinear resizing and a "
                                          r"center crop, not this project's eval transform"):
        load_model(other)
    cnn = tmp_path / "resnet"
    cnn.mkdir()
    resnet = timm.create_model("resnet10t", num_classes=10)
    save_file(resnet.state_dict(), str(cnn / "model.safetensors"))
    cfg = dict(resnet.pretrained_cfg, mean=config["pretrained_cfg"]["mean"],
               std=config["pretrained_cfg"]["std"], crop_pct=0.875, interpolation="bilinear")
    (cnn / "config.json").write_text(json.dumps({"architecture": "resnet10t", "num_classes": 10,
                                                 "pretrained_cfg": cfg}))
    with pytest.raises(ConfigError, match=r"is a ResNet, not a timm VisionTransformer"):
        load_model(cnn)


def test_an_unreachable_server_costs_one_warning_and_nothing_else(ft, tmp_path, caplog):
    from pretrain import evaluate_model, evaluation_report
    from pretrain.model_files import load_model

    ev = evaluate_model.evaluate(load_model(ft.out / "final.safetensors"), str(ft.data), "test",
                                 workers=0)
    written = evaluation_report.write_outputs(ev, tmp_path / "ev")
    with caplog.at_level(logging.INFO, logger="pretrain"):
        lines = evaluation_report.log_to_mlflow(ev, tmp_path / "ev", written,
                                                f"http://127.0.0.1:{free_port()}")
    assert lines == []
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "upload_spool.py" in warnings[0].getMessage()
    assert json.loads((tmp_path / "ev/metrics.json").read_text())["top1"] == ev.top1
    assert (tmp_path / "ev/tracking/spool.jsonl").is_file()  # sent later by upload_spool.py
    assert Path(tmp_path / "ev/tracking/artifacts/confusion_matrix.png").is_file()


def test_a_checkpoints_results_and_run_name_come_from_its_run_not_from_checkpoints(tmp_path):
    """``RUN/checkpoints/step_N`` of every run read alike in MLflow ('eval test:
    checkpoints/step_00000150'), and its results would land among the step dirs: both are
    the run's (``RUN/step_N``)."""
    from pretrain import evaluation_report
    step = tmp_path / "runs/demo-finetune/checkpoints/step_00000150"
    step.mkdir(parents=True)
    assert evaluation_report.run_name("test", step) == "eval test: demo-finetune/step_00000150"
    assert evaluation_report.output_dir(str(step), "test", None, False) == \
        tmp_path / "runs/demo-finetune/step_00000150-eval-test"
    assert evaluation_report.run_name("test", tmp_path / "runs/demo-finetune/final") == \
        "eval test: demo-finetune/final"


def test_the_dev_split_a_fine_tune_chose_its_best_by_is_evaluated_again(ft):
    """The best export and its registered version carry a dev figure, from the share of the
    training split the fine-tune held out: `--split dev` reads that share again (it was
    refused: the dataset has no split of that name) and gives the figure the run logged."""
    from pretrain import evaluate_model, model_files
    from pretrain.evaluate_model import EvaluateError

    card = json.loads((ft.out / "best.json").read_text())
    mf = model_files.load_model(ft.out / "best")
    ev = evaluate_model.evaluate(mf, str(ft.data), "dev", workers=0)
    assert ev.top1 == pytest.approx(card["metrics"]["eval/dev/top1"], abs=1e-9)
    assert ev.reported == {"metric": "eval/dev/top1", "step": card["step"],
                           "value": card["metrics"]["eval/dev/top1"]}
    train = evaluate_model.evaluate(mf, str(ft.data), "train", workers=0)
    dev_samples, train_samples = (sum(c["samples"] for c in e.per_class) for e in (ev, train))
    assert 0 < dev_samples < 0.2 * train_samples  # data.dev_fraction=0.1 of it, by key hash
    assert any("its figure there is a training accuracy" in n for n in train.notes)
    mf.run_config["data"]["dev_fraction"] = 0  # a run that held none out
    with pytest.raises(EvaluateError, match=r"^--split dev is the share of the training split "
                                            r"a fine-tune holds out"):
        evaluate_model.evaluate(mf, str(ft.data), "dev", workers=0)


def test_evaluations_of_an_export_a_run_replaces_are_renamed_after_their_weights(tmp_path):
    """A relaunch that trains on replaces final (best at a new best): its evaluations,
    ``final-eval-test`` next to it, stayed and passed for the new weights'. They are renamed
    after the step they describe; one of the same weights, and a folder that is no evaluation
    (no metrics.json), stay."""
    from pretrain.evaluation_report import set_aside_evaluations

    def evaluation(name, step):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(json.dumps({"step": step}))
    evaluation("final-eval-test", 20)
    evaluation("final-eval-test-2", 20)
    evaluation("final.safetensors-eval-dev", 20)
    evaluation("final-step20-eval-validation", 20)  # taken: the next name is used
    evaluation("final-eval-validation", 20)
    evaluation("best-eval-test", 20)  # another export's
    (tmp_path / "final-eval-notes").mkdir()  # the user's own folder
    assert set_aside_evaluations(tmp_path, "final", 40) == [
        "final-eval-test -> final-step20-eval-test",
        "final-eval-test-2 -> final-step20-eval-test-2",
        "final-eval-validation -> final-step20-eval-validation-2",
        "final.safetensors-eval-dev -> final.safetensors-step20-eval-dev"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "best-eval-test", "final-eval-notes", "final-step20-eval-test",
        "final-step20-eval-test-2", "final-step20-eval-validation",
        "final-step20-eval-validation-2", "final.safetensors-step20-eval-dev"]
    evaluation("best-eval-dev", 40)  # of the weights exported again at the same step
    assert set_aside_evaluations(tmp_path, "best", 40) == [
        "best-eval-test -> best-step20-eval-test"]
    assert (tmp_path / "best-eval-dev").is_dir()

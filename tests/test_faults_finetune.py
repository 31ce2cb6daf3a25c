"""The fault suite's fine-tuning part (see ``test_faults.py``, whose helpers it shares): a
fine-tune on two CPU ranks under torchrun (Accelerate's DDP) and under Accelerate's DeepSpeed,
stopped by SIGTERM or a killed rank, then relaunched: the same losses, samples and figures as an
uninterrupted run. A file of its own so that the suite's workers can run it beside the rest of
the fault suite."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from conftest import REPO
from pretrain.checkpoint import CheckpointStore
from test_faults import (EVERY, FAULTY, NO_PERIODIC, STEPS, check_stop_and_resume, compare_with,
                         launch, mlflow_run, mlflow_steps_lost, resumed_at, signal_and_wait,
                         signal_when_finishing, stopped_step)

pytestmark = pytest.mark.faults


FINETUNE_EVALS = ("eval/dev/top1", "eval/validation/top1")


def finetune_run_args(out, data, *extra):
    return [f"output_dir={out}", f"data.root={data}", "init=null", "data.generate_demo=false",
            "data.val_split=validation", "data.dev_fraction=0.1", "data.num_workers=1",
            "data.shuffle_buffer=50", "model.img_size=16", "model.patch_size=4", "model.depth=2",
            "model.embed_dim=64", "model.num_heads=2", "model.num_classes=8",
            "train.global_batch_size=16", "train.grad_accum_steps=2", "train.ema_decay=0.9",
            # a log line every 3 steps: a stop or a kill between two of them must carry the
            # steps since the last one over, or the next line's average loss would differ
            f"train.total_steps={STEPS}", "schedule.warmup_steps=2", "log.every_steps=3",
            f"checkpoint.every_steps={EVERY}", "eval.every_steps=10", "eval.batch_size=16",
            f"debug.log_sample_keys={out / 'keys'}", "tracking.system_metrics=false", *extra]


# How a fine-tune is launched on the two CPU ranks: torchrun (Accelerate's DDP), or under
# DeepSpeed in bf16 (DeepSpeed holds the model in bf16 and sums the micro-batches' gradients in
# fp32): `accelerate launch` with the repository's ZeRO-2 config (--zero_stage for another), or
# torchrun with Accelerate's environment variables, as launch/slurm_finetune.sh takes them.
TORCHRUN = ["torch.distributed.run", "--nproc_per_node", "2", "--master_port"]


def _accelerate_deepspeed(stage, *extra):
    return ([], ["accelerate.commands.launch", "--config_file",
                 str(REPO / "configs/accelerate/deepspeed_zero2.yaml"), "--zero_stage",
                 str(stage), "--mixed_precision", "bf16",  # agreeing with the run: accepted
                 "--main_process_port"], ["train.precision=bf16", *extra])


FINETUNE_LAUNCHERS = {  # name: (environment, launcher, the run's own keys)
    "torchrun": ([], TORCHRUN, []),
    "accelerate-deepspeed-zero2": _accelerate_deepspeed(2),
    "torchrun-deepspeed-zero1": (["ACCELERATE_USE_DEEPSPEED=true",
                                  "ACCELERATE_DEEPSPEED_ZERO_STAGE=1"], TORCHRUN,
                                 ["train.precision=bf16"]),
    # the EMA, a whole copy of the model per rank, is refused under ZeRO-3's shards
    "accelerate-deepspeed-zero3": _accelerate_deepspeed(3, "train.ema_decay=null"),
}


def finetune_cmd(*args, script=REPO / "launch/finetune.py", launcher="torchrun"):
    from conftest import free_port
    env, start, extra = FINETUNE_LAUNCHERS[launcher]
    return [*(["env", *env] if env else []), sys.executable, "-m", *start, str(free_port()),
            str(script), "--config", str(REPO / "configs/finetune/demo.yaml"), *args,
            *extra]  # the launcher's keys last: they win


@pytest.fixture(scope="module")
def finetune_reference_of(tmp_path_factory, tiny_data):
    """The uninterrupted run under a launcher of FINETUNE_LAUNCHERS, made once per module."""
    made = {}

    def reference(launcher):
        if launcher not in made:
            out = tmp_path_factory.mktemp(f"finetune-reference-{launcher}") / "run"
            proc = subprocess.run(finetune_cmd(*finetune_run_args(out, tiny_data),
                                               launcher=launcher),
                                  cwd=REPO, capture_output=True, text=True, timeout=400)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            made[launcher] = out
        return made[launcher]
    return reference


@pytest.fixture(scope="module")
def finetune_reference(finetune_reference_of):
    return finetune_reference_of("torchrun")


def finetune_faulty(out, data, *extra, faults=None, fails=False, launcher="torchrun"):
    proc = subprocess.run(finetune_cmd(*finetune_run_args(out, data, *extra), script=FAULTY,
                                       launcher=launcher),
                          cwd=REPO, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "FAULTY_LAUNCHER": "finetune.py",
                               "FAULTS": json.dumps(faults or {})})
    assert (proc.returncode != 0) == fails, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("to,launcher", [
    pytest.param("group", "torchrun", marks=pytest.mark.slow), ("launcher", "torchrun"),
    ("launcher", "accelerate-deepspeed-zero2"),
    *(pytest.param("launcher", name, marks=pytest.mark.slow)
      for name in ("torchrun-deepspeed-zero1", "accelerate-deepspeed-zero3"))])
def test_sigterm_stops_a_finetune_with_a_checkpoint_and_the_relaunch_loses_nothing(
        to, launcher, tmp_path, tiny_data, finetune_reference_of, fault_ledger):
    """Under torchrun (DDP) and under Accelerate's DeepSpeed (ZeRO-2, bf16; ZeRO-1 through
    torchrun's environment and ZeRO-3 in the slow variants): DeepSpeed's optimizer state and
    the EMA are in the stop checkpoint too."""
    finetune_reference = finetune_reference_of(launcher)
    out, status = tmp_path / "run", tmp_path / "job-status"
    proc = launch(finetune_cmd(*finetune_run_args(out, tiny_data, NO_PERIODIC), launcher=launcher),
                  tmp_path / "run.log", env={"VITSCALE_JOB_STATUS": str(status)})
    signal_and_wait(proc, out, to)
    text = (tmp_path / "run.log").read_text()
    # what the SLURM script reads, as torchrun turns the ranks' 4 into its own code: rank 0's
    # line for the checkpoint of the stop and the code it chose
    assert status.read_text().splitlines() == [f"checkpoint {stopped_step(text)}", "exit 4"]
    if "deepspeed" in launcher:
        stage = launcher[-1]
        assert f"under Accelerate's DeepSpeed config: ZeRO-{stage}, 2 micro-batches' gradients " \
               f"summed in fp32" in text
    lost = check_stop_and_resume(
        out, text, lambda: finetune_faulty(out, tiny_data, NO_PERIODIC, launcher=launcher),
        finetune_reference, FINETUNE_EVALS)
    # the exports of the resumed run are the uninterrupted run's
    for name in ("best", "final"):
        assert json.loads((out / f"{name}.json").read_text())["metrics"] == \
            json.loads((finetune_reference / f"{name}.json").read_text())["metrics"]
    if "deepspeed" in launcher:  # DeepSpeed's config, as the run filled it
        client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
        path = client.download_artifacts(mlflow_run(out).info.run_id, "deepspeed_config.json",
                                         str(tmp_path))
        ds = json.loads(Path(path).read_text())
        assert (ds["train_batch_size"], ds["gradient_accumulation_steps"]) == (16, 2)
        assert ds["bf16"]["enabled"] and ds["data_types"] == {"grad_accum_dtype": "fp32"}
    fault_ledger.record(1, 1, *lost)


@pytest.mark.parametrize("launcher", ["accelerate-deepspeed-zero2", "accelerate-deepspeed-zero3"])
def test_a_deepspeed_finetunes_checkpoint_evaluates_as_the_run_and_its_export_did(
        launcher, tmp_path, tiny_data):
    """Under an Accelerate DeepSpeed config a checkpoint holds DeepSpeed's files, no whole-model
    file: evaluate.py reads the module the run evaluated from them (under ZeRO-3 the fp32
    masters, merged and rounded to the bf16 the module held), where it used to refuse and name
    final/ (not written yet by a stopped run). Its figure is the run's, its predictions final/'s."""
    from conftest import run_launcher
    out = tmp_path / "run"
    proc = subprocess.run(finetune_cmd(*finetune_run_args(
        out, tiny_data, "train.ema_decay=null", "train.total_steps=6"), launcher=launcher),
        cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ckpt = CheckpointStore(out / "checkpoints").latest()
    assert ckpt.step == 6 and not list(ckpt.path.glob("*.safetensors")), list(ckpt.path.iterdir())
    figures = {}
    for name, model in (("checkpoint", ckpt.path), ("final", out / "final")):
        ev = run_launcher("evaluate.py", str(model), "--data", str(tiny_data), "--split",
                          "validation", "--out", str(tmp_path / name), "--no-tracking")
        assert ev.returncode == 0, ev.stderr[-2000:]
        assert "the run reported eval/validation/top1 = " in ev.stdout and \
            "at step 6: the same" in ev.stdout, ev.stdout
        figures[name] = (json.loads((tmp_path / name / "metrics.json").read_text())["top1"],
                         (tmp_path / name / "confusion_matrix.csv").read_text())
    assert figures["checkpoint"] == figures["final"]
    # the very weights of the export (which the run took from its module at the end)
    from safetensors.torch import load_file

    from pretrain.model_files import load_model
    read = load_model(ckpt.path).model.state_dict()
    export = load_file(str(out / "final.safetensors"))
    assert read.keys() == export.keys() and all(torch.equal(read[k], export[k]) for k in read)
    if launcher.endswith("zero3"):  # a copy without the optimizer shards: said in one line
        import shutil
        copy = tmp_path / "copy" / "kept"  # (under its step_N name, the manifest refuses it)
        shutil.copytree(ckpt.path, copy, ignore=shutil.ignore_patterns("*optim_states.pt"))
        ev = run_launcher("evaluate.py", str(copy), "--data", str(tiny_data), "--split",
                          "validation", "--no-tracking")
        assert ev.returncode == 2 and ev.stderr.strip().splitlines()[-1].startswith(
            f"error: cannot read the weights from DeepSpeed's files in '{copy / 'pytorch_model'}'"
        ), ev.stderr[-2000:]


def test_sigkill_of_a_finetune_rank_resumes_to_the_same_losses_and_samples(
        tmp_path, tiny_data, finetune_reference, fault_ledger):
    out = tmp_path / "run"
    finetune_faulty(out, tiny_data, faults={"kill": [1, 13]}, fails=True)
    assert [c.step for c in CheckpointStore(out / "checkpoints").complete()] == [10, 5]
    again = finetune_faulty(out, tiny_data)
    assert resumed_at(again) == [10]
    samples_lost, metrics_lost = compare_with(finetune_reference, out, FINETUNE_EVALS)
    fault_ledger.record(1, 1, samples_lost, metrics_lost + mlflow_steps_lost(out))


def test_sigterm_in_the_final_evaluation_stops_before_the_exports_and_the_relaunch_does_them(
        tmp_path, tiny_data, finetune_reference, fault_ledger):
    """The test split's evaluation and the exports after the last step can outlast a
    scheduler's grace period: a stop signal then ends the job at the next part with exit code 4
    (the SLURM script requeues), not with the kill after the grace period; the relaunch trains
    nothing and does them."""
    out, status, log = tmp_path / "run", tmp_path / "job-status", tmp_path / "run.log"
    proc = launch(finetune_cmd(*finetune_run_args(out, tiny_data, NO_PERIODIC), script=FAULTY),
                  log, env={"VITSCALE_JOB_STATUS": str(status), "FAULTY_LAUNCHER": "finetune.py",
                            "FAULTS": json.dumps({"slow_test": 3.0})})
    stopped = signal_when_finishing(proc, out, "launcher")
    text = log.read_text()
    assert stopped.format("the final exports") in text, text[-3000:]
    assert status.read_text().splitlines() == [f"checkpoint {STEPS}", "exit 4"]
    assert not (out / "final.safetensors").exists() and not (out / "final").exists()
    run = mlflow_run(out)
    assert run.info.status == "KILLED" and run.data.tags["stop.step"] == str(STEPS)

    again = finetune_faulty(out, tiny_data, NO_PERIODIC)
    assert resumed_at(again) == [STEPS] and "nothing to train" in again
    samples_lost, metrics_lost = compare_with(finetune_reference, out, FINETUNE_EVALS)
    for name in ("best", "final"):
        assert json.loads((out / f"{name}.json").read_text())["metrics"] == \
            json.loads((finetune_reference / f"{name}.json").read_text())["metrics"]
    run = mlflow_run(out)
    assert run.info.status == "FINISHED"
    fault_ledger.record(1, 1, samples_lost, metrics_lost + mlflow_steps_lost(out))
    # the last step's evaluations, done before the stop, are the relaunch's figures too (its
    # closing line and finished.json had the test split's alone)
    def figures(folder):
        return {k: v for k, v in json.loads((folder / "finished.json").read_text())[
            "metrics"].items() if k.startswith("eval/")}
    assert figures(out) == figures(finetune_reference) and "eval/dev/top1" in figures(out)
    [done] = [line for line in again.splitlines() if "done: " in line]
    assert f" eval/dev/top1 {figures(out)['eval/dev/top1']:.4f};" in done, done

    # its end done, a relaunch does nothing: no test split evaluated again, no export rewritten
    def written():  # by the end: the test split's per-class figures and the final export
        return {p.name: p.stat().st_mtime_ns for p in [*out.glob("final*"),
                                                        out / "per_class_top1.json"]}
    exported = written()
    third = finetune_faulty(out, tiny_data, NO_PERIODIC)
    assert f"the run in {out} finished: its {STEPS} steps" in third, third[-3000:]
    assert "resumed from" not in third, third[-3000:]
    assert written() == exported and len(exported) == 4, exported
    assert mlflow_run(out).info.end_time == run.info.end_time
    # train.total_steps lowered below the step reached (other settings: the end is done
    # again): the exports are the weights of the step reached and say so; they were labelled
    # as the lower step's, whose checkpoint is another
    fourth = finetune_faulty(out, tiny_data, NO_PERIODIC, f"train.total_steps={STEPS - 5}")
    assert f"the run is at step {STEPS}, past train.total_steps={STEPS - 5}: nothing to " \
           f"train" in fourth, fourth[-3000:]
    assert json.loads((out / "final.json").read_text())["step"] == STEPS

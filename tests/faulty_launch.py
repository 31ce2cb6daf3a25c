"""``launch/$FAULTY_LAUNCHER`` (``pretrain.py``, the default, or ``finetune.py``) with faults
injected where ``$FAULTS`` (JSON) says: how the fault suite breaks a real DeepSpeed or
Accelerate run from the inside. Every key is optional; ranks are global ranks.

  "kill":         [rank, step]         SIGKILL that rank once ``step`` steps are done
  "freeze":       [rank, step]         SIGSTOP that rank once ``step`` steps are done (a frozen
                                       node: none of its threads runs again)
  "term":         [rank, step, ...]    SIGTERM to that rank alone once ``step`` steps are done,
                                       for each step given (a stop noted during the next step)
  "kill_in_save": [rank, step]         SIGKILL that rank as it starts writing checkpoint ``step``
  "write_error":  [rank, step, errno]  that rank's writes of checkpoint ``step`` fail (OSError)
  "nan":          [i, j, ...]          rank 0's i-th, j-th... forward pass of this process (from 1)
                                       gives NaN logits
  "nan_loss":     [i, j, ...]          ...gives a NaN loss whose gradients are finite (as 0 x inf
                                       inside a loss would), counted with "nan"'s passes
  "slow_save":    seconds              every file of every checkpoint takes this much longer to
                                       write; while one is written, OUTPUT_DIR/saving names it
  "slow_convert": seconds              rank 0's conversion of a checkpoint to DeepSpeed's
                                       universal one takes this much longer
  "slow_start":   seconds              the start-up (pretraining's engine build) takes this much
                                       longer; meanwhile OUTPUT_DIR/starting exists
  "slow_data":    [rank, seconds]      that rank waits this much longer for each training batch
                                       (a node with a slow disk or network)
  "bad_input":    [rank, batch]        that rank's ``batch``-th training batch (from 1) raises
                                       the loader's error for a shard it may not read
  "override":     [rank, key=value]    that rank alone gets this config override too (a node
                                       whose recipe file was edited)
  "stale_view":   rank                 that rank sees the newest checkpoint without its manifest
                                       (a node whose NFS attribute cache lags)
  "late":         [rank, seconds]      that rank starts this much later (a busy node)
  "node":         [rank, host]         that rank is the first of a second node of that host
                                       name ($LOCAL_RANK 0), on this machine
  "slow_end":     [rank, seconds]      that rank's work after the last step (pretraining's
                                       finish) takes this much longer; meanwhile
                                       OUTPUT_DIR/finishing exists
  "slow_test":    seconds              a fine-tune's evaluation of its test split, after the last
                                       step, takes this much longer on every rank; meanwhile
                                       OUTPUT_DIR/finishing exists
"""
import json
import os
import runpy
import signal
import sys
import time
from pathlib import Path

import torch

import pretrain.engine as eng_lib

REPO = Path(__file__).resolve().parent.parent
FAULTS = json.loads(os.environ.get("FAULTS", "{}"))
RANK = int(os.environ.get("RANK", "0"))


def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


for key, signum in (("kill", signal.SIGKILL), ("freeze", signal.SIGSTOP),
                    ("term", signal.SIGTERM)):
    if key in FAULTS and FAULTS[key][0] == RANK:
        build_scheduler = eng_lib.build_scheduler

        def _scheduler_that_kills(*args, _steps=FAULTS[key][1:], _signum=signum,
                                  _build=build_scheduler, **kwargs):
            scheduler = _build(*args, **kwargs)
            step_update = scheduler.step_update

            def update(step, *a, **k):
                if step in _steps:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os.kill(os.getpid(), _signum)
                return step_update(step, *a, **k)
            scheduler.step_update = update
            return scheduler
        eng_lib.build_scheduler = _scheduler_that_kills

for key in ("kill_in_save", "write_error"):
    if key in FAULTS and FAULTS[key][0] == RANK:
        tag, save = f"step_{FAULTS[key][1]:08d}", torch.save

        def _save(obj, f, *args, _key=key, _tag=tag, _save=save, **kwargs):
            if _tag in str(f):
                if _key == "kill_in_save":
                    _die()
                code = FAULTS["write_error"][2]
                raise OSError(code, os.strerror(code), str(f))
            return _save(obj, f, *args, **kwargs)
        torch.save = _save

if "slow_convert" in FAULTS:
    import pretrain.checkpoint as ckpt_lib
    as_adam = ckpt_lib.momentum_as_adam

    def _slow_as_adam(*args, **kwargs):
        time.sleep(FAULTS["slow_convert"])
        return as_adam(*args, **kwargs)
    ckpt_lib.momentum_as_adam = _slow_as_adam

if "slow_save" in FAULTS:
    _torch_save = torch.save

    def _slow_save(obj, f, *args, **kwargs):
        if "/step_" in str(f):
            marker = Path(str(f).split("/checkpoints/")[0]) / "saving"
            marker.write_text(str(f))
            time.sleep(FAULTS["slow_save"])
            try:
                return _torch_save(obj, f, *args, **kwargs)
            finally:
                marker.unlink(missing_ok=True)
        return _torch_save(obj, f, *args, **kwargs)
    torch.save = _slow_save

if "slow_start" in FAULTS:
    _build_optimizer = eng_lib.build_optimizer

    def _slow_build_optimizer(*args, **kwargs):
        out = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("output_dir="))
        Path(out, "starting").write_text("")
        time.sleep(FAULTS["slow_start"])
        return _build_optimizer(*args, **kwargs)
    eng_lib.build_optimizer = _slow_build_optimizer

if "slow_data" in FAULTS and FAULTS["slow_data"][0] == RANK:
    import pretrain.data.device_batch as batch_lib
    _prepare_batch = batch_lib.prepare_batch

    def _slow_prepare_batch(*args, **kwargs):
        time.sleep(FAULTS["slow_data"][1])
        return _prepare_batch(*args, **kwargs)
    batch_lib.prepare_batch = _slow_prepare_batch

if "bad_input" in FAULTS and FAULTS["bad_input"][0] == RANK:
    import pretrain.data.device_batch as batch_lib
    from pretrain.data.shards import LoaderError
    _prepare, _batches = batch_lib.prepare_batch, [0]

    def _refused_prepare_batch(*args, **kwargs):
        _batches[0] += 1
        if _batches[0] == FAULTS["bad_input"][1]:
            raise LoaderError("shard s3://bucket/train-000007.tar cannot be read (AccessDenied); "
                              "fix the credentials or the storage's permissions, or set "
                              "data.missing_shards=skip")
        return _prepare(*args, **kwargs)
    batch_lib.prepare_batch = _refused_prepare_batch

if "late" in FAULTS and FAULTS["late"][0] == RANK:
    time.sleep(FAULTS["late"][1])

if "node" in FAULTS and FAULTS["node"][0] == RANK:
    import socket
    socket.gethostname = lambda: FAULTS["node"][1]
    os.environ["LOCAL_RANK"] = "0"

if "slow_end" in FAULTS and FAULTS["slow_end"][0] == RANK:
    import pretrain.stage as stage_lib
    _finish = stage_lib.PretrainStage.finish

    def _slow_finish(*args, **kwargs):
        out = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("output_dir="))
        Path(out, "finishing").write_text("")
        time.sleep(FAULTS["slow_end"][1])
        return _finish(*args, **kwargs)
    stage_lib.PretrainStage.finish = _slow_finish

if "slow_test" in FAULTS:
    import pretrain.evaluate as evaluate_lib
    _run = evaluate_lib.ClassificationEvaluator.run

    def _slow_run(self, *args, **kwargs):
        if self.name != "dev":  # not the periodic one on the held-out share of train
            out = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("output_dir="))
            Path(out, "finishing").write_text("")
            time.sleep(FAULTS["slow_test"])
        return _run(self, *args, **kwargs)
    evaluate_lib.ClassificationEvaluator.run = _slow_run

if ("nan" in FAULTS or "nan_loss" in FAULTS) and RANK == 0:
    loss_fn, calls = eng_lib.classification_loss, [0]

    def _loss(logits, *args, **kwargs):
        calls[0] += 1
        if calls[0] in FAULTS.get("nan", []):
            logits = logits * float("nan")
        loss = loss_fn(logits, *args, **kwargs)
        return loss + float("nan") if calls[0] in FAULTS.get("nan_loss", []) else loss
    eng_lib.classification_loss = _loss

if FAULTS.get("stale_view", -1) == RANK:
    import pretrain.checkpoint as ckpt_lib
    problem = ckpt_lib._problem

    def _late_view(d):
        newest = ckpt_lib.CheckpointStore(d.parent)._tag_dirs()[0]
        return "no COMPLETE.json (a save was interrupted)" if d == newest else problem(d)
    ckpt_lib._problem = _late_view

if "override" in FAULTS and FAULTS["override"][0] == RANK:
    sys.argv.append(FAULTS["override"][1])

sys.argv[0] = str(REPO / "launch" / os.environ.get("FAULTY_LAUNCHER", "pretrain.py"))
sys.path.insert(0, str(REPO / "launch"))  # as when the launcher runs it (for its _bootstrap)
runpy.run_path(sys.argv[0], run_name="__main__")

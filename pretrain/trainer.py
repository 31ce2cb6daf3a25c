"""The training loop of both stages, top to bottom: setup, resume, the step, metrics,
evaluation, checkpoints, stopping on a signal.

What differs between pretraining and fine-tuning is small and lives elsewhere:

- the **backend** runs the step and writes the checkpoint files: a DeepSpeed engine for
  pretraining (:class:`pretrain.engine.DeepSpeedBackend`), Accelerate for fine-tuning
  (:class:`finetune.backend.AccelerateBackend`);
- the **stage** says which model weights to start from, what is evaluated (and on which
  weights: EMA) and what is exported: :class:`pretrain.stage.PretrainStage`,
  :class:`finetune.stage.FinetuneStage`.

Everything else -- exact resume of data, weights, optimizer, RNG and MLflow run; the
non-finite guard and rollback; checkpoint failures; stopping on SIGTERM/SIGINT/SIGUSR1 with
a checkpoint of the step in progress -- is written once, here, and holds for both stages.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import math
import socket
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch

from pretrain.checkpoint import CheckpointStore, CheckpointWriteError
from pretrain.config import ConfigError, RunConfig
from pretrain.cli import tame_logs, user_errors
from pretrain.config_files import save_config, to_yaml
from pretrain.distributed import agreed, all_reduce_sum, gather, peer_gone, raise_together
from pretrain.guard import NonFiniteGuard, TrainingStopped
from pretrain.interpreter import training_starts
from pretrain.model import resolve_spec
from pretrain import same_job
from pretrain.randomness import rng_state, seed_everything, set_rng_state
from pretrain.finished_run import (finished_line, forget_finished, mark_finished,
                                   nothing_to_do, read_finished)
from pretrain.run_dir import (check_every_rank_sees, check_same_run, hold_output_dir, make_dir,
                              release_output_dir, removed_if_left_empty, set_aside_earlier_run,
                              unshare_written_files)
from pretrain.stopping import StopSignals, StoppedBySignal
from pretrain.watchdog import StallWatchdog, progress

log = logging.getLogger("pretrain")


# --------------------------------------------------------------------------------------------
# Setup
# --------------------------------------------------------------------------------------------
def setup_logging(rank: int) -> None:
    """Helpful logs on rank 0; other ranks only say something when it is a warning."""
    # torch.distributed's own deprecation notices, once per rank per call site: noise
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(message)s", datefmt="%H:%M:%S",
                        force=True)
    tame_logs()


def batch_layout(cfg: RunConfig, world: int, on_gpu: bool) -> tuple[int, int]:
    """(micro-batch, accumulation steps) of this world, or the one-line reason there is none;
    what only the world and the device can tell, checked before any work."""
    if cfg.train.precision == "fp16" and not on_gpu:
        # DeepSpeed would fail with a traceback, Accelerate train in fp32 without a word
        raise ConfigError("train.precision=fp16 needs a GPU; use bf16 or fp32 on the CPU")
    micro, accum = same_job.batch_layout(cfg, world)
    if micro % 2 and (cfg.data.mixup_alpha or cfg.data.cutmix_alpha):
        raise agreed(ConfigError(
            f"mixup/cutmix pair each image with another of its micro-batch, which is {micro} "
            f"here (train.global_batch_size / ranks / accumulation): make it even"))
    return micro, accum


def total_steps(cfg: RunConfig, samples_per_epoch: int) -> int:
    if cfg.train.total_steps:
        return cfg.train.total_steps
    return max(1, math.ceil(cfg.train.epochs * samples_per_epoch / cfg.train.global_batch_size))


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------
def train(cfg: RunConfig, stage=None) -> dict:
    """Train until ``train.total_steps``; returns the last logged metrics (rank 0's view).
    ``stage``: :class:`pretrain.stage.PretrainStage` when None."""
    with removed_if_left_empty(Path(cfg.output_dir)) as made, contextlib.ExitStack() as job:
        return _train(cfg, stage, job, made)


def _train(cfg: RunConfig, stage, job: contextlib.ExitStack, made_out: bool) -> dict:
    from pretrain.data.device_batch import build_mixup, prepare_batch
    from pretrain.data.loader import build_train_loader
    from pretrain.data.shards import describe_skips
    from pretrain.engine import build_scheduler
    from pretrain.evaluate import is_due, run_due
    from pretrain.metrics import MultiLogger, build_logger, closing_line
    from pretrain.throughput import StepTimer, peak_memory_gib, peak_tflops, slowest_data
    from pretrain.stage import PretrainStage
    from pretrain.tracking import start_tracking
    from pretrain.tracking_store import check_store

    check_store(cfg.tracking)  # a store MLflow refuses: one line now, not metrics lost later
    stage = stage or PretrainStage(cfg)
    backend = stage.backend(cfg)  # joins the process group, checks every rank runs this job
    rank, world = backend.rank, backend.world_size
    setup_logging(rank)
    micro, accum = batch_layout(cfg, world, backend.on_gpu)
    out = Path(cfg.output_dir)
    make_dir(out, "output_dir")
    if rank == 0:
        unshare_written_files(out)
    check_every_rank_sees(out)
    held = hold_output_dir(out)  # until this job ends: no second one writes here meanwhile
    if held is not None:
        job.callback(release_output_dir, held, out, made_out)
    if cfg.debug.log_sample_keys:
        make_dir(Path(cfg.debug.log_sample_keys), "debug.log_sample_keys")
    stage.prepare_data(cfg)
    # the data first: a missing shard, a bad info file or labels beyond the model's classes
    # fail here, before anything in output_dir is touched or the model is built
    spec = resolve_spec(cfg.model)
    loader, error = None, None
    try:
        loader = build_train_loader(cfg.data, img_size=spec.img_size, batch_size=micro,
                                    rank=rank, world_size=world, seed=cfg.seed,
                                    num_classes=spec.num_classes, holdout=stage.holdout(cfg),
                                    exact_classes=cfg.head_per_class,
                                    log_sample_keys=cfg.debug.log_sample_keys,
                                    pin_memory=backend.on_gpu,
                                    read_before=(out / "checkpoints").is_dir())
    except user_errors() as e:  # every rank reads the same info file: one line, not per rank
        error = e
    raise_together(error, world)

    store = CheckpointStore(out / "checkpoints", cfg.checkpoint.keep_last)
    resume = store.latest_agreed() if cfg.checkpoint.resume else None
    set_aside = None  # (rank 0: where the earlier run went)
    if not cfg.checkpoint.resume:  # a new run here: the earlier one is moved aside, not mixed in
        set_aside = set_aside_earlier_run(out, stage.inputs(cfg))
    changed = check_same_run(out, cfg, resume)

    steps = total_steps(cfg, loader.num_samples)
    finished = read_finished(out)
    if resume is not None and nothing_to_do(finished, cfg, resume.step, steps):
        if rank == 0:  # its end done with these settings: MLflow's run stays as it ended
            log.info("%s", finished_line(out, finished))
        return {**finished.get("metrics", {}), **finished.get("end_metrics", {})}
    # the last figures of a run that trains nothing now, for the closing line and the record
    carried_metrics = finished.get("metrics", {}) if finished and resume is not None and \
        finished.get("step") == resume.step >= steps else {}
    if finished is not None and rank == 0:  # this relaunch acts: not finished until its end
        if carried_metrics:
            log.info("the run in %s finished at step %d with other settings than this "
                     "relaunch's: its end (evaluations, exports) is done again with these",
                     out, resume.step)
        forget_finished(out)
    # a run relaunched after its last step trains nothing: its weights are loaded only when
    # the stage's finish reads them, or when the last step's evaluation is owed (see below)
    client = None
    if resume is not None and resume.step >= steps and not stage.finish_reads_weights:
        client = backend.client_state(store.root, resume)  # (no weights read)
    weights_from = None if client is not None and client.get("eval_owed") is None else resume
    seed_everything(cfg.seed)  # identical initial weights on every rank
    backend.build(cfg, micro, accum, weights_from, store,
                  init_weights=stage.init_weights if resume is None else None)
    evaluators = stage.evaluators(cfg, spec, backend)  # checks the eval shards now
    scheduler = build_scheduler(backend.optimizer, cfg, steps)
    mixup = build_mixup(cfg.data, spec.num_classes)
    guard = NonFiniteGuard(cfg.train.nonfinite_limit, cfg.train.on_nonfinite,
                           cfg.train.max_rollbacks)

    step, run_id, carried, owed = 0, None, None, None
    last_eval: dict = {}  # each evaluation's latest figures, carried in the checkpoints
    if resume is not None:
        if weights_from is not None:
            client = store.load(backend, resume)
        owed = client.get("eval_owed")  # a stop came before the resumed step's evaluation
        step, run_id = int(client["step"]), client.get("tracking_run_id")
        if resume.world_size == world:  # the loss window the next log line averages
            carried = (client.get("loss_window") or [None] * world)[rank]
        loader.load_state_dict(client["loader"])
        if resume.world_size == world:  # dropout / drop-path draws continue exactly
            set_rng_state(client["rng"][rank])
        guard.skipped = int(client.get("nonfinite_skipped", 0))
        stage.load_state_dict(client.get("stage") or {})
        last_eval = dict(client.get("eval_figures") or {})
        if step >= steps and not carried_metrics:  # stopped after the last step: its figures
            carried_metrics = dict(last_eval)
        log.info("resumed from %s at step %d", resume.path, step)
        if changed and rank == 0:  # config.yaml stays the start's, as the MLflow params do
            kept = save_config(cfg, out / f"config.resume_step_{step:08d}.yaml")
            log.warning("resumed with settings other than the ones it trained with until "
                        "now: %s; they apply from step %d on (this relaunch's config: %s)",
                        "; ".join(changed), step, kept)
    elif rank == 0:
        save_config(cfg, out / "config.yaml")
    else:
        out.mkdir(parents=True, exist_ok=True)

    # MLflow on rank 0: one more sink; the same MLflow run when resuming (id from the checkpoint)
    tracker = start_tracking(cfg, stage.name, out, rank, world_size=world,
                             ds_config=backend.config_artifact(),
                             hosts=gather(socket.gethostname(), world), run_id=run_id,
                             resumed_at=step if resume is not None else None,
                             extra_tags=stage.tracking_tags(), changed=changed,
                             set_aside=set_aside,
                             resolved={"train.total_steps": steps, "train.micro_batch_size": micro,
                                       "train.grad_accum_steps": accum,
                                       **{f"model.{k}": v for k, v in asdict(spec).items()}})
    sink = MultiLogger(build_logger(out, steps, rank), tracker)

    def ended_by(why: str) -> None:  # a rank ended where no exception is raised: a stall, say
        tracker.fail({"failure": why})
    timer = StepTimer(spec.train_flops_per_image(), world_size=world,
                      peak_tflops=peak_tflops(cfg.log.peak_tflops))
    if rank == 0:
        log.info("%s %s at %d px for %d steps%s: global batch %d = %d rank%s x %d x %d "
                 "accumulation, %.3f TFLOP per image", stage.verb, spec.name, spec.img_size,
                 steps, stage.describe_start(), cfg.train.global_batch_size, world,
                 "s" if world > 1 else "", micro, accum, spec.train_flops_per_image() / 1e12)
        if step > steps:  # its end (exports, a fine-tune's test) is of the weights it has
            log.info("the run is at step %d, past train.total_steps=%d: nothing to train; its "
                     "end is done with step %d's weights (for step %d's, start a run from "
                     "its checkpoint)", step, steps, step, steps)
        elif step == steps:
            log.info("the run finished its %d steps before: nothing to train", steps)

    # what is alive now lives to the end: out of the garbage collector's sight, before the
    # loader forks its workers (pretrain/interpreter.py)
    training_starts()
    # from the first batch on, a rank stuck for train.stall_timeout_s shows its stacks and ends
    watchdog = StallWatchdog(cfg.train.stall_timeout_s, rank, last_words=ended_by,
                              world=world).start()
    stream = iter(loader)  # closed at the end: its worker processes go with it
    batches = stream
    if resume is None:  # a picture of what the model sees: the first batch, augmented
        try:
            first = next(batches)
        except BaseException:  # a bad shard, say: no watchdog left behind in this process
            watchdog.stop()
            raise
        tracker.log_sample_grid(first.images)
        batches = itertools.chain([first], batches)
    loss_sum, window = torch.zeros((), device=backend.device), 0
    if carried:  # steps since the last log line, trained before the checkpoint: the next line
        # averages them too, as an uninterrupted run's does
        loss_sum.fill_(carried[0])
        window = int(carried[1])
    failed_saves = 0
    metrics: dict = dict(carried_metrics)
    skipped: dict = {}  # samples skipped over all ranks, by cause, as of the last log line

    def rollback() -> None:
        nonlocal step, window
        step = roll_back(store, backend, guard, step)
        tracker.rewind(step)  # MLflow takes the retrained steps' values too
        scheduler.step_update(step)
        loss_sum.zero_()  # the rolled-back steps' losses are not this window's
        window = 0

    def nonfinite(good_before: bool, dropped: str = "micro-batch skipped",
                  hint: str = "") -> bool:
        """After a micro-batch dropped for its loss: True when the run rolled back."""
        if guard.verdict(step, dropped) != "rollback":
            return False
        if good_before:  # these weights gave finite losses in this very step
            raise guard.stop(step, "the weights of this step gave finite losses, so the data "
                                   "is the likely cause" + hint)
        rollback()
        return True

    def dropped_step(late: list) -> None:
        """After a step with a non-finite loss whose check was read after the update
        (``late``: its micro-batches' verdicts; see pretrain.guard). The optimizer dropped the
        update, so the step is done again with new batches, unless the run rolls back or stops.
        Its finite losses do not end the streak of bad ones: the step trained on nothing."""
        for i, ok in enumerate(late):
            if ok:
                continue
            guard.record(False)
            if nonfinite(any(late[:i]), "update dropped, the step is done again with new "
                         "batches", "; train.nonfinite_check=before_backward drops only the "
                         "bad micro-batches instead of whole steps"):
                return

    def applied_nonfinite(late: list) -> None:
        """A loss was not finite but its gradients were (0 x inf inside the loss, say): the
        optimizer applied the update, so only a checkpoint from before it is clean."""
        for ok in late:
            guard.record(ok)
        message = (f"step {step + 1}: a loss was not finite but its gradients were, and the "
                   f"optimizer applied the update")
        if guard.action != "rollback" or guard.rollbacks >= guard.max_rollbacks:
            raise TrainingStopped(
                f"{message}; relaunch with train.nonfinite_check=before_backward: it resumes "
                f"from the newest checkpoint, which is intact")
        if backend.rank == 0:
            log.warning("%s: rolling back to undo it", message)
        rollback()

    # From here a stop signal is only noted, and the ranks act on it together at a step
    # boundary; before, during setup, it ends the process at once (there is nothing to save).
    stop = StopSignals(cfg.checkpoint.stop_signals, cfg.checkpoint.grace_period_s,
                       last_words=ended_by)
    # noted until the job ends: one after the last stop point (during the MLflow delivery,
    # say) leaves the work done and cuts that wait to its grace period, not the process short
    job.callback(stop.restore)
    tracker.leave_by = stop.leave_by

    def evaluate() -> None:
        """The evaluations due at ``step`` (all of them at the last), logged; a fine-tune's
        best export follows its dev figures."""
        results = run_due(evaluators, stage.evaluated(backend), step, force=step >= steps)
        if results:
            sink.log(results, step)
            metrics.update(results)
            last_eval.update(results)
            stage.after_eval(results, step, backend, tracker)
            timer.exclude_elapsed()

    try:
        if owed is not None and owed == step:
            evaluate()
        while step < steps:
            scheduler.step_update(step)
            done, step_loss = 0, torch.zeros((), device=backend.device)
            while done < accum:
                timer.fetching()
                images, targets = prepare_batch(next(batches), backend.device,
                                                cfg.data.normalize, mixup, backend.dtype)
                timer.data_ready()
                loss = backend.train_micro_batch(images, targets, cfg, guard,
                                                 last=done == accum - 1)
                if loss is None:  # not finite: dropped on every rank; the next one replaces it
                    nonfinite(good_before=done > 0)
                    continue
                step_loss += loss.float()
                done += 1
            # checks the backend deferred until after the update (see pretrain.guard)
            late = guard.settle()
            if not all(late):
                if backend.update_applied():
                    applied_nonfinite(late)
                else:
                    dropped_step(late)
                continue  # the same step again (or the one rolled back to), with new batches
            if late:
                guard.record(True)
            loss_sum += step_loss
            # the backend's own overflow check (DeepSpeed's ZeRO-1/2, a non-finite gradient
            # norm under Accelerate) may still have dropped the update
            guard.count_update(backend.update_applied())
            timer.step_done(images=micro * accum * world)
            step += 1
            window += accum

            if step % cfg.log.every_steps == 0 or step == steps:
                causes = loader.skipped_by_cause
                waits = torch.zeros(world)  # each rank's data-wait share, in its own slot
                waits[rank] = timer.data_wait_frac
                loss_total, total, *rest = all_reduce_sum(
                    [loss_sum, float(loader.skipped), *causes.values(), waits], backend.device)
                counts, waits = rest[:len(causes)], rest[len(causes):]
                skipped = {cause: round(n) for cause, n in zip(causes, counts)}
                metrics = {"train/loss": loss_total / (window * world),
                           "train/lr": backend.optimizer.param_groups[0]["lr"],
                           "train/grad_norm": backend.grad_norm(),
                           # the per-epoch counts: also right after resuming a checkpoint
                           # written before the causes were counted
                           "data/skipped_samples": round(total),
                           **{f"data/skipped/{c}": n for c, n in skipped.items() if n},
                           "train/epoch": loader.epoch,
                           **guard.metrics(), **timer.summary(), **slowest_data(waits)}
                if failed_saves:
                    metrics["checkpoint/failed_saves"] = failed_saves
                if sink.unwritten:  # metrics.jsonl / the MLflow spool on a full disk
                    metrics["log/unwritten_records"] = sink.unwritten
                loss_sum.zero_()
                window = 0
                sink.log(metrics, step)
            due = any(is_due(ev, step, force=step == steps) for ev in evaluators)
            # A stop signal before a due evaluation: the checkpoint comes first, and the
            # relaunch evaluates this step before it trains on (an evaluation of a whole split
            # can outlast a scheduler's grace period, and a kill after it loses every step
            # since the last checkpoint). After the last step the finish's stop points ask.
            if due:  # answered at once, not a boundary late as at other steps
                signame = stop.agreed_now()
            else:
                signame = stop.agreed() if step < steps else None
            owed = step if due and signame else None
            if due and not signame:
                evaluate()
                signame = stop.agreed_now() if step < steps else None  # one came meanwhile
            if step % cfg.checkpoint.every_steps == 0 or step == steps or signame:
                started = time.monotonic()
                saved = save(store, backend, loader, stage, cfg, step, steps, world,
                             tracker.run_id, guard, must_succeed=bool(signame),
                             loss_window=(float(loss_sum), window),
                             figures=last_eval, owed=owed)
                failed_saves += not saved
                if saved and not signame and step < steps:  # signalled while it was written?
                    signame = stop.agreed_now()  # then it is the stop checkpoint
                if signame:
                    stop.ending()
                    stop.report_save(time.monotonic() - started, signame)
                    if owed is not None and rank == 0:
                        log.info("%s came before step %d's evaluation: the checkpoint was "
                                 "written first; the relaunch evaluates step %d first", signame,
                                 step, step)
                    raise StoppedBySignal(signame, step, store.root / f"step_{step:08d}",
                                          "its evaluation" if step >= steps else None)
                progress()
                timer.exclude_elapsed()
        stop.ending()  # the last checkpoint is written: ranks may now leave at their own pace

        def stop_point(left: str) -> None:
            """Collective, between the parts of the stage's finish (an evaluation of a whole
            split, exports of GBs, each longer than a scheduler's grace period may be): a stop
            signal ends the job here as it does after a step; the relaunch finds the last
            step done and does the finish again."""
            signame = stop.agreed_now()
            if signame:  # (step: the resumed one, where train.total_steps was lowered below)
                raise StoppedBySignal(signame, step, store.root / f"step_{step:08d}", left)
        trained = dict(metrics)
        # (step: past total_steps where a relaunch lowered it; the weights are that step's)
        end_metrics = stage.finish(backend, step, sink, tracker, stop_point)
        metrics.update(end_metrics)
        stop.drain()
        tracker.stop_sampling()  # every node's last system sample on disk before rank 0's
        peaks = gather(peak_memory_gib(backend.device), world)  # tracker delivers the last
    except StoppedBySignal as e:  # a complete checkpoint of this step exists: a clean stop
        watchdog.stop()  # closing waits for an unreachable MLflow server, and that is no stall
        tracker.close("KILLED", tags={"stop.signal": e.signal, "stop.step": str(e.step)})
        sink.close()
        raise
    except BaseException as e:  # a stop, a bad shard, a crash: the MLflow run ends FAILED, now
        watchdog.stop()
        why = peer_gone(e)
        tracker.close("FAILED", tags={"failure": why} if why else None)
        raise
    finally:
        watchdog.stop()
        stream.close()
    sink.close()
    if rank == 0:  # (its MLflow run ended, or its end recorded for upload_spool.py)
        mark_finished(out, step, cfg, trained, end_metrics)
        log.info("data: %s", describe_skips(skipped))
        log.info("%s", closing_line(out, metrics, peaks))
    return metrics


def roll_back(store: CheckpointStore, backend, guard: NonFiniteGuard, step: int) -> int:
    """Reload weights and optimizer from the newest complete checkpoint; returns its step. The
    loader is not rewound: the batches since the checkpoint are not replayed (they may be why)."""
    ckpt = store.latest_agreed()
    if ckpt is None:
        raise guard.stop(step, "there is no complete checkpoint to roll back to yet")
    store.load(backend, ckpt)
    guard.rolled_back()
    if backend.rank == 0:
        log.warning("step %d: rolled back to %s (rollback %d of at most %d); the data goes on "
                    "from where it was", step + 1, ckpt.path, guard.rollbacks, guard.max_rollbacks)
    return ckpt.step


def save(store: CheckpointStore, backend, loader, stage, cfg: RunConfig, step: int, steps: int,
         world: int, run_id: Optional[str], guard: NonFiniteGuard, must_succeed: bool,
         loss_window: tuple = (0.0, 0), figures: Optional[dict] = None,
         owed: Optional[int] = None) -> bool:
    """Write checkpoint ``step``; False if the write failed and ``checkpoint.on_write_error``
    lets the run go on (never for the last one, nor for the one a stop signal asked for).
    ``loss_window``: this rank's (loss sum, micro-batches) since the last log line;
    ``figures``: the latest evaluations', which a relaunch after the last step reports;
    ``owed``: the step whose evaluation a stop signal put off, which the relaunch does."""
    # run_id: rank 0's MLflow run (None elsewhere, or while the server has not been reached)
    client = {"step": step, "loader": loader.state_dict(), "rng": gather(rng_state(), world),
              "config": to_yaml(cfg), "world_size": world, "tracking_run_id": run_id,
              "nonfinite_skipped": guard.skipped, "stage": stage.state_dict(),
              "loss_window": gather(list(loss_window), world), "eval_figures": figures or {},
              "eval_owed": owed}
    started = time.monotonic()
    try:
        ckpt = store.save(backend, step, client)
    except CheckpointWriteError as e:
        if cfg.checkpoint.on_write_error == "stop" or must_succeed or step == steps:
            raise
        if backend.rank == 0:
            log.warning("%s -- checkpoint.on_write_error=continue: training goes on and tries "
                        "again at step %d", e, min(steps, step + cfg.checkpoint.every_steps))
        return False
    if backend.rank == 0:  # the time: what each save costs the run, and a stop's grace period
        log.info("checkpoint %s (written in %.1f s)", ckpt.path, time.monotonic() - started)
    return True

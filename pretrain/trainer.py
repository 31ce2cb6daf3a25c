"""The pretraining loop, top to bottom: distributed setup, resume, the step, evaluation,
checkpoints. Components (data, engine, checkpoints, evaluators, metrics) live in their modules."""
from __future__ import annotations

import itertools
import logging
import math
import random
import socket
import warnings
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from pretrain import engine as eng_lib
from pretrain.checkpoint import Checkpoint, CheckpointStore, CheckpointWriteError
from pretrain.config import ConfigError, PretrainConfig, load_config, save_config, to_yaml
from pretrain.distributed import gather, init_distributed
from pretrain.guard import NonFiniteGuard
from pretrain.model import resolve_spec

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
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def check_same_run(out: Path, cfg: PretrainConfig, resume: Optional[Checkpoint]) -> None:
    """Refuse to continue someone else's run: a resumed checkpoint must be of this model."""
    if resume is None:
        return
    saved = out / "config.yaml"
    if not saved.is_file():
        return
    old = load_config(PretrainConfig, saved)
    if old.model != cfg.model:
        diff = [k for k in cfg.model.model_fields if getattr(old.model, k) != getattr(cfg.model, k)]
        raise ConfigError(
            f"output_dir '{out}' holds a run of another model (model.{diff[0]}: "
            f"{getattr(old.model, diff[0])!r} there, {getattr(cfg.model, diff[0])!r} now); "
            f"pick a new output_dir or set checkpoint.resume=false")


def total_steps(cfg: PretrainConfig, samples_per_epoch: int) -> int:
    if cfg.train.total_steps:
        return cfg.train.total_steps
    return max(1, math.ceil(cfg.train.epochs * samples_per_epoch / cfg.train.global_batch_size))


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------
def train(cfg: PretrainConfig) -> dict:
    """Train until ``train.total_steps``; returns the last logged metrics (rank 0's view)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from pretrain.data.loader import build_mixup, build_train_loader, prepare_batch
    from pretrain.demo import ensure_demo_data
    from pretrain.evaluate import run_due
    from pretrain.metrics import (MultiLogger, StepTimer, build_logger, peak_memory_gib,
                                  peak_tflops)
    from pretrain.tracking import start_tracking

    rank, world = init_distributed()
    setup_logging(rank)
    if cfg.data.generate_demo:
        ensure_demo_data(cfg.data.root, cfg.model.num_classes)
    micro, accum = cfg.train.batch_layout(world)
    out = Path(cfg.output_dir)
    store = CheckpointStore(out / "checkpoints", cfg.checkpoint.keep_last)
    resume = store.latest() if cfg.checkpoint.resume else None
    check_same_run(out, cfg, resume)

    ds_config = eng_lib.deepspeed_config(cfg, micro, accum, world)
    if resume is not None and resume.world_size != world:
        ds_config["checkpoint"] = {"load_universal": True}
        store.prepare_universal(resume)

    # the data first: a missing shard or a bad info file fails here, before the model is built
    spec = resolve_spec(cfg.model)
    loader = build_train_loader(cfg.data, img_size=spec.img_size, batch_size=micro, rank=rank,
                                world_size=world, seed=cfg.seed, num_classes=spec.num_classes,
                                log_sample_keys=cfg.debug.log_sample_keys,
                                pin_memory=get_accelerator().device_name() == "cuda")

    seed_everything(cfg.seed)  # identical initial weights on every rank
    model = eng_lib.build_model(cfg, ds_config)
    optimizer = eng_lib.build_optimizer(model, cfg)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    if cfg.train.compile:
        engine.compile()
    device = engine.device
    dtype = eng_lib.input_dtype(cfg.train.precision)
    evaluators = build_evaluators(cfg, spec, rank, world, device, dtype)  # checks the val shards
    steps = total_steps(cfg, loader.num_samples)
    scheduler = eng_lib.build_scheduler(optimizer, cfg, steps)
    mixup = build_mixup(cfg.data, spec.num_classes)

    step, run_id = 0, None
    if resume is not None:
        client = store.load(engine, resume)
        step, run_id = int(client["step"]), client.get("tracking_run_id")
        loader.load_state_dict(client["loader"])
        if resume.world_size == world:  # dropout / drop-path draws continue exactly
            set_rng_state(client["rng"][rank])
        log.info("resumed from %s at step %d", resume.path, step)
    elif rank == 0:
        save_config(cfg, out / "config.yaml")
    else:
        out.mkdir(parents=True, exist_ok=True)

    # MLflow on rank 0: one more sink; the same MLflow run when resuming (id from the checkpoint)
    tracker = start_tracking(cfg, "pretrain", out, rank, world_size=world, ds_config=ds_config,
                             hosts=gather(socket.gethostname(), world), run_id=run_id,
                             resumed_at=step if resume is not None else None)
    sink = MultiLogger(build_logger(out, steps, rank), tracker)
    timer = StepTimer(spec.train_flops_per_image(), world_size=world,
                      peak_tflops=peak_tflops(cfg.log.peak_tflops))
    if rank == 0:
        log.info("training %s for %d steps: global batch %d = %d ranks x %d x %d accumulation, "
                 "%.3f TFLOP per image", spec.name, steps, cfg.train.global_batch_size, world,
                 micro, accum, spec.train_flops_per_image() / 1e12)

    batches = iter(loader)
    if resume is None:  # a picture of what the model sees: the first batch, augmented
        first = next(batches)
        tracker.log_sample_grid(first.images)
        batches = itertools.chain([first], batches)
    guard = NonFiniteGuard(cfg.train.nonfinite_limit, cfg.train.on_nonfinite,
                           cfg.train.max_rollbacks)
    if resume is not None:
        guard.skipped = int(client.get("nonfinite_skipped", 0))
    loss_sum, window = torch.zeros((), device=device), 0
    failed_saves = 0
    metrics: dict = {}
    try:
        while step < steps:
            scheduler.step_update(step)
            done = 0
            while done < accum:
                images, targets = prepare_batch(next(batches), device, cfg.data.normalize, mixup,
                                                dtype)
                if done == 0:
                    timer.data_ready()
                loss = eng_lib.train_micro_batch(engine, images, targets, cfg, guard)
                if loss is None:  # not finite: dropped on every rank; the next one replaces it
                    if guard.verdict(step) == "rollback":
                        if done:  # these weights gave finite losses in this very step
                            raise guard.stop(step, "the weights of this step gave finite "
                                                   "losses, so the data is the likely cause")
                        step = roll_back(store, engine, guard, step)
                        scheduler.step_update(step)
                        loss_sum.zero_()  # the rolled-back steps' losses are not this window's
                        window = 0
                    continue
                loss_sum += loss.float()
                done += 1
            # DeepSpeed's own overflow check (ZeRO-1/2) may still have dropped the update
            guard.count_update(engine.was_step_applied())
            timer.step_done(images=micro * accum * world)
            step += 1
            window += accum

            if step % cfg.log.every_steps == 0 or step == steps:
                dist.all_reduce(loss_sum)
                skipped = torch.tensor(float(loader.skipped), device=device)
                dist.all_reduce(skipped)
                metrics = {"train/loss": loss_sum.item() / (window * world),
                           "train/lr": optimizer.param_groups[0]["lr"],
                           "train/grad_norm": float(engine.get_global_grad_norm() or 0.0),
                           "data/skipped_samples": skipped.item(),
                           "train/epoch": loader.epoch,
                           **guard.metrics(), **timer.summary()}
                if failed_saves:
                    metrics["checkpoint/failed_saves"] = failed_saves
                loss_sum.zero_()
                window = 0
                sink.log(metrics, step)
            results = run_due(evaluators, engine.module, step, force=step == steps)
            if results:
                sink.log(results, step)
                metrics.update(results)
                timer.exclude_elapsed()
            if step % cfg.checkpoint.every_steps == 0 or step == steps:
                failed_saves += not save(store, engine, loader, cfg, step, steps, world,
                                         tracker.run_id, guard)
                timer.exclude_elapsed()
    except BaseException:  # a stop, a bad shard, Ctrl-C: the MLflow run ends FAILED, now
        tracker.close("FAILED")
        raise
    sink.close()
    peaks = gather(peak_memory_gib(device), world)
    if rank == 0:
        log.info("done; peak memory per rank: %s", ", ".join(f"{g:.2f} GiB" for g in peaks))
    return metrics


def roll_back(store: CheckpointStore, engine, guard: NonFiniteGuard, step: int) -> int:
    """Reload weights and optimizer from the newest complete checkpoint; returns its step. The
    loader is not rewound: the batches since the checkpoint are not replayed (they may be why)."""
    ckpt = store.latest()
    if ckpt is None:
        raise guard.stop(step, "there is no complete checkpoint to roll back to yet")
    store.load(engine, ckpt)
    guard.rolled_back()
    if dist.get_rank() == 0:
        log.warning("step %d: rolled back to %s (rollback %d of at most %d); the data goes on "
                    "from where it was", step + 1, ckpt.path, guard.rollbacks, guard.max_rollbacks)
    return ckpt.step


def build_evaluators(cfg: PretrainConfig, spec, rank: int, world: int, device, dtype) -> list:
    """Held-out classification on data.val_split; the few-shot probe when eval.fewshot_root."""
    import functools

    from pretrain.data.info import read_info
    from pretrain.data.loader import build_eval_loader, normalize
    from pretrain.evaluate import ClassificationEvaluator, FewShotEvaluator

    norm = functools.partial(normalize, mode=cfg.data.normalize)
    common = dict(normalize=norm, device=device, dtype=dtype)

    def data(root: str, split: str):
        # built now, so a missing or unreadable split fails at start, not at the first evaluation
        loader = build_eval_loader(cfg.data.model_copy(update={"root": root}),
                                   img_size=spec.img_size, split=split,
                                   batch_size=cfg.eval.batch_size, rank=rank, world_size=world)
        return lambda: loader

    out = []
    if cfg.data.val_split:
        out.append(ClassificationEvaluator(data(cfg.data.root, cfg.data.val_split),
                                           name=cfg.eval.val_name,
                                           every_steps=cfg.eval.every_steps,
                                           max_samples=cfg.eval.max_samples, **common))
    e = cfg.eval
    if e.fewshot_root:
        classes = read_info(e.fewshot_root).classes
        out.append(FewShotEvaluator(
            data(e.fewshot_root, e.fewshot_train_split), data(e.fewshot_root, e.fewshot_test_split),
            name="fewshot_" + Path(e.fewshot_root.rstrip("/")).name, every_steps=e.fewshot_every_steps,
            shots=e.fewshot_shots, l2_reg=e.fewshot_l2_reg,
            num_classes=len(classes) if classes else None, seed=cfg.seed, **common))
    return out


def save(store: CheckpointStore, engine, loader, cfg: PretrainConfig, step: int, steps: int,
         world: int, run_id: Optional[str], guard: NonFiniteGuard) -> bool:
    """Write checkpoint ``step``; False if the write failed and ``checkpoint.on_write_error``
    lets the run go on (never for the last one)."""
    # run_id: rank 0's MLflow run (None elsewhere, or while the server has not been reached)
    client = {"step": step, "loader": loader.state_dict(), "rng": gather(rng_state(), world),
              "config": to_yaml(cfg), "world_size": world, "tracking_run_id": run_id,
              "nonfinite_skipped": guard.skipped}
    try:
        ckpt = store.save(engine, step, client)
    except CheckpointWriteError as e:
        if cfg.checkpoint.on_write_error == "stop" or step == steps:
            raise
        if dist.get_rank() == 0:
            log.warning("%s -- checkpoint.on_write_error=continue: training goes on and tries "
                        "again at step %d", e, min(steps, step + cfg.checkpoint.every_steps))
        return False
    if dist.get_rank() == 0:
        log.info("checkpoint %s", ckpt.path)
    return True

"""What our DeepSpeed engine costs per step over a plain PyTorch loop, measured in one process.

Both sides train the same model (same config, same seed, so the same initial weights) on the
same uint8 batches, with the same optimizer (:func:`pretrain.engine.build_optimizer`: AdamW,
decoupled weight decay on the same parameter groups), the same loss and the same gradient
clipping:

- **ours**: the trainer's step (:func:`pretrain.engine.train_micro_batch`, its non-finite
  check included) through ``deepspeed.initialize`` with
  :func:`pretrain.deepspeed_json.deepspeed_config` (ZeRO-2, a world of one,
  ``train.precision=bf16``): DeepSpeed casts the module to bf16 (every op computes in bf16),
  keeps fp32 master weights and fp32 AdamW state in ZeRO's flat partitions, turns the bf16
  gradients into fp32 there, clips, steps in fp32 and copies the result back into the bf16
  weights.
- **plain**: ``torch.autocast(bf16)`` over fp32 weights -- matmuls and convolutions in bf16,
  normalisation, softmax and the loss in fp32 --, fp32 gradients, ``clip_grad_norm_``, AdamW
  stepping the fp32 weights directly.

Both are "bf16 training with fp32 master weights and fp32 optimizer state"; they differ in
where the fp32 copy lives (the weights themselves vs ZeRO's partition) and in the precision of
the non-matmul ops (fp32 under autocast, bf16 in DeepSpeed's module).

Each side runs in a process of its own, as it would in training: in one process, the two
loops' allocation patterns evict each other's freed memory from glibc's heap, and DeepSpeed's
large flat buffers then come back as fresh pages to fault in every step (measured: +18 ms of a
270 ms step, page faults that a DeepSpeed loop alone stops having after its first step). Step
times are wall clock per step; the two processes take turns in blocks (which one goes first
alternates too) so load from other processes falls on both alike, and the medians are compared.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, List, Optional

import torch

from pretrain.benchmark import (as_json, bench_config, build_engine, device_name, input_dtype,
                                synthetic_batches)
from pretrain.config import PretrainConfig
from pretrain.distributed import init_distributed, leave


def _ds_step(cfg, engine, dtype) -> Callable:
    from pretrain import engine as eng
    from pretrain.data.device_batch import prepare_batch
    from pretrain.guard import NonFiniteGuard

    guard = NonFiniteGuard(cfg.train.nonfinite_limit, "stop", 0)  # the trainer's check too
    defer = eng.defers_check(cfg, engine.optimizer)

    def step(batch):
        images, targets = prepare_batch(batch, engine.device, cfg.data.normalize, None, dtype)
        loss = eng.train_micro_batch(engine, images, targets, cfg, guard, defer)
        guard.settle()  # a deferred check is read after the update, as the trainer reads it
        return loss
    return step


def _plain_step(cfg, model, optimizer, amp_dtype: Optional[torch.dtype]) -> Callable:
    from pretrain import engine as eng
    from pretrain.data.device_batch import prepare_batch

    params = [p for p in model.parameters() if p.requires_grad]
    device = next(model.parameters()).device

    def step(batch):
        images, targets = prepare_batch(batch, device, cfg.data.normalize, None, torch.float32)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(images)
        loss = eng.classification_loss(logits, targets, cfg.train.loss, cfg.data.label_smoothing)
        loss.backward()
        if cfg.optimizer.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.optimizer.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss
    return step


def _timed(step: Callable, batches: list, n: int, start: int) -> List[float]:
    out = []
    for i in range(n):
        t = time.perf_counter()
        step(batches[(start + i) % len(batches)])
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def _side_main(side: str, cfg_json: str, threads: Optional[int], warmup: int, conn) -> None:
    """One loop in a process of its own: build it, run ``warmup`` steps, report the first loss,
    then time blocks of steps as the parent asks (``(steps, start)``; None ends it)."""
    try:
        if threads:
            torch.set_num_threads(threads)
        cfg = PretrainConfig.model_validate_json(cfg_json)
        step, spec, device, extra = _build_side(side, cfg)
        batches = synthetic_batches(cfg.train.micro_batch_size, spec.img_size,
                                    spec.num_classes, device, count=2, seed=cfg.seed)
        first = [float(step(batches[0]).detach().float()) for _ in range(warmup)][0]
        conn.send(("ready", dict(extra, first_loss=first, device=device_name(device),
                                 threads=torch.get_num_threads(), model=spec.name,
                                 image_size=spec.img_size, num_classes=spec.num_classes)))
        while (ask := conn.recv()) is not None:
            conn.send(("times", _timed(step, batches, *ask)))
    except BaseException as e:  # noqa: BLE001 -- reported to the parent, which raises
        conn.send(("error", f"{side} loop: {type(e).__name__}: {e}"))
        raise
    finally:
        leave()


def _build_side(side: str, cfg: PretrainConfig):
    """(step, model spec, device, what to report) for one side; both sides seed the same
    initial weights."""
    from pretrain import engine as eng
    from pretrain.deepspeed_json import zero_stage

    torch.manual_seed(cfg.seed)
    if side == "deepspeed":
        if init_distributed()[1] != 1:
            raise ValueError("the overhead comparison runs in a world of one rank")
        engine, _, ds_config = build_engine(cfg)
        return (_ds_step(cfg, engine, input_dtype(cfg.train.precision)), engine.module.spec,
                engine.device, {"zero_stage": zero_stage(ds_config)})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = eng.build_model(cfg, {}).to(device)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)
    return (_plain_step(cfg, model, eng.build_optimizer(model, cfg), amp), model.spec, device,
            {})


def _receive(conn, kind: str):
    try:
        what, value = conn.recv()
    except EOFError:
        raise RuntimeError("a loop's process of the overhead comparison died; its error is "
                           "above") from None
    if what == "error":
        raise RuntimeError(value)
    assert what == kind, (what, kind)
    return value


def measure_overhead(model: str = "vit_small_patch16_224", batch: int = 32,
                     image_size: int = 64, num_classes: int = 1000, zero: int = 2,
                     precision: str = "bf16", steps: int = 3, repeats: int = 8, warmup: int = 2,
                     threads: Optional[int] = None, overrides=()) -> dict:
    """One DeepSpeed step against one plain step, each loop in a process of its own (spawned
    here); medians of ``repeats`` alternating blocks of ``steps`` steps each, after ``warmup``
    steps of each side. The DeepSpeed side is a world of one."""
    import multiprocessing as mp

    cfg = bench_config(model, batch, image_size=image_size, zero=zero, precision=precision,
                       num_classes=num_classes, overrides=overrides)
    ctx = mp.get_context("spawn")
    sides, procs = {}, []
    try:
        for name in ("deepspeed", "plain"):
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_side_main, daemon=True,
                               args=(name, as_json(cfg), threads, warmup, there))
            proc.start()
            there.close()  # so that a side that dies unannounced ends recv() with EOFError
            procs.append(proc)
            sides[name] = here
        info = {name: _receive(conn, "ready") for name, conn in sides.items()}
        times = {name: [] for name in sides}
        for r in range(repeats):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for name in order:
                sides[name].send((steps, r * steps))
                times[name] += _receive(sides[name], "times")
        for conn in sides.values():
            conn.send(None)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    ds_ms = 1e3 * statistics.median(times["deepspeed"])
    plain_ms = 1e3 * statistics.median(times["plain"])
    ds = info["deepspeed"]
    return {
        "model": ds["model"], "image_size": ds["image_size"], "batch": batch,
        "num_classes": ds["num_classes"], "zero_stage": ds["zero_stage"],
        "precision": cfg.train.precision, "device": ds["device"], "threads": ds["threads"],
        "steps_per_block": steps, "repeats": repeats, "processes": "one per side",
        "deepspeed_step_ms": ds_ms, "plain_step_ms": plain_ms, "ratio": ds_ms / plain_ms,
        "deepspeed_step_ms_min": 1e3 * min(times["deepspeed"]),
        "plain_step_ms_min": 1e3 * min(times["plain"]),
        "first_loss": {name: i["first_loss"] for name, i in info.items()},
    }

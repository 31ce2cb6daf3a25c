"""What our DeepSpeed engine costs per step over a plain PyTorch loop, measured in one process.

Both sides train the same model (same config, same seed, so the same initial weights) on the
same uint8 batches, with the same optimizer (:func:`pretrain.engine.build_optimizer`: AdamW,
decoupled weight decay on the same parameter groups), the same loss and the same gradient
clipping:

- **ours**: the trainer's step (:func:`pretrain.engine.train_micro_batch`, its non-finite
  check included) through ``deepspeed.initialize`` with
  :func:`pretrain.engine.deepspeed_config` (ZeRO-2, a world of one, ``train.precision=bf16``):
  DeepSpeed casts the module to bf16 (every op computes in bf16), keeps fp32 master weights
  and fp32 AdamW state in ZeRO's flat partitions, turns the bf16 gradients into fp32 there,
  clips, steps in fp32 and copies the result back into the bf16 weights.
- **plain**: ``torch.autocast(bf16)`` over fp32 weights -- matmuls and convolutions in bf16,
  normalisation, softmax and the loss in fp32 --, fp32 gradients, ``clip_grad_norm_``, AdamW
  stepping the fp32 weights directly.

Both are "bf16 training with fp32 master weights and fp32 optimizer state"; they differ in
where the fp32 copy lives (the weights themselves vs ZeRO's partition) and in the precision of
the non-matmul ops (fp32 under autocast, bf16 in DeepSpeed's module).

Step times are wall clock per step; the two sides alternate in blocks (which one goes first
alternates too) so load from other processes falls on both alike, and the medians are compared.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Callable, List, Optional

import torch

from pretrain.benchmark import bench_config, build_engine, input_dtype, synthetic_batches


def _ds_step(cfg, engine, dtype) -> Callable:
    from pretrain import engine as eng
    from pretrain.data.loader import prepare_batch
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
    from pretrain.data.loader import prepare_batch

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


def measure_overhead(model: str = "vit_small_patch16_224", batch: int = 32,
                     image_size: int = 64, num_classes: int = 1000, zero: int = 2,
                     precision: str = "bf16", steps: int = 3, repeats: int = 8, warmup: int = 2,
                     threads: Optional[int] = None, overrides=()) -> dict:
    """One DeepSpeed step against one plain step; medians of ``repeats`` alternating blocks of
    ``steps`` steps each, after ``warmup`` steps of each side. Runs in a world of one."""
    import deepspeed
    import torch.distributed as dist

    from pretrain import engine as eng
    from pretrain.benchmark import device_name
    from pretrain.distributed import free_port

    if threads:
        torch.set_num_threads(threads)
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    deepspeed.init_distributed(verbose=False)
    if dist.get_world_size() != 1:
        raise ValueError("the overhead comparison runs in a world of one rank")
    cfg = bench_config(model, batch, image_size=image_size, zero=zero, precision=precision,
                       num_classes=num_classes, overrides=overrides)

    torch.manual_seed(cfg.seed)
    engine, _, ds_config = build_engine(cfg)
    device = engine.device
    torch.manual_seed(cfg.seed)  # the same initial weights on the plain side
    plain_model = eng.build_model(cfg, {}).to(device)
    plain_opt = eng.build_optimizer(plain_model, cfg)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)

    spec = plain_model.spec
    batches = synthetic_batches(batch, spec.img_size, spec.num_classes, device, count=2,
                                seed=cfg.seed)
    sides = {"deepspeed": _ds_step(cfg, engine, input_dtype(cfg.train.precision)),
             "plain": _plain_step(cfg, plain_model, plain_opt, amp)}
    losses = {name: [float(step(batches[0]).detach().float()) for _ in range(warmup)]
              for name, step in sides.items()}
    times = {name: [] for name in sides}
    for r in range(repeats):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        for name in order:
            times[name] += _timed(sides[name], batches, steps, r * steps)
    ds_ms = 1e3 * statistics.median(times["deepspeed"])
    plain_ms = 1e3 * statistics.median(times["plain"])
    return {
        "model": spec.name, "image_size": spec.img_size, "batch": batch,
        "num_classes": spec.num_classes, "zero_stage": eng.zero_stage(ds_config),
        "precision": cfg.train.precision, "device": device_name(device),
        "threads": torch.get_num_threads(), "steps_per_block": steps, "repeats": repeats,
        "deepspeed_step_ms": ds_ms, "plain_step_ms": plain_ms, "ratio": ds_ms / plain_ms,
        "deepspeed_step_ms_min": 1e3 * min(times["deepspeed"]),
        "plain_step_ms_min": 1e3 * min(times["plain"]),
        "first_loss": {k: v[0] for k, v in losses.items()},
    }

"""The fine-tuning loop (ViT paper, App. B.1.1), on Accelerate: one zero-initialised head on a
pretrained backbone, SGD with momentum, cosine decay, a dev split carved from train for choosing
and the official test/val split for the reported figure; the best (by dev top-1) and final
weights exported as safetensors with a small JSON model card."""
from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import socket
from pathlib import Path

import torch

from finetune.config import FinetuneConfig
from pretrain import engine as eng_lib
from pretrain.config import save_config
from pretrain.guard import NonFiniteGuard

log = logging.getLogger("finetune")


def finetune(cfg: FinetuneConfig) -> dict:
    """Fine-tune until ``train.total_steps``; returns the final metrics (rank 0's view)."""
    from accelerate import Accelerator
    from accelerate.utils import gather_object

    from pretrain.data.loader import build_eval_loader, build_mixup, build_train_loader, \
        normalize, prepare_batch
    from pretrain.demo import ensure_demo_data
    from pretrain.evaluate import ClassificationEvaluator
    from pretrain.metrics import MultiLogger, StepTimer, build_logger, peak_tflops
    from pretrain.model import create_model
    from pretrain.tracking import lineage_tags, start_tracking
    from pretrain.trainer import seed_everything, setup_logging

    on_gpu = torch.cuda.is_available()
    precision = cfg.train.precision if on_gpu else "fp32"  # CPUs lack fast bf16/fp16 matmuls
    # Accelerate runs several CPU processes (gloo) only when told to use the CPU (DESIGN.md 5).
    accelerator = Accelerator(cpu=not on_gpu,
                              mixed_precision={"bf16": "bf16", "fp16": "fp16"}.get(precision, "no"))
    rank, world = accelerator.process_index, accelerator.num_processes
    setup_logging(rank)
    micro, accum = cfg.train.batch_layout(world)
    out = Path(cfg.output_dir)
    if cfg.data.generate_demo:
        ensure_demo_data(cfg.data.root, cfg.model.num_classes, layout="cifar10")

    seed_everything(cfg.seed)
    model = create_model(cfg.model)  # the new head: zero-initialised, no pre-logits
    lineage = {"format": "scratch"}
    if cfg.init:
        from finetune.weights import load_init
        lineage = load_init(model, cfg.init)
    spec = model.spec
    steps = cfg.train.total_steps
    optimizer = eng_lib.build_optimizer(model, cfg)
    scheduler = eng_lib.build_scheduler(optimizer, cfg, steps)
    model, optimizer = accelerator.prepare(model, optimizer)
    device = accelerator.device
    ema = None
    if cfg.train.ema_decay:  # every rank keeps the same average: its weights are the same
        from timm.utils import ModelEmaV3
        ema = ModelEmaV3(accelerator.unwrap_model(model), decay=cfg.train.ema_decay)
    if rank == 0:
        save_config(cfg, out / "config.yaml")
        log.info("fine-tuning %s at %d px from %s for %d steps: global batch %d = %d ranks x %d "
                 "x %d accumulation", spec.name, spec.img_size, cfg.init or "scratch", steps,
                 cfg.train.global_batch_size, world, micro, accum)

    loader = build_train_loader(cfg.data, img_size=spec.img_size, batch_size=micro, rank=rank,
                                world_size=world, seed=cfg.seed, num_classes=spec.num_classes,
                                holdout=cfg.data.dev_fraction, pin_memory=on_gpu)
    mixup = build_mixup(cfg.data, spec.num_classes)
    norm = functools.partial(normalize, mode=cfg.data.normalize)

    def evaluator(name, split, holdout=0.0):
        data = lambda: build_eval_loader(cfg.data, img_size=spec.img_size, split=split,  # noqa
                                         batch_size=cfg.eval.batch_size, rank=rank,
                                         world_size=world, holdout=holdout)
        return ClassificationEvaluator(data, normalize=norm, name=name, device=device,
                                       max_samples=cfg.eval.max_samples)

    dev = evaluator("dev", cfg.data.train_split, cfg.data.dev_fraction) \
        if cfg.data.dev_fraction else None
    test = evaluator(cfg.data.val_split, cfg.data.val_split) if cfg.data.val_split else None
    # MLflow: the fine-tune run carries the pretraining run it starts from (lineage tags)
    extra = lineage_tags(lineage.get("pretrain_run_id"), lineage.get("path"),
                         lineage.get("step") or 0) if cfg.init else {"init": "scratch"}
    hosts = gather_object([socket.gethostname()])
    tracker = start_tracking(cfg, "finetune", out, rank, world_size=world, hosts=hosts,
                             extra_tags=extra)
    sink = MultiLogger(build_logger(out, steps, rank), tracker)
    timer = StepTimer(spec.train_flops_per_image(), world_size=world,
                      peak_tflops=peak_tflops(cfg.log.peak_tflops))

    def reported():
        """The weights the figures and exports are of: the EMA when there is one."""
        return ema.module if ema is not None else model

    batches = iter(loader)
    loss_sum, window = torch.zeros((), device=device), 0
    guard = NonFiniteGuard(cfg.train.nonfinite_limit, cfg.train.on_nonfinite, 0, unit="step",
                           no_rollback="fine-tuning keeps no checkpoints to roll back to")
    best, metrics = -1.0, {}
    try:
        for step in range(steps):
            scheduler.step_update(step)
            step_loss = torch.zeros((), device=device)
            for micro_step in range(accum):
                images, targets = prepare_batch(next(batches), device, cfg.data.normalize, mixup)
                if micro_step == 0:
                    timer.data_ready()
                # gradients are averaged across ranks only on the last micro-batch
                sync = contextlib.nullcontext() if micro_step == accum - 1 \
                    else accelerator.no_sync(model)
                with sync, accelerator.autocast():
                    loss = eng_lib.classification_loss(model(images), targets, cfg.train.loss,
                                                       cfg.data.label_smoothing)
                    accelerator.backward(loss / accum)
                step_loss += loss.detach().float()
            grad_norm = accelerator.clip_grad_norm_(model.parameters(),
                                                    cfg.optimizer.grad_clip or float("inf"))
            if guard.finite(step_loss + grad_norm.detach().float()):  # same verdict on every rank
                optimizer.step()
                if ema is not None:
                    ema.update(accelerator.unwrap_model(model), step=step)
                loss_sum += step_loss
                window += accum
            else:  # the step is dropped: the weights (and the average) stay as they were
                guard.verdict(step)
            optimizer.zero_grad(set_to_none=True)
            timer.step_done(images=micro * accum * world)
            done = step + 1

            if done % cfg.log.every_steps == 0 or done == steps:
                mean = accelerator.reduce(loss_sum, "mean").item() / max(window, 1)
                metrics = {"train/loss": mean,
                           "train/lr": optimizer.param_groups[0]["lr"],
                           "train/grad_norm": float(grad_norm),
                           "train/nonfinite_skipped": guard.skipped, **timer.summary()}
                loss_sum.zero_()
                window = 0
                sink.log(metrics, done)
            if dev is not None and (done % cfg.eval.every_steps == 0 or done == steps):
                results = {f"eval/dev/{k}": v for k, v in dev.run(reported(), done).items()}
                sink.log(results, done)
                metrics.update(results)
                if results["eval/dev/top1"] > best:
                    best = results["eval/dev/top1"]
                    _export(accelerator, reported(), out / "best.safetensors", cfg, lineage, done,
                            results)
                timer.exclude_elapsed()

        if test is not None:
            results = {f"eval/{test.name}/{k}": v for k, v in test.run(reported(), steps).items()}
            sink.log(results, steps)
            metrics.update(results)
            if rank == 0:
                per_class = {str(c): acc for c, acc in enumerate(test.per_class_top1)}
                (out / "per_class_top1.json").write_text(json.dumps(per_class, indent=1))
                tracker.log_artifact_bytes("per_class_top1.json", json.dumps(per_class).encode())
                tracker.log_artifact_bytes("per_class_top1.png",
                                           per_class_png(test.per_class_top1, test.name))
    except BaseException:  # a stop, a bad shard, Ctrl-C: the MLflow run ends FAILED, now
        tracker.close("FAILED")
        raise
    _export(accelerator, reported(), out / "final.safetensors", cfg, lineage, steps, metrics)
    sink.close()
    accelerator.end_training()
    return metrics


def _export(accelerator, model, path: Path, cfg: FinetuneConfig, lineage: dict, step: int,
            metrics: dict) -> None:
    """Weights as safetensors plus ``<name>.json``: a model card a person or script can read."""
    from safetensors.torch import save_file

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        module = accelerator.unwrap_model(model)
        state = {k: v.detach().float().cpu().contiguous() for k, v in module.state_dict().items()}
        card = {"model": module.spec.name, "resolution": module.spec.img_size,
                "ema_decay": cfg.train.ema_decay,
                "num_classes": module.spec.num_classes, "dataset": cfg.data.root, "step": step,
                "init": lineage, "metrics": {k: v for k, v in metrics.items()
                                             if k.startswith("eval/")}}
        tmp = path.with_name(path.name + ".tmp")
        save_file(state, str(tmp), metadata={"model_card": json.dumps(card)})
        tmp.replace(path)
        path.with_suffix(".json").write_text(json.dumps(card, indent=1))


def per_class_png(per_class: list, split: str) -> bytes:
    """A bar chart of top-1 per class (classes absent from the split are left out)."""
    import matplotlib
    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt

    shown = [(c, acc) for c, acc in enumerate(per_class) if acc is not None]
    fig, ax = plt.subplots(figsize=(max(6, len(shown) * 0.12), 3), dpi=100)
    ax.bar([c for c, _ in shown], [acc for _, acc in shown], width=0.9)
    ax.set(xlabel="class", ylabel="top-1", ylim=(0, 1), title=f"per-class top-1 on {split}")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()

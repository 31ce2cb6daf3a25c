"""DeepSpeed engine from the typed config: optimizer with decoupled weight decay, warmup + decay
schedule (timm's schedulers), losses, ZeRO-3 model building, and :class:`DeepSpeedBackend`, the
pretraining backend of the training loop. The DeepSpeed JSON it hands to ``deepspeed.initialize``
is made in :mod:`pretrain.deepspeed_json`."""
from __future__ import annotations

import functools
import logging
import types
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.checkpoint_layout import (allow_universal, conversion, layout_changes,
                                        load_universal)
from pretrain.config import ConfigError, PretrainConfig, RunConfig
from pretrain.deepspeed_json import deepspeed_config, zero_stage
from pretrain.distributed import rank
from pretrain.grad_accum import keep_zero1_optimizer
from pretrain.model import ViTClassifier, create_model
from pretrain.profile import ENGINE_STEP

log = logging.getLogger(__name__)

def initialize(cfg: PretrainConfig, model: nn.Module, optimizer: torch.optim.Optimizer,
               ds_config: dict):
    """``deepspeed.initialize``; with ``deepspeed.one_pass_grad_checks``, ZeRO-1/2 check and
    measure the gradients in one pass each (:mod:`pretrain.grad_checks`); ZeRO-1/2 point the
    weights at the flat buffer after an update only where they are not
    (:mod:`pretrain.zero_views`); ZeRO-1 summing gradients in fp32 keeps DeepSpeed's ZeRO
    optimizer (:mod:`pretrain.grad_accum`)."""
    import deepspeed

    from pretrain import grad_checks, zero_views
    with keep_zero1_optimizer():
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                               config=ds_config)
    if cfg.deepspeed.one_pass_grad_checks:
        grad_checks.install(engine.optimizer)
    zero_views.install(engine.optimizer)
    return engine


def build_model(cfg: PretrainConfig, ds_config: dict) -> ViTClassifier:
    """Build the model; under ZeRO-3 inside ``zero.Init`` so no rank ever holds all of it."""
    if zero_stage(ds_config) < 3:
        model = create_model(cfg.model)
    else:
        import deepspeed
        # zero.Init patches tensor construction; importing timm (hence torch._dynamo) inside it
        # fails with a signature mismatch, so import it first.
        import timm  # noqa: F401

        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = create_model(cfg.model)
        # zero.Init partitions each submodule as soon as it is built, so the initialisation a
        # parent applies to its children afterwards (timm's trunc-normal, our head init) ran on
        # empty shards and did nothing: redo it on gathered parameters (rank 0's values win).
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            model.backbone.init_weights()
            model.init_head(bias=cfg.model.head_bias_init, zero=cfg.model.head_zero_init)
    apply_train_options(model, cfg)
    allow_universal(model)
    return model


def apply_train_options(model: ViTClassifier, cfg: RunConfig) -> None:
    """What ``train.*`` changes in the model itself, for both stages' backends."""
    t = cfg.train
    if t.block_kernels:
        from pretrain.block_kernels import adopt_block_kernels
        adopt_block_kernels(model.backbone)
    if not t.activation_checkpointing:
        return
    blocks = model.backbone.blocks
    count = checkpointed_blocks(t, len(blocks))
    if count == len(blocks):  # recompute every block's activations in backward (timm's own)
        model.backbone.set_grad_checkpointing(True)
        return
    for i in sorted({i * len(blocks) // count for i in range(count)}):  # spread over the depth
        checkpoint_module(blocks[i])


def checkpoint_module(module: nn.Module) -> None:
    """Make ``module`` keep only its input for the backward pass and run its forward again
    there. Its parameters and state-dict keys stay as they are (no wrapper module); dropout and
    stochastic depth draw the same numbers again (the RNG state is replayed). A bound method,
    not a closure, so that a deep copy (the EMA's) runs its own weights."""
    module.forward = types.MethodType(_checkpointed_forward, module)


def checkpointed_blocks(t, depth: int) -> int:
    """How many of ``depth`` blocks ``train.activation_checkpointing`` recomputes (``t``: the
    train section); more than the model has is a config error."""
    count = depth if t.checkpointed_blocks is None else t.checkpointed_blocks
    if t.activation_checkpointing and count > depth:
        raise ConfigError(f"config key 'train.checkpointed_blocks': {count} is more than the "
                          f"model's {depth} blocks")
    return count


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    from torch.utils.checkpoint import checkpoint
    return checkpoint(type(self).forward, self, *args, use_reentrant=False, **kwargs)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decoupled weight decay on weight matrices only: never on biases, norms, the position
    embedding or the class token (AugReg / big_vision)."""
    no_decay_names = {"pos_embed", "cls_token", "reg_token"}
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        shape = getattr(p, "ds_shape", p.shape)  # ZeRO-3 keeps the full shape aside
        if len(shape) <= 1 or name.rsplit(".", 1)[-1] in no_decay_names:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]




def build_optimizer(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    o = cfg.optimizer
    ignored = [k for k in o.unused() if k in o.model_fields_set]
    if ignored and rank() == 0:
        log.warning("optimizer.%s not used by optimizer.name=%s (set by a recipe or override "
                    "for the other optimizer)", ", optimizer.".join(ignored), o.name)
    groups = param_groups(model, o.weight_decay)
    on_gpu = torch.cuda.is_available()
    if o.name == "adamw":
        # fused kernels on GPU; foreach elsewhere
        fast = {"fused": True} if on_gpu else {"foreach": True}
        return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, **fast)
    return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, foreach=True)


def steps_to_param_device(optimizer: torch.optim.Optimizer) -> None:
    """A fused (or capturable) AdamW keeps its step counter on its parameter's device, where
    its kernel reads it; torch's ``load_state_dict`` moves it there. DeepSpeed's universal
    checkpoint load sets the counter it read on the CPU directly, so move it here."""
    for group in optimizer.param_groups:
        if group.get("fused") or group.get("capturable"):
            for p in group["params"]:
                state = optimizer.state.get(p)
                if state and "step" in state:
                    state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).to(p.device)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: RunConfig, total_steps: int):
    """Linear warmup from 0, then linear (ViT paper) or cosine decay to ``min_lr`` at the end.

    timm's schedulers are pure functions of the update count: resuming only needs the step.
    """
    from timm.scheduler import CosineLRScheduler, PolyLRScheduler

    s = cfg.schedule
    warmup = min(s.warmup_steps, max(total_steps - 1, 0))
    if warmup < s.warmup_steps and rank() == 0:
        log.warning("schedule.warmup_steps=%d is not shorter than the run's %d steps: the "
                    "learning rate warms up over %d steps and never decays; lower "
                    "schedule.warmup_steps", s.warmup_steps, total_steps, warmup)
    common = dict(t_initial=max(total_steps - warmup, 1), lr_min=s.min_lr, warmup_t=warmup,
                  warmup_lr_init=0.0, warmup_prefix=True, t_in_epochs=False)
    made = CosineLRScheduler if s.decay == "cosine" else \
        functools.partial(PolyLRScheduler, power=1.0)
    # timm says the same (a decay over one step has no effect) on every rank, in its words
    timm_log = logging.getLogger("timm.scheduler")
    level = timm_log.level
    if warmup < s.warmup_steps:
        timm_log.setLevel(logging.ERROR)
    try:
        return made(optimizer, **common)
    finally:
        timm_log.setLevel(level)


def soft_targets(labels: torch.Tensor, num_classes: int, smoothing: float = 0.0) -> torch.Tensor:
    """Integer labels -> dense targets; dense (mixup) targets pass through."""
    if labels.ndim == 2:
        return labels.float()
    off = smoothing / num_classes
    out = torch.full((labels.shape[0], num_classes), off, device=labels.device)
    return out.scatter_(1, labels.long().unsqueeze(1), 1.0 - smoothing + off)


def classification_loss(logits: torch.Tensor, targets: torch.Tensor, kind: str,
                        smoothing: float = 0.0) -> torch.Tensor:
    """Softmax cross-entropy, or the paper's sigmoid cross-entropy summed over classes
    (a per-element mean would shrink the gradient by the 21k classes)."""
    logits = logits.float()
    dense = soft_targets(targets, logits.shape[-1], smoothing)
    if kind == "sigmoid":
        return F.binary_cross_entropy_with_logits(logits, dense, reduction="none").sum(-1).mean()
    return torch.sum(-dense * F.log_softmax(logits, dim=-1), dim=-1).mean()


def train_micro_batch(engine, images: torch.Tensor, targets: torch.Tensor, cfg: RunConfig,
                      guard=None, defer: bool = False) -> Optional[torch.Tensor]:
    """One micro-batch through the DeepSpeed engine: forward, loss, backward, step (DeepSpeed
    applies the update on the accumulation boundary). The trainer and the benchmarks share it,
    so what they time is what trains. With a :class:`pretrain.guard.NonFiniteGuard`, a loss that
    is not finite on some rank is dropped on every rank before backward (returns None), or with
    ``defer`` its check is queued for :meth:`~pretrain.guard.NonFiniteGuard.settle` and the
    optimizer's own overflow check drops the update (see :func:`drops_nonfinite_updates`)."""
    loss = classification_loss(engine(images), targets, cfg.train.loss, cfg.data.label_smoothing)
    if guard is not None:
        if defer:
            guard.defer(loss)
        elif not guard.finite(loss):
            return None
    engine.backward(loss)
    # a profiler range (almost free without a profiler): what runs inside is the update or
    # DeepSpeed's bookkeeping around it, in `benchmark.py train --profile`'s breakdown
    with torch.profiler.record_function(ENGINE_STEP):
        engine.step()
    return loss.detach()


def defers_check(cfg: RunConfig, optimizer) -> bool:
    """Whether the non-finite check waits until after the update (``train.nonfinite_check``).
    Never under fp16: its dynamic loss scaler would take every non-finite loss for an
    overflow, halve the scale (so the step done again would not train what it would have) and,
    after enough of them, stop the run with a bare exception at the minimum scale."""
    return cfg.train.nonfinite_check == "after_update" and cfg.train.precision != "fp16" and \
        drops_nonfinite_updates(optimizer)


def drops_nonfinite_updates(optimizer) -> bool:
    """Whether DeepSpeed's optimizer skips, on every rank, an update whose gradients are not
    finite, cleaning its gradient buffers (so the non-finite check can wait until after it).

    Its fp16/bf16 optimizers for ZeRO-0 always do (bf16 runs in ``FP16_UnfusedOptimizer`` or
    ``BF16_Optimizer``); ZeRO-1/2 do when told to check for overflow (``check_grad_overflow``:
    on for fp16, and for bf16 by default). ZeRO-3 checks only under fp16, and a plain PyTorch
    optimizer (fp32, ZeRO-0) never does: those check first."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    if isinstance(optimizer, (BF16_Optimizer, FP16_Optimizer, FP16_UnfusedOptimizer)):
        return True
    return isinstance(optimizer, DeepSpeedZeroOptimizer) and \
        bool(getattr(optimizer, "check_grad_overflow", False))


def compile_options(cfg: RunConfig) -> dict:
    """torch.compile's keyword arguments for ``train.compile_mode`` (both stages)."""
    mode = cfg.train.compile_mode
    return {} if mode == "default" else {"mode": mode}


def input_dtype(precision: str) -> torch.dtype:
    """The dtype DeepSpeed's engine expects its inputs in for ``train.precision``."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


class DeepSpeedBackend:
    """Pretraining's backend for :func:`pretrain.trainer.train`: a DeepSpeed engine (ZeRO 0-3,
    bf16/fp16, gradient clipping) and DeepSpeed's checkpoint files. The fine-tuning twin is
    :class:`finetune.backend.AccelerateBackend`; both offer the same attributes and methods."""

    def __init__(self, cfg: PretrainConfig):
        from deepspeed.accelerator import get_accelerator

        from pretrain.distributed import init_distributed
        from pretrain.same_job import batch_layout, check_same_job
        self.rank, self.world_size = init_distributed()
        check_same_job(cfg, self.world_size)  # each node its own checkout and recipe file
        layout = batch_layout(cfg, self.world_size)
        # a bad deepspeed.config file, or what DeepSpeed cannot run with this world's batch
        # layout (pretrain.grad_accum), fails now, before any work
        deepspeed_config(cfg, *layout, self.world_size)
        self.on_gpu = get_accelerator().device_name() == "cuda"
        self.engine = self.optimizer = self.ds_config = None
        self.precision = cfg.train.precision  # the checkpoints' manifests keep it

    def build(self, cfg: RunConfig, micro: int, accum: int, resume, store,
              init_weights=None) -> None:
        """Model, optimizer and engine; ``resume`` (a :class:`pretrain.checkpoint.Checkpoint`
        or None) written on another world size is first converted to a universal checkpoint."""
        if init_weights is not None:
            raise NotImplementedError("pretraining starts from the model's own initialisation")
        self.ds_config = deepspeed_config(cfg, micro, accum, self.world_size)
        self.zero_stage = zero_stage(self.ds_config)
        why = conversion(resume, self.world_size, self.zero_stage, self.precision,
                         cfg.optimizer.name) if resume is not None else ""
        if why:
            load_universal(self.ds_config)
            store.prepare_universal(resume, why)
        model = build_model(cfg, self.ds_config)
        self.optimizer = build_optimizer(model, cfg)
        self.engine = initialize(cfg, model, self.optimizer, self.ds_config)
        if cfg.train.compile:
            self.engine.compile(compile_kwargs=compile_options(cfg))
        self.device = self.engine.device
        self.dtype = input_dtype(cfg.train.precision)
        self.defer_check = defers_check(cfg, self.engine.optimizer)

    def _needs_universal(self, ckpt) -> str:
        return layout_changes(ckpt, self.world_size, self.zero_stage, self.precision)

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    def config_artifact(self) -> Optional[dict]:
        """Logged next to the run's config in MLflow."""
        return self.ds_config

    def train_micro_batch(self, images, targets, cfg: RunConfig, guard, last: bool):
        # DeepSpeed knows the accumulation boundary itself: ``last`` is for other backends
        return train_micro_batch(self.engine, images, targets, cfg, guard, self.defer_check)

    def update_applied(self) -> bool:
        return self.engine.was_step_applied()

    def grad_norm(self) -> float:
        return float(self.engine.get_global_grad_norm() or 0.0)

    def save_checkpoint(self, root: Path, tag: str, client_state: dict) -> None:
        # ends in a barrier of all ranks (CheckpointStore.save relies on it)
        self.engine.save_checkpoint(str(root), tag=tag, client_state=client_state,
                                    save_latest=False)

    def client_state(self, root: Path, ckpt) -> dict:
        """What :meth:`load_checkpoint` returns, read from rank 0's file without loading any
        weights (``weights_only``: no screening needed)."""
        from pretrain.consolidate import read_client_state
        return read_client_state(Path(root) / ckpt.tag)

    def load_checkpoint(self, root: Path, ckpt) -> dict:
        from pretrain.pickle_screen import check_pickles_are_inert
        universal = bool(self._needs_universal(ckpt))
        tag = ckpt.tag + "_universal" if universal else ckpt.tag
        # DeepSpeed unpickles with weights_only=False: every file it may read is screened first,
        # a universal copy's zero/<param>/*.pt included
        check_pickles_are_inert(Path(root) / tag)
        # DeepSpeed reads the universal layout whenever its config said so at the start; a
        # rollback of a job that resumed on another world size loads its own, plain checkpoint
        self.engine._config.load_universal_checkpoint = universal
        path, client = self.engine.load_checkpoint(str(root), tag=tag,
                                                   load_optimizer_states=True,
                                                   load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {Path(root) / tag}")
        steps_to_param_device(self.optimizer)
        return client

"""Fine-tuning's backend for the training loop (:func:`pretrain.trainer.train`): Accelerate.

Plain PyTorch under ``accelerate launch`` or ``torchrun`` (DDP; DeepSpeed when an Accelerate
config asks for it, on GPUs or CPUs: :mod:`finetune.accelerate_deepspeed`; FSDP on GPUs), with
optional Polyak/EMA weights. It offers what :class:`pretrain.engine.DeepSpeedBackend` offers,
so the loop does not know which one it drives.

Checkpoints are Accelerate's ``save_state`` files (model, optimizer, EMA, per-rank RNG, written
the right way for DDP, FSDP and DeepSpeed alike) plus the loop's ``client_state.pt``; they are
read back with ``weights_only=True``: loading a checkpoint runs no pickled code. Two exceptions:
DeepSpeed's own directory under an Accelerate DeepSpeed config, which DeepSpeed unpickles with
``weights_only=False``, is screened first, as pretraining's checkpoints are; FSDP's sharded state
(``torch.distributed.checkpoint``) has a ``.metadata`` file that torch unpickles as it is.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from finetune import accelerate_deepspeed, launch_options
from pretrain.checkpoint import CLIENT_STATE
from pretrain.config import ConfigError, RunConfig
from pretrain.deepspeed_json import zero_stage
from pretrain.checkpoint_layout import (allow_universal, as_written, conversion, load_universal,
                                       saved_precision, unresumable)
from pretrain.engine import (apply_train_options, build_optimizer, classification_loss,
                             compile_options, input_dtype)
from pretrain.grad_accum import keep_zero1_optimizer, summed_in
from pretrain.same_job import check_same_job

log = logging.getLogger("finetune")

# How Accelerate wrote a checkpoint, told from its files (checkpoints from before the manifest
# kept anything of it included): each kind's files load only under the same kind.
LAYOUTS = {"plain": "without DeepSpeed or FSDP", "deepspeed": "under Accelerate's DeepSpeed config",
           "fsdp": "under Accelerate's FSDP config"}


def saved_layout(path: Path) -> str:
    """Which of :data:`LAYOUTS` wrote the checkpoint folder ``path``."""
    from accelerate.utils.constants import FSDP_MODEL_NAME, MODEL_NAME
    if (path / MODEL_NAME).is_dir():  # DeepSpeed's own save_checkpoint folder
        return "deepspeed"
    if any(path.glob(FSDP_MODEL_NAME + "*")):
        return "fsdp"
    return "plain"


class AccelerateBackend:
    zero_stage = 0  # the checkpoint manifest's field: DeepSpeed's stage under its config

    def __init__(self, cfg: RunConfig):
        self.on_gpu = torch.cuda.is_available()
        if not self.on_gpu:
            # Accelerate imports DeepSpeed (where installed) at the first export, to unwrap
            # the model; DeepSpeed's accelerator probe would then warn from every rank, in the
            # middle of the log, that it found no GPU: this run is on the CPU by now anyway
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        precision = self.precision = cfg.train.precision  # fp16 on a CPU: refused by the trainer
        launch_options.check(precision, self.on_gpu)
        self.accelerator = accelerate_deepspeed.accelerator(
            self.on_gpu, mixed_precision={"bf16": "bf16", "fp16": "fp16"}.get(precision, "no"))
        self.rank = self.accelerator.process_index
        self.world_size = self.accelerator.num_processes
        check_same_job(cfg, self.world_size)  # each node its own checkout and recipe file
        self.device = self.accelerator.device
        from accelerate.utils import DistributedType
        self.deepspeed = self.accelerator.distributed_type == DistributedType.DEEPSPEED
        # inputs stay fp32 and autocast picks the matmul precision, but for DeepSpeed, which
        # holds the model itself in bf16/fp16 and runs no autocast
        self.dtype = input_dtype(precision) if self.deepspeed else torch.float32
        self.ema = None
        self._applied, self._grad_norm = True, 0.0

    def build(self, cfg: RunConfig, micro: int, accum: int, resume, store,
              init_weights: Optional[Callable[[nn.Module], None]] = None) -> None:
        from pretrain.model import create_model

        why = self._resume_plan(resume, cfg.optimizer.name) if resume is not None else ""
        # the average is a whole copy of the model on every rank, updated from this rank's
        # parameters, and the few-shot probe calls the model's pre-logits directly: under
        # sharding both would see shards
        whole = [k for k, v in (("train.ema_decay", cfg.train.ema_decay),
                                ("eval.fewshot_root", cfg.eval.fewshot_root)) if v]
        if whole and self._sharded():
            raise ConfigError(f"{whole[0]} needs every rank to hold the whole model, which FSDP "
                              f"and DeepSpeed ZeRO-3 do not; use an Accelerate config without "
                              f"sharding (DDP, ZeRO-1/2) or set {whole[0]}=null")
        model = create_model(cfg.model)  # the new head: zero-initialised, no pre-logits
        if init_weights is not None:
            init_weights(model)
        apply_train_options(model, cfg)
        if self.deepspeed:
            allow_universal(model)
        if cfg.train.compile:
            # in place, as DeepSpeed's engine.compile() does for pretraining: the state dict
            # keeps its keys (Accelerate's dynamo_backend would prefix them with _orig_mod.,
            # into checkpoints and exports)
            model.compile(**compile_options(cfg))
        optimizer = build_optimizer(model, cfg)
        if self.deepspeed:
            accelerate_deepspeed.fill_deepspeed_values(
                self.ds_config, micro, accum, self.world_size, cfg.optimizer.grad_clip,
                cfg.train.precision)
            # the layout Accelerate itself keeps (it would warn that the config's differs); it
            # divides no loss by it under DeepSpeed, which does that itself
            self.accelerator.gradient_accumulation_steps = accum
            if why:
                from accelerate.utils.constants import MODEL_NAME
                load_universal(self.ds_config)
                store.prepare_universal(resume, why, MODEL_NAME)
        with keep_zero1_optimizer() if self.deepspeed else contextlib.nullcontext():
            self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        if self.deepspeed:
            self.zero_stage = zero_stage(self.ds_config)
            summed = summed_in(self.ds_config, cfg.train.precision)
            log.info("under Accelerate's DeepSpeed config: ZeRO-%d%s", self.zero_stage,
                     f", {accum} micro-batches' gradients summed in {summed}" if accum > 1 else "")
        self.cfg, self.accum = cfg, accum
        # _update drops a step whose gradient norm is not finite, so the non-finite check can
        # wait until after it (pretrain.guard); not under an Accelerate DeepSpeed config
        # (DeepSpeed's step decides alone) nor under fp16 (its loss scaler must see each step)
        self.defer_check = cfg.train.nonfinite_check == "after_update" and \
            cfg.train.precision != "fp16" and not self.deepspeed
        if cfg.train.ema_decay:  # every rank keeps the same average: its weights are the same
            from timm.utils import ModelEmaV3
            # in fp32 whatever the model's dtype (DeepSpeed's is bf16/fp16): a half-precision
            # average cannot hold (1 - decay) x the weights' change (timm rounds a bf16 one
            # stochastically, which only holds in expectation; an fp16 one it cannot)
            self.ema = ModelEmaV3(self.module, decay=cfg.train.ema_decay, dtype=torch.float32)
            self.accelerator.register_for_checkpointing(self.ema)

    def _layout(self) -> str:
        from accelerate.utils import DistributedType
        return "deepspeed" if self.deepspeed else \
            "fsdp" if self.accelerator.distributed_type == DistributedType.FSDP else "plain"

    def _resume_plan(self, ckpt, optimizer: str) -> str:
        """Why DeepSpeed's files of ``ckpt`` are read through the universal copy
        :meth:`pretrain.checkpoint.CheckpointStore.prepare_universal` makes (another world size,
        ZeRO stage or precision, as in pretraining; "" when they are read as written), or a
        one-line refusal of a checkpoint this job's Accelerate cannot load (it failed in
        DeepSpeed with a bare AssertionError, a KeyError or a missing file): one written under
        another layout; under DeepSpeed, one that needs converting but cannot be (SGD's state at
        ZeRO-3, or written before the fine-tune's model was marked for conversion). Without
        DeepSpeed the files hold the whole state: another world size or precision loads, but
        fp16 then needs the loss scaler's state, which no other precision saves."""
        from accelerate.utils.constants import MODEL_NAME, SCALER_NAME
        was, now = saved_layout(ckpt.path), self._layout()
        if was == now == "deepspeed":
            return conversion(ckpt, self.world_size, zero_stage(self.ds_config), self.precision,
                              optimizer, ckpt.path / MODEL_NAME, LAYOUTS[was],
                              marked=ckpt.precision is not None)
        precision = saved_precision(ckpt, self.precision, ckpt.path / MODEL_NAME) \
            if was == "deepspeed" else ckpt.precision
        if was != now:
            refused = f"written {LAYOUTS[was]}, this job runs {LAYOUTS[now]}"
        elif self.precision == "fp16" and not (ckpt.path / SCALER_NAME).is_file():
            refused = f"train.precision {precision or 'fp32 or bf16'} -> fp16, whose loss " \
                      f"scaler state the checkpoint lacks"
        else:
            return ""
        raise unresumable(ckpt, refused,
                          as_written(ckpt, precision, LAYOUTS[was], zero=was == "deepspeed"))

    def _sharded(self) -> bool:
        """Whether Accelerate's config shards the parameters across ranks."""
        from accelerate.utils import DistributedType
        kind = self.accelerator.distributed_type
        if kind == DistributedType.FSDP:
            return True
        plugin = self.accelerator.state.deepspeed_plugin
        return kind == DistributedType.DEEPSPEED and plugin is not None and \
            plugin.zero_stage == 3

    @property
    def module(self) -> nn.Module:
        return self.accelerator.unwrap_model(self.model)

    @property
    def ds_config(self) -> dict:
        return self.accelerator.state.deepspeed_plugin.deepspeed_config

    def config_artifact(self) -> Optional[dict]:
        return self.ds_config if self.deepspeed else None

    def train_micro_batch(self, images, targets, cfg: RunConfig, guard, last: bool):
        """Forward, the non-finite check, backward; on the step's ``last`` micro-batch also
        clipping and the update. None when the loss was dropped (see :mod:`pretrain.guard`)."""
        acc = self.accelerator
        # gradients are averaged across ranks only on the last micro-batch of a step
        with contextlib.nullcontext() if last else acc.no_sync(self.model):
            with acc.autocast():
                loss = classification_loss(self.model(images), targets, cfg.train.loss,
                                           cfg.data.label_smoothing)
            if guard is not None:
                if self.defer_check:
                    guard.defer(loss)
                elif not guard.finite(loss):
                    return None
            if self.deepspeed:
                # Accelerate's DeepSpeed wrapper steps the engine whenever sync_gradients is
                # set, and DeepSpeed divides the loss by its gradient_accumulation_steps itself
                acc.sync_gradients = last
                acc.backward(loss)
            else:
                acc.backward(loss / self.accum)
        if last:
            self._update()
        return loss.detach()

    def _update(self) -> None:
        clip = self.cfg.optimizer.grad_clip or float("inf")
        norm = self.accelerator.clip_grad_norm_(self.model.parameters(), clip)
        # the norm of the all-reduced gradients: the same verdict on every rank (None: an
        # Accelerate DeepSpeed config clips, and checks for overflow, inside DeepSpeed's step)
        self._grad_norm = float(norm) if norm is not None else 0.0
        if self.accelerator.scaler is not None:
            # fp16 (GPU only): the loss scaler skips a step with non-finite gradients itself
            # and lowers its scale, but only inside optimizer.step(); without that call it
            # would keep this step's unscaled state, and the next clip would raise
            self.optimizer.step()
            self._applied = not self.optimizer.step_was_skipped
        else:
            self._applied = math.isfinite(self._grad_norm)
            if self._applied:
                self.optimizer.step()
        if self._applied and self.ema is not None:
            self.ema.update(self.module)
        self.optimizer.zero_grad(set_to_none=True)

    def update_applied(self) -> bool:
        return self._applied

    def grad_norm(self) -> float:
        return self._grad_norm

    def save_checkpoint(self, root: Path, tag: str, client_state: dict) -> None:
        path = Path(root) / tag
        self.accelerator.save_state(str(path), safe_serialization=True)
        if self.accelerator.is_main_process:
            torch.save(client_state, path / CLIENT_STATE)
        self.accelerator.wait_for_everyone()  # the closing barrier CheckpointStore relies on

    def load_checkpoint(self, root: Path, ckpt) -> dict:
        from accelerate.utils import MODEL_NAME
        from accelerate.utils import load  # torch.load(weights_only=True), numpy arrays allowed

        from pretrain.pickle_screen import check_pickles_are_inert
        path = Path(root) / ckpt.tag
        # DeepSpeed's files, which load_state has it unpickle: screened before anything reads
        # them, the universal copy made of them too
        if (path / MODEL_NAME).is_dir():
            check_pickles_are_inert(path / MODEL_NAME)
        universal = bool(self._resume_plan(ckpt, self.cfg.optimizer.name))
        if universal:
            path = path.with_name(ckpt.tag + "_universal")
            check_pickles_are_inert(path / MODEL_NAME)
        if self.deepspeed:  # as pretraining's: a rollback loads this job's own, as written
            self.model._config.load_universal_checkpoint = universal
        self.accelerator.load_state(str(path))
        return load(path / CLIENT_STATE, map_location="cpu")

    def full_state_dict(self, module: Optional[nn.Module] = None) -> Optional[dict]:
        """The whole model's weights on the main process (None elsewhere): gathered from the
        shards under FSDP or DeepSpeed ZeRO-3, so every rank must call it. ``module``: another
        copy of the model to export instead (the EMA, kept whole on every rank)."""
        if module is not None:
            state = module.state_dict()
        else:
            state = self.accelerator.get_state_dict(self.model)
        if not self.accelerator.is_main_process:
            return None
        return {k: v.detach().float().cpu().contiguous() for k, v in state.items()}

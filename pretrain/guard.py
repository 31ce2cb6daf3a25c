"""Never train on a non-finite loss.

Every micro-batch's loss is checked on all ranks together (one scalar all-reduce: ranks must
agree, or the gradient reduction of those that go on would wait for the others forever). A
micro-batch whose loss is NaN or infinite on any rank is never trained on, on any rank, and is
counted. When the verdict is read depends on the optimizer (``train.nonfinite_check``):

- **after the update**, where the optimizer itself skips an update whose gradients are not
  finite (DeepSpeed's bf16 optimizers for ZeRO-0/1/2, see
  :func:`pretrain.engine.drops_nonfinite_updates`; plain PyTorch under Accelerate in fp32 or
  bf16, which drops a step with a non-finite gradient norm) and no fp16 loss scaler would
  count a bad loss as an overflow: the check is only queued on the device (:meth:`defer`) and
  the backward pass follows at once. A bad loss makes the gradients non-finite, the optimizer
  drops the whole update, and the verdicts, read after it (:meth:`settle`), say why: the step
  is then done again with new micro-batches, so a bad batch costs its step's batches. The host
  waits for nothing it did not wait for already (the optimizer reads the gradient norm), and a
  step trains exactly what it would have with the check read first. Should a bad loss leave
  the gradients finite (0 x inf inside the loss), the update went in: the run rolls back to
  the newest checkpoint, or stops where it may not.
- **before the backward pass** elsewhere (DeepSpeed under fp32 or fp16, ZeRO-3 under bf16, a
  fine-tune in fp16 or under an Accelerate DeepSpeed config) or with
  ``train.nonfinite_check=before_backward`` (:meth:`finite`): the bad micro-batch is dropped --
  no backward, no optimizer step -- and the step goes on with the next micro-batch from the
  loader, so a bad batch costs one batch. The price is one host sync per micro-batch: on a GPU
  the CPU waits for the forward pass before it queues the backward one, and the GPU idles.

``train.nonfinite_limit`` bad losses in a row -- with the check after the update: since the
last update that went in, as a dropped step trains on none of its batches -- mean the weights
themselves have gone bad (or the data has): the run then either rolls back to the newest
complete checkpoint and goes on with the data *after* the bad stretch, as PaLM did for loss
spikes (``train.on_nonfinite: rollback``, at most ``train.max_rollbacks`` times), or stops with
a message saying where it stopped and what is on disk (``stop``).

Apart from losses, an update can still overflow with a finite loss; those optimizers skip it
too (``engine.was_step_applied()``), and it is counted as a dropped update.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pretrain.distributed import rank

log = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
    """The run cannot go on without a person deciding something; the message says what."""


@dataclass
class NonFiniteGuard:
    limit: int
    action: str  # "rollback" | "stop"
    max_rollbacks: int
    skipped: int = 0  # units dropped for a non-finite loss, over the whole run
    in_a_row: int = 0
    rollbacks: int = 0  # in this job
    dropped_updates: int = 0  # optimizer steps DeepSpeed's overflow check skipped, this job
    _pending: list = field(default_factory=list, repr=False)  # deferred checks (see settle)

    def finite(self, loss: torch.Tensor) -> bool:
        """True when ``loss`` is finite on every rank, read now (collective: every rank must
        call it)."""
        return self.record(_Check(loss).ok())

    def defer(self, loss: torch.Tensor) -> None:
        """Queue the check of ``loss`` and go on; :meth:`settle` reads it after the update."""
        self._pending.append(_Check(loss))

    def settle(self) -> list[bool]:
        """The deferred checks since the last call, in order: True where the loss was finite
        on every rank. Not counted yet: pass each to :meth:`record`."""
        pending, self._pending = self._pending, []
        return [check.ok() for check in pending]

    def record(self, ok: bool) -> bool:
        """Count one verdict; returns it."""
        if ok:
            self.in_a_row = 0
        else:
            self.skipped += 1
            self.in_a_row += 1
        return ok

    def verdict(self, step: int, dropped: str = "micro-batch skipped") -> str:
        """After a dropped micro-batch: "go on" or "rollback"; raises :class:`TrainingStopped`
        when the run has to stop. ``dropped``: what the log line says was dropped."""
        if rank() == 0:
            log.warning("step %d: non-finite loss, %s (%d in a row, %d in all)",
                        step + 1, dropped, self.in_a_row, self.skipped)
        if self.in_a_row < self.limit:
            return "go on"
        if self.action == "rollback" and self.rollbacks < self.max_rollbacks:
            return "rollback"
        raise self.stop(step, f"after {self.rollbacks} rollback(s)" if self.rollbacks else
                        f"train.on_nonfinite={self.action}, "
                        f"train.max_rollbacks={self.max_rollbacks}")

    def rolled_back(self) -> None:
        self.rollbacks += 1
        self.in_a_row = 0

    def stop(self, step: int, reason: str) -> TrainingStopped:
        return TrainingStopped(
            f"training stopped at step {step + 1}: {self.in_a_row} non-finite losses in a row "
            f"({reason}); none of them was trained on. Lower optimizer.lr or raise "
            f"schedule.warmup_steps, check the data, then relaunch: it resumes from the newest "
            f"checkpoint, which is intact")

    def count_update(self, applied: bool) -> None:
        if not applied:
            self.dropped_updates += 1

    def metrics(self) -> dict:
        return {"train/nonfinite_skipped": self.skipped, "train/rollbacks": self.rollbacks,
                "train/dropped_updates": self.dropped_updates}


class _Check:
    """The all-ranks finiteness of one loss, started at once and read when needed.

    On a GPU nothing here waits: the all-reduce is queued on the stream, and the flag is copied
    to pinned host memory behind an event that completes with the forward pass -- not with the
    backward pass queued after it, as ``.item()`` on the stream would."""

    def __init__(self, loss: torch.Tensor):
        flag = torch.isfinite(loss.detach()).all().to(torch.float32).reshape(1)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        self.event = None
        if flag.is_cuda:
            self.flag = torch.empty(1, dtype=torch.float32, pin_memory=True)
            self.flag.copy_(flag, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.flag = flag

    def ok(self) -> bool:
        if self.event is not None:
            self.event.synchronize()
        return self.flag.item() == 1.0


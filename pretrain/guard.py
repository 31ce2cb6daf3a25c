"""Never train on a non-finite loss.

Every micro-batch's loss is checked before its backward pass, on all ranks together (one
scalar all-reduce: ranks must agree, or the gradient reduction of those that go on would wait
for the others forever). A micro-batch whose loss is NaN or infinite on any rank is dropped on
every rank -- no backward, no optimizer step -- and counted; the step goes on with the next
micro-batch from the loader, so a single bad batch costs one batch, never the weights. The
price is that scalar all-reduce and one host sync per micro-batch (on a GPU the CPU waits for
the forward pass before it queues the backward one); ``benchmark.py`` times the same step.

``train.nonfinite_limit`` bad micro-batches in a row mean the weights themselves have gone bad
(or the data has): the run then either rolls back to the newest complete checkpoint and goes on
with the data *after* the bad stretch, as PaLM did for loss spikes (``train.on_nonfinite:
rollback``, at most ``train.max_rollbacks`` times), or stops with a message saying where it
stopped and what is on disk (``stop``).

Fine-tuning (plain PyTorch under Accelerate) checks once per step instead, and drops the whole
step: its accumulated gradients are simply discarded. It keeps no checkpoints, so a streak stops.

DeepSpeed adds a second line for gradients that overflow with a finite loss: its ZeRO-1/2
optimizers skip such an update (``engine.was_step_applied()``); those are counted too.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
    """The run cannot go on without a person deciding something; the message says what."""


@dataclass
class NonFiniteGuard:
    limit: int
    action: str  # "rollback" | "stop"
    max_rollbacks: int
    unit: str = "micro-batch"  # what is dropped: fine-tuning drops whole steps
    # when rolling back is not possible at all (fine-tuning keeps no checkpoints), why not
    no_rollback: str = ""
    skipped: int = 0  # units dropped for a non-finite loss, over the whole run
    in_a_row: int = 0
    rollbacks: int = 0  # in this job
    dropped_updates: int = 0  # optimizer steps DeepSpeed's overflow check skipped, this job

    def finite(self, loss: torch.Tensor) -> bool:
        """True when ``loss`` is finite on every rank (collective: every rank must call it)."""
        ok = torch.isfinite(loss.detach()).all().to(torch.float32).reshape(1)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item() == 1.0:
            self.in_a_row = 0
            return True
        self.skipped += 1
        self.in_a_row += 1
        return False

    def verdict(self, step: int) -> str:
        """After a dropped micro-batch: "go on" or "rollback"; raises :class:`TrainingStopped`
        when the run has to stop."""
        if _rank() == 0:
            log.warning("step %d: non-finite loss, %s skipped (%d in a row, %d in all)",
                        step + 1, self.unit, self.in_a_row, self.skipped)
        if self.in_a_row < self.limit:
            return "go on"
        if self.action == "rollback" and self.rollbacks < self.max_rollbacks:
            return "rollback"
        raise self.stop(step, f"after {self.rollbacks} rollback(s)" if self.rollbacks else
                        self.no_rollback or f"train.on_nonfinite={self.action}, "
                                            f"train.max_rollbacks={self.max_rollbacks}")

    def rolled_back(self) -> None:
        self.rollbacks += 1
        self.in_a_row = 0

    def stop(self, step: int, reason: str) -> TrainingStopped:
        after = ("start again" if self.no_rollback else
                 "then relaunch: it resumes from the newest checkpoint, which is intact")
        return TrainingStopped(
            f"training stopped at step {step + 1}: {self.in_a_row} non-finite losses in a row "
            f"({reason}); none of them was trained on. Lower optimizer.lr or raise "
            f"schedule.warmup_steps, check the data, {after}")

    def count_update(self, applied: bool) -> None:
        if not applied:
            self.dropped_updates += 1

    def metrics(self) -> dict:
        return {"train/nonfinite_skipped": self.skipped, "train/rollbacks": self.rollbacks,
                "train/dropped_updates": self.dropped_updates}


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

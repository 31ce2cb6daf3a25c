"""Never train on a non-finite loss.

Every micro-batch's loss is checked before its backward pass, on all ranks together (one
scalar all-reduce: ranks must agree, or the gradient reduction of those that go on would wait
for the others forever). A micro-batch whose loss is NaN or infinite on any rank is dropped on
every rank -- no backward, no optimizer step -- and counted; the step goes on with the next
micro-batch from the loader, so a single bad batch costs one batch, never the weights.

``train.nonfinite_limit`` bad micro-batches in a row mean the weights themselves have gone bad
(or the data has): the run then either rolls back to the newest complete checkpoint and goes on
with the data *after* the bad stretch, as PaLM did for loss spikes (``train.on_nonfinite:
rollback``, at most ``train.max_rollbacks`` times), or stops with a message saying where it
stopped and what is on disk (``stop``).

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
    skipped: int = 0  # micro-batches dropped for a non-finite loss, over the whole run
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
            log.warning("step %d: non-finite loss, micro-batch skipped (%d in a row, %d in all)",
                        step + 1, self.in_a_row, self.skipped)
        if self.in_a_row < self.limit:
            return "go on"
        if self.action == "rollback" and self.rollbacks < self.max_rollbacks:
            return "rollback"
        raise self.stop(step, f"after {self.rollbacks} rollback(s)" if self.rollbacks else
                        "train.on_nonfinite=stop" if self.action == "stop" else
                        "train.max_rollbacks=0")

    def rolled_back(self) -> None:
        self.rollbacks += 1
        self.in_a_row = 0

    def stop(self, step: int, reason: str) -> TrainingStopped:
        return TrainingStopped(
            f"training stopped at step {step + 1}: {self.in_a_row} non-finite losses in a row "
            f"({reason}); none of them was trained on and the checkpoints are intact. Lower "
            f"optimizer.lr or raise schedule.warmup_steps, check the data, then relaunch to "
            f"resume from the newest checkpoint")

    def count_update(self, applied: bool) -> None:
        if not applied:
            self.dropped_updates += 1

    def metrics(self) -> dict:
        return {"train/nonfinite_skipped": self.skipped, "train/rollbacks": self.rollbacks,
                "train/dropped_updates": self.dropped_updates}


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

"""Stop on a signal with nothing lost: the time limit, a preemption, ``scancel``, Ctrl-C.

Schedulers end a job step with a signal and a grace period: SLURM sends SIGTERM to every
process of the step and SIGKILL ``KillWait`` later (30 s by default; ``--signal=USR1@180`` asks
for an earlier SIGUSR1), Kubernetes sends SIGTERM and kills after
``terminationGracePeriodSeconds`` (30 s), a terminal's Ctrl-C sends SIGINT to the foreground
process group, and the per-node launchers (DeepSpeed's ``launch.py``, ``torchrun``) pass
SIGTERM on to every rank when they receive SIGINT or SIGTERM themselves.

A signal reaches the ranks at different moments, often in the middle of a collective, so the
handler only notes it. At every step boundary :meth:`StopSignals.agreed` asks all ranks whether
any of them was signalled; the answer is the same everywhere, so every rank finishes the same
step, writes its part of the same checkpoint and leaves -- none saves alone, none waits forever
in a collective for a rank that left. The question travels on a separate gloo (CPU) group and
is answered one step late: the reduction of step N's flags is started after step N and read
after step N+1, so the GPU stream never waits for it. A signal therefore stops the run one step
after it arrived, which costs a second or so of a grace period of tens of seconds.

A second signal while the checkpoint is being written is noted and ignored: the save finishes
(a SIGKILL cannot be ignored, and a checkpoint cut short by one is never loaded: see
:mod:`pretrain.checkpoint`).
"""
from __future__ import annotations

import logging
import signal
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# A rank process that stopped on a signal after a complete checkpoint of its last step exits
# with this code; relaunching the same command resumes there (0: finished, 2: bad input,
# 3: stopped for a person to decide, e.g. non-finite losses or a failed checkpoint write).
EXIT_STOPPED = 4


class StoppedBySignal(Exception):
    """The ranks stopped together on a signal after writing a complete checkpoint."""

    def __init__(self, signal_name: str, step: int, checkpoint):
        self.signal, self.step, self.checkpoint = signal_name, step, checkpoint
        super().__init__(f"{signal_name} received: stopped after step {step} with a complete "
                         f"checkpoint at {checkpoint}; relaunch the same command to resume "
                         f"there (exit code {EXIT_STOPPED})")


class StopSignals:
    """Notes the signals named in ``checkpoint.stop_signals``; the ranks agree on stopping."""

    def __init__(self, names: Sequence[str], grace_period_s: float):
        self.grace_period_s = grace_period_s
        self.received: Optional[int] = None  # the first signal this process got
        self.received_at: Optional[float] = None
        self.count = 0
        self._previous = {}
        self._group = None
        self._pending = None  # (work, tensor) of the reduction started at the last boundary
        self.signals = [getattr(signal, name) for name in names]
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._note)
            # restart interrupted system calls: a collective library's blocking read must not
            # fail with EINTR because a signal was noted
            signal.siginterrupt(sig, False)
        if self.signals and dist.is_available() and dist.is_initialized() \
                and dist.get_world_size() > 1:
            # every rank creates it at the same point; gloo: no GPU work, no stream sync
            self._group = dist.new_group(backend="gloo")

    def _note(self, signum, frame) -> None:  # a signal handler: set flags only
        self.count += 1
        if self.received is None:
            self.received, self.received_at = signum, time.monotonic()

    @property
    def name(self) -> Optional[str]:
        return signal.Signals(self.received).name if self.received else None

    def agreed(self) -> Optional[str]:
        """Collective, at every step boundary: the name of the signal some rank received (the
        same answer on every rank, one boundary late), or None to go on."""
        if not self.signals:
            return None
        if self._group is None:  # a world of one: nobody to agree with
            return self.name
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            self._pending = None
            if flag.item():
                return signal.Signals(int(flag.item())).name
        flag = torch.tensor([self.received or 0], dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._pending = (work, flag)
        return None

    def drain(self) -> None:
        """Finish a reduction still in flight (collective): call before the process group
        goes away, or before a path on which ``agreed`` will not be called again."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None

    def report_save(self, seconds: float, signame: str) -> None:
        """Say how long the stop checkpoint took; warn when it came close to the grace
        period after which the scheduler kills the job."""
        # from the moment this rank was signalled (another rank may have been, not this one)
        total = seconds if self.received_at is None else time.monotonic() - self.received_at
        msg = (f"{signame}: checkpoint written in {seconds:.1f} s, {total:.1f} s after the "
               f"signal reached this rank")
        if total > 0.5 * self.grace_period_s:
            log.warning("%s: that is more than half of checkpoint.grace_period_s=%.0f s; "
                        "ask the scheduler for an earlier signal (SLURM: --signal=USR1@180) or "
                        "a longer grace period", msg, self.grace_period_s)
        else:
            log.info("%s", msg)

    def restore(self) -> None:
        """Put the previous handlers back (a later signal then acts as it did before)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

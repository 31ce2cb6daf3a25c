"""What a training step achieves: images/s, TFLOP/s per device, MFU, and the share of time
spent waiting for data.

- :func:`peak_tflops`: the bf16 dense peak of this GPU (the MFU denominator), or
  ``log.peak_tflops``.
- :class:`StepTimer`: splits each step into data wait and compute; every logging window it
  gives the ``perf/*`` metrics; :func:`slowest_data` finds the rank that waits most.
- :func:`peak_memory_gib`: the peak memory a run used, on a GPU or the CPU.
"""
from __future__ import annotations

import logging
import re
import time
from typing import Callable, Dict, Optional

import torch

from pretrain.distributed import rank

log = logging.getLogger(__name__)

# Vendors' dense (no 2:4 sparsity) BF16 tensor-core peaks per device, TFLOP/s. Datasheets quote
# the sparse figure first; the dense one is half of it. First match wins, so a variant comes
# before the plain name (``H100 PCIe`` before ``H100``); \b keeps A10 from matching A100.
PEAK_BF16_TFLOPS = (
    (r"\bH100\b.*\bPCIe\b", 756.0),    # NVIDIA H100 datasheet: 1,513 sparse
    (r"\bH100\b.*\bNVL\b", 835.0),     # H100 NVL: 1,671 sparse
    (r"\bH100\b", 989.0),              # SXM5 (reports as "NVIDIA H100 80GB HBM3"): 1,979 sparse
    (r"\bH200\b.*\bNVL\b", 835.0),     # H200 datasheet, NVL: 1,671 sparse
    (r"\bH200\b", 989.0),              # H200 SXM: 1,979 sparse
    (r"\bGH200\b", 989.0),             # Grace Hopper: the H100 SXM tensor cores
    (r"\bB200\b", 2250.0),             # HGX B200: 4.5 PFLOPS sparse per GPU
    (r"\bA100\b", 312.0),              # SXM4 and PCIe alike: 624 sparse
    (r"\bA10G\b", 70.0),               # AWS's A10G: no NVIDIA datasheet; commonly quoted ~70
    (r"\bA10\b", 125.0),               # A10 datasheet: 250 sparse
    (r"\bL40S\b", 362.0),              # L40S datasheet: 733 sparse
    (r"\bL40\b", 181.0),               # L40 datasheet: 362 sparse
    (r"\bL4\b", 121.0),                # L4 datasheet: 242 sparse
    (r"\bMI300X\b", 1307.0),           # AMD Instinct MI300X: 2,615 with sparsity
    (r"\bMI250X\b", 383.0),            # AMD Instinct MI250X (no sparsity mode)
)


def lookup_peak_tflops(device_name: str) -> Optional[float]:
    """The table's bf16 dense TFLOP/s for a ``torch.cuda.get_device_name()`` string, or None."""
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return tflops
    return None


def peak_tflops(override: Optional[float] = None,
                device_name: Optional[str] = None) -> Optional[float]:
    """MFU denominator per device: ``override`` (``log.peak_tflops``), else the table entry of
    this GPU (or of ``device_name``); None on the CPU or an unknown GPU (MFU is then not
    reported; TFLOP/s still is)."""
    if override is not None:
        return float(override)
    if device_name is None:
        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    found = lookup_peak_tflops(device_name)
    if found is None and rank() == 0:
        log.warning("no bf16 peak known for GPU '%s'; set log.peak_tflops to report MFU",
                    device_name)
    return found


class StepTimer:
    """Per-step data-wait / compute split, summarised over a logging window.

    The caller marks two points per step: :meth:`data_ready` when the batch is in hand and
    :meth:`step_done` after the optimizer step. Data wait is the time from the previous
    ``step_done`` to ``data_ready``; compute is the rest. A step of several micro-batches
    (gradient accumulation) marks each: :meth:`fetching` before it asks for one,
    :meth:`data_ready` once it has it; the later micro-batches' waits count too, not only the
    first one's. Call :meth:`exclude_elapsed` after work that is neither (evaluation,
    checkpointing) so it is not booked as waiting for data.

    On a GPU ``step_done`` waits until the previous step has run on the device: unbounded, the
    host could run steps ahead, compute would be the kernel-launch time and the split would be
    meaningless; one step behind, a window's time is the device's up to one step's tail, and
    the device still has this step's update queued while the host fetches the next batch and
    launches the next forward. Waiting for this step itself (``torch.cuda.synchronize()``)
    left the GPU idle at every step boundary: ~1 ms of ViT-L/16's step on an H100, with
    DeepSpeed's own throughput timer's waits (the profile of README row 2).

    ``perf/tflops`` and ``perf/mfu`` are per device (global images/s x FLOPs per image / world
    size), the figure to compare with a datasheet; ``perf/images_per_sec`` is global.
    """

    def __init__(self, flops_per_image: float, *, world_size: int = 1,
                 peak_tflops: Optional[float] = None, cuda_sync: Optional[bool] = None,
                 clock: Callable[[], float] = time.perf_counter):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.flops_per_image = float(flops_per_image)
        self.world_size = world_size
        self.peak_tflops = peak_tflops
        self.cuda_sync = torch.cuda.is_available() if cuda_sync is None else cuda_sync
        self._clock = clock
        self._last = clock()
        self._ready: Optional[float] = None
        self._fetching: Optional[float] = None  # when a later micro-batch was asked for
        self._step_wait = 0.0  # the later micro-batches' waits in this step
        self._previous = None  # the CUDA event that marks the end of the previous step
        self._reset_window()

    def _reset_window(self) -> None:
        self._steps = 0
        self._images = 0
        self._wait = 0.0
        self._compute = 0.0

    def fetching(self) -> None:
        """A micro-batch is being asked for (ignored for a step's first: its wait runs from the
        previous step's end)."""
        self._fetching = self._clock()

    def data_ready(self) -> None:
        now = self._clock()
        if self._ready is None:  # the step's first batch
            self._wait += now - self._last
            self._ready = now
        elif self._fetching is not None:  # a later micro-batch of the same step
            self._wait += now - self._fetching
            self._step_wait += now - self._fetching
        self._fetching = None

    def step_done(self, images: int) -> None:
        """End of a step that consumed ``images`` samples over all ranks (the global batch)."""
        if self._ready is None:
            raise RuntimeError("StepTimer.step_done() without data_ready(); mark data_ready() "
                               "when the batch is in hand")
        if self.cuda_sync:
            done = torch.cuda.Event()
            done.record()
            if self._previous is not None:
                self._previous.synchronize()
            self._previous = done
        now = self._clock()
        self._compute += now - self._ready - self._step_wait
        self._last, self._ready, self._step_wait = now, None, 0.0
        self._steps += 1
        self._images += images

    def exclude_elapsed(self) -> None:
        """Drop the time since the last mark from the measurements (an eval, a checkpoint)."""
        self._last = self._clock()

    @property
    def steps_in_window(self) -> int:
        return self._steps

    @property
    def data_wait_frac(self) -> float:
        """This rank's share of the window so far spent waiting for data."""
        elapsed = self._wait + self._compute
        return self._wait / elapsed if elapsed > 0 else 0.0

    def summary(self) -> Dict[str, float]:
        """The window's ``perf/*`` metrics (``perf/mfu`` only with a known peak); starts a new
        window. Empty when no step finished since the last summary."""
        elapsed = self._wait + self._compute
        if self._steps == 0 or elapsed <= 0:
            self._reset_window()
            return {}
        images_per_sec = self._images / elapsed
        tflops = images_per_sec * self.flops_per_image / self.world_size / 1e12
        out = {"perf/images_per_sec": images_per_sec, "perf/tflops": tflops,
               "perf/data_wait_frac": self.data_wait_frac}
        if self.peak_tflops:
            out["perf/mfu"] = tflops / self.peak_tflops
        self._reset_window()
        return out


def slowest_data(waits: list[float]) -> Dict[str, float]:
    """From every rank's data-wait share (rank order): the largest and its rank. A rank starved
    of data (a slow disk or network on its node) holds every other rank up at the gradient
    reduction, where they book the wait as compute: rank 0's own share, ``perf/data_wait_frac``,
    does not show it. Empty for a single rank."""
    if len(waits) < 2:
        return {}
    worst = max(range(len(waits)), key=waits.__getitem__)
    return {"perf/data_wait_frac_max": waits[worst], "perf/data_wait_frac_max_rank": worst}


def peak_memory_gib(device: torch.device) -> float:
    """Peak accelerator memory, or the process's peak resident memory on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB on Linux

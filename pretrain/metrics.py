"""What the train loop measures, and where it goes.

- :func:`peak_tflops`: the bf16 dense peak of this GPU (for MFU), or ``log.peak_tflops``.
- :class:`StepTimer`: splits each step into data wait and compute; every logging window it
  gives images/s, achieved TFLOP/s per device, MFU and the share of time spent waiting for data.
- :class:`MetricsLogger`: the sink protocol, ``log(metrics, step)`` + ``close()``.
  :class:`JsonlLogger` appends to ``output_dir/metrics.jsonl``, :class:`ConsoleLogger` prints the
  progress line, :func:`build_logger` gives rank 0 both and every other rank a no-op. The MLflow
  sink of the tracking issue implements the same two methods.
- :class:`LineFile`: the append-only file under the JSONL sink and the MLflow spool; a write that
  fails (a full disk) is counted in the sink's ``unwritten`` and skipped, never raised, and the
  sink warns once.

Metric names: ``train/loss``, ``train/lr``, ``train/grad_norm``, ``perf/images_per_sec``,
``perf/tflops``, ``perf/mfu``, ``perf/data_wait_frac``, ``data/skipped_samples`` and
``eval/<evaluator>/<metric>`` (see :mod:`pretrain.evaluate`).
"""
from __future__ import annotations

import collections
import json
import logging
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Mapping, Optional, Protocol, TextIO, runtime_checkable

import torch

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"

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
    if found is None and _rank() == 0:
        log.warning("no bf16 peak known for GPU '%s'; set log.peak_tflops to report MFU",
                    device_name)
    return found


# --------------------------------------------------------------------------------------------
# Step timing
# --------------------------------------------------------------------------------------------
class StepTimer:
    """Per-step data-wait / compute split, summarised over a logging window.

    The caller marks two points per step: :meth:`data_ready` when the batch is in hand and
    :meth:`step_done` after the optimizer step. Data wait is the time from the previous
    ``step_done`` to ``data_ready``; compute is the rest. Call :meth:`exclude_elapsed` after
    work that is neither (evaluation, checkpointing) so it is not booked as waiting for data.

    On a GPU ``step_done`` synchronises: otherwise compute would be the kernel-launch time and
    the next data wait would overlap kernels still running, so the split would be meaningless.

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
        self._reset_window()

    def _reset_window(self) -> None:
        self._steps = 0
        self._images = 0
        self._wait = 0.0
        self._compute = 0.0

    def data_ready(self) -> None:
        now = self._clock()
        self._wait += now - self._last
        self._ready = now

    def step_done(self, images: int) -> None:
        """End of a step that consumed ``images`` samples over all ranks (the global batch)."""
        if self._ready is None:
            raise RuntimeError("StepTimer.step_done() without data_ready(); mark data_ready() "
                               "when the batch is in hand")
        if self.cuda_sync:
            torch.cuda.synchronize()
        now = self._clock()
        self._compute += now - self._ready
        self._last, self._ready = now, None
        self._steps += 1
        self._images += images

    def exclude_elapsed(self) -> None:
        """Drop the time since the last mark from the measurements (an eval, a checkpoint)."""
        self._last = self._clock()

    @property
    def steps_in_window(self) -> int:
        return self._steps

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
               "perf/data_wait_frac": self._wait / elapsed}
        if self.peak_tflops:
            out["perf/mfu"] = tflops / self.peak_tflops
        self._reset_window()
        return out


# --------------------------------------------------------------------------------------------
# Sinks
# --------------------------------------------------------------------------------------------
@runtime_checkable
class MetricsLogger(Protocol):
    """Where metrics go. A sink with a remote backend (MLflow) should swallow and report its
    transient failures: a multi-day run must not die because a metric was not delivered."""

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class NullLogger:
    """What ranks other than 0 get: logging is rank 0's job."""

    unwritten = 0

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def close(self) -> None:
        pass


def _as_float(value) -> float:
    return float(value.item() if hasattr(value, "item") else value)


class LineFile:
    """An append-only file of lines whose writes never raise: on a full disk a multi-day run
    must lose log lines, not its training.

    ``append`` returns the byte offset just past the line, or None when the line is not in the
    file; such lines are counted in ``unwritten`` and each failure goes to ``on_error`` (the
    sink warns once). A write the disk cut short leaves a partial line; the next line then starts
    on a fresh one, so the partial one stays the only damaged line -- as after a crash, whose
    partial last line is handled the same way when the file is opened again.
    """

    def __init__(self, path: os.PathLike | str, on_error: Callable[[OSError], None]):
        self.path = Path(path)
        self.unwritten = 0
        self._on_error = on_error
        # os-level, unbuffered: a failed write must not stay in a buffer that a later write or
        # close() would retry (and raise from)
        self._fd: Optional[int] = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                                          0o644)
        self.offset = os.lseek(self._fd, 0, os.SEEK_END)
        self._at_line_start = True
        if self.offset:
            with open(self.path, "rb") as f:
                f.seek(self.offset - 1)
                self._at_line_start = f.read(1) == b"\n"

    def append(self, line: bytes) -> Optional[int]:
        data = line if self._at_line_start else b"\n" + line
        done = 0
        try:
            while done < len(data):
                done += os.write(self._fd, data[done:])
        except OSError as e:
            self._on_error(e)
        self.offset += done
        if done:
            self._at_line_start = data[done - 1:done] == b"\n"
        # the record is the text before the newline: with only the newline missing it is in the
        # file (readers take a last line without one), and the next append writes the newline
        if done >= len(data) - 1:
            return self.offset + len(data) - done
        self.unwritten += 1
        return None

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    @property
    def closed(self) -> bool:
        return self._fd is None


class JsonlLogger:
    """One JSON object per ``log`` call, ``{"step": s, "time": unix_s, <metric>: value, ...}``,
    appended to ``path`` and in the OS's hands at once.

    The file is never truncated: a resumed run appends, so steps between the last checkpoint
    and a crash appear twice -- the later line is the one that counts. NaN/inf are written as
    Python's json writes them (``NaN``), because a diverging loss must stay visible.

    A full disk does not stop training: one warning, then records that cannot be written are
    counted in ``unwritten`` (the trainer can log that count) and writing resumes by itself
    once there is space again.
    """

    def __init__(self, path: os.PathLike | str):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._error: Optional[OSError] = None
        self._file = LineFile(self.path, self._write_failed)

    @property
    def unwritten(self) -> int:
        """Records that could not be written to the file."""
        return self._file.unwritten

    def _write_failed(self, exc: OSError) -> None:
        if self._error is None:
            self._error = exc
            log.warning("cannot write metrics to %s (%s); training goes on, records that do not "
                        "fit are skipped and counted", self.path, exc)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        record = {"step": int(step), "time": round(time.time(), 3)}
        record.update((k, _as_float(v)) for k, v in metrics.items())
        self._file.append((json.dumps(record) + "\n").encode())

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.close()
        if self.unwritten:
            log.warning("%d metric records were not written to %s (%s)", self.unwritten,
                        self.path, self._error)


def read_jsonl(path: os.PathLike | str) -> list[dict]:
    """The records of a metrics file, skipping a line a crash left half-written."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    return (f"{days}d " if days else "") + f"{hours:02d}:{minutes:02d}:{secs:02d}"


class ConsoleLogger:
    """Plain progress lines on ``stream`` (not a tqdm bar: SLURM logs stay readable).

    A ``log`` call carrying ``train/loss`` prints
    ``step 1200/90000 (1.3%) | loss 6.2341 | lr 9.60e-04 | 3,210 img/s | MFU 41.2% | ETA 2d 03:14:05``;
    one carrying ``eval/*`` metrics prints them on an ``eval`` line. The trainer's calls set the
    cadence (every ``log.every_steps``). ETA uses the wall-clock step rate of the last
    ``rate_window`` lines, so evaluation and checkpoint time is part of it.
    """

    def __init__(self, total_steps: int, stream: Optional[TextIO] = None, rate_window: int = 10,
                 clock: Callable[[], float] = time.monotonic):
        self.total_steps = total_steps
        self.stream = stream
        self._clock = clock
        self._marks: collections.deque = collections.deque(maxlen=rate_window + 1)

    def _eta(self, step: int) -> Optional[float]:
        self._marks.append((step, self._clock()))
        (s0, t0), (s1, t1) = self._marks[0], self._marks[-1]
        if s1 <= s0:
            return None
        return (t1 - t0) / (s1 - s0) * max(self.total_steps - step, 0)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        stream = self.stream or sys.stdout
        if "train/loss" in metrics:
            print(self.progress_line(metrics, step), file=stream, flush=True)
        evals = {k[len("eval/"):]: v for k, v in metrics.items() if k.startswith("eval/")}
        if evals:
            shown = " | ".join(f"{k} {_as_float(v):.4f}" for k, v in sorted(evals.items()))
            print(f"eval step {step}/{self.total_steps} | {shown}", file=stream, flush=True)

    def progress_line(self, metrics: Mapping[str, float], step: int) -> str:
        parts = [f"step {step}/{self.total_steps} ({100.0 * step / max(self.total_steps, 1):.1f}%)",
                 f"loss {_as_float(metrics['train/loss']):.4f}"]
        if "train/lr" in metrics:
            parts.append(f"lr {_as_float(metrics['train/lr']):.2e}")
        if "perf/images_per_sec" in metrics:
            parts.append(f"{_as_float(metrics['perf/images_per_sec']):,.0f} img/s")
        if "perf/mfu" in metrics:
            parts.append(f"MFU {100.0 * _as_float(metrics['perf/mfu']):.1f}%")
        eta = self._eta(step)
        if eta is not None and math.isfinite(eta):
            parts.append(f"ETA {format_duration(eta)}")
        return " | ".join(parts)

    def close(self) -> None:
        pass


class MultiLogger:
    """Fans one ``log`` call out to several sinks."""

    def __init__(self, *sinks: MetricsLogger):
        self.sinks = sinks

    @property
    def unwritten(self) -> int:
        """Records its sinks could not write to disk (a full disk), summed."""
        return sum(getattr(sink, "unwritten", 0) for sink in self.sinks)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def build_logger(output_dir: os.PathLike | str, total_steps: int,
                 rank: Optional[int] = None) -> MetricsLogger:
    """Rank 0: ``output_dir/metrics.jsonl`` + the console line; other ranks: a no-op."""
    if (_rank() if rank is None else rank) != 0:
        return NullLogger()
    return MultiLogger(JsonlLogger(Path(output_dir) / METRICS_FILE), ConsoleLogger(total_steps))


def peak_memory_gib(device: torch.device) -> float:
    """Peak accelerator memory, or the process's peak resident memory on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB on Linux

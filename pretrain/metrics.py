"""Where the train loop's metrics go.

- :class:`MetricsLogger`: the sink protocol, ``log(metrics, step)`` + ``close()``.
  :class:`JsonlLogger` appends to ``output_dir/metrics.jsonl``, :class:`ConsoleLogger` prints the
  progress line, :func:`build_logger` gives rank 0 both and every other rank a no-op. The MLflow
  sink (:mod:`pretrain.tracking`) implements the same two methods.
- :class:`LineFile`: the append-only file under the JSONL sink and the MLflow spool; a write that
  fails (a full disk) is counted in the sink's ``unwritten`` and skipped, never raised, and the
  sink warns once.

What is measured (images/s, TFLOP/s, MFU, data wait) is :mod:`pretrain.throughput`'s. This
module does not import torch, so the spool uploader can use it without.

Metric names: ``train/loss``, ``train/lr``, ``train/grad_norm``, ``perf/images_per_sec``,
``perf/tflops``, ``perf/mfu``, ``perf/data_wait_frac`` (rank 0's; with several ranks also
``perf/data_wait_frac_max`` and ``perf/data_wait_frac_max_rank``), ``data/skipped_samples`` and
``eval/<evaluator>/<metric>`` (see :mod:`pretrain.evaluate`).
"""
from __future__ import annotations

import collections
import errno
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable, Mapping, Optional, Protocol, TextIO, runtime_checkable

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
# the progress line names the data wait from this share of the step on: the accelerators idle
DATA_WAIT_SHOWN = 0.05

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
                n = os.write(self._fd, data[done:])
                if n == 0:  # no byte taken and no error (a file system at its limit): retrying
                    # at once would spin forever, in the training thread
                    raise OSError(errno.ENOSPC, "no byte written")
                done += n
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
        wait = metrics.get("perf/data_wait_frac_max", metrics.get("perf/data_wait_frac"))
        if wait is not None and _as_float(wait) >= DATA_WAIT_SHOWN:  # the job is held up
            rank = metrics.get("perf/data_wait_frac_max_rank")
            parts.append(f"data wait {100.0 * _as_float(wait):.0f}%" +
                         (f" (rank {int(rank)})" if rank is not None else ""))
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


def build_logger(output_dir: os.PathLike | str, total_steps: int,
                 rank: Optional[int] = None) -> MetricsLogger:
    """Rank 0: ``output_dir/metrics.jsonl`` + the console line; other ranks: a no-op."""
    if rank is None:
        from pretrain.distributed import rank as current_rank  # torch, only where it is needed
        rank = current_rank()
    if rank != 0:
        return NullLogger()
    return MultiLogger(JsonlLogger(Path(output_dir) / METRICS_FILE), ConsoleLogger(total_steps))


def closing_line(out: Path, metrics: Mapping[str, float], peaks: list) -> str:
    """A run's last line: its final accuracies, peak memory and what its output_dir holds."""
    figures = "".join(f" {k} {v:.4f};" for k, v in sorted(metrics.items())
                      if k.endswith(("/top1", "/top5")) and isinstance(v, (int, float)))
    held = ", ".join(p.name + ("/" if p.is_dir() else "") for p in sorted(out.iterdir())
                     if not p.name.startswith("."))
    return (f"done:{figures} peak memory per rank {', '.join(f'{g:.2f} GiB' for g in peaks)}; "
            f"{out} holds {held}")

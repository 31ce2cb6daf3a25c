"""System metrics (CPU, memory, disk, network, GPUs) of every node of a job, kept on disk the way
the training metrics are and delivered to MLflow by rank 0's tracker.

MLflow's own monitor posts its samples straight to the server from one process: under a
multi-node job only node 0's machine was seen, and every sample taken while the server was
away was lost (the monitor stopped at the first failed request). Here the first rank of each
node runs a :class:`NodeSampler`, which reads MLflow's collectors (``mlflow.system_metrics``)
every ``tracking.system_metrics_every_s`` and appends one line per sample to
``output_dir/tracking/system/<host>.jsonl``; the tracker's thread sends the lines it has not
sent yet (``<host>.delivered`` holds the offset), after an outage too, and
``launch/upload_spool.py`` sends what a job left behind. Other nodes' lines reach rank 0 through
the output_dir, which a multi-node job shares (its checkpoints live there too). At a job's end
every node stops sampling before the ranks' last collective, after which rank 0 delivers: the
last samples of every node arrive. A job stopped or failed leaves what other nodes sampled after
rank 0's last delivery in their files: the resumed job, or ``upload_spool.py``, sends it.

Names are MLflow's (``system/gpu_0_utilization_percentage``); with more than one node each
carries its host (``system/<host>/gpu_0_utilization_percentage``), as MLflow's ``node_id`` does.
Steps count samples, per metric, on from the last one MLflow holds, as MLflow's monitor does
when it resumes a run: a requeued job's samples follow its predecessor's.

Line: ``{"time": <unix ms>, "metrics": {"system/cpu_utilization_percentage": 12.5, ...}}``.
"""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Iterable, Optional

from pretrain.metrics import LineFile

log = logging.getLogger("pretrain.tracking")

SYSTEM_DIR = "system"  # under the tracking directory
PREFIX = "system/"


def prefix_for(host: str, hosts: Iterable[str]) -> str:
    """The names' prefix on ``host`` in a job on ``hosts`` (every rank's host)."""
    return PREFIX + (f"{_safe(host)}/" if len(set(hosts)) > 1 else "")


def _safe(host: str) -> str:
    """A host name fit for a file name and an MLflow metric name."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", host) or "host"


def _collectors(output_dir: Path) -> list:
    """MLflow's CPU/memory, disk ("/"), network and GPU collectors (GPUs where nvidia-ml-py, or
    pyrsmi for AMD, finds any), and the output_dir's free space: the disk checkpoints fill."""
    from mlflow.system_metrics.metrics.base_metrics_monitor import BaseMetricsMonitor
    from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
    from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
    from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor
    from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor
    from mlflow.system_metrics.metrics.rocm_monitor import ROCMMonitor

    class OutputDirDisk(BaseMetricsMonitor):
        def collect_metrics(self):
            import psutil
            self._metrics["output_dir_available_megabytes"] = \
                psutil.disk_usage(str(output_dir)).free / 1e6

        def aggregate_metrics(self):
            return dict(self._metrics)

    out = [CPUMonitor(), DiskMonitor(), NetworkMonitor(), OutputDirDisk()]
    for gpus in (GPUMonitor, ROCMMonitor):
        try:
            out.append(gpus())
            break
        except Exception:  # noqa: BLE001 -- no such GPUs, or no library to read them
            continue
    return out


class NodeSampler:
    """Appends this node's system metrics to ``track_dir/system/<host>.jsonl`` every
    ``every_s`` seconds, from a daemon thread; :meth:`close` stops it."""

    def __init__(self, track_dir: os.PathLike | str, output_dir: os.PathLike | str,
                 every_s: float, prefix: str = PREFIX, host: Optional[str] = None):
        import psutil
        self.path = Path(track_dir) / SYSTEM_DIR / f"{_safe(host or socket.gethostname())}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.every_s = every_s
        self.prefix = prefix
        # a failing GPU query warns on every sample in MLflow's words; ours says it once
        logging.getLogger("mlflow.system_metrics").setLevel(logging.CRITICAL)
        self._collectors = _collectors(Path(output_dir))
        psutil.cpu_percent()  # the first sample's CPU share then covers its whole interval
        self._warned = False
        self._file = LineFile(self.path, self._failed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="system-metrics", daemon=True)
        self._thread.start()

    def _failed(self, e: Exception) -> None:
        if not self._warned:
            self._warned = True
            log.warning("system metrics: a sample was not taken or not written to %s (%s); "
                        "training goes on", self.path, e)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def sample(self) -> None:
        """Take one sample and append it (also called by the thread)."""
        metrics: dict[str, float] = {}
        try:
            for c in self._collectors:
                c.collect_metrics()
                metrics.update(c.aggregate_metrics())
                c.clear_metrics()
        except Exception as e:  # noqa: BLE001 -- a flaky driver query must not end the thread
            self._failed(e)
        if metrics:
            line = {"time": int(time.time() * 1000),
                    "metrics": {self.prefix + k: float(v) for k, v in metrics.items()}}
            self._file.append((json.dumps(line) + "\n").encode())

    def close(self) -> None:
        """Stop sampling. Waits a second at most: a sample blocked on a hung GPU query or file
        system must not hold up a job that is ending (a stalled one has seconds left)."""
        self._stop.set()
        self._thread.join(1.0)
        if not self._thread.is_alive():  # else the file stays open for it: it may yet write
            self._file.close()

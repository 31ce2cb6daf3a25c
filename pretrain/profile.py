"""Where a training step's time goes: a torch.profiler trace of a few steady-state steps, and
the device (or, on a CPU, the host) time split into the kinds of work an MFU hunt cares about.

``launch/benchmark.py train --profile DIR`` writes ``DIR/trace_rank<R>.json`` (open it in
Perfetto or chrome://tracing) and ``DIR/breakdown_rank<R>.json``; the breakdown is printed too.
Kernels are sorted into kinds by name, which is a heuristic: the trace is the ground truth.
"""
from __future__ import annotations

import json
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import torch

# First match wins: attention before matmul (flash kernels use tensor cores too).
KINDS = (
    ("attention", r"flash|fmha|attention|sdpa|scaled_dot_product|efficient_attention"),
    ("matmul", r"gemm|matmul|\bmm\b|addmm|bmm|linear|cutlass|sm90_xmma|cublas|wgmma"),
    ("optimizer", r"adam|multi_tensor|foreach|_fused_|optimizer|lamb|sgd"),
    ("norms", r"norm"),
    ("communication", r"nccl|allreduce|all_reduce|allgather|all_gather|reduce_scatter|gloo"),
    ("copies", r"memcpy|memset|copy_|\bto\b|contiguous"),
)
OTHER = "elementwise and other"


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return OTHER


@contextmanager
def profiled(out_dir: Optional[str], rank: int, device: torch.device) -> Iterator[List]:
    """Profile the body when ``out_dir`` is set; afterwards the list holds the breakdown
    (empty without profiling)."""
    holder: List = []
    if not out_dir:
        yield holder
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=False) as prof:
        yield holder
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out / f"trace_rank{rank}.json"))
    breakdown = summarize(prof, on_device=device.type == "cuda")
    (out / f"breakdown_rank{rank}.json").write_text(json.dumps(breakdown, indent=1))
    holder.append(breakdown)


# CUDA runtime calls in which the host waits for the device (``.item()``, ``.cpu()``, events):
# while it waits it queues nothing, so the device runs dry unless enough was queued before.
HOST_SYNC = re.compile(r"^cuda(Stream|Event|Device)Synchronize$")


def summarize(prof, on_device: bool) -> Dict[str, float]:
    """Self time per kind in ms (device kernels on a GPU; leaf host ops on a CPU), and each
    kind's share of the busy time; on a GPU also the host's waits for the device."""
    totals: Dict[str, float] = {}
    syncs, sync_ms = 0, 0.0
    for event in prof.key_averages():
        if on_device and HOST_SYNC.match(event.key):
            syncs += event.count
            sync_ms += event.cpu_time_total / 1e3
            continue
        us = (getattr(event, "self_device_time_total", None) or
              getattr(event, "self_cuda_time_total", 0)) if on_device else \
            event.self_cpu_time_total
        if us > 0:
            kind = kind_of(event.key)
            totals[kind] = totals.get(kind, 0.0) + us / 1e3
    busy = sum(totals.values()) or 1.0
    return {"busy_ms": round(busy, 3), "time_base": "device kernels" if on_device else
            "host operators (CPU)",
            **({"host_syncs": syncs, "host_sync_ms": round(sync_ms, 3)} if on_device else {}),
            "ms": {k: round(v, 3) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])},
            "share": {k: round(v / busy, 4) for k, v in sorted(totals.items(),
                                                                key=lambda kv: -kv[1])}}


def format_breakdown(b: Dict, steps: int, step_ms: float) -> str:
    """A small table: ms per step and share of the busy time, plus the idle remainder."""
    lines = [f"where the time goes ({b['time_base']}, per step of {step_ms:.1f} ms):"]
    for kind, ms in b["ms"].items():
        lines.append(f"  {kind:<24}{ms / steps:>10.2f} ms {100 * b['share'][kind]:>6.1f} %")
    idle = step_ms - b["busy_ms"] / steps
    lines.append(f"  {'idle / not on the device' if b['time_base'] == 'device kernels' else 'other host time':<24}"
                 f"{max(idle, 0.0):>10.2f} ms")
    if "host_syncs" in b:
        lines.append(f"  host waits for the device: {b['host_syncs'] / steps:.1f} per step, "
                     f"{b['host_sync_ms'] / steps:.2f} ms")
    return "\n".join(lines)

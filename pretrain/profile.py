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

# DeepSpeed's step (the update and everything it does around it) runs inside this profiler
# range (see pretrain.engine.train_micro_batch); the optimizer's own update inside it runs in
# torch's "Optimizer.step#<class>.step" range. Work launched inside the first but outside the
# second is DeepSpeed's bookkeeping: flattening, overflow checks, gradient norms, copies back.
ENGINE_STEP = "vitscale.engine_step"
OPTIMIZER_STEP = "Optimizer.step#"
OPTIMIZER, BOOKKEEPING = "optimizer", "DeepSpeed bookkeeping"

# By kernel (or host operator) name; first match wins: attention before matmul (flash kernels
# use tensor cores too). Inductor's pointwise and reduction kernels are named after the ops they
# fused ("triton_poi_fused_addmm_gelu_0" is the bias and GELU after a cuBLAS matmul), so they
# are elementwise work, or norms where a norm was fused in; its templates ("triton_tem_") are
# matmuls. cuBLAS 12.8+ names its Hopper GEMMs "nvjet_*".
KINDS = (
    ("attention", r"flash|fmha|attention|sdpa|scaled_dot_product"),
    ("norms", r"^triton_(poi|red|per)_.*norm"),
    (None, r"^triton_(poi|red|per)_"),
    ("matmul", r"gemm|matmul|\bmm\b|addmm|bmm|linear|cutlass|xmma|cublas|wgmma|nvjet|^triton_tem_"),
    (OPTIMIZER, r"adam|multi_tensor|foreach|optimizer|lamb|sgd"),
    ("norms", r"norm"),
    ("communication", r"nccl|allreduce|all_reduce|allgather|all_gather|reduce_scatter|gloo"),
    ("copies", r"memcpy|memset|copy_|\bto\b|contiguous"),
)
OTHER = "elementwise and other"


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind or OTHER
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


# Operators that only make another view of a tensor, allocate, or read its metadata: no kernel
# on a GPU (DeepSpeed's ZeRO-1/2 step calls several per parameter to point it into its buffer).
NO_KERNEL = frozenset("aten::" + name for name in (
    "view", "_unsafe_view", "_reshape_alias", "reshape", "narrow", "slice", "select",
    "as_strided", "alias", "detach", "t", "transpose", "permute", "expand", "squeeze",
    "unsqueeze", "flatten", "unflatten", "split", "chunk", "empty", "empty_strided",
    "empty_like", "_has_compatible_shallow_copy_type", "result_type", "lift_fresh",
    "resolve_conj", "resolve_neg", "set_"))

# CUDA runtime calls in which the host waits for the device (``.item()``, ``.cpu()``, events):
# while it waits it queues nothing, so the device runs dry unless enough was queued before.
HOST_SYNC = re.compile(r"^cuda(Stream|Event|Device)Synchronize$")
# On a CPU the same waits, by operator: a value read on the host (``.item()``, ``bool()``) or a
# tensor made from Python data (``torch.tensor(x, device=...)``: on a GPU, a blocking copy).
HOST_READS = frozenset({"aten::_local_scalar_dense", "aten::lift_fresh"})


def _phase(event) -> Optional[str]:
    """OPTIMIZER or BOOKKEEPING for a host event inside DeepSpeed's step, else None."""
    inside_optimizer = False
    while event is not None:
        if event.name.startswith(OPTIMIZER_STEP):
            inside_optimizer = True
        elif event.name == ENGINE_STEP:
            return OPTIMIZER if inside_optimizer else BOOKKEEPING
        event = event.cpu_parent
    return None


def summarize(prof, on_device: bool) -> Dict[str, float]:
    """Time per kind of work in ms, and each kind's share of the busy time: on a GPU the device
    kernels (each counted once, as the kernel itself: the profiler also hangs its time on the
    host call that launched it), on a CPU the host operators' self time. Work done inside
    DeepSpeed's step is the optimizer's update or DeepSpeed's bookkeeping, whatever its name;
    the rest is sorted by name. Also how many kernels DeepSpeed's step launched (on a CPU: how
    many operators it called, each a launch or more on a GPU); on a GPU the host's waits for the
    device, and the host time spent inside DeepSpeed's step (the device idles through it unless
    enough was queued); on a CPU the reads in DeepSpeed's step that would be such waits."""
    from torch.autograd import DeviceType

    totals: Dict[str, float] = {}

    def add(kind: str, us: float) -> None:
        if us > 0:
            totals[kind] = totals.get(kind, 0.0) + us / 1e3

    events = [e for e in prof.events() if not e.is_async]
    host = [e for e in events if e.device_type == DeviceType.CPU]
    extra: Dict[str, float] = {}
    if on_device:
        # A kernel is tied to the host call that launched it (the profiler's correlation);
        # that call's ancestors say whether it ran inside DeepSpeed's step.
        stepped: Dict[str, float] = {}
        launches = 0
        for e in host:
            phase = _phase(e) if e.kernels else None
            for k in e.kernels if phase else ():
                add(phase, k.duration)
                stepped[k.name] = stepped.get(k.name, 0.0) + k.duration
                launches += 1
        for e in events:
            if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False):
                taken = min(stepped.get(e.name, 0.0), e.self_device_time_total)
                stepped[e.name] = stepped.get(e.name, 0.0) - taken
                add(kind_of(e.name), e.self_device_time_total - taken)
        syncs = [e for e in host if HOST_SYNC.match(e.name)]
        extra = {"host_syncs": len(syncs),
                 "host_sync_ms": round(sum(e.cpu_time_total for e in syncs) / 1e3, 3),
                 "engine_step_host_ms": round(sum(e.cpu_time_total for e in host
                                                  if e.name == ENGINE_STEP) / 1e3, 3)}
    else:
        launches = reads = 0
        for e in host:
            phase = _phase(e)
            add(phase or kind_of(e.name), e.self_cpu_time_total)
            # the optimizer's own are left out: on a CPU its step counter lives on the host,
            # on a GPU the fused AdamW keeps it on the device and reads nothing
            reads += phase == BOOKKEEPING and e.name in HOST_READS
            # an operator called from Python (not from inside another) that computes
            # something: on a GPU each one launches a kernel or more
            launches += bool(phase and e.name.startswith("aten::") and e.name not in NO_KERNEL
                             and not (e.cpu_parent is not None and
                                      e.cpu_parent.name.startswith("aten::")))
        extra["engine_step_host_reads"] = reads
    extra["engine_step_launches"] = launches
    busy = sum(totals.values()) or 1.0
    order = sorted(totals.items(), key=lambda kv: -kv[1])
    return {"busy_ms": round(busy, 3), "time_base": "device kernels" if on_device else
            "host operators (CPU)", **extra,
            "ms": {k: round(v, 3) for k, v in order},
            "share": {k: round(v / busy, 4) for k, v in order}}


def format_breakdown(b: Dict, steps: int, step_ms: float) -> str:
    """A small table: ms per step and share of the busy time, plus the idle remainder."""
    lines = [f"where the time goes ({b['time_base']}, per step of {step_ms:.1f} ms; the "
             f"shares are of its {b['busy_ms'] / steps:.1f} ms busy):"]
    for kind, ms in b["ms"].items():
        lines.append(f"  {kind:<24}{ms / steps:>10.2f} ms {100 * b['share'][kind]:>6.1f} %")
    idle = step_ms - b["busy_ms"] / steps
    lines.append(f"  {'idle / not on the device' if b['time_base'] == 'device kernels' else 'other host time':<24}"
                 f"{max(idle, 0.0):>10.2f} ms")
    if "host_syncs" in b:
        lines.append(f"  host waits for the device: {b['host_syncs'] / steps:.1f} per step, "
                     f"{b['host_sync_ms'] / steps:.2f} ms")
    if "engine_step_host_reads" in b:
        lines.append(f"  host reads in DeepSpeed's step (a wait each on a GPU): "
                     f"{b['engine_step_host_reads'] / steps:.1f} per step")
    if "engine_step_host_ms" in b:
        lines.append(f"  host time in DeepSpeed's step: {b['engine_step_host_ms'] / steps:.2f} ms "
                     f"per step")
    if "engine_step_launches" in b:
        what = "kernels launched" if b["time_base"] == "device kernels" else "operators called"
        lines.append(f"  {what} in DeepSpeed's step: {b['engine_step_launches'] / steps:.0f} "
                     f"per step")
    return "\n".join(lines)

"""Benchmark figures with where they came from, and the README table made from them.

``launch/benchmark.py train ... --record FILE`` appends the result as one JSON line together
with the command that gave it, the commit it ran (``+dirty`` when tracked files had changes),
and the date. ``launch/benchmark.py table FILE --readme README.md`` rewrites the part of the
README between the two marker lines from those records: one row per command and device (the
newest record wins), the commands listed under the table, and, for records made with
``--profile``, where their step's time went. No figure in that table is typed by hand.
"""
from __future__ import annotations

import datetime
import json
import os
import shlex
from pathlib import Path
from typing import Iterable

BEGIN, END = "<!-- benchmark-table: begin -->", "<!-- benchmark-table: end -->"
# flags that change how a result is printed or kept, not what is measured
_NOT_MEASURED = {"--json": 0, "--record": 1, "--profile": 1, "--profile-steps": 1}


# what every row of the table shows
_NEEDED = ("command", "commit", "date", "device", "model", "image_size", "batch_per_rank",
           "ranks", "precision", "zero_stage", "images_per_sec")


def provenance(argv: Iterable[str]) -> dict:
    """The command (without the flags that only print or keep results), commit and date."""
    argv, kept = list(argv), []
    i = 0
    while i < len(argv):
        flag = argv[i].split("=", 1)[0]
        if flag in _NOT_MEASURED:
            i += 1 + (_NOT_MEASURED[flag] if "=" not in argv[i] else 0)
            continue
        kept.append(argv[i])
        i += 1
    return {"command": "python launch/benchmark.py " + shlex.join(kept),
            "commit": _commit(), "date": datetime.datetime.now(datetime.timezone.utc)
            .strftime("%Y-%m-%d")}


def _commit() -> str:
    from pretrain.cli import REPO_ROOT
    from pretrain.run_info import git_info
    # a copy of a checkout shipped to a GPU node names its commit here: its .git may be
    # missing, or another commit's (benchmarks/gpu_suite.sh)
    if os.environ.get("VITSCALE_COMMIT"):
        return os.environ["VITSCALE_COMMIT"]
    info = git_info(REPO_ROOT)
    if not info:
        return "unknown (not a git checkout)"
    return info["git.commit"][:10] + ("+dirty" if info["git.dirty"] == "true" else "")


def append(path: Path, result: dict, argv: Iterable[str]) -> dict:
    record = {**provenance(argv), **result}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
    return record


def load(path: Path) -> list[dict]:
    """The newest record per (command, device), in the order each first appeared."""
    latest: dict = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {n}: not a JSON record ({e.msg})") from None
            missing = [k for k in _NEEDED if not isinstance(record, dict) or k not in record]
            if missing:
                raise ValueError(f"{path}, line {n}: not a record of `benchmark.py train "
                                 f"--record` (it lacks {', '.join(missing)})")
            latest[(record.get("command"), record.get("device"))] = record  # keeps its place
    return list(latest.values())


def mfu_at_median(r: dict) -> float | None:
    """MFU from the median step's time, where the record's ``mfu`` is from the timed window's
    mean. They agree over a steady run; over a few long steps (16 micro-batches per update, 3
    timed) one unusual step moves the mean by a third of its difference: on the H100 one of
    three updates ran ~300 ms short, so the mean read 45.8 % where the median gave 44.7 %."""
    if r.get("mfu") is None or not r.get("step_time_ms_median"):
        return None
    images = r["batch_per_rank"] * (r.get("grad_accum_steps") or 1) * r["ranks"]
    per_device = images / r["ranks"] / (r["step_time_ms_median"] / 1e3)
    return per_device * r["train_flops_per_image"] / 1e12 / r["peak_tflops"]


def _options(r: dict) -> str:
    opts = [r["precision"], f"ZeRO-{r['zero_stage']}"]
    if r.get("compile"):
        mode = r.get("compile_mode") or "default"
        opts.append("compiled" + ("" if mode == "default" else f" ({mode})"))
    if r.get("grad_accum_steps", 1) > 1:
        opts.append(f"{r['grad_accum_steps']} micro-batches per update")
    if r.get("activation_checkpointing"):
        opts.append("act. ckpt" + (f" of {r['checkpointed_blocks']} blocks"
                                   if r.get("checkpointed_blocks") else ""))
    if r.get("block_kernels") is not None:  # older records and CPUs: not applicable
        opts.append("block kernels" if r["block_kernels"] else "timm's block backward")
    if r.get("mixup"):
        opts.append("mixup/cutmix")
    if r.get("nonfinite_check") == "before_backward":
        opts.append("check before backward")
    if r.get("one_pass_grad_checks") is False and r["zero_stage"] in (1, 2):
        opts.append("DeepSpeed's per-tensor grad checks")
    return ", ".join(opts)


def _data(r: dict) -> str:
    if r.get("data") != "loader":
        return "synthetic"
    workers = r.get("loader_workers")
    return f"shards, {workers} workers: {100 * r['data_wait_frac']:.1f} % wait"


def _model(r: dict) -> str:
    changes = r.get("arch_changes") or {}
    names = {"embed_dim": "width", "num_heads": "heads", "patch_size": "patch",
             "mlp_ratio": "MLP ratio"}
    said = ", ".join(f"{names.get(k, k)} {v:g}" for k, v in changes.items())
    return f"{r['model']}{f' ({said})' if said else ''} @{r['image_size']}"


def markdown(records: list[dict]) -> str:
    lines = ["| # | device | model | batch/GPU × GPUs | options | input | images/s | MFU | "
             "median step (timed steps) | MFU at the median | commit | date |",
             "|---" * 12 + "|"]
    for i, r in enumerate(records, 1):
        mfu = "relative only" if r.get("mfu") is None else f"{100 * r['mfu']:.1f} %"
        at_median = mfu_at_median(r)
        at_median = "—" if at_median is None else f"{100 * at_median:.1f} %"
        median = f"{r['step_time_ms_median']:,.1f} ms ({r['steps']})" \
            if r.get("step_time_ms_median") else "—"
        lines.append(f"| {i} | {r['device']} | {_model(r)} | "
                     f"{r['batch_per_rank']} × {r['ranks']} | {_options(r)} | {_data(r)} | "
                     f"{r['images_per_sec']:,.1f} | {mfu} | {median} | {at_median} | "
                     f"{r['commit']} | {r['date']} |")
    lines.append("")
    lines += [f"{i}. `{r['command']}`" for i, r in enumerate(records, 1)]
    profiled = [(i, r) for i, r in enumerate(records, 1) if r.get("profile")]
    if profiled:
        kinds = sorted({k for _, r in profiled for k in r["profile"]["ms"]},
                       key=lambda k: -max(r["profile"]["ms"].get(k, 0) for _, r in profiled))
        lines += ["", "Where a step's time goes (ms per step; device kernels on a GPU, host "
                  "operators on a CPU; the idle rest is the step time not covered by them; on a "
                  "GPU, the host's waits for the device and the host time spent in DeepSpeed's "
                  "step, through which the device idles unless enough work was queued; the "
                  "kernels DeepSpeed's step launched, on a CPU the operators it called):", "",
                  "| # | step | " + " | ".join(kinds) + " | idle rest | host waits | "
                  "host in DeepSpeed's step | launches in it |", "|---" * (len(kinds) + 6) + "|"]
        for i, r in profiled:
            b, steps, step_ms = r["profile"], r["profile_steps"], r["profile_step_ms"]
            cells = [f"{b['ms'].get(k, 0) / steps:.1f}" for k in kinds]
            idle = max(step_ms - b["busy_ms"] / steps, 0.0)
            waits = "—" if "host_syncs" not in b else \
                f"{b['host_syncs'] / steps:.0f} ({b['host_sync_ms'] / steps:.1f} ms)"
            in_step = "—" if "engine_step_host_ms" not in b else \
                f"{b['engine_step_host_ms'] / steps:.1f}"
            launches = "—" if "engine_step_launches" not in b else \
                f"{b['engine_step_launches'] / steps:.0f}"
            lines.append(f"| {i} | {step_ms:.1f} | " + " | ".join(cells) +
                         f" | {idle:.1f} | {waits} | {in_step} | {launches} |")
    return "\n".join(lines)


def rewrite_readme(readme: Path, table: str) -> None:
    """Replace what lies between the marker lines; refuses a README without them."""
    text = Path(readme).read_text()
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{readme} needs one '{BEGIN}' line and one '{END}' line after it, "
                         f"around the place the table goes")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    Path(readme).write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")


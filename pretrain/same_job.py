"""Every rank must run the same job: the same resolved config, the same code, the same packages.

On one node this holds by construction; across nodes it does not. Each node reads its own
recipe file and its own checkout, and runs its own Python environment: a node with an older
checkout, a recipe edited on one node's disk, or an image with another torch trains on with
the others -- a different learning rate on some ranks, or a collective one rank calls and the
others do not, which hangs the job until its timeout. So right after the process group is
joined, rank 0's facts go to every rank, each compares its own, and every rank stops with the
same line when any differs, naming the ranks, their hosts and what differs.
"""
from __future__ import annotations

import hashlib
import json
import socket
import sys
from pathlib import Path

from pretrain.config import ConfigError

PACKAGES = ("torch", "deepspeed", "timm", "webdataset", "accelerate", "mlflow")
SHOWN = 3  # differences named in the line; the rest are counted


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _code() -> dict:
    """{file: digest} of the library and the entry script this process runs."""
    import finetune
    import pretrain
    files = {}
    for pkg in (pretrain, finetune):
        root = Path(pkg.__file__).parent
        for f in sorted(root.rglob("*.py")):
            files[f"{root.name}/{f.relative_to(root)}"] = f
    script = Path(sys.argv[0])
    if script.suffix == ".py" and script.is_file():
        files[f"{script.parent.name}/{script.name}"] = script
    return {name: _digest(f.read_bytes()) for name, f in files.items()}


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def facts(cfg) -> dict:
    """What must be the same on every rank: ``config <key>`` (and the DeepSpeed JSON file's
    contents), ``code <file>``, ``package <name>`` (and Python's major.minor) to a value."""
    import importlib.metadata as md

    from pretrain.deepspeed_json import json_path
    out = {f"config {k}": json.dumps(v) for k, v in _flat(cfg.model_dump(mode="json")).items()}
    name = getattr(getattr(cfg, "deepspeed", None), "config", None)
    if name:  # its keys are the run's too; a node's own copy of the file may differ
        path = json_path(name)
        out["config deepspeed.config's contents"] = \
            _digest(path.read_bytes()) if path is not None else "not found"
    out.update({f"code {name}": digest for name, digest in _code().items()})
    out["package python"] = ".".join(map(str, sys.version_info[:2]))
    for name in PACKAGES[1:]:
        try:
            out[f"package {name}"] = md.version(name)
        except md.PackageNotFoundError:
            out[f"package {name}"] = "not installed"
    import torch
    out["package torch"] = torch.__version__  # with its build: +cu130, +cpu
    return out


def differences(mine: dict, first: dict) -> list[str]:
    """What of ``mine`` differs from rank 0's ``first``, a phrase each."""
    said = []
    for key in sorted(set(mine) | set(first)):
        here, there = mine.get(key, "none"), first.get(key, "none")
        if here == there:
            continue
        kind, name = key.split(" ", 1)
        if kind == "code":  # a file only one side has is not run (an import would fail)
            if key in mine and key in first:
                said.append(f"{name} differs")
        else:
            said.append(f"{name} {here[:60]} (rank 0: {there[:60]})")
    return said


def batch_layout(cfg, world: int) -> tuple[int, int]:
    """``cfg.train.batch_layout(world)``, whose error every rank meets alike once
    :func:`check_same_job` passed: said once, by rank 0."""
    from pretrain.distributed import agreed
    try:
        return cfg.train.batch_layout(world)
    except ConfigError as e:
        raise agreed(e)


def check_same_job(cfg, world: int) -> None:
    """Collective: refuse, on every rank alike, a job whose ranks do not run the same config,
    code and packages as rank 0."""
    from pretrain.distributed import agreed, broadcast_from_0, gather, is_distributed
    if not is_distributed():
        return
    try:
        mine = facts(cfg)
    except (OSError, ImportError) as e:  # every rank must reach the collectives below
        mine = {"package files": f"unreadable here ({e})"}
    first = broadcast_from_0(mine)
    said = differences(mine, first)
    told = gather((socket.gethostname(), said) if said else None, world)
    odd = [(r, host, said) for r, got in enumerate(told) if got for host, said in [got]]
    if not odd:
        return
    r, host, said = odd[0]
    others = f" and {len(odd) - 1} more rank{'s' if len(odd) > 2 else ''}" if len(odd) > 1 else ""
    more = f" and {len(said) - SHOWN} more" if len(said) > SHOWN else ""
    raise agreed(ConfigError(
        f"rank {r} (on {host}){others} does not run the same job as rank 0: "
        f"{'; '.join(said[:SHOWN])}{more}; give every node the same checkout, config file and "
        f"packages (a shared filesystem or one image) and relaunch"))

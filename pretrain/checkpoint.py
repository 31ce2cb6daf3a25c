"""Checkpoints that survive failures, for both stages.

The files of a checkpoint are the training backend's (DeepSpeed's ``save_checkpoint`` for
pretraining, :class:`pretrain.engine.DeepSpeedBackend`; Accelerate's ``save_state`` for
fine-tuning, :class:`finetune.backend.AccelerateBackend`); this store decides where they go,
when a checkpoint counts and which one a relaunch resumes from.

Layout: ``output_dir/checkpoints/step_00001000/`` holds the backend's files plus ``COMPLETE.json``,
a manifest written by rank 0 only after every rank has returned from its save. A directory
without a manifest (a kill mid-write), or whose manifest lists a file that is missing or has
another size (a lost rank's shard), is never loaded: resume takes the newest valid one and says
which it skipped. Only the last ``keep_last`` valid checkpoints are kept. The directory must be
on storage every node sees (as DeepSpeed itself requires to resume).

A write that fails on any rank (full disk, I/O error) fails the save on every rank alike with
:class:`CheckpointWriteError`: the partial directory is removed, the earlier checkpoints are
untouched, and the trainer stops or goes on as ``checkpoint.on_write_error`` says.

The manifest is the last thing written, and only once the rest is on disk: every file and
directory of the checkpoint is fsynced first (by one rank per node), then the manifest goes to a
temporary file that is fsynced, renamed into place, and its directory fsynced. A power loss right
after a save cannot leave a checkpoint that counts as complete but whose files never reached disk.

DeepSpeed unpickles checkpoints with ``weights_only=False``; every one is screened first
(:mod:`pretrain.pickle_screen`).

Changing the world size goes through DeepSpeed's universal checkpoint format: the first resume
on a new world size converts the checkpoint (``ds_to_universal``) into ``<tag>_universal/``.
"""
from __future__ import annotations

import json
import logging
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from pretrain import job_status
from pretrain.atomic_write import fsync_fd, fsync_path
from pretrain.checkpoint_layout import momentum_as_adam, momentum_back
from pretrain.config import ConfigError
from pretrain.data.info import StorageUnreachable
from pretrain.distributed import barrier, first_of_node, rank, rank_0_does
from pretrain.guard import TrainingStopped
from pretrain.helper_processes import ignore_stop_signals

log = logging.getLogger(__name__)

MANIFEST = "COMPLETE.json"
# a fine-tune checkpoint (Accelerate's files) keeps the loop's client state in this file
CLIENT_STATE = "client_state.pt"
MANIFEST_TMP = MANIFEST + ".tmp"
TAG_RE = re.compile(r"^step_(\d{8,})$")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    world_size: int
    zero_stage: int
    precision: Optional[str] = None  # train.precision (None: a manifest from before it was kept)

    @property
    def tag(self) -> str:
        return self.path.name


UNIVERSAL_WITHIN_S = 4 * 3600.0  # the other ranks' wait for rank 0's conversion


class StaleView(StorageUnreachable):
    """A rank's view of output_dir lags rank 0's: exit code 1, as storage that may come back."""


class CheckpointStore:
    def __init__(self, root: os.PathLike | str, keep_last: int = 3):
        self.root = Path(root)
        self.keep_last = keep_last

    # -- writing ---------------------------------------------------------------------------
    def save(self, backend, step: int, client_state: dict) -> Checkpoint:
        """Every rank calls this; returns once the checkpoint is complete on all ranks, or raises
        :class:`CheckpointWriteError` on all ranks when any rank could not write its part.
        ``backend.save_checkpoint`` writes the files and ends in one barrier of all ranks."""
        tag = tag_for(step)
        path = self.root / tag
        if rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            try:
                (path / MANIFEST).unlink()  # re-saving a step: invalid until done
            except FileNotFoundError:
                pass
            else:  # on disk too: after a crash the old one must not be back over new files
                fsync_path(path)
            # and none of the earlier save's files stays beside the new ones (a save killed
            # midway, on another world size: its ranks' files would be listed as this one's,
            # and DeepSpeed's conversion of the checkpoint would read them)
            shutil.rmtree(path, ignore_errors=True)
            if path.exists():
                log.warning("could not empty %s before saving step %d again: %s stay there "
                            "and are listed with the new files", path, step,
                            ", ".join(sorted(p.name for p in path.iterdir())[:4]))
        barrier()
        error = None
        try:
            backend.save_checkpoint(self.root, tag, client_state)
        except Exception as e:  # noqa: BLE001 -- full disk, I/O error: torch.save raises either
            error = f"rank {rank()}: {type(e).__name__}: {e}"
            # A write fails inside the backend's write phase, which ends in one barrier: the
            # ranks that wrote their part wait there, so meet them before agreeing on the outcome.
            barrier()
        files = None
        # one rank per node (and rank 0, which lists the files in the manifest) fsyncs: a node's
        # page cache holds the writes of all its ranks, and only that node can flush them (on
        # NFS or Lustre an fsync from another node does not)
        if error is None and first_of_node():
            try:
                files = _sync_tree(path)
                fsync_path(self.root)  # holds the entry of the step directory
            except OSError as e:  # EIO or ENOSPC surface here when the data reach the disk late
                error = f"rank {rank()}: fsync: {type(e).__name__}: {e}"
        ckpt = Checkpoint(path, step, backend.world_size, backend.zero_stage,
                          getattr(backend, "precision", None))
        errors = _errors_on_any_rank(error)  # a collective: past it, every node has synced
        if not errors and rank() == 0:
            try:
                self._write_manifest(ckpt, files)
                self._prune()
            except OSError as e:
                error = f"rank 0: manifest: {type(e).__name__}: {e}"
        errors = errors or _errors_on_any_rank(error)
        if errors:
            if rank() == 0:  # never loaded anyway, and on a full disk it is in the way
                shutil.rmtree(path, ignore_errors=True)
            barrier()
            # every rank says it: rank 0 may be held up ending its MLflow run, and be ended by
            # the launcher before it could say it alone
            raise CheckpointWriteError(self._write_failure(tag, errors))
        job_status.note("checkpoint", step)
        return ckpt

    def _write_manifest(self, ckpt: Checkpoint, files: dict[str, int]) -> None:
        manifest = {"step": ckpt.step, "world_size": ckpt.world_size,
                    "zero_stage": ckpt.zero_stage, "precision": ckpt.precision,
                    "time": time.time(), "files": files}
        _write_durably(ckpt.path / MANIFEST, json.dumps(manifest, indent=1))

    def _write_failure(self, tag: str, errors: list[str]) -> str:
        free = shutil.disk_usage(self.root).free
        previous = self.complete()
        kept = f"{previous[0].path} is intact" if previous else "there is no earlier checkpoint"
        disk = (f"the disk holding it is full ({free / 2**20:.1f} MiB free)"
                if previous and free < folder_bytes(previous[0].path) or free < 2**20
                else f"{free / 2**30:.1f} GiB free there")
        full, fix = disk.startswith("the disk"), "Free space"
        # out of room on a disk with room: a quota, its inodes, a file-size limit (torch's
        # writer loses the cause of a short write: "unexpected pos")
        if not full and any(re.search(r"\[Errno (28|122|27)\]|unexpected pos", e)
                            for e in errors):
            limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
            disk += (", so a quota, the inodes (`df -i`) or a file-size limit may have stopped "
                     "it (`ulimit -f`: " + (f"{limit / 2**20:.1f} MiB here)"
                                            if limit != resource.RLIM_INFINITY else "none here)"))
            fix = "Free space or inodes, raise the quota or the limit,"
        more = f" (and {len(errors) - 1} more rank(s))" if len(errors) > 1 else ""
        return (f"checkpoint {self.root / tag} could not be written: {errors[0]}{more}; {disk}; "
                f"{kept}. {fix} or move output_dir, then relaunch: it resumes from the newest "
                f"complete checkpoint")

    def _prune(self) -> None:
        valid = self.complete()
        for old in valid[self.keep_last:]:
            shutil.rmtree(old.path, ignore_errors=True)
            shutil.rmtree(old.path.with_name(old.tag + "_universal"), ignore_errors=True)
        # half-written directories older than the newest good one can never be resumed from
        if valid:
            for d in self._tag_dirs():
                step = int(TAG_RE.match(d.name).group(1))
                if step < valid[0].step and not (d / MANIFEST).exists():
                    log.warning("removing incomplete checkpoint %s", d)
                    shutil.rmtree(d, ignore_errors=True)

    # -- reading ---------------------------------------------------------------------------
    def _tag_dirs(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted((d for d in self.root.iterdir() if d.is_dir() and TAG_RE.match(d.name)),
                      key=lambda d: int(TAG_RE.match(d.name).group(1)), reverse=True)

    def complete(self, warn: bool = False) -> list[Checkpoint]:
        """Valid checkpoints, newest first; with ``warn``, say why each skipped one is skipped."""
        out = []
        for d in self._tag_dirs():
            problem = _problem(d)
            if problem is None:
                out.append(self._read(d))
            elif warn and rank() == 0:
                log.warning("skipping checkpoint %s: %s", d, problem)
        return out

    @staticmethod
    def _read(d: Path) -> Checkpoint:
        m = json.loads((d / MANIFEST).read_text())
        return Checkpoint(d, int(m["step"]), int(m["world_size"]), int(m["zero_stage"]),
                          m.get("precision"))

    def latest(self) -> Optional[Checkpoint]:
        valid = self.complete(warn=True)
        return valid[0] if valid else None

    def latest_agreed(self) -> Optional[Checkpoint]:
        """Collective: the newest complete checkpoint as rank 0 sees it, the one every rank
        loads. Each rank choosing for itself could pick different steps where the filesystem
        shows some nodes a late view (an NFS attribute cache): a checkpoint fewer, or the one
        being written. A rank that does not see rank 0's choice complete stops the job, on every
        rank alike, as a crash (exit code 1): a late view catches up."""
        from pretrain.distributed import agreed, broadcast_from_0, gather, rank_world
        first = rank() == 0
        valid = self.complete(warn=True) if first else []
        chosen = broadcast_from_0(valid[0].tag if valid else None)
        mine = valid[0] if valid else None
        if not first and chosen is not None:  # only rank 0's choice is looked at here: a late
            try:  # view may list a folder rank 0 has removed, whose files are then gone
                mine = None if _problem(self.root / chosen) else self._read(self.root / chosen)
            except OSError:  # (a stale file handle)
                mine = None
        hosts = gather(None if mine is not None or chosen is None else socket.gethostname(),
                       rank_world()[1])
        blind = [(r, host) for r, host in enumerate(hosts) if host is not None]
        if blind:
            (r, host), more = blind[0], len(blind) - 1
            raise agreed(StaleView(
                f"rank {r} (on {host}){f' and {more} more' if more else ''} cannot see checkpoint "
                f"{self.root / chosen} complete, which rank 0 resumes from: output_dir's storage "
                f"shows that node an older view; relaunch (or mount it without attribute "
                f"caching)"))
        return mine

    def load(self, backend, ckpt: Checkpoint) -> dict:
        """Load model/optimizer state into ``backend``; returns the client state (step, loader
        position, RNG, ...). A DeepSpeed backend on another world size, ZeRO stage or precision
        than the one that saved ``ckpt`` reads the universal copy :meth:`prepare_universal` made.

        The optimizer's settings stay this job's config's: loading its state puts the saved
        ones back too, so a relaunch with another ``optimizer.weight_decay`` (``betas``,
        ``eps``, ``momentum``, and DeepSpeed's ``grad_clip``) would otherwise go on with the
        old (the scheduler sets lr)."""
        configured = _settings(backend)
        client = backend.load_checkpoint(self.root, ckpt)
        if not client or "step" not in client:  # DeepSpeed carries it through ds_to_universal
            raise RuntimeError(f"checkpoint {ckpt.path} has no client state (step, loader "
                               f"position); it was not written by this trainer")
        for optimizer, groups, clip in configured:
            for group, settings in zip(optimizer.param_groups, groups):
                group.update(settings)
            if clip is not None:
                optimizer.clip_grad = clip
        _unshare_steps(backend)
        return client

    def prepare_universal(self, ckpt: Checkpoint, why: str, deepspeed_dir: str = "") -> None:
        """Convert ``ckpt`` for another world size, ZeRO stage or precision (``why`` says which;
        rank 0 converts, the others wait) into ``<tag>_universal/``. ``deepspeed_dir``: the
        folder of DeepSpeed's files inside the checkpoint (Accelerate's ``pytorch_model``),
        converted into the same folder of the copy, where the checkpoint's other files (RNG
        states, the EMA, the client state) are linked."""
        out = ckpt.path.with_name(ckpt.tag + "_universal")

        def convert() -> None:
            if (out / MANIFEST).exists():  # converted by an earlier launch
                return
            from pretrain.pickle_screen import check_pickles_are_inert  # (imports this module)
            check_pickles_are_inert(ckpt.path)  # the conversion unpickles it
            log.warning("%s: converting %s to DeepSpeed's universal checkpoint", why, ckpt.path)
            shutil.rmtree(out, ignore_errors=True)
            started = time.monotonic()
            src, staging = ckpt.path / deepspeed_dir, out / "sgd-as-adam"
            momentum = momentum_as_adam(src, staging)
            cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                   "--input_folder", str(src if momentum is None else staging),
                   "--output_folder", str(out / deepspeed_dir)]
            # a stop signal sent to every process of the job (SLURM's --signal) must not kill
            # the conversion: the rank stops at its first step boundary instead
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  preexec_fn=ignore_stop_signals)
            if proc.returncode != 0:
                tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
                # (the staged copy converted by hand would hold SGD's momentum as Adam's)
                retry = f"run: {' '.join(cmd)}" if momentum is None else \
                    "a relaunch converts it again"
                raise RuntimeError(f"converting {ckpt.path} to a universal checkpoint failed: "
                                   f"{tail[0]}; {retry}")
            if momentum is not None:
                momentum_back(out / deepspeed_dir, momentum)
                shutil.rmtree(staging)
            if deepspeed_dir:
                for f in ckpt.path.iterdir():
                    if f.name not in (deepspeed_dir, MANIFEST) and f.is_file():
                        _link_or_copy(f, out / f.name)
            # the manifest says "converted": a crash must not leave it over files not on disk
            _sync_tree(out)
            fsync_path(out.parent)
            _write_durably(out / MANIFEST, (ckpt.path / MANIFEST).read_text())
            log.info("converted to %s in %.1f s", out, time.monotonic() - started)
        # hours for the largest models' optimizer states: more than a barrier's 10 minutes
        rank_0_does(convert, f"universal/{ckpt.tag}", within_s=UNIVERSAL_WITHIN_S)


def resume_point(cfg) -> Optional[Checkpoint]:
    """The checkpoint a launch of ``cfg`` goes on from: the newest complete one in its
    output_dir (None: a new run there, or checkpoint.resume=false)."""
    if not cfg.checkpoint.resume:
        return None
    done = CheckpointStore(Path(cfg.output_dir) / "checkpoints").complete()
    return done[0] if done else None


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)  # the EMA is a whole model: no second copy on disk
    except OSError:  # a file system without hard links
        shutil.copy2(src, dst)


# the optimizer settings a run's config gives (per parameter group: no decay on norms and biases)
OPTIMIZER_SETTINGS = ("weight_decay", "betas", "eps", "momentum")


def _optimizers(backend) -> list:
    """The backend's optimizer and every wrapper around or under it (DeepSpeed's engine holds
    its ZeRO or bf16 optimizer, Accelerate's wraps DeepSpeed's or torch's): each may restore
    settings of its own from a checkpoint."""
    chain = []
    engine = getattr(backend, "engine", None)
    for opt in (getattr(engine, "optimizer", None), getattr(backend, "optimizer", None)):
        while opt is not None and all(opt is not o for o in chain):
            chain.append(opt)
            opt = getattr(opt, "optimizer", None)
    return chain


def _unshare_steps(backend) -> None:
    """Give every parameter's optimizer state a step counter of its own. DeepSpeed 0.19's ZeRO-3
    load of a universal checkpoint hands one step tensor to all its parameter groups, which
    torch's Adam then advances in place once per group: two steps counted for each step trained
    (with decay and without), and a wrong bias correction for the rest of the run."""
    for optimizer in _optimizers(backend):
        if not isinstance(optimizer, torch.optim.Optimizer):
            continue
        seen = set()
        for state in optimizer.state.values():
            step = state.get("step") if isinstance(state, dict) else None
            if isinstance(step, torch.Tensor):
                if id(step) in seen:
                    state["step"] = step.clone()
                seen.add(id(step))


def _settings(backend) -> list[tuple]:
    """(optimizer, its param groups' OPTIMIZER_SETTINGS or [], its clip_grad or None) for each
    of :func:`_optimizers`: the torch optimizers' groups, which their step reads, and the
    gradient clipping DeepSpeed's optimizers keep (and load) themselves."""
    out = []
    for o in _optimizers(backend):
        innermost = isinstance(o, torch.optim.Optimizer) and getattr(o, "optimizer", None) is None
        groups = [{k: g[k] for k in OPTIMIZER_SETTINGS if k in g}
                  for g in o.param_groups] if innermost else []
        clip = getattr(o, "clip_grad", None)
        if groups or clip is not None:
            out.append((o, groups, clip))
    return out


class CheckpointError(ConfigError):
    """A checkpoint that cannot be read or exported: one line naming the path and the fix."""


def _raise(e: OSError) -> None:
    raise e


# -- durability ------------------------------------------------------------------------------
def _sync_tree(top: Path) -> dict[str, int]:
    """fsync every file and directory under ``top`` (``top`` included); returns the files'
    sizes by their path relative to ``top``, the manifest left out. One walk does both, with
    one open per file: a checkpoint is a few files per rank, thousands on a large job, and on
    shared storage every open and stat is a round trip to the server. Each node syncs every
    file, since which node wrote which is not known here; a file with nothing left to write
    from this node costs one cheap fsync."""
    files, top = {}, os.fspath(top)
    for dirpath, dirnames, filenames in os.walk(top, onerror=_raise):
        dirnames.sort()
        for name in sorted(filenames):
            if name in (MANIFEST, MANIFEST_TMP) and dirpath == top:
                continue
            f = os.path.join(dirpath, name)
            fd = os.open(f, os.O_RDONLY)
            try:
                fsync_fd(fd)
                files[os.path.relpath(f, top)] = os.fstat(fd).st_size
            finally:
                os.close(fd)
        fsync_path(dirpath)
    return files


def _write_durably(path: Path, text: str) -> None:
    """``path`` holds ``text`` -- on disk, not only in the page cache -- or is left as it was."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        fsync_fd(fh.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)  # the rename itself


class CheckpointWriteError(TrainingStopped):
    """A rank could not write its part of a checkpoint; the partial directory was removed."""


def _errors_on_any_rank(error: Optional[str]) -> list[str]:
    """Every rank's error (collective), in rank order; empty when all succeeded."""
    if not (dist.is_available() and dist.is_initialized()):
        return [error] if error else []
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, error)
    return [e for e in out if e]


def folder_bytes(d: Path) -> int:
    """What the files under ``d`` hold (a checkpoint's size)."""
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def _problem(d: Path) -> Optional[str]:
    manifest = d / MANIFEST
    if not manifest.exists():
        return "no COMPLETE.json (a save was interrupted)"
    try:
        m = json.loads(manifest.read_text())
        files = m["files"]
    except (ValueError, KeyError) as e:
        return f"unreadable manifest ({e})"
    for name, size in files.items():
        f = d / name
        if not f.exists():
            return f"file {name} is missing"
        if f.stat().st_size != size:
            return f"file {name} has {f.stat().st_size} bytes, expected {size}"
    return None

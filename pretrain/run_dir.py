"""One run per output directory.

A relaunch into an ``output_dir`` continues the run there (``checkpoint.resume``, the default).
With ``checkpoint.resume=false`` a new run starts there instead, and the earlier one's files are
first moved, whole, into ``output_dir/earlier-<time>/`` (what runs write, ``RUN_FILES``; other
files there are the user's and stay). Left in place they would be overwritten
(a checkpoint of the same step, ``config.yaml``, a fine-tune's ``best`` export), pruned by the
new run's ``keep_last``, or worse, resumed: the earlier run's newer checkpoints would outrank
the new run's at the next relaunch.

A job holds its ``output_dir`` (a lock, :data:`JOB_LOCK`) while it runs: a second job started
there is refused, where it would write checkpoints among the first one's or, with
``checkpoint.resume=false``, move them from under it. Also here: a relaunch that would
continue another model's run is refused (one that changes
other settings is reported, :func:`check_same_run`), a folder the run
writes to that cannot be made is a config error, an ``output_dir`` that some ranks do not see
(node-local storage in a multi-node job) is refused (:func:`check_every_rank_sees`), and a
start refused before it wrote anything leaves no empty ``output_dir`` behind.
"""
from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import re
import secrets
import shutil
import socket
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Iterable, Iterator, Optional

from pretrain.config import ConfigError, RunConfig
from pretrain.config_files import load_config
from pretrain.distributed import agreed, gather, raise_together, rank_world
from pretrain.run_info import flatten

if TYPE_CHECKING:
    from pretrain.checkpoint import Checkpoint

log = logging.getLogger(__name__)

EARLIER = "earlier-"
# what makes a folder hold a run: the trainer writes both before anything else
RUN_MARKERS = ("config.yaml", "checkpoints")
# what runs and the commands on their models write in an output_dir; anything else there (a
# user's notes, the code of a job launched with output_dir=.) is the user's, and stays put
RUN_FILES = ("config.yaml", "config.resume_step_*.yaml", "checkpoints", "metrics.jsonl",
             "tracking", "tracking.*", "best", "best.*", "final", "final.*",
             "per_class_top1.json", "backbone", "*-eval-*",
             "finished.json")  # (pretrain.finished_run.FINISHED)
# how a run was launched, not how it trains: the same folder named anew, a fresh start's flag
HOW_LAUNCHED = ("output_dir", "checkpoint.resume")
JOB_LOCK = ".job.lock"  # in output_dir: held by the rank 0 of the job running there
# how long a requeued SLURM job waits for its earlier allocation's lock: a node cut off from the
# cluster keeps it on NFS until the server's lease for it runs out (90 s by default)
REQUEUE_LOCK_WAIT_S = 300.0


def hold_output_dir(out: Path) -> Optional[IO]:
    """Lock ``out`` for this job: rank 0 returns the file that holds the lock until closed
    (None elsewhere); the loader workers it forks do not hold it (a rank killed outright must
    not leave a requeued job refused by its orphans), and a requeued SLURM job waits a while for
    its own earlier allocation to let go. Collective: every rank raises when another job still
    holds it."""
    from pretrain.distributed import rank_0_does
    from pretrain.file_lock import earlier_allocation, holder, try_lock
    me, world = rank_world()
    lock = out / JOB_LOCK
    held, error, wait_s = None, None, None
    if me == 0:
        try:
            held = try_lock(lock, children_hold=False)
            if held is None and earlier_allocation(lock):
                wait_s = _requeue_wait_s()
            elif held is None:
                error = (f"a job is still running in '{out}' ({holder(lock)} holds {lock}); let "
                         f"it finish, or stop it, before starting another there")
        except OSError as e:  # another user's lock file, a quota
            error = (f"cannot lock {lock} ({e.strerror or e}); pick an output_dir you can "
                     f"write to")
        except ConfigError as e:
            error = str(e)
    error, wait_s = gather((error, wait_s), world)[0]
    if wait_s is not None and error is None:
        def wait() -> None:  # longer than a collective may wait: the others wait on the store
            nonlocal held, error
            log.warning("%s holds %s: an earlier allocation of this job; waiting up to %.0f s "
                        "for it to let go", holder(lock), lock, wait_s)
            deadline = time.monotonic() + wait_s
            while held is None and time.monotonic() < deadline:
                time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
                held = try_lock(lock, children_hold=False)
            if held is None:
                error = (f"{lock} is still held ({holder(lock)}) after {wait_s:.0f} s of waiting "
                         f"for an earlier allocation of this job; end its processes there (or "
                         f"take that node down), then scontrol requeue "
                         f"{os.environ.get('SLURM_JOB_ID')}")
        rank_0_does(wait, "job-lock", within_s=wait_s + 60)
        error = gather(error, world)[0]
    if error:
        raise agreed(ConfigError(error))
    return held


def _requeue_wait_s() -> float:
    text = os.environ.get("VITSCALE_REQUEUE_LOCK_WAIT_S", str(REQUEUE_LOCK_WAIT_S))
    try:
        wait_s = float(text)
    except ValueError:
        wait_s = -1.0
    if not wait_s >= 0:
        raise ConfigError(f"VITSCALE_REQUEUE_LOCK_WAIT_S={text} is not a number of seconds")
    return wait_s


def release_output_dir(held: IO, out: Path, made: bool) -> None:
    """Let ``out`` go; a folder this start made that holds nothing but the lock loses it, while
    it is still held (so no other job's lock is ever removed), to be removed itself."""
    try:
        if made and [p.name for p in out.iterdir()] == [JOB_LOCK]:
            (out / JOB_LOCK).unlink()
    except OSError:
        pass
    finally:
        held.close()


def set_aside_earlier_run(out: Path, inputs: Iterable[Optional[str]] = ()) -> Optional[Path]:
    """Move the run in ``out`` (if there is one) into ``out/earlier-<time>/``; returns that
    folder on rank 0, None elsewhere or when there was nothing to move. ``inputs``: paths this
    run reads (data, initial weights); one inside the earlier run is refused, since moving it
    would pull it from under the run. Collective: every rank calls it, rank 0 moves."""
    rank, world = rank_world()
    moved, error = None, None
    if rank == 0:
        try:
            moved = _set_aside(Path(out), [i for i in inputs if i])
        except ConfigError as e:
            error = str(e)
        except OSError as e:
            error = (f"cannot move the earlier run in '{out}' aside ({type(e).__name__}: {e}); "
                     f"move it yourself or pick another output_dir")
    error = next((e for e in gather(error, world) if e), None)  # all ranks wait for rank 0
    if error:
        raise agreed(ConfigError(error))
    return moved


def _set_aside(out: Path, inputs: list[str]) -> Optional[Path]:
    from pretrain.spool import STATE, TRACKING_DIR, RunState, lock, undelivered

    if not any((out / m).exists() for m in RUN_MARKERS):
        return None
    entries, kept = [], []
    for p in sorted(out.iterdir()):
        if not p.name.startswith(EARLIER) and p.name != JOB_LOCK:
            (entries if any(fnmatch.fnmatchcase(p.name, f) for f in RUN_FILES) else kept).append(p)
    for given in inputs:
        path = Path(given).resolve()
        if path == out.resolve() or any(path == p.resolve() or p.resolve() in path.parents
                                        for p in entries):
            raise ConfigError(
                f"'{given}', which this run reads, is (inside) the earlier run in '{out}' that "
                f"checkpoint.resume=false moves aside: copy it out of '{out}' first, or pick "
                f"another output_dir")
    track = out / TRACKING_DIR
    held = lock(track) if track.is_dir() else None
    if track.is_dir() and held is None:  # a job (or upload_spool.py) still at work there
        raise ConfigError(f"a job is still running in '{out}' (it holds {track}); let it "
                          f"finish or stop it before starting a new run there")
    try:
        left = undelivered(track) if held else 0
    finally:
        if held:
            held.close()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = out / f"{EARLIER}{stamp}", 1
    while aside.exists():  # two fresh starts within a second
        n += 1
        aside = out / f"{EARLIER}{stamp}-{n}"
    aside.mkdir()
    moved = []
    for p in entries:
        try:
            os.rename(p, aside / p.name)  # one file system: instant, whatever the checkpoints weigh
        except OSError as e:
            raise OSError(f"{e.strerror or e} moving {p.name}; already in {aside}: "
                          f"{', '.join(moved) or 'nothing'}") from None
        moved.append(p.name)
    if (aside / TRACKING_DIR / STATE).is_file():  # its MLflow run is there now, not here
        try:
            state = RunState.load(aside / TRACKING_DIR)
            state.tags["output_dir"] = str(aside.resolve())
            state.save(aside / TRACKING_DIR)
        except (OSError, ValueError, TypeError) as e:  # the move is done: only the tag is stale
            log.info("%s still names %s as its output_dir (%s)", aside / TRACKING_DIR / STATE,
                     out, e)
    log.warning("checkpoint.resume=false: a new run starts in %s; the earlier run there (%s) "
                "was moved to %s, nothing of it deleted%s%s", out, ", ".join(moved), aside,
                f"; left in place, as no run writes them: {', '.join(p.name for p in kept)}"
                if kept else "",
                f"; `python launch/upload_spool.py {aside}` sends its {left} MLflow records "
                f"that never reached the server" if left else "")
    return aside


@contextlib.contextmanager
def removed_if_left_empty(path: Path) -> Iterator[bool]:
    """A run that fails (bad data, a wrong ``init``) and leaves the ``output_dir`` it made
    empty removes it: the next try, with another name, leaves no litter. Only an empty
    folder goes (``rmdir``), and only one this start made."""
    made = not path.exists()
    try:
        yield made
    except BaseException:
        if made:
            with contextlib.suppress(OSError):  # not empty, or another rank got there first
                path.rmdir()
        raise


def make_dir(path: Path, key: str) -> None:
    """Before anything is built: a folder the run writes to that cannot be made is a config
    error, not a traceback at the first write; said once (collective)."""
    error = None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        error = ConfigError(f"{key} '{path}' cannot be created ({e.strerror or e}); pick a "
                            f"folder you can write to")
    raise_together(error, rank_world()[1])


def unshare_written_files(out: Path) -> None:
    """A copy of a run made with hard links (``cp -al``, ``rsync --link-dest``: checkpoints are
    large) shares every file with the original; those a run appends to or locks (metrics.jsonl,
    its tracking records, the job lock) become files of its own here before this job touches
    them, else the copy's steps would land in the original's files too. Rank 0, before the
    job lock."""
    from pretrain.spool import TRACKING_DIR
    track = out / TRACKING_DIR
    for f in [out / "metrics.jsonl", out / JOB_LOCK,
              *(track.rglob("*") if track.is_dir() else [])]:
        try:
            if f.is_file() and not f.is_symlink() and f.stat().st_nlink > 1:
                own = f.with_name(f.name + ".unshared")
                shutil.copy2(f, own)
                os.replace(own, f)  # the original keeps its inode; this name gets a new one
        except OSError as e:
            log.warning("could not make %s a file of its own (%s): it is a hard link, and this "
                        "run writes to it", f, e)


def check_every_rank_sees(out: Path) -> None:
    """The output_dir of a job over several nodes must be one folder they all see: every rank
    writes its part of each checkpoint there, every rank reads its part back, and a relaunch
    decides where to resume from what it finds there. On a node-local disk (or as a relative
    path resolved in another working directory on each node) each checkpoint would be split
    between the nodes, rank 0's manifest vouching for its own node's files only, and a relaunch
    on other nodes would find other checkpoints, or none. Rank 0 writes a file of a new name
    (no node can have cached its absence), the others look for it; a collective."""
    me, world = rank_world()
    if world == 1:
        return
    name = None
    if me == 0:
        name = f".seen-by-every-rank-{secrets.token_hex(8)}"
        try:
            (out / name).touch()
        except OSError:  # cannot write there: every rank learns it from the name
            name = None
    try:
        name = gather(name, world)[0]  # rank 0 wrote the file before it joined this collective
        seen = gather((socket.gethostname(), name is not None and _finds(out / name)), world)
    finally:
        if me == 0 and name is not None:
            with contextlib.suppress(OSError):
                (out / name).unlink()
    if name is None:
        raise agreed(ConfigError(f"output_dir '{out}' cannot be written by rank 0; pick a "
                                 f"folder every rank can write to"))
    blind = [(r, host) for r, (host, ok) in enumerate(seen) if not ok]
    if blind:
        raise agreed(ConfigError(
            f"output_dir '{out}' is not one folder that every rank sees: {len(blind)} of "
            f"{world} ranks (on {', '.join(sorted({h for _, h in blind}))}) do not find the "
            f"file rank 0 (on {seen[0][0]}) wrote there; every rank writes and reads "
            f"checkpoints there, so give an absolute path on storage every node mounts (NFS, "
            f"Lustre, a parallel file system)"))


def _finds(path: Path, patience_s: float = 2.0) -> bool:
    """Whether ``path`` can be found, asked again for ``patience_s`` before answering no: a
    caching file system may show another node's new file a moment late. An error (no
    permission on this node, a stale NFS handle) is a no."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            if path.exists():
                return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def _same_path(was, now) -> bool:
    """Whether two settings name the same file or folder (a fine-tune's init written with a
    trailing slash, as tab completion adds it, or absolute)."""
    return isinstance(was, str) and isinstance(now, str) and os.path.exists(now) and \
        os.path.realpath(was) == os.path.realpath(now)


def _saved_config(out: Path, saved: Path, schema: type[RunConfig]) -> RunConfig:
    """The run's config.yaml; one that is the other stage's (a fine-tune given the pretraining
    run's folder as its output_dir) is refused as such, not as keys of the user's to fix."""
    try:
        return load_config(schema, saved)
    except ConfigError as e:
        import finetune.config  # noqa: F401  (the fine-tune's schema, to be among the stages)
        for other in RunConfig.__subclasses__():
            if other is schema or not other.launcher:
                continue
            try:
                load_config(other, saved)
            except ConfigError:
                continue
            raise ConfigError(f"output_dir '{out}' holds a run of {other.launcher}, not of "
                              f"{schema.launcher}; give this run an output_dir of its own") \
                from None
        raise ConfigError(f"output_dir '{out}' holds a config.yaml this run cannot read ({e}); "
                          f"pick a new output_dir, or set checkpoint.resume=false to start a new "
                          f"run there (the earlier one is moved into '{out}/earlier-<time>/')") \
            from None


def _trained_with(out: Path, step: int, schema: type[RunConfig]) -> Optional[RunConfig]:
    """The config of the latest relaunch that changed settings at or before ``step`` (its
    ``config.resume_step_N.yaml``: they applied from step N on); None: config.yaml's."""
    kept = []
    for path in out.glob("config.resume_step_*.yaml"):
        match = re.fullmatch(r"config\.resume_step_(\d+)\.yaml", path.name)
        if match and int(match.group(1)) <= step:
            kept.append((int(match.group(1)), path))
    try:
        return load_config(schema, max(kept)[1]) if kept else None
    except ConfigError:  # edited by hand into something unreadable: config.yaml's, then
        return None


def _tracked_in(out: Path) -> Optional[str]:
    """The MLflow experiment the run in ``out`` is tracked in (its tracking/run.json: the
    experiment of the job that made its MLflow run, which a start without tracking did not)."""
    from pretrain.spool import TRACKING_DIR, RunState
    try:
        return RunState.load(out / TRACKING_DIR).experiment
    except (OSError, ValueError, TypeError):  # none, or not one this version reads
        return None


def check_same_run(out: Path, cfg: RunConfig, resume: Optional[Checkpoint]) -> list[str]:
    """Refuse to continue someone else's run: a resumed checkpoint must have been saved with
    the same ``identity_keys`` (the model; a fine-tune's init too). Returns the other settings
    that differ from those the run trained with until the checkpoint (``config.yaml``'s, or the
    latest relaunch's ``config.resume_step_N.yaml``: ``"optimizer.lr: 0.002 -> 0.0005"``), which a
    relaunch may change (a lower learning rate after a divergence, more steps), and which the
    trainer reports and keeps."""
    if resume is None:
        return []
    saved = out / "config.yaml"
    if not saved.is_file():
        return []
    old = _saved_config(out, saved, type(cfg))
    for key in cfg.identity_keys:
        was, now = old, cfg
        for part in key.split("."):  # (data.train_split: a key of a section)
            was, now = getattr(was, part), getattr(now, part)
        if was != now and hasattr(now, "model_fields"):  # a section: name the first difference
            field = next(f for f in now.model_fields if getattr(was, f) != getattr(now, f))
            key, was, now = f"{key}.{field}", getattr(was, field), getattr(now, field)
        if was != now and not _same_path(was, now):
            raise ConfigError(
                f"output_dir '{out}' holds a run with another {key} ({was!r} there, {now!r} "
                f"now); pick a new output_dir, or set checkpoint.resume=false to start a new "
                f"run there (the earlier one is moved into '{out}/earlier-<time>/')")
    tracked = _tracked_in(out) or (old.tracking.experiment if old.tracking.enabled else None)
    if tracked and cfg.tracking.enabled and tracked != cfg.tracking.experiment:
        raise ConfigError(
            f"output_dir '{out}' holds a run tracked in MLflow experiment '{tracked}' "
            f"('{cfg.tracking.experiment}' now), and an MLflow run cannot move to another "
            f"experiment: keep tracking.experiment={tracked}, pick a new output_dir, or set "
            f"checkpoint.resume=false to start a new run there (the earlier one is moved into "
            f"'{out}/earlier-<time>/')")
    was, now = old.checkpoint_layout(), cfg.checkpoint_layout()
    for key in was:
        if was[key] != now.get(key):
            raise ConfigError(
                f"output_dir '{out}' holds a run whose checkpoints need {key} {was[key]} (now "
                f"{now.get(key)}): they hold its optimizer state and weights in that form; keep "
                f"{key} {was[key]}, pick a new output_dir, or set checkpoint.resume=false to "
                f"start a new run there (the earlier one is moved into '{out}/earlier-<time>/')")
    from pretrain.spool import redacted  # a tracking.uri's password is for no log
    # against what trained the steps until now: a relaunch's changes apply from its step on, and
    # one back to config.yaml's settings is a change too (it went unsaid, its record stale)
    old = _trained_with(out, resume.step, type(cfg)) or old
    was, now = flatten(old.model_dump(mode="json")), flatten(cfg.model_dump(mode="json"))
    return [redacted(f"{k}: {was.get(k)} -> {now.get(k)}") for k in sorted(was.keys() | now.keys())
            if k not in HOW_LAUNCHED and was.get(k) != now.get(k)
            and not _same_path(was.get(k), now.get(k))]

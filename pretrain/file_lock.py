"""An exclusive lock on a folder's lock file, held while a process works there.

Two processes writing the same place (a training job and ``upload_spool.py`` sending the same
tracking spool, or two ``prepare_data.py`` runs on one output folder) would each undo the
other's work. ``flock`` is released by the kernel however the holder ends, a kill included, so
a lock file left behind never blocks a rerun.
"""
from __future__ import annotations

import fcntl
import logging
import os
import socket
from pathlib import Path
from typing import IO, Optional

log = logging.getLogger(__name__)


def try_lock(path: Path, children_hold: bool = True) -> Optional[IO]:
    """Lock ``path`` (created if missing) and write our pid and host in it; the returned file
    holds the lock until closed. None when another process holds it: :func:`holder` names it.
    Processes forked from ours hold it too (workers writing where we do), unless
    ``children_hold`` is False: then a forked child closes its copy at once, and the lock ends
    with this process."""
    f = open(path, "a+")  # not "w": that would wipe the holder's pid before we learn it
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    except OSError as e:  # a file system without locks (Lustre mounted noflock, some FUSE)
        log.warning("cannot lock %s (%s): nothing keeps a second process out of %s", path, e,
                    path.parent)
    f.truncate(0)
    line = f"{os.getpid()} {socket.gethostname()}"
    job = os.environ.get("SLURM_JOB_ID")  # a requeue keeps the id, and counts its restarts
    if job:
        line += f" slurm {job}.{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    f.write(line + "\n")
    f.flush()
    if not children_hold:  # (closing a copy never releases the lock; a closed file: no-op)
        os.register_at_fork(after_in_child=f.close)
    return f


def earlier_allocation(path: Path) -> bool:
    """Whether the holder of ``path`` is an earlier allocation of this very SLURM job (same job
    id, fewer restarts): a requeue that started while a node of the old one, cut off, still
    holds the lock on shared storage until its lease runs out."""
    job = os.environ.get("SLURM_JOB_ID")
    try:
        fields = Path(path).read_text().split()
        their_job, _, their_restarts = fields[fields.index("slurm") + 1].partition(".")
        return bool(job) and their_job == job and \
            int(their_restarts) < int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    except (OSError, ValueError, IndexError):
        return False


def holder(path: Path) -> str:
    """Who holds the lock: "pid N", and when that process has ended, that its children (forked
    workers, which inherit the lock) are still finishing."""
    try:
        pid, *host = Path(path).read_text().split()
        pid = int(pid)
    except (OSError, ValueError):
        return "pid ?"
    if host and host[0] != socket.gethostname():  # its process cannot be looked at from here
        return f"pid {pid} on {host[0]}"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"pid {pid}, which has ended: its worker processes are still finishing"
    except PermissionError:  # another user's process: alive
        pass
    return f"pid {pid}"

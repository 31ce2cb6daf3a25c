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
from pathlib import Path
from typing import IO, Optional

log = logging.getLogger(__name__)


def try_lock(path: Path) -> Optional[IO]:
    """Lock ``path`` (created if missing) and write our pid in it; the returned file holds the
    lock until closed. None when another process holds it: :func:`holder` names it."""
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
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def holder(path: Path) -> str:
    """Who holds the lock: "pid N", and when that process has ended, that its children (forked
    workers, which inherit the lock) are still finishing."""
    try:
        pid = int(Path(path).read_text())
    except (OSError, ValueError):
        return "pid ?"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"pid {pid}, which has ended: its worker processes are still finishing"
    except PermissionError:  # another user's process: alive
        pass
    return f"pid {pid}"

"""An exclusive lock on a folder's lock file, held while a process works there.

Two processes writing the same place (a training job and ``upload_spool.py`` sending the same
tracking spool, or two ``prepare_data.py`` runs on one output folder) would each undo the
other's work. ``flock`` is released by the kernel however the holder ends, a kill included, so
a lock file left behind never blocks a rerun.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO, Optional


def try_lock(path: Path) -> Optional[IO]:
    """Lock ``path`` (created if missing) and write our pid in it; the returned file holds the
    lock until closed. None when another process holds it: :func:`holder` names it."""
    f = open(path, "a+")  # not "w": that would wipe the holder's pid before we learn it
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def holder(path: Path) -> str:
    """The pid written by the lock's holder, as text ("?" when it has not written it yet)."""
    try:
        return Path(path).read_text().strip() or "?"
    except OSError:
        return "?"

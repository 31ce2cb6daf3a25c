"""Writing a file whole or not at all.

Files that another process may read while we write them, or that a restarted run reads after a
crash (configs, dataset info, the index cache, exported weights, evaluation outputs, tracking
spools), are written under a temporary name in the same folder and then renamed over the final
name. A rename within a folder is atomic, so a reader sees the old file or the new one, never
half of one. A write that fails (a full disk, Ctrl-C) removes its temporary file, so it takes no
room. This does not flush to disk unless asked (``durable=True``: the file's data, then its
name); checkpoints and shards, which must survive a power loss, fsync on their own
(``pretrain.checkpoint``, ``pretrain.data.shard_writer``).
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import Callable, Union


def write_atomic(path: Union[str, os.PathLike],
                 data: Union[bytes, str, Callable[[Path], None]], durable: bool = False) -> Path:
    """Replace ``path`` with ``data``: bytes, text, or a function that writes the file it is
    given (for writers that take a path, such as safetensors' ``save_file``). ``durable``: on
    disk when this returns, so a power loss leaves the old file or the new one whole."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        if callable(data):
            tmp.touch()  # the mode a file made here gets (umask); the writer may replace it
            mode = stat.S_IMODE(tmp.stat().st_mode)
            data(tmp)
            # safetensors' save_file makes its own file, private (0600): a teammate on the
            # cluster could not read the exported model; it gets the folder's usual mode
            os.chmod(tmp, mode)
        elif isinstance(data, str):
            tmp.write_text(data)
        else:
            tmp.write_bytes(data)
        if durable:
            fsync_path(tmp)
        os.replace(tmp, path)
        if durable:
            fsync_path(path.parent)  # the folder holds the new name
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    return path


def fsync_fd(fd: int) -> None:
    """fsync, where the file system can: some cannot sync directories (EINVAL), and for them
    there is nothing more to do."""
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise


def fsync_path(path: Union[str, os.PathLike]) -> None:
    """fsync the file or folder at ``path`` (a folder: the names in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fsync_fd(fd)
    finally:
        os.close(fd)

"""The progress bars of long data work (``prepare_data.py``'s index and write passes).

On a terminal, tqdm's bar, redrawn in place. Where stderr is a file (a batch job's log: SLURM's
``--output``), a redrawn bar is a single line of carriage returns that grows for hours, and a
warning lands in the middle of it: there, each redraw is a line of its own, at most one every
:data:`LOG_EVERY_S`, with the same figures (done, rate, ETA).
"""
from __future__ import annotations

import io
import sys

LOG_EVERY_S = 60.0


class _OwnLines(io.TextIOBase):
    """tqdm's output with each redraw on a line of its own (blank redraws, which clear the
    bar for a message, dropped)."""

    def write(self, text: str) -> int:
        shown = text.replace("\r", "").strip()
        if shown:
            sys.stderr.write(shown + "\n")
        return len(text)

    def flush(self) -> None:
        sys.stderr.flush()


def progress_bar(**kwargs):
    """A tqdm bar (``kwargs`` as tqdm takes them) fit for where stderr goes."""
    from tqdm import tqdm

    if sys.stderr.isatty() or kwargs.get("disable"):
        return tqdm(**kwargs)
    return tqdm(file=_OwnLines(), **{**kwargs, "mininterval": LOG_EVERY_S})

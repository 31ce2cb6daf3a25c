"""What a job's trainer tells the batch script that started it (``launch/slurm_job.sh``), which
sees only the step's exit code: whether a checkpoint was completed, and the exit code the
trainer chose, which torchrun turns into 1 whatever it was.

The script names a file in ``$VITSCALE_JOB_STATUS`` (new for each allocation); rank 0 appends
one line per event, ``checkpoint 1200`` once a checkpoint of step 1200 is complete and
``exit 3`` as it leaves with a code of its choosing. A crash after a checkpoint of this
allocation is then requeued (it resumes past where the previous allocation started), one
before any is not (it would fail the same way), and a 2 or 3 is not requeued. Any other rank
writes its ``exit 2`` or ``exit 3`` too: bad input only that rank met (a shard it may not
read) ends it alone, and rank 0 then fails as a crash (its peer is gone), which the script
would requeue; the script takes a 2 or 3 from any rank over rank 0's later code. So with a
stalled rank's ``exit 5`` (pretrain/watchdog.py), which explains the crash of the ranks that
lost it: it comes after a 2 or 3, before rank 0's own code. Without the variable nothing is
written.

The script writes there too: ``stop 10 <unix time>`` when it passes SIGUSR1 on to the step.
A rank still starting then has the signal ignored (inherited from the script's ``trap ''``), or
has not been started by its launcher yet; each rank reads the line once its stop handlers are
in place (:func:`stop_asked`), so such a stop is not lost.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Optional

ENV = "VITSCALE_JOB_STATUS"
FOR_A_PERSON = (2, 3)  # bad input; a run that had to stop (pretrain/cli.py)
STALLED = 5  # a rank that made no progress (pretrain/watchdog.py)
log = logging.getLogger(__name__)


def note(event: str, value: int) -> None:
    """Append ``event value`` to the job's status file, on rank 0, and on the other ranks an
    exit for a person (:data:`FOR_A_PERSON`) or a stall; a failure to write is one warning (the
    script then decides on the exit code alone)."""
    path = os.environ.get(ENV)
    rank_0 = os.environ.get("RANK", "0") == "0"
    told = event == "exit" and int(value) in (*FOR_A_PERSON, STALLED)
    if not path or not (rank_0 or told):
        return
    try:
        with open(path, "a") as f:
            f.write(f"{event} {int(value)}\n")
    except OSError as e:
        log.warning("could not write %s=%s (%s): the batch script decides whether to requeue "
                    "on the exit code alone", ENV, path, e)


def stop_asked() -> Optional[tuple[int, float]]:
    """(the signal, how many seconds ago) the batch script passed a stop on to the step (its
    ``stop N TIME`` line), if it did: a grace period counts from then, not from this read."""
    path = os.environ.get(ENV)
    try:
        with open(path or "") as f:
            asked = [line.split()[1:] for line in f if line.startswith("stop ")]
    except OSError:  # no script, or the file unreadable: the signal itself is all there is
        return None
    if not asked or not asked[-1] or not asked[-1][0].isdigit():
        return None
    signum, when = int(asked[-1][0]), asked[-1][1:]
    ago = time.time() - int(when[0]) if when and when[0].isdigit() else 0.0
    return signum, max(0.0, ago)

"""Which rank to look at when the ranks stall together.

A rank that hangs for good (its node frozen, its process stopped or stuck in the kernel) stalls
the others too: they wait for it in their next collective, so every live rank's stall watchdog
fires at about the same time, each naming itself, and a log of hundreds of stack dumps does not
say which node to look at. So each rank's watchdog keeps a line on the job's rendezvous store
(the TCP store at ``$MASTER_ADDR:$MASTER_PORT`` that every launcher starts and every rank
reaches): when the rank last made progress, when it last wrote the line, its host and pid. A
rank that stalls reads the lines back and names the ranks that stopped writing (frozen) or,
failing that, the rank that stopped making progress first.

Wall clocks of different nodes are compared: NTP keeps them within milliseconds of each other,
and every threshold here is seconds.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Callable, Optional

from pretrain.distributed import job_key, job_store

log = logging.getLogger(__name__)

READ_WITHIN_S = 15.0  # a stalled rank waits this long for the lines before it ends anyway
SHOWN = 8  # ranks named in a line; the rest are counted


def _key(rank: int) -> str:
    return job_key(f"progress/{rank}")


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:SHOWN]))
    more = f" and {len(ranks) - SHOWN} more" if len(ranks) > SHOWN else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}{more}"


class ProgressBoard:
    """This rank's line on the rendezvous store, rewritten every ``every_s`` seconds by a thread
    of its own (a frozen store host blocks that thread, never the watchdog), with the wall time
    ``last_progress()`` gives."""

    def __init__(self, rank: int, world: int, every_s: float,
                 last_progress: Callable[[], float]):
        self.rank, self.world, self.every_s = rank, world, every_s
        self.last_progress = last_progress
        self.host = socket.gethostname()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._write, name="progress-board", daemon=True)

    @staticmethod
    def wanted(world: int) -> bool:
        return world > 1 and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ

    def start(self) -> "ProgressBoard":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()  # not joined: a write to a frozen store host may take its timeout

    def _write(self) -> None:
        store = None
        while True:
            try:
                if store is None:
                    store = job_store(max(30.0, 3 * self.every_s))
                store.set(_key(self.rank), json.dumps(
                    [self.last_progress(), time.time(), self.host, os.getpid()]))
            except Exception as e:  # (RuntimeError, DistError...) the store's host is gone or
                # frozen; a stall, if it comes, says so
                log.debug("progress board: %s", e)
                store = None
            if self._stop.wait(self.every_s):
                return

    def whom_to_look_at(self) -> Optional[str]:
        """A clause naming the ranks that stopped answering, or else the one that stopped
        making progress well before this one; None when there is no one else to name."""
        found: list = []
        reader = threading.Thread(target=lambda: found.append(self._read()), daemon=True)
        reader.start()
        reader.join(READ_WITHIN_S)
        if not found:
            return (f"the job's rendezvous store at {os.environ['MASTER_ADDR']}:"
                    f"{os.environ['MASTER_PORT']} did not answer within {READ_WITHIN_S:.0f} s: "
                    f"the node it runs on (rank 0's) may be the one that froze")
        return found[0]

    def _read(self) -> Optional[str]:
        try:
            store = job_store(READ_WITHIN_S / 3)
            keys = [_key(r) for r in range(self.world)]
            present = [r for r, k in enumerate(keys) if store.check([k])]
            lines = dict(zip(present, store.multi_get([keys[r] for r in present])))
        except Exception as e:
            return f"the other ranks' progress could not be read from the job's store ({e})"
        now = time.time()
        silent_after = max(5.0, 3 * self.every_s)
        board = {r: json.loads(v) for r, v in lines.items()}
        silent = sorted(r for r, (_, wrote, _, _) in board.items()
                        if r != self.rank and now - wrote > silent_after)
        missing = sorted(set(range(self.world)) - set(board) - {self.rank})
        parts = []
        if silent:
            hosts = sorted({board[r][2] for r in silent})
            since = min(now - board[r][1] for r in silent)
            pid = f", pid {board[silent[0]][3]}" if len(silent) == 1 else ""
            whose = "its process is" if len(silent) == 1 else "their processes are"
            parts.append(f"{_ranks(silent)} (on {', '.join(hosts[:SHOWN])}{pid}) stopped "
                         f"answering {since:.0f}+ s ago: {whose} frozen or gone (a hung node, "
                         f"a kill), look there first")
        if missing:
            parts.append(f"{_ranks(missing)} never reported progress")
        own = self.last_progress()
        if not parts and board:
            first = min(board, key=lambda r: own if r == self.rank else board[r][0])
            if first != self.rank and own - board[first][0] > 1.0:
                parts.append(f"rank {first} (on {board[first][2]}, pid {board[first][3]}) made "
                             f"its last progress {own - board[first][0]:.0f} s before this "
                             f"rank: look there first")
        return "; ".join(parts) or None

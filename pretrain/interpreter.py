"""What the Python interpreter itself costs a launcher: its cyclic garbage collector and its
teardown at exit.

Once torch, DeepSpeed (or Accelerate), timm and MLflow are imported, a rank holds about half a
million Python objects, and every full collection of CPython's cyclic collector walks all of
them (0.3 s on one core of a 2-core x86 test machine). Left to itself the collector makes
several full collections while the imports grow the heap (1 to 2 s of each rank's start
there), several more in the interpreter's teardown after the run has ended (1.5 s of each
rank's exit), and now and then one during training, where a pause on one rank holds every
other at the next collective. Nothing is gained by them: those objects live until the process
ends.

- :func:`launcher` wraps a launcher's ``main``. In the training launchers the collector is off
  while the run starts. In every launcher, once ``main`` has ended with an exit code, the
  process ends as the interpreter would -- threads joined, ``atexit`` handlers run (MLflow,
  logging, multiprocessing's children, the loaders' workers), output flushed -- but without
  the teardown that follows them: its garbage collections, objects' finalizers, C++
  destructors and C exit handlers. A crash (any other exception), and a run under a profiler
  or tracer, keep the interpreter's own exit.
- :func:`training_starts`, from the trainer once the run is set up and before it forks its
  loader workers: one full collection frees the garbage the start left, what is alive then
  (modules, model, engine, optimizer) is moved out of the collector's sight for good
  (``gc.freeze``), and the collector is on again for what training allocates. The forked
  workers inherit both; frozen objects are not written to by their collector, so the memory
  pages they share with the rank stay shared.

Processes that did not go through :func:`launcher` (tests calling the trainer, notebooks) are
left as they are. :func:`heap_frozen` gives a block the trainer's regime in any process, so
that ``benchmark.py train`` times steps as the launched trainer runs them.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import threading
import traceback
from typing import Iterator

_in_launcher = False  # launcher() manages this process's collector


@contextlib.contextmanager
def launcher(pause_collector: bool = True) -> Iterator[None]:
    """``with launcher(): main()`` in a launcher's ``__main__`` block, and only there: leaving
    the block ends the process (see the module's docstring). ``pause_collector=False``: the
    exit only, for launchers that do not train (their work may be long, and nothing of theirs
    calls :func:`training_starts`)."""
    global _in_launcher
    if pause_collector:
        _in_launcher = True
        gc.disable()
    try:
        yield
        code = 0
    except SystemExit as e:
        code = 0 if e.code is None else e.code
        if not isinstance(code, int):  # a message as the code: Python prints it
            _usual_exit()
            raise
    except BaseException:  # a crash: Python prints the traceback
        _usual_exit()
        raise
    if sys.getprofile() is not None or sys.gettrace() is not None:
        # a profiler or tracer (python -m cProfile -o, a debugger, coverage) may write its
        # results once the script is done, which a process ended here never reaches
        _usual_exit()
        sys.exit(code)
    exit_without_teardown(code)


def _usual_exit() -> None:
    """Leave the exit to the interpreter, whose teardown then collects everything once more."""
    gc.unfreeze()
    gc.enable()


def training_starts() -> None:
    """The run is set up: freeze what is alive and collect garbage again (launchers only)."""
    if _in_launcher:
        _freeze_heap()


def _freeze_heap() -> None:
    gc.collect()  # once: the start's cyclic garbage (a loaded checkpoint's, say) is not kept
    gc.freeze()
    gc.enable()


@contextlib.contextmanager
def heap_frozen() -> Iterator[None]:
    """The block runs with the heap as a launched trainer's is from its first step on (what
    is alive frozen, the collector on), in any process; afterwards the collector is on or off
    as it was, and the heap unfrozen unless it was frozen before. For benchmarks that time
    training steps outside the launcher: spawned ranks, tests."""
    was_enabled, was_frozen = gc.isenabled(), gc.get_freeze_count() > 0
    _freeze_heap()
    try:
        yield
    finally:
        if not was_frozen:
            gc.unfreeze()
        if not was_enabled:
            gc.disable()


def exit_without_teardown(code: int) -> None:
    """End the process as the interpreter's own exit does, up to the ``atexit`` handlers and
    the flush of the standard streams, then skip its teardown (``os._exit``)."""
    shutdown = getattr(threading, "_shutdown", None)  # what Python's exit runs first
    if shutdown is None:  # an interpreter without it: its own exit then
        _usual_exit()
        sys.exit(code)
    try:
        shutdown()  # joins the threads; runs what concurrent.futures & co. registered for then
    except Exception as e:
        # as Python's exit: reported, and the exit goes on with its code (3.11's process pool
        # can find its wake-up pipe closed here, an error of no consequence that would
        # otherwise turn a finished prepare_data.py into exit code 1)
        with contextlib.suppress(Exception):
            print(f"Exception ignored in: {threading!r}", file=sys.stderr)
            traceback.print_exception(e)
    atexit._run_exitfuncs()
    for name in ("stdout", "stderr"):
        try:
            getattr(sys, name).flush()
        except Exception as e:  # a full disk under the job's log, say: Python's exit says so
            with contextlib.suppress(OSError):
                os.write(2, f"Exception ignored on flushing sys.{name}: {e!r}\n".encode())
            code = 120  # and ends with this code, whatever the code was
    with contextlib.suppress(Exception):  # what C code printed into the C library's buffers
        import ctypes
        ctypes.CDLL(None).fflush(None)
    os._exit(code)

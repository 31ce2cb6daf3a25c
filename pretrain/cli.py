"""What every launcher shares: ``--config`` + ``key=value`` overrides, ``--print-config``,
``--dry-run``, one-line errors, and the run summary (architecture, parameters, FLOPs, batch)."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import typing
from pathlib import Path
from typing import Callable, Optional, Sequence, Type

from pretrain import job_status
from pretrain.config import ConfigError, PretrainConfig, Section
from pretrain.config_files import config_keys, load_config

REPO_ROOT = Path(__file__).resolve().parent.parent
# libraries whose INFO lines are theirs, not the job's ("Found credentials in environment
# variables.", DeepSpeed's config dumps): shown from WARNING up
NOISY_LOGGERS = ("DeepSpeed", "deepspeed", "torch.distributed", "accelerate", "botocore",
                 "boto3", "s3transfer",
                 # "Waiting up to 300 seconds for model version to finish creation", per version
                 "mlflow.store.model_registry.abstract_store")


# loggers that log what they then raise, with its traceback (each write to an MLflow sqlite
# store on a failing disk: hundreds a second), which the tracker says itself in one line
RAISES_WHAT_IT_LOGS = ("mlflow.store.db.utils",)


def tame_logs() -> None:
    """After ``logging.basicConfig``: libraries' chatter down to warnings, and no log line
    shows a URL's password (``data.root=https://user:token@host/...`` in a retry warning ends
    up in a shared job log)."""
    import logging
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in RAISES_WHAT_IT_LOGS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _NoPasswords) for f in handler.filters):
            handler.addFilter(_NoPasswords())


class _NoPasswords:
    """A handler filter: the record's message with every URL's password as ``***``."""

    def filter(self, record) -> bool:
        from pretrain.spool import redacted
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 -- a malformed call: the handler reports it, as before
            return True
        if redacted(text) != text:
            record.msg, record.args = redacted(text), None
        return True


def user_errors() -> tuple:
    """Exceptions that mean "bad input" (config, data, checkpoint), or an outage that may end
    by itself (:func:`input_exit_code`): one line, no traceback."""
    from pretrain.data.info import DatasetInfoError, StorageUnreachable
    from pretrain.data.shards import LoaderError
    from pretrain.data.sources import PrepareError
    from pretrain.spool import TrackingError  # e.g. the tracking dir held by upload_spool.py
    return (ConfigError, DatasetInfoError, LoaderError, PrepareError, TrackingError,
            StorageUnreachable)


def input_exit_code(exc: BaseException) -> int:
    """The exit code of one of :func:`user_errors`: 2 (a person must fix the input), but 1, as
    a crash, for storage that answered at the start and then failed every retry
    (:class:`pretrain.data.info.StorageUnreachable`): the outage may end by itself, so a
    wrapper that relaunches on failures retries it."""
    from pretrain.data.info import StorageUnreachable
    return 1 if isinstance(exc, StorageUnreachable) else 2


def stop_errors() -> tuple:
    """Exceptions that end a run on purpose (non-finite losses, a failed checkpoint write): their
    message says what happened, what is intact and what to do; exit code 3."""
    from pretrain.guard import TrainingStopped
    return (TrainingStopped,)


def _describe_keys(schema: Type[Section]) -> str:
    """Every config key with its default, for ``--help``."""
    lines = []
    defaults = schema().model_dump(mode="json")
    for key in config_keys(schema):
        section, field = schema, None
        value = defaults
        for part in key.split("."):
            field = section.model_fields[part]
            value = value[part]
            ann = field.annotation
            section = ann if isinstance(ann, type) and issubclass(ann, Section) else None
        choices = typing.get_args(field.annotation)
        kind = "|".join(map(str, choices)) if typing.get_origin(field.annotation) is typing.Literal \
            else ""
        doc = field.description or ""
        lines.append(f"  {key} = {value}" + (f"   [{kind}]" if kind else "") +
                     (f"   {doc}" if doc else ""))
    return "\n".join(lines)


def _count_of_at_least(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"expected a whole number of at least {least}, "
                                             f"got '{text}'")
        return value
    return parse


# argparse ``type=`` for counts: of things there must be one of at least (ranks, steps,
# batches), of things that may be none (worker processes, warm-up steps)
positive_int = _count_of_at_least(1)
whole_number = _count_of_at_least(0)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("nan")  # which every range check below refuses


def positive_number(text: str) -> float:
    """argparse ``type=`` for a size above 0, such as a GPU's memory in GiB."""
    value = _number(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number above 0, got '{text}'")
    return value


def fraction(text: str) -> float:
    """argparse ``type=`` for a fraction in (0, 1], such as an MFU."""
    value = _number(text)
    if not 0 < value <= 1:  # also refuses inf
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], e.g. 0.45 for 45 %, "
                                         f"got '{text}'")
    return value


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line naming --help, as every other bad input of
    the launchers is, instead of its usage block (which every rank of a job prints)."""

    config_keys: Sequence[str] = ()  # a stage launcher's: "--init=PATH" is then named

    def error(self, message: str) -> typing.NoReturn:
        unknown = message.split(": ", 1)[1].split() \
            if message.startswith("unrecognized arguments: ") else []
        keys = [a[2:].split("=")[0] for a in unknown if a.startswith("--")]
        keys = [k for k in keys if k in self.config_keys or k.replace("-", "_") in
                self.config_keys]
        if keys:  # a config key given as an option
            message += (f" ({', '.join('--' + k for k in keys)}: config keys are set as "
                        f"key=value, with no dashes: {keys[0].replace('-', '_')}=...)")
        fail(f"{message}; see {self.prog} --help", quiet=_said_by_local_rank_0())


# the options of --dry-run's plan, with their defaults
PLAN_FLAGS = {"world_size": None, "mfu": 0.45, "samples": None, "gpu_memory": None}


def build_parser(prog: str, description: str, schema: Type[Section],
                 default_config: Optional[Path] = None) -> argparse.ArgumentParser:
    epilog = ("overrides: any config key as key=value, YAML-typed, e.g. optimizer.lr=3e-4 "
              "model.drop_path_rate=0.2 data.crop_scale=[0.08,1]\n\nconfig keys and defaults "
              "(a recipe sets its own; --print-config shows what a run gets):\n"
              + _describe_keys(schema))
    p = OneLineParser(prog=prog, description=description, epilog=epilog,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.config_keys = config_keys(schema)
    p.add_argument("--config", type=Path, default=default_config,
                   help="YAML recipe from configs/ (may 'inherit:' another); "
                        + (f"default: {default_config.relative_to(REPO_ROOT)}"
                           if default_config else "required"))
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides applied on top of the recipe")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config as YAML and exit")
    # Only the pretraining plan (pretrain/plan.py) has memory, steps and a time to finish; the
    # options tuning those are not offered where they would be ignored.
    plans = issubclass(schema, PretrainConfig)
    p.add_argument("--dry-run", action="store_true",
                   help="check the config, print it with the model size, training FLOPs per "
                        "image and batch layout"
                        + (", memory per GPU (model states and activations), steps and time to "
                           "finish" if plans
                           else "")
                        + ", and exit without allocating the model")
    p.add_argument("--world-size", type=positive_int, default=None, metavar="N",
                   help="with --dry-run: plan for N >= 1 ranks (default: $WORLD_SIZE or 1)")
    if plans:
        p.add_argument("--mfu", type=fraction, default=PLAN_FLAGS["mfu"], metavar="F",
                       help="with --dry-run: the model FLOPs utilisation the time-to-finish "
                            "estimate assumes, a fraction in (0, 1] (default 0.45)")
        p.add_argument("--gpu-memory", type=positive_number, default=None, metavar="GIB",
                       help="with --dry-run: each GPU's memory in GiB, which the plan's memory "
                            "estimate is checked against (default 79: an H100 80GB)")
        p.add_argument("--samples", type=positive_int, default=None, metavar="N",
                       help="with --dry-run: samples per epoch to plan with (default: "
                            "data.root's train split, when readable here; ImageNet-21k fall11: "
                            "about 14.15 M after the 50k held out)")
    # The DeepSpeed launcher appends --local_rank=N; torchrun sets $LOCAL_RANK instead.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None,
                   help=argparse.SUPPRESS)
    return p


# A rank that leaves the line to another waits this long before it exits: a launcher ends
# every rank once one has exited, and the one with the line (slower to start on a busy node)
# must not be ended before it has said it. It ends this one too, once it has.
QUIET_EXIT_WAIT_S = 3.0


def fail(message: str, code: int = 2, quiet: bool = False) -> typing.NoReturn:
    """One line on stderr, no traceback: the message names the problem and the fix. ``quiet``:
    the exit code only (another rank says the line), after :data:`QUIET_EXIT_WAIT_S`."""
    if quiet:
        import time
        time.sleep(QUIET_EXIT_WAIT_S)
    else:
        # one write: the ranks of a job share the launcher's stderr, and print() writes the line
        # and its newline separately, so two ranks' messages could end up on one line
        from pretrain.spool import redacted  # the URLs it quotes
        sys.stderr.write(f"error: {redacted(message)}\n")
        sys.stderr.flush()
        # (quiet: every rank met it, and rank 0, which is never quiet, notes it once for all)
        job_status.note("exit", code)
    raise SystemExit(code)


def _said_by_rank_0(exc: BaseException) -> bool:
    """An error the ranks agreed on (:func:`pretrain.distributed.agreed`), on a rank other than
    0: every rank raised the same, and rank 0 prints it. One each rank of a node meets alike
    (``per_node``: the ranks did not meet, so none can agree) is printed by the node's first."""
    if getattr(exc, "per_node", False):
        return _said_by_local_rank_0()
    return getattr(exc, "agreed", False) and os.environ.get("RANK", "0") != "0"


def _said_by_local_rank_0() -> bool:
    """For errors of the command line and the config files, on a rank other than its node's
    first: the ranks of a node share both (the launcher gives each the same arguments), so
    they all raise the same, and the node's first rank prints it: a line per node, not per GPU."""
    return os.environ.get("LOCAL_RANK", "0") != "0"


def parse(schema: Type[Section], prog: str, description: str, argv: Optional[Sequence[str]] = None,
          default_config: Optional[Path] = None):
    """Parse the command line into (args, validated config); exits with one line on bad input."""
    args = build_parser(prog, description, schema, default_config).parse_intermixed_args(argv)
    plan_only = [f"--{k.replace('_', '-')}" for k, default in PLAN_FLAGS.items()
                 if getattr(args, k, default) != default]
    if plan_only and not args.dry_run:  # a run's world is its launcher's: it would be ignored
        one = len(plan_only) == 1
        ranks = " (a run's ranks are its launcher's)" if "--world-size" in plan_only else ""
        fail(f"{', '.join(plan_only)} only {'shapes' if one else 'shape'} the --dry-run plan; "
             f"add --dry-run, or drop {'it' if one else 'them'}{ranks}",
             quiet=_said_by_local_rank_0())
    if args.print_config and args.dry_run:  # the first one alone ran, skipping the checks
        fail("--print-config and --dry-run: give one (--dry-run prints the config too, then "
             "checks it and plans the run)", quiet=_said_by_local_rank_0())
    if args.config is None:
        fail("--config is required, e.g. --config configs/finetune/demo.yaml",
             quiet=_said_by_local_rank_0())
    try:
        cfg = load_config(schema, args.config, args.overrides)
    except ConfigError as e:
        fail(str(e), quiet=_said_by_local_rank_0())
    return args, cfg


def world_size(args) -> int:
    if args.world_size is not None:
        return args.world_size
    text = os.environ.get("WORLD_SIZE", "1")
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        fail(f"$WORLD_SIZE={text!r} is not a number of ranks; unset it or give --world-size N")


def dry_run(args, cfg, preflight: Optional[Callable[[Section], None]] = None) -> None:
    """Print the resolved config and what the run will cost; the pretraining plan adds memory
    per GPU for its ZeRO stage, steps and the time to finish. ``preflight``: the stage's own
    checks of its inputs (the fine-tune's ``init``), as the run makes them at its start."""
    from pretrain.config import PretrainConfig
    from pretrain.plan import DEFAULT_GPU_MEMORY_GIB, describe, plan, resume_line
    from pretrain.tracking_store import check_store

    try:
        check_store(cfg.tracking)
        if preflight is not None:
            preflight(cfg)
        if isinstance(cfg, PretrainConfig):
            summary = plan(cfg, world_size(args), mfu=args.mfu, samples_per_epoch=args.samples,
                           gpu_memory_gib=args.gpu_memory or DEFAULT_GPU_MEMORY_GIB)
        else:
            lines = describe(cfg, world_size(args))[0]
            summary = "\n".join(lines + [line for line in [resume_line(cfg, world_size(args))]
                                         if line])
    except user_errors() as e:
        fail(str(e))
    from pretrain.spool import redacted  # a job log is read by others: no URL's password
    print(redacted(cfg.to_yaml() + summary))


def main(schema: Type[Section], prog: str, description: str, run: Callable[[Section], object],
         argv: Optional[Sequence[str]] = None, default_config: Optional[Path] = None,
         preflight: Optional[Callable[[Section], None]] = None) -> None:
    """A stage launcher: parse, then ``--print-config``, ``--dry-run``, or ``run(cfg)``; bad
    input (config, data, checkpoint) ends in one line on stderr and exit code 2, shards that
    stayed unreachable through the retries in one line and exit code 1 (as a crash), a run that
    had to stop (see :func:`stop_errors`) in one line and exit code 3, a run stopped by a
    signal after a complete checkpoint (``checkpoint.stop_signals``) in one line and exit
    code 4 (a stalled rank ends itself with exit code 5: :mod:`pretrain.watchdog`)."""
    args, cfg = parse(schema, prog, description, argv, default_config=default_config)
    if args.print_config:
        print(cfg.to_yaml(), end="")
    elif args.dry_run:
        dry_run(args, cfg, preflight)
    else:
        from pretrain.distributed import leave
        from pretrain.stopping import EXIT_STOPPED, StoppedBySignal, unignore_stop_signals
        unignore_stop_signals(cfg.checkpoint.stop_signals)
        try:
            run(cfg)
        except user_errors() as e:
            fail(str(e), code=input_exit_code(e), quiet=_said_by_rank_0(e))
        except stop_errors() as e:
            fail(str(e), code=3, quiet=_said_by_rank_0(e))
        except StoppedBySignal as e:  # not an error: the run goes on when relaunched
            if os.environ.get("RANK", "0") == "0":
                sys.stderr.write(f"stopped: {e}\n")
                sys.stderr.flush()
            leave()
            job_status.note("exit", EXIT_STOPPED)
            raise SystemExit(EXIT_STOPPED)
        except KeyboardInterrupt:  # Ctrl-C before the stop handlers are in place (start-up)
            if os.environ.get("RANK", "0") == "0":
                sys.stderr.write("interrupted (SIGINT); relaunch to start again, or to resume "
                                 "from the newest complete checkpoint if there is one\n")
            raise SystemExit(128 + signal.SIGINT) from None
        except Exception as e:  # noqa: BLE001 -- one kind is said in a line, not a traceback
            from pretrain.distributed import RankZeroFailed, peer_gone
            if isinstance(e, RankZeroFailed):  # rank 0 says why, with its traceback
                fail(str(e), code=1, quiet=True)
            why = peer_gone(e)
            if why is None:
                raise
            fail(f"rank {os.environ.get('RANK', '0')}: {why}; the launcher's log names it and "
                 f"its exit code (-9 or 137: killed, by the OOM killer say); relaunching "
                 f"resumes from the newest complete checkpoint", code=1)
        # the job is done, though a launcher a stop signal ended (during the final MLflow
        # delivery, say) exits 1: the batch script reads this and does not requeue
        job_status.note("exit", 0)
        leave()

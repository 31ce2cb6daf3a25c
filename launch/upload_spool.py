"""Send a run's spooled MLflow metrics, artifacts and model registrations that never reached
the server.

    python launch/upload_spool.py OUTPUT_DIR [--uri URI]

A job that could not reach its tracking server keeps every metric in OUTPUT_DIR/tracking/spool.jsonl
(and every node's system metrics in OUTPUT_DIR/tracking/system/<host>.jsonl).
This creates the MLflow run if the job never could, sends the records MLflow does not have yet
(one value per step: steps MLflow already holds are skipped; system metrics numbered on from
the last sample MLflow holds), uploads pending artifacts, then
registers the uploaded models still waiting for their tracking.register_as version (after the
upload, so that a version never points at a half-uploaded model). Run it after the job has
ended. --uri sends to another server than the one the job was given.
"""
from __future__ import annotations

import argparse
import logging
import sys

import _bootstrap  # noqa: F401  (keeps launch/ from shadowing the pretrain package)
from pretrain import cli, interpreter
from pretrain.mlflow_delivery import upload_spool
from pretrain.spool import TrackingError
from pretrain.tracking_store import check_uri


def main(argv=None) -> None:
    p = cli.OneLineParser(prog="upload_spool.py", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output_dir", help="the run's output_dir (holds tracking/)")
    p.add_argument("--uri", help="tracking URI to send to (default: the one the job used)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cli.tame_logs()
    try:
        if args.uri:  # (the job's own was checked when it started)
            check_uri(args.uri, "--uri")
        for line in upload_spool(args.output_dir, uri=args.uri):
            print(line)
    except TrackingError as e:
        cli.fail(str(e))


if __name__ == "__main__":
    with interpreter.launcher(pause_collector=False):  # no teardown at exit
        main(sys.argv[1:])

"""Evaluate a model on one split of a prepared dataset: top-1, top-5, per-class top-1 and a
confusion matrix, logged to MLflow next to the run that produced the model.

    python launch/evaluate.py runs/demo-finetune/final --data runs/demo-cifar10 --split test
    python launch/evaluate.py runs/demo-finetune/final.safetensors --data runs/demo-cifar10 --split test
    python launch/evaluate.py runs/demo --data runs/demo-data --split validation --no-tracking

MODEL is one of
  - a model folder in timm's layout: a fine-tune's best/ or final/, or what
    `launch/export.py RUN --out FOLDER` writes (built by timm: local-dir:FOLDER);
  - a .safetensors file: a fine-tune's best.safetensors / final.safetensors, or the full file
    of `launch/export.py RUN --out FILE.safetensors`;
  - a checkpoint: a pretraining or fine-tune output dir (its newest complete checkpoint) or one
    checkpoints/step_N/ dir. A fine-tune with train.ema_decay is evaluated on its EMA weights.

The figure is the one the run reported for the same split: the same eval loader (centre crop,
the run's resolution and data.normalize), the same evaluator, one process, under the run's
train.precision autocast on a GPU and on the CPU alike, as both stages evaluate during training
(--precision overrides). A backbone without a head (a pretraining folder export) has no top-1:
evaluate the pretraining checkpoint instead.

Output: the figures on stdout; metrics.json, per_class_top1.json, confusion_matrix.csv (.json
beyond 1000 classes) and confusion_matrix.png in --out. MLflow: an evaluation run (tag
stage=evaluate, metrics eval/SPLIT/top1 and top5, the files as artifacts) in the experiment of
the run that produced the model, nested under it. If MLflow cannot be reached: one warning, and
`python launch/upload_spool.py OUT` sends it later. Bad input ends in one line and exit code 2;
remote shards that stay unreachable through the retries in one line and exit code 1.
"""
from __future__ import annotations

import argparse
import logging
import sys

import _bootstrap  # noqa: F401  (keeps launch/ from shadowing the pretrain package)
from pretrain import cli, interpreter


def build_parser() -> argparse.ArgumentParser:
    p = cli.OneLineParser(prog="evaluate.py", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL",
                   help="model folder (timm layout), .safetensors file, or checkpoint "
                        "(output dir or checkpoints/step_N)")
    p.add_argument("--data", required=True, metavar="ROOT",
                   help="prepared dataset: a folder (or URL prefix) with _info.json and shards, "
                        "as launch/prepare_data.py writes it")
    p.add_argument("--split", required=True, metavar="NAME",
                   help="the split to evaluate, a key of the dataset's _info.json splits "
                        "(e.g. test, validation), or dev: the share of its training split a "
                        "fine-tune held out (data.dev_fraction) and chose its best model by")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="folder for the results (default: a new folder next to MODEL, "
                        "MODEL-eval-SPLIT, with -2, -3... when taken; a checkpoint's in its "
                        "run dir, not among the checkpoints); a folder that already "
                        "holds an evaluation is refused unless --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the evaluation already in --out")
    p.add_argument("--batch-size", type=cli.positive_int, default=None, metavar="N",
                   help="images per forward pass (default: the run's eval.batch_size, else 100)")
    p.add_argument("--workers", type=cli.whole_number, default=None, metavar="N",
                   help="data-loader worker processes (default: the run's data.num_workers, at "
                        "most the CPU count; 0 decodes in this process)")
    p.add_argument("--device", default=None,
                   help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                   help="autocast precision (default auto: what the run's backend used, see "
                        "above)")
    p.add_argument("--no-tracking", action="store_true",
                   help="do not log the evaluation to MLflow")
    p.add_argument("--tracking-uri", default=None, metavar="URI",
                   help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else the one the "
                        "source run logged to, else ./mlflow.db as training uses)")
    return p


class _Lines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        kind = "warning" if record.levelno >= logging.WARNING else "note"
        return f"{kind}: {record.getMessage()}"


def _check_device(name: str) -> None:
    """Before the model is loaded: a device torch cannot name, or has not, in one line."""
    import torch
    try:
        device = torch.device(name)
    except RuntimeError:
        cli.fail(f"--device {name}: not a torch device; use cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        cli.fail(f"--device {name}: torch sees no CUDA device here; use --device cpu")
    if device.type == "cuda" and device.index is not None and \
            device.index >= torch.cuda.device_count():
        cli.fail(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA "
                 f"device(s), numbered from 0")


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.device is not None:
        _check_device(args.device)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Lines())
    logging.basicConfig(level=logging.WARNING, handlers=[handler], force=True)
    cli.tame_logs()
    logging.getLogger("pretrain").setLevel(logging.INFO)

    from pretrain import evaluate_model as em
    from pretrain import evaluation_report as report
    from pretrain.model_files import load_model
    from pretrain.tracking_store import check_uri
    try:
        if not args.no_tracking:  # found before the evaluation, not after it
            check_uri(args.tracking_uri, "--tracking-uri")
        out = report.output_dir(args.model, args.split, args.out, args.overwrite)
        mf = load_model(args.model)
        ev = em.evaluate(mf, args.data, args.split, batch_size=args.batch_size,
                         workers=args.workers, device=args.device, precision=args.precision)
        written = report.write_outputs(ev, out)
    except cli.user_errors() as e:
        cli.fail(str(e), code=cli.input_exit_code(e))
    except OSError as e:  # unwritable --out, full disk
        cli.fail(f"cannot write the results: {e}")
    for note in ev.notes:
        logging.getLogger("pretrain").info(note)
    print("\n".join(report.report_lines(ev, out, written)), flush=True)
    if not args.no_tracking:
        lines = report.log_to_mlflow(ev, out, written, report.tracking_uri(mf, args.tracking_uri))
        print("\n".join(lines), flush=True) if lines else None


if __name__ == "__main__":
    with interpreter.launcher(pause_collector=False):  # no teardown at exit
        main(sys.argv[1:])

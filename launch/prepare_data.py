"""Turn a raw image dataset into shuffled WebDataset shards plus a timm-compatible ``_info.json``.

    python launch/prepare_data.py imagenet21k --src /data/winter21_whole.tar.gz --out /shards/in21k
    python launch/prepare_data.py imagenet1k --src /data/imagenet --out /shards/in1k --workers 16
    python launch/prepare_data.py cifar10 --src /data/cifar-10-batches-py --out /shards/cifar10
    python launch/prepare_data.py cifar100 --src /data/cifar-100-python --out s3://bucket/cifar100 --stage /scratch/cifar100
    python launch/prepare_data.py cifar10 --src /data/cifar-10-batches-py --stage /scratch/c10 --out "pipe:aws s3 cp - s3://bucket/c10"
"""
from __future__ import annotations

import argparse
import errno
import logging
import os
import shutil
import signal
import sys

import _bootstrap  # noqa: F401  (keeps launch/ from shadowing the pretrain package)
from tqdm.contrib.logging import logging_redirect_tqdm
from pretrain import interpreter
from pretrain.cli import OneLineParser, positive_int, tame_logs
from pretrain.data.info import INFO_NAMES, DatasetInfoError
from pretrain.data.publish import claim_prefix, publish
from pretrain.data.remote import is_remote
from pretrain.data.shard_writer import (DEFAULT_I21K_VAL_COUNT, DEFAULT_SHARD_SIZE, WORK_DIR,
                                        check_stage_folder, make_settings, prepare,
                                        settings_if_complete)
from pretrain.data.sources import SOURCES, PrepareError
from pretrain.spool import redacted

SOURCE_HELP = """\
SOURCE and what --src points at:
  imagenet21k  a folder of per-synset tars (n01440764.tar holding n01440764_*.JPEG), or the
               outer fall11_whole.tar / winter21_whole.tar.gz itself, read as one stream
               (its images are spilled into DIR/.prepare while the shards are written:
               that needs free space for about twice the dataset under DIR); the first
               pass, the "index" bar, saves its progress every minute and a rerun goes on
               from there (a .tar.gz is decompressed up to there first: it cannot be
               entered in the middle)
  imagefolder  ROOT/<class>/<image> (jpg, jpeg, jfif, png, webp, bmp, tif, tiff, gif, any
               case; classes sorted by name); ROOT/train/<class> with ROOT/val/<class> (or
               validation/, valid/) and ROOT/test/<class> give train, validation and test
               splits (split folder names in any case); other files and folders are left
               out with a warning
  imagenet1k   ROOT/train/<synset>/*.JPEG and ROOT/val/, either in synset folders or flat with
               LOC_val_solution.csv, val_labels.txt or val.txt (file name, synset or index)
               in ROOT or val/ (Kaggle's CSV also up to three folders above ROOT, where its
               download puts it); labels in timm's 1000-synset order. The per-synset tars
               of ILSVRC2012_img_train.tar are extracted into folders of their names first
  cifar10      cifar-10-batches-py (the python version), splits train and test
  cifar100     cifar-100-python (fine labels), splits train and test

Output: DIR/<name>-<split>-000000.tar ... with samples __key__, jpg, cls, json
({label, class_name, width, height}; width and height of the source image, before any
--max-size), DIR/_info.json (timm's layout, written last) and DIR/_skipped.json (unreadable
files). Rerun the same command to resume an interrupted run.
"""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="prepare_data.py", description=__doc__.splitlines()[0],
                      epilog=SOURCE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="SOURCE", choices=SOURCES, help=f"raw layout: {', '.join(SOURCES)}")
    p.add_argument("--src", required=True, metavar="PATH", help="the raw data (see below)")
    p.add_argument("--out", required=True, metavar="DIR|URL",
                   help="output folder; new or empty, or one written before by the same command (resume); "
                        "or a prefix written through --stage: s3://, gs://, http(s):// (PUT) or pipe:CMD (CMD "
                        "+ '/' + file name is run with the file on its standard input)")
    p.add_argument("--stage", metavar="DIR",
                   help="with a remote --out: the local folder the shards are written to (room for the whole "
                        "output) before they are uploaded, _info.json last; rerun to resume either part")
    p.add_argument("--name", help="dataset name, the shards' file name prefix (default: SOURCE)")
    p.add_argument("--shard-size", type=int, default=DEFAULT_SHARD_SIZE, metavar="N",
                   help=f"samples per shard (default {DEFAULT_SHARD_SIZE}: ~110 MB of ImageNet JPEGs)")
    p.add_argument("--val-count", type=int, metavar="N",
                   help=f"images held out as split 'validation', chosen by a seeded hash of their key so "
                        f"a rerun picks the same ones (default {DEFAULT_I21K_VAL_COUNT:,} for imagenet21k, "
                        f"0 otherwise; not for sources with their own held-out split)")
    p.add_argument("--max-size", type=int, metavar="PX",
                   help="resize images whose shorter side is longer than PX down to PX (default: keep the "
                        "original size and, for JPEGs, the original bytes)")
    p.add_argument("--workers", type=positive_int, default=_usable_cores(), metavar="N",
                   help="processes writing shards in parallel, and reading the headers of "
                        "per-synset tars in the index pass (default: %(default)s, the cores "
                        "this process may use: a SLURM job's, not the node's)")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="seed of the held-out choice and of the shuffle (default %(default)s)")
    p.add_argument("--synsets", default="goog", metavar="goog|fall11|PATH",
                   help="imagenet21k label list: goog = timm's 21843 classes of Google's checkpoints "
                        "(default), fall11 = timm's 21841 classes of fall11_whole.tar, or a text file "
                        "with one synset per line; the label is the line number from 0")
    p.add_argument("--skip-unknown", action="store_true",
                   help="leave out synsets / class folders missing from the label list (listed in "
                        "_skipped.json) instead of stopping with an error")
    return p


def _usable_cores() -> int:
    """The cores this process may run on (its affinity: a SLURM job's allotment, taskset), not
    the machine's: 128 decoding processes on the 8 cores a job was given run out of memory."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # (macOS)
        return os.cpu_count() or 1


class _Stopped(KeyboardInterrupt):
    """SIGTERM (a job's time limit, scancel, a preemption): ends the run as Ctrl-C does."""


def _stop(signum, frame):
    raise _Stopped()


def _error(line: str) -> None:
    """The one error line, with no URL's password (the log may be read by others)."""
    sys.stderr.write(f"error: {redacted(line)}\n")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)  # (the pool's workers get the default back: they end)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tame_logs()
    logging.captureWarnings(True)  # a library's warning, too, goes above the progress bar
    remote = is_remote(args.out)
    if remote and args.out.startswith(("http://", "https://")) and "?" in args.out:
        # (its signature is no one's to print)
        build_parser().error(f"--out {args.out.split('?')[0]}?... has a query string (a "
                             f"presigned URL signs one object), but --out is a prefix the "
                             f"files' names are appended to: use s3:// or gs:// with "
                             f"credentials, or a WebDAV prefix")
    if remote and not args.stage:
        build_parser().error(f"--out {args.out} is remote: add --stage DIR, a local folder with room "
                             f"for the output, where the shards are written before the upload")
    if args.stage and not remote:
        build_parser().error(f"--stage is for a remote --out; --out {args.out} is local and is "
                             f"written directly: drop --stage")
    options = dict(name=args.name, shard_size=args.shard_size, val_count=args.val_count,
                   max_size=args.max_size, seed=args.seed, synsets=args.synsets,
                   skip_unknown=args.skip_unknown)
    try:
        if remote:  # before hours of work: a prefix holding something else, or taking no
            settings = make_settings(args.source, args.src, **options)  # uploads, is refused now
            # a finished stage folder is its dataset, wherever its source is now: compared as it
            # was prepared
            settings = settings_if_complete(args.stage, settings) or settings
            check_stage_folder(args.stage, settings)
            claim_prefix(args.stage, args.out, settings)
        # a warning during a pass goes above its progress bar, not glued onto the bar's line
        with logging_redirect_tqdm():
            tame_logs()  # on tqdm's handlers too (older tqdm does not copy handlers' filters)
            prepare(args.source, args.src, args.stage if remote else args.out,
                    workers=args.workers, **options)
            if remote:
                publish(args.stage, args.out, INFO_NAMES[0])
    except (PrepareError, DatasetInfoError, ImportError) as e:
        _error(str(e))
        return 2
    except OSError as e:
        src, gone = os.path.abspath(args.src), os.path.abspath(str(e.filename or ""))
        if isinstance(e, FileNotFoundError) and (gone == src or gone.startswith(src + os.sep)):
            # the rerun would find the source changed, and say so
            _error(f"{e}: gone from --src during the run; put it back and rerun the same "
                   f"command to resume, or start afresh in a new output folder")
        elif _cannot_make(e, args.stage if remote else args.out):
            _error(f"cannot write {e.filename} ({e.strerror}); choose "
                   f"{'a --stage' if remote else 'an --out'} folder you can write to, in place "
                   f"of {args.stage if remote else args.out}")
            return 2
        elif e.errno in DISK_FULL:
            _error(f"{e}, {out_of_room(args.stage if remote else args.out)}; make room "
                   f"there (or raise the quota or the file-size limit, `ulimit -f`) and "
                   f"rerun the same command to resume")
        else:
            _error(f"{e}; fix it and rerun the same command to resume")
        return 1
    except _Stopped:
        sys.stderr.write("stopped by SIGTERM; rerun the same command to resume\n")
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        sys.stderr.write("interrupted; rerun the same command to resume\n")
        return 130
    return 0


def _cannot_make(e: OSError, out: str) -> bool:
    """Whether ``e`` says the output folder cannot be made or written: no permission there (or
    a read-only file system), or a path to it that cannot be (a file on the way). Not a file
    gone from inside it meanwhile, which a rerun mends."""
    if not e.filename:
        return False
    failing, out = os.path.abspath(str(e.filename)), os.path.abspath(out)
    above = out == failing or out.startswith(failing + os.sep) or \
        failing == os.path.join(out, WORK_DIR)
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return above or failing.startswith(out + os.sep)
    return e.errno in (errno.ENOENT, errno.ENOTDIR) and above


# what only a write gets, whose message may name no file (a write to a shard being made)
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def out_of_room(folder: str) -> str:
    """Where the output is written, and the room left there."""
    try:
        free = f"{shutil.disk_usage(folder).free / 2 ** 30:.1f} GiB free there"
    except OSError:
        free = "its disk not readable"
    return f"writing under {os.path.abspath(folder)} ({free})"


if __name__ == "__main__":
    with interpreter.launcher(pause_collector=False):  # no teardown at exit
        sys.exit(main())

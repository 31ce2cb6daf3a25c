"""Throughput figures.

    # benchmark data: >= 2000 real photos of 500x375 (crops of scikit-learn's sample photos)
    python launch/benchmark.py photos --count 2048 --out /tmp/photos
    # loader images/s against a plain webdataset + torchvision pipeline, same crop/flip/size;
    # --decoders adds images/s per core of each JPEG decoder candidate (decode + train transform)
    python launch/benchmark.py loader --shards /tmp/photos --workers 2 --batches 20 [--json]
        [--decoders [--decoder-photos 500x375] [--decoder-quality 90] [--decoder-count 200]]

    # training images/s, TFLOP/s, MFU, peak memory through our DeepSpeed engine (synthetic
    # uint8 batches on the device; --shards DIR feeds the real loader and gives the data wait)
    python launch/benchmark.py train --model vit_large_patch16_224 --batch 128 [--zero 1]
        [--image-size 224] [--compile] [--ranks R] [--steps 20] [--precision fp32] [--json]
        [--profile DIR [--profile-steps 3]]   # a torch.profiler trace and where the time goes
        [--record benchmarks/train.jsonl]     # keep the result with its command, commit, date
    # the README's table from those records (between its benchmark-table marker lines)
    python launch/benchmark.py table benchmarks/train.jsonl --readme README.md
    # one step through our DeepSpeed engine (ZeRO-2, 1 rank, bf16) against a plain PyTorch loop
    python launch/benchmark.py overhead [--json]

``--shards`` is a directory (or URL prefix) holding ``_info.json``, or a shard pattern such as
``/data/shards-{000000..000019}.tar``. On the CPU, train figures are relative only (no MFU).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from pathlib import Path

# Ranks spawned by `train --ranks R` re-import this file with launch/ already off sys.path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bootstrap  # noqa: E402,F401  (keeps launch/ from shadowing the pretrain package)
from pretrain import bench_tables, interpreter  # noqa: E402
from pretrain.cli import OneLineParser, fail, positive_int, whole_number  # noqa: E402


def run_loader(args) -> dict:
    from pretrain.data.loader_benchmark import (bench_decoders, bench_ours, bench_reference,
                                                check_reference_reads, resolve_shards)
    from pretrain.data.transforms import decoder_description

    photo_size = _photo_size(args.decoder_photos)  # a typo fails now, not after the timing
    if not 1 <= args.decoder_quality <= 100:
        fail(f"--decoder-quality {args.decoder_quality}: a JPEG quality is 1 to 100")
    shards = resolve_shards(args.shards, args.split)
    check_reference_reads(shards.urls)
    common = dict(workers=args.workers, batches=args.batches, batch_size=args.batch_size,
                  img_size=args.img_size, buffer=args.shuffle_buffer)
    ours, reference = 0.0, 0.0
    # Alternating the two and keeping each one's best run evens out load from other processes.
    for _ in range(args.repeats):
        ours = max(ours, bench_ours(shards, **common))
        reference = max(reference, bench_reference(shards.urls, **common))
    result = dict(images_per_sec=round(ours, 1), reference_images_per_sec=round(reference, 1),
                  ratio=round(ours / reference, 3), workers=args.workers, repeats=args.repeats,
                  batch_size=args.batch_size, batches=args.batches, img_size=args.img_size,
                  shards=len(shards.urls), decoder=decoder_description())
    if args.decoders:
        result["decoder_benchmark"] = bench_decoders(
            img_size=args.img_size, photo_size=photo_size,
            quality=args.decoder_quality, count=args.decoder_count)
    return result


def _photo_size(text: str):
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        width = height = 0
    if width < 1 or height < 1:
        fail(f"--decoder-photos {text}: expected WIDTHxHEIGHT in px, e.g. 500x375")
    return width, height


# --------------------------------------------------------------------------------------------
# train: the model step through our DeepSpeed engine; overhead: ours against a plain loop
# --------------------------------------------------------------------------------------------
def _quiet() -> None:
    """DeepSpeed's per-rank info lines would bury the one table or JSON object."""
    import logging
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    for name in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)


@contextlib.contextmanager
def _stdout_to_stderr():
    """DeepSpeed prints to stdout (its logger, the JIT op builder, spawned ranks): send the
    process's file descriptor 1 to stderr meanwhile, so stdout carries our output alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_train(args) -> dict:
    # an option that would change nothing: said, not ignored
    if args.workers is not None and args.shards is None:
        fail("--workers sets the loader's workers, which only --shards uses; add --shards DIR "
             "or drop --workers")
    if args.profile_steps is not None and args.profile is None:
        fail("--profile-steps needs --profile FOLDER (where the trace goes)")
    # output paths that would fail only after the measurement, losing it
    if args.record is not None and (args.record.is_dir() or any(
            p.exists() and not p.is_dir() for p in args.record.parents)):
        fail(f"--record {args.record} is a folder or under a file; name a .jsonl file (made "
             f"if missing, appended to if there)")
    if args.profile is not None and args.profile.exists() and not args.profile.is_dir():
        fail(f"--profile {args.profile} is a file; name a folder for the trace (made if missing)")
    try:  # made now: a place that cannot be written is found before the measurement
        if args.record is not None:
            args.record.parent.mkdir(parents=True, exist_ok=True)
            open(args.record, "a").close()
        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(f"cannot write {e.filename or args.record or args.profile} ({e.strerror or e}); "
             f"name a --record file or --profile folder that can be written")
    _quiet()
    from pretrain import benchmark

    cfg = benchmark.bench_config(
        args.model, args.batch, image_size=args.image_size, zero=args.zero,
        precision=args.precision, ranks=args.ranks,
        activation_checkpointing=args.activation_checkpointing, num_classes=args.num_classes,
        recipe=args.config, compile=args.compile, accum=args.accum, overrides=args.overrides)
    return benchmark.run(cfg, ranks=args.ranks, steps=args.steps, warmup=args.warmup,
                         shards=args.shards, workers=args.workers,
                         profile=str(args.profile) if args.profile else None,
                         profile_steps=args.profile_steps or 3)


def run_table(args) -> int:
    from pretrain import bench_records
    if not args.records.is_file():
        fail(f"{args.records}: no such file; write it with `benchmark.py train ... --record "
             f"{args.records}`")
    try:
        records = bench_records.load(args.records)
        table = bench_records.markdown(records)
    except (ValueError, OSError) as e:  # not records; unreadable; not UTF-8
        fail(f"{args.records}: {e}" if str(args.records) not in str(e) else str(e))
    if not records:  # (a README's table would be emptied)
        fail(f"{args.records} holds no records; write them with `benchmark.py train ... "
             f"--record {args.records}`")
    if args.readme is None:
        print(table)
        return 0
    try:
        bench_records.rewrite_readme(args.readme, table)
    except UnicodeDecodeError as e:
        fail(f"--readme {args.readme}: not UTF-8 text ({e.reason}); name the README")
    except ValueError as e:
        fail(str(e))
    except OSError as e:  # a missing or unwritable --readme
        fail(f"--readme {args.readme}: {e.strerror or e}; name the README that holds the "
             f"table's marker lines")
    print(f"rewrote the benchmark table in {args.readme}")
    return 0


def run_overhead(args) -> dict:
    _quiet()
    from pretrain.overhead import measure_overhead

    return measure_overhead(args.model, args.batch, image_size=args.image_size,
                            num_classes=args.num_classes, steps=args.steps,
                            repeats=args.repeats, threads=args.threads or None)


# --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    photos = sub.add_parser(
        "photos", help="write benchmark shards of real 500x375 photos",
        description="Write WebDataset shards of real photos (500x375 JPEG crops of "
                    "scikit-learn's sample photos) with their _info.json, the input of `loader` "
                    "and of `train --shards`.")
    photos.add_argument("--count", type=positive_int, default=2048,
                        help="photos to write (default 2048)")
    photos.add_argument("--out", type=Path, required=True, metavar="DIR",
                        help="folder for the shards and their _info.json (made if missing); one "
                             "that already holds a dataset is refused")
    photos.add_argument("--shard-size", type=positive_int, default=128,
                        help="photos per shard (default 128)")
    photos.add_argument("--seed", type=whole_number, default=0,
                        help="seed of the crops and flips; the same seed writes the same photos "
                             "(default 0)")

    loader = sub.add_parser(
        "loader", help="loader images/s against a reference pipeline",
        description="Images/s of our training loader against a plain webdataset + torchvision "
                    "pipeline (same shards, crop, flip and size). --decoders also "
                    "times decode + train transform per core for each JPEG decoder candidate.")
    loader.add_argument("--shards", required=True,
                        help="directory with _info.json, or a shard pattern {000..009}")
    loader.add_argument("--split", default="train",
                        help="split of _info.json to read (default train)")
    loader.add_argument("--workers", type=whole_number, default=os.cpu_count() or 1,
                        help="loader worker processes of each pipeline (default: all %(default)s "
                             "cores)")
    loader.add_argument("--batches", type=positive_int, default=20,
                        help="timed batches per pipeline (default 20)")
    loader.add_argument("--batch-size", type=positive_int, default=256,
                        help="images per batch (default 256)")
    loader.add_argument("--img-size", type=positive_int, default=224,
                        help="side of the random resized crop in px (default 224)")
    loader.add_argument("--shuffle-buffer", type=positive_int, default=1000,
                        help="samples in each pipeline's shuffle buffer (default 1000)")
    loader.add_argument("--repeats", type=positive_int, default=1,
                        help="alternate the two pipelines this many times, keep each one's best "
                             "(default 1)")
    loader.add_argument("--decoders", action="store_true",
                        help="also time decode + train transform per core for each JPEG "
                             "decoder candidate (PIL, simplejpeg, torchvision, torchcodec, "
                             "PyTurboJPEG), on photos made in memory")
    loader.add_argument("--decoder-photos", default="500x375", metavar="WxH",
                        help="size of those photos (default: the shards' 500x375)")
    loader.add_argument("--decoder-quality", type=int, default=90,
                        help="their JPEG quality (default: the shards' 90; 98 gives ~100 KB "
                             "at 500x375, ImageNet's average file size)")
    loader.add_argument("--decoder-count", type=positive_int, default=200,
                        help="how many photos (default 200)")
    loader.add_argument("--json", action="store_true", help="print one JSON object")

    train = sub.add_parser(
        "train", help="training images/s, TFLOP/s, MFU, peak memory",
        description="Steady-state training images/s, TFLOP/s, MFU and peak memory through our "
                    "DeepSpeed engine, warm-up steps excluded, on synthetic uint8 batches on "
                    "the device unless --shards. The run config is a pretraining recipe "
                    "(--config) with the options below put in.")
    train.add_argument("--model", default=None,
                       help="timm ViT name (default: the --config recipe's model; "
                            "vit_large_patch16_224 without --config)")
    train.add_argument("--batch", type=positive_int, required=True, metavar="N",
                       help="micro-batch per rank (required: e.g. 256 for ViT-L/16 on an H100)")
    train.add_argument("--accum", type=positive_int, default=1, metavar="N",
                       help="micro-batches per optimizer update (train.grad_accum_steps; "
                            "default 1: an update per micro-batch, the least favourable case). "
                            "A real run at batch 4096 on few GPUs accumulates, which spreads "
                            "DeepSpeed's per-update work over N micro-batches; a timed step is "
                            "then one update"),
    train.add_argument("--image-size", type=positive_int, default=None,
                       help="resolution (default: the model's own, 224 for the i21k models)")
    train.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=None,
                       help="ZeRO stage (default: the recipe's deepspeed.zero_stage; 1 with "
                            "the default recipe, which sets none)")
    train.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default=None,
                       help="train.precision (default: the recipe's, bf16 with the default "
                            "recipe); fp32 for quicker CPU runs")
    train.add_argument("--compile", action="store_true",
                       help="engine.compile() (torch.compile), as train.compile=true does; "
                            "--set train.compile_mode=max-autotune-no-cudagraphs autotunes "
                            "the matmuls too")
    train.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction,
                       default=None,
                       help="recompute the blocks' activations in the backward pass (default: "
                            "the recipe's train.activation_checkpointing; off with the default "
                            "recipe, which sets none)")
    train.add_argument("--num-classes", type=positive_int, default=None,
                       help="classes of the head, model.num_classes (default: the recipe's, "
                            "21843 for ImageNet-21k)")
    train.add_argument("--ranks", type=positive_int, default=1,
                       help="data-parallel ranks spawned on this machine (one per GPU; "
                            "default 1)")
    train.add_argument("--steps", type=positive_int, default=10,
                       help="timed steps after the warmup (default 10)")
    train.add_argument("--warmup", type=whole_number, default=3,
                       help="untimed steps first (default 3)")
    train.add_argument("--shards", default=None,
                       help="feed the real loader from these shards (default: synthetic "
                            "batches on the device: no loader to wait for)")
    train.add_argument("--workers", type=whole_number, default=None,
                       help="with --shards: loader workers per rank (default: the recipe's "
                            "data.num_workers)")
    train.add_argument("--config", default=None,
                       help="recipe YAML to start from (default configs/pretrain/vit_l16_i21k.yaml "
                            "with the pre-logits width set to the model's)")
    train.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="KEY=VALUE",
                       help="any config override, repeatable; what the training step reads "
                            "takes effect as in the trainer (model, optimizer, train, deepspeed, "
                            "data augmentation with --shards, mixup/cutmix always; "
                            "log.peak_tflops, the MFU's denominator), while checkpoint, eval, "
                            "tracking and other log keys do nothing here")
    train.add_argument("--profile", type=Path, default=None, metavar="DIR",
                       help="after the timed steps, run --profile-steps more under torch.profiler: "
                            "DIR/trace_rank<R>.json and a breakdown by kind of work (matmul, attention, "
                            "norms, optimizer, ...), printed too (default: no profile)")
    train.add_argument("--profile-steps", type=positive_int, default=None,
                       help="with --profile: steps profiled (default 3)")
    train.add_argument("--json", action="store_true", help="print one JSON object")
    train.add_argument("--record", type=Path, default=None, metavar="FILE",
                       help="append the result to FILE (JSON lines) with this command, the "
                            "commit and the date; `table FILE` makes the README table of them "
                            "(default: not kept)")

    table = sub.add_parser(
        "table", help="the README table from train --record files",
        description="The README's benchmark table from the results `train --record` kept, "
                    "each with its command, commit and date: printed, or written into --readme.")
    table.add_argument("records", type=Path, help="a file written by train --record")
    table.add_argument("--readme", type=Path, default=None,
                       help="rewrite this file's table between its benchmark-table marker "
                            "lines instead of printing it")

    over = sub.add_parser(
        "overhead", help="our DeepSpeed step against a plain PyTorch step, each in a process "
                         "of its own",
        description="One training step through our DeepSpeed engine (ZeRO-2, bf16, one rank) "
                    "against a plain PyTorch step (autocast, clip_grad_norm_, AdamW), each loop "
                    "in a process of its own, taking turns in blocks; prints both median step "
                    "times and their ratio.")
    over.add_argument("--model", default="vit_tiny_patch16_224",
                      help="timm ViT name (default vit_tiny_patch16_224)")
    over.add_argument("--batch", type=positive_int, default=32, help="images per step (default 32)")
    over.add_argument("--image-size", type=positive_int, default=64,
                      help="resolution in px (default 64)")
    over.add_argument("--num-classes", type=positive_int, default=1000,
                      help="classes of the head (default 1000)")
    over.add_argument("--steps", type=positive_int, default=3,
                      help="steps per timed block (default 3)")
    over.add_argument("--repeats", type=positive_int, default=6,
                      help="alternating blocks per side; medians are compared (default 6)")
    # One thread by default: on a CPU shared with other processes, a second OpenMP thread
    # waiting at barriers for a busy core makes step times swing many-fold, which would drown
    # the difference being measured. Both sides always run with the same thread count.
    over.add_argument("--threads", type=whole_number, default=1,
                      help="torch CPU threads (default 1; 0: torch's own default)")
    over.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "photos":
        from pretrain.data.info import INFO_NAMES
        from pretrain.data.loader_benchmark import make_photos
        if args.out.exists() and not args.out.is_dir():
            fail(f"--out {args.out} is a file; name a new or empty folder")
        if any((args.out / name).exists() for name in INFO_NAMES):
            fail(f"--out {args.out} already holds a dataset (_info.json), which this would "
                 f"replace; name a new or empty folder")
        out = make_photos(args.count, args.out, args.shard_size, args.seed)
        print(f"wrote {args.count} photos to {out}")
        return 0
    if args.command == "table":
        return run_table(args)
    from pretrain.cli import input_exit_code, user_errors
    try:  # a bad model, precision or data: one line, as the launchers say it
        if args.command == "train":
            with _stdout_to_stderr():
                result = run_train(args)
            show = bench_tables.train
        elif args.command == "overhead":
            with _stdout_to_stderr():
                result = run_overhead(args)
            show = bench_tables.overhead
        else:
            result = run_loader(args)
            show = bench_tables.loader
    except user_errors() as e:
        fail(str(e), code=input_exit_code(e))
    if args.command == "train" and args.record:
        from pretrain import bench_records
        bench_records.append(args.record, result, sys.argv[1:] if argv is None else argv)
    if args.json:
        print(json.dumps(result))
    else:
        show(result)
    return 0


if __name__ == "__main__":
    with interpreter.launcher(pause_collector=False):  # no teardown at exit
        sys.exit(main())

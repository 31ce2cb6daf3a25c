"""Export a pretraining checkpoint as safetensors: one file with the whole model (pre-logits and
head included, model config in the header), or a model folder in timm's own layout, and,
optionally, a timm-format backbone file.

    python launch/export.py runs/pretrain --out vit_l16_i21k.safetensors
    python launch/export.py runs/pretrain --out vit_l16_i21k_timm/
    python launch/export.py runs/pretrain/checkpoints/step_00090000 --out full.safetensors \\
        --timm-backbone vit_l16_timm.safetensors

CHECKPOINT_OR_OUTPUT_DIR is a pretraining output dir (its newest complete checkpoint is used) or
one checkpoint dir (checkpoints/step_N/). The ZeRO shards (stages 0-3) are merged to fp32 with
DeepSpeed's zero-to-fp32 utilities. A fine-tune's checkpoint dir (RUN/checkpoints/step_N/) is
exported too, as the fine-tune exports its best and final weights (the EMA's where the run
averaged them; its head goes into the folder); a fine-tune's output dir holds those already.
The full file is what `finetune init=FILE` takes; the timm file loads with
timm.create_model(NAME, pretrained=True, pretrained_cfg_overlay=dict(file=FILE, ...),
num_classes=0, ...): the whole call, with the run's architecture and eval preprocessing (timm's
defaults for NAME are another model's), is printed once the file is written.

An --out that does not end in .safetensors is a folder (config.json, model.safetensors,
README.md) that loads with nothing else: timm.create_model("local-dir:FOLDER", pretrained=True),
and timm.data.resolve_model_data_config(model) gives the run's eval preprocessing. It holds the
whole classifier, or, for a model with pre-logits (the ViT paper's i21k models), the backbone
(num_classes=0): timm's ViT has no pre-logits layer to put a head behind.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import _bootstrap  # noqa: F401  (keeps launch/ from shadowing the pretrain package)
from pretrain import cli, interpreter


def build_parser() -> argparse.ArgumentParser:
    p = cli.OneLineParser(prog="export.py", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CHECKPOINT_OR_OUTPUT_DIR",
                   help="pretraining output dir (newest complete checkpoint) or one "
                        "checkpoint dir, a fine-tune's too")
    p.add_argument("--out", required=True, metavar="FILE_OR_FOLDER",
                   help="FILE.safetensors: the whole model + its config; any other name: a "
                        "folder in timm's layout (local-dir:FOLDER); a name ending in another "
                        "weights file's suffix (.pt, .pth, .bin, ...) is refused")
    p.add_argument("--timm-backbone", metavar="FILE", default=None,
                   help="also write the backbone alone with timm's key names")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out / --timm-backbone (default: refuse, so an "
                        "earlier export is never lost by a repeated command); a folder that "
                        "holds more than an export's files is refused even so")
    return p


# names that mean a file, not the folder any other --out name is: a typo of .safetensors, or
# another framework's weights file
FILE_NAMES = (".safetensor", ".pt", ".pth", ".bin", ".ckpt", ".npz", ".h5")


def check_targets(args, folder: bool) -> None:
    """Refuse, before the checkpoint is read, what would lose something the user has."""
    from pathlib import Path
    targets = [Path(args.out)] + ([Path(args.timm_backbone)] if args.timm_backbone else [])
    if len(targets) == 2 and targets[0].resolve() == targets[1].resolve():
        cli.fail(f"--out and --timm-backbone are the same file '{args.out}'; name two files")
    src = Path(args.checkpoint).resolve()
    for target in targets:
        t = target.resolve()
        if src.is_relative_to(t):  # a folder export into the run would make it a timm folder
            cli.fail(f"'{target}' holds the checkpoint read ({args.checkpoint}); write the "
                     f"export to a folder of its own")
        taken = target.is_file() or (target.is_dir() and any(target.iterdir()))
        if taken and target.is_dir():  # the export's files would land among another's
            from pretrain.timm_folder import CARD, CONFIG, WEIGHTS
            others = sorted(p.name for p in target.iterdir()  # (a hub clone's .git is fine)
                            if p.name not in (CARD, CONFIG, WEIGHTS) and p.name[0] != ".")
            if others:  # (said first: --overwrite would not help)
                cli.fail(f"'{target}' is no export folder (it holds {', '.join(others[:4])}"
                         f"{', ...' if len(others) > 4 else ''}); --overwrite replaces an "
                         f"earlier export only: name a folder of its own")
        if taken and not args.overwrite:
            cli.fail(f"'{target}' exists; pass --overwrite to replace it, or name another")


def _size(folder) -> str:
    from pretrain.checkpoint import folder_bytes
    try:
        return f" ({folder_bytes(folder) / 2 ** 30:.2f} GiB)"
    except OSError:  # pruned meanwhile, say: consolidate() tells
        return ""


def finetune_checkpoint(path: Path):
    """(Consolidated, lineage, what) of a fine-tune's checkpoint dir: the weights its run
    evaluated and exported (the EMA's with train.ema_decay), in fp32."""
    import yaml

    from pretrain.checkpoint import CLIENT_STATE, CheckpointError
    from pretrain.export import from_model
    from pretrain.model_files import load_model

    if not (path / CLIENT_STATE).is_file():
        raise CheckpointError(f"checkpoint '{path}' is incomplete (no {CLIENT_STATE}: a save was "
                              f"interrupted); pick another step in {path.parent}")
    print(f"reading {path}{_size(path)}", file=sys.stderr, flush=True)
    mf = load_model(path)
    c = from_model(mf.model, source=str(mf.path), step=mf.step,
                   tracking_run_id=mf.source_run_id, config_yaml=yaml.safe_dump(mf.run_config))
    return c, mf.lineage, mf.kind


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    folder = not args.out.endswith(".safetensors")
    if args.timm_backbone and not args.timm_backbone.endswith(".safetensors"):
        cli.fail(f"--timm-backbone '{args.timm_backbone}' must end in .safetensors")
    if folder and os.path.splitext(args.out)[1].lower() in FILE_NAMES:
        cli.fail(f"--out '{args.out}' would be a folder (any name but FILE.safetensors is); "
                 f"the single-file export is FILE.safetensors: name one, or a folder")
    if folder and os.path.isfile(args.out):
        cli.fail(f"--out '{args.out}' is a file; name a folder, or a FILE.safetensors for the "
                 f"single-file export")
    check_targets(args, folder)
    from finetune.stage import write_finetune_folder
    from pretrain.checkpoint import CLIENT_STATE, TAG_RE, CheckpointError, CheckpointStore
    from pretrain.consolidate import consolidate, is_finetune_dir, resolve_checkpoint
    from pretrain.export import export_full, export_timm_backbone, timm_kwargs
    from pretrain.model_files import ModelFileError
    from pretrain.timm_folder import CONFIG, file_overlay, head_fits, write_timm_folder

    try:
        started = time.monotonic()
        given = Path(args.checkpoint)
        if given.resolve().name == "checkpoints" and is_finetune_dir(given.resolve().parent):
            complete = CheckpointStore(given).complete(warn=True)  # its newest one
            if not complete:
                raise CheckpointError(f"'{given}' holds no complete checkpoint")
            given = complete[0].path
        if (given / CLIENT_STATE).is_file() or (  # a fine-tune's: Accelerate's files
                TAG_RE.match(given.name) and is_finetune_dir(given.parent.parent)):
            c, lineage, what = finetune_checkpoint(given)
            full = write_finetune_folder(c, args.out, lineage=lineage) if folder else \
                export_full(c, args.out)
        else:
            # a ZeRO checkpoint of a large model takes minutes to read and merge: say what first
            ckpt = resolve_checkpoint(args.checkpoint)  # once: a run still saving adds steps
            print(f"reading {ckpt}{_size(ckpt)}", file=sys.stderr, flush=True)
            c = consolidate(ckpt, origin=args.checkpoint)  # a newer one if ckpt is pruned
            full = write_timm_folder(c, args.out, head=head_fits(c.spec)) if folder else \
                export_full(c, args.out)
            ranks = f"{c.world_size} rank{'s' * (c.world_size != 1)}" if c.world_size else \
                "ranks not recorded"
            what = f"ZeRO-{c.zero_stage}, {ranks}"
        timm_file = export_timm_backbone(c, args.timm_backbone) if args.timm_backbone else None
    except (CheckpointError, ModelFileError) as e:
        cli.fail(str(e))
    except OSError as e:  # unwritable output, full disk
        cli.fail(f"cannot write the export: {e}")
    s = c.spec
    params = sum(v.numel() for v in c.state_dict.values())
    print(f"checkpoint {c.source} (step {c.step}, {what}, tracking run "
          f"{c.tracking_run_id or '-'}; exported in {time.monotonic() - started:.1f} s)")
    print(f"model {s.name}: {s.img_size}px, patch {s.patch_size}, width {s.embed_dim}, "
          f"depth {s.depth}, pre-logits {s.representation_size or '-'}, "
          f"{s.num_classes} classes, {params / 1e6:.2f} M parameters (fp32)")
    if folder:
        head = json.loads((full / CONFIG).read_text())["num_classes"]
        print(f"wrote {full}/ (timm layout, {'with its head' if head else 'backbone'}); load it "
              f"with timm.create_model('local-dir:{full}', pretrained=True)")
    else:
        print(f"wrote {full}")
    if timm_file is not None:
        extra = "".join(f", {k}={v!r}" for k, v in timm_kwargs(s).items())
        overlay = ", ".join(f"{k}={v!r}" for k, v in file_overlay(c, timm_file).items())
        print(f"wrote {timm_file}; load it with timm.create_model('{s.name}', pretrained=True, "
              f"pretrained_cfg_overlay=dict({overlay}), num_classes=0{extra})")


if __name__ == "__main__":
    with interpreter.launcher(pause_collector=False):  # no teardown at exit
        main(sys.argv[1:])

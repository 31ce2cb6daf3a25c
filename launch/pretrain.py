"""Pretrain a Vision Transformer with DeepSpeed.

    deepspeed [--hostfile H] launch/pretrain.py --config configs/pretrain/vit_l16_i21k.yaml [key=value ...]
    python launch/pretrain.py --config configs/pretrain/vit_h14_i21k.yaml --dry-run
"""
from __future__ import annotations

import sys

import _bootstrap  # noqa: F401  (keeps launch/ from shadowing the pretrain package)
from pretrain import cli
from pretrain.config import PretrainConfig

DEMO_CONFIG = cli.REPO_ROOT / "configs" / "pretrain" / "demo.yaml"


def main(argv=None) -> None:
    args, cfg = cli.parse(PretrainConfig, "pretrain.py", __doc__, argv, default_config=DEMO_CONFIG)
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return
    if args.dry_run:
        cli.dry_run(args, cfg)
        return
    from pretrain.trainer import train
    try:
        train(cfg)
    except cli.user_errors() as e:
        cli.fail(str(e))


if __name__ == "__main__":
    main(sys.argv[1:])

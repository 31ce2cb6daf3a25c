"""Pretrain a Vision Transformer with DeepSpeed.

    deepspeed [--hostfile H] launch/pretrain.py --config configs/pretrain/vit_l16_i21k.yaml [key=value ...]
    python launch/pretrain.py --config configs/pretrain/vit_h14_i21k.yaml --dry-run --world-size 64
    deepspeed launch/pretrain.py          # no --config: the built-in demo on generated data
"""
from __future__ import annotations

import sys

import _bootstrap  # noqa: F401  (keeps launch/ from shadowing the pretrain package)
from pretrain import cli, interpreter
from pretrain.config import PretrainConfig


def train(cfg: PretrainConfig) -> None:
    from pretrain.trainer import train as run  # imports DeepSpeed: not for --help/--dry-run
    run(cfg)


if __name__ == "__main__":
    with interpreter.launcher():  # the collector paused at start, no teardown at exit
        cli.main(PretrainConfig, "pretrain.py", __doc__, train, sys.argv[1:],
                 default_config=cli.REPO_ROOT / "configs" / "pretrain" / "demo.yaml")

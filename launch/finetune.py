"""Fine-tune a pretrained ViT: pre-logits and head dropped, one zero-initialised head, higher
resolution with 2-D interpolated position embeddings (ViT paper, App. B.1.1).

    accelerate launch launch/finetune.py --config configs/finetune/vit_l16_in1k_384.yaml init=runs/vit_l16_i21k
    torchrun --nproc_per_node 2 launch/finetune.py --config configs/finetune/demo.yaml   # two CPU ranks
    accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml launch/finetune.py --config configs/finetune/demo.yaml   # DeepSpeed ZeRO-2, two ranks
    python launch/finetune.py --config configs/finetune/demo.yaml init=null output_dir=runs/demo-finetune-scratch   # from scratch
"""
from __future__ import annotations

import sys

import _bootstrap  # noqa: F401  (keeps launch/ from shadowing the packages)
from finetune.config import FinetuneConfig
from pretrain import cli, interpreter


def finetune(cfg: FinetuneConfig) -> None:
    from finetune.stage import finetune as run  # imports Accelerate: not for --help/--dry-run
    run(cfg)


def check_inputs(cfg: FinetuneConfig) -> None:
    """--dry-run: the launcher's options agree with the config, and the init is read and fits
    the model (as the run checks at start)."""
    import torch

    from finetune.launch_options import check
    check(cfg.train.precision, torch.cuda.is_available())
    from pretrain.checkpoint import resume_point
    if cfg.init and resume_point(cfg) is None:  # (resumed: the weights are the checkpoint's)
        from finetune.weights import check_init_fits
        check_init_fits(cfg.init, cfg.model, cfg.data.normalize)


if __name__ == "__main__":
    with interpreter.launcher():  # the collector paused at start, no teardown at exit
        cli.main(FinetuneConfig, "finetune.py", __doc__, finetune, sys.argv[1:],
                 preflight=check_inputs)

"""The ViT block's fused backward (pretrain.block_kernels): its Triton kernels, run by Triton's
interpreter on the CPU, against PyTorch; the model trained with them against timm's; the paths
where timm's forward must run instead; and torch.compile tracing them into one graph.

Each check runs in a process of its own (tests/interpreted_block_kernels.py) because Triton picks
its interpreter when the kernels are defined."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECKS = Path(__file__).with_name("interpreted_block_kernels.py")


@pytest.mark.parametrize("check", ["kernels", "training", "autocast", "checkpointed",
                                   "zero3_marked", "compiled"])
def test_block_kernels_under_the_triton_interpreter(check):
    proc = subprocess.run([sys.executable, str(CHECKS), check], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def _training_model(*sets):
    from pretrain.config import ModelConfig, PretrainConfig
    from pretrain.config_files import load_config
    from pretrain.engine import apply_train_options
    from pretrain.model import create_model

    model = create_model(ModelConfig(name="vit_tiny_patch16_224", img_size=32, patch_size=8,
                                     embed_dim=48, depth=1, num_heads=2, num_classes=3))
    apply_train_options(model, load_config(PretrainConfig, None, [
        "data.root=/x", "train.total_steps=1", *sets]))
    return model.train()


def test_block_kernels_false_keeps_timms_modules():
    from timm.models.vision_transformer import Attention, Mlp

    block = _training_model("train.block_kernels=false").backbone.blocks[0]
    assert (type(block.attn), type(block.mlp)) == (Attention, Mlp)


def test_without_the_interpreter_a_cpu_model_trains_through_timms_forward():
    """On the CPU (no Triton device) the blocks keep their class but run timm's own forward
    and backward: the kernels' autograd Functions are not in the graph."""
    import torch

    from pretrain.block_kernels import BlockAttention, BlockMlp, kernels_run_on

    assert not kernels_run_on(torch.device("cpu"))
    model = _training_model()
    assert type(model.backbone.blocks[0].attn) is BlockAttention
    assert type(model.backbone.blocks[0].mlp) is BlockMlp
    out = model(torch.randn(2, 3, 32, 32))
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(n for n, _ in node.next_functions)
    names = {type(n).__name__ for n in seen}
    assert "GeluBackward0" in names and not any("Qkv" in n or "LinearGelu" in n for n in names)

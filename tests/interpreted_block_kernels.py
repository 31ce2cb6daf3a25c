"""Checks of pretrain.block_kernels with its Triton kernels run by Triton's interpreter on the CPU.

Run as ``TRITON_INTERPRET=1 python tests/interpreted_block_kernels.py CHECK`` by
test_block_kernels.py: the interpreter is chosen when the kernels are defined (at import), so
it needs a process of its own. Exit status 0 when the check holds; an assertion error otherwise.
Without TRITON_INTERPRET, on a CUDA GPU, the same checks run the compiled kernels (and the
``compiled`` check Inductor instead of AOTAutograd's eager backend).
"""
import collections
import os
import sys

import torch

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
assert DEVICE == "cpu" or torch.cuda.is_available(), "run with TRITON_INTERPRET=1, or on a GPU"
torch.set_default_device(DEVICE)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pretrain import block_kernels  # noqa: E402
from pretrain.block_kernels import BlockAttention, BlockMlp  # noqa: E402
from pretrain.config import ModelConfig, PretrainConfig  # noqa: E402
from pretrain.config_files import load_config  # noqa: E402
from pretrain.engine import apply_train_options  # noqa: E402
from pretrain.model import create_model  # noqa: E402

ARCH = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=2)


def kernels():
    """Both kernels against PyTorch, on shapes that leave partial tiles in both directions and
    on dQ/dK/dV laid out as (batch, tokens, heads, dim) and as (batch, heads, tokens, dim);
    with the tiles in use and with a tile whose programs each take three blocks of rows."""
    in_use = block_kernels.GELU_TILE, block_kernels.QKV_TILE
    for tiles in (in_use, (block_kernels.Tile(16, 64, 3, 4),) * 2):
        block_kernels.GELU_TILE, block_kernels.QKV_TILE = tiles
        _kernels_against_pytorch()
    block_kernels.GELU_TILE, block_kernels.QKV_TILE = in_use


def _kernels_against_pytorch():
    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        h = torch.randn(130, 200, dtype=dtype) * 3
        dg = torch.randn(130, 200, dtype=dtype)
        dh, db = torch.ops.vitscale.gelu_grad_and_bias_grad(dg, h)
        ref = torch.ops.aten.gelu_backward(dg.float(), h.float())
        torch.testing.assert_close(dh, ref.to(dtype), rtol=tol, atol=tol)
        torch.testing.assert_close(db.float(), ref.sum(0), rtol=tol, atol=tol * 20)
        assert (dh.dtype, db.dtype, db.shape) == (dtype, dtype, (200,))

        b, nh, t, d = 3, 5, 17, 24  # 5 x 24 = 120 features: a partial tile of columns
        by_token = [torch.randn(b, t, nh, d, dtype=dtype).transpose(1, 2) for _ in range(3)]
        by_head = [torch.randn(b, nh, t, d, dtype=dtype) for _ in range(3)]
        for dq, dk, dv in (by_token, by_head, (by_token[0], by_head[1], by_token[2])):
            out, db = torch.ops.vitscale.qkv_grad_and_bias_grad(dq, dk, dv)
            ref = torch.stack((dq, dk, dv)).permute(1, 3, 0, 2, 4).reshape(b * t, 3 * nh * d)
            assert torch.equal(out, ref)  # a copy: exact
            torch.testing.assert_close(db.float(), ref.float().sum(0), rtol=tol, atol=tol * 20)


def _ours(*sets, **kw):
    torch.manual_seed(0)
    ours = create_model(ModelConfig(name="vit_tiny_patch16_224", num_classes=0, **ARCH, **kw))
    apply_train_options(ours, load_config(PretrainConfig, None, ["data.root=/x",
                                                                 "train.total_steps=1", *sets]))
    return ours.backbone


def _pair(**kw):
    """Our training model and timm's stock one with the same weights, and our patch embedding
    (tested on its own in test_model.py), so that the blocks are all that differ."""
    import timm

    from pretrain.model import PatchConv2d

    ours = _ours(**kw)
    stock = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0,
                              global_pool="token", **ARCH)
    stock.load_state_dict(ours.state_dict())  # strict: the same keys
    stock.patch_embed.proj = PatchConv2d.replacing(stock.patch_embed.proj)
    return ours, stock


def _backward_nodes(t):
    """The backward graph's node types by name, each with how many nodes of it there are."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(n for n, _ in node.next_functions)
    return collections.Counter(type(n).__name__ for n in seen)


def _grads(model, x, run=None):
    """Output, gradients by parameter name and backward node types of ``run(x)`` (``model``'s
    forward unless given: a compiled one)."""
    model.zero_grad(set_to_none=True)
    out = (model if run is None else run)(x)
    out.square().sum().backward()
    return out, {n: p.grad for n, p in model.named_parameters()}, _backward_nodes(out)


def _assert_close_grads(grads, ref):
    """Each gradient within 1e-6 of the reference's norm (float32 sums in another order)."""
    assert grads.keys() == ref.keys()
    for name, g in grads.items():
        err = (g - ref[name]).norm() / ref[name].norm()
        assert err < 1e-6, f"{name}: {err:.2e} of its norm"


def training():
    """In training the blocks run our backward: the same forward as timm's, bit for bit, the
    same gradients to rounding (bias gradients are summed in another order); eval, no-grad
    and a ZeRO-3-partitioned weight take timm's path."""
    ours, stock = _pair(drop_path_rate=0.0)
    assert all(type(b.attn) is BlockAttention and type(b.mlp) is BlockMlp for b in ours.blocks)
    x = torch.randn(3, 3, 32, 32)
    out, grads, nodes = _grads(ours.train(), x)
    ref, ref_grads, ref_nodes = _grads(stock.train(), x)
    assert (nodes["_QkvHeadsBackward"], nodes["_LinearGeluBackward"]) == (2, 2), nodes
    assert not {"_LinearGeluBackward", "_QkvHeadsBackward"} & set(ref_nodes)
    assert torch.equal(out, ref)
    _assert_close_grads(grads, ref_grads)
    with torch.no_grad():
        assert torch.equal(ours.eval()(x), stock.eval()(x))
    ours.train()
    ours.blocks[0].mlp.fc1.weight.ds_id = 0  # as ZeRO-3 marks a partitioned weight
    ours.blocks[1].attn.qkv.weight.ds_id = 1
    nodes = _grads(ours, x)[2]
    # one of each left: block 0's attention and block 1's MLP; the marked ones ran timm's
    assert (nodes["_QkvHeadsBackward"], nodes["_LinearGeluBackward"]) == (1, 1), nodes


def autocast():
    """The fine-tune stage's precision: bf16 autocast over float32 weights. The same forward as
    timm's, bit for bit, float32 gradients, and the same to bf16 rounding (the interpreter
    rounds to bf16 by truncation where a GPU rounds to nearest: up to ~1e-2 of a norm here)."""
    ours, stock = _pair(drop_path_rate=0.0)
    x = torch.randn(3, 3, 32, 32)
    runs = []
    for model in (ours, stock):
        model.train().zero_grad(set_to_none=True)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            out = model(x)
        out.float().square().sum().backward()
        runs.append((out, {n: p.grad for n, p in model.named_parameters()}))
    assert "_LinearGeluBackward" in _backward_nodes(runs[0][0])
    assert torch.equal(runs[0][0], runs[1][0])
    for name, g in runs[0][1].items():
        ref = runs[1][1][name]
        assert g.dtype == torch.float32, (name, g.dtype)
        err = (g - ref).norm() / ref.norm()
        assert err < 3e-2, f"{name}: {err:.2e} of its norm"


def checkpointed():
    """Activation checkpointing (all blocks, or one) recomputes the blocks' forward in the
    backward pass through the kernels' Functions: the very same gradients as without it
    (dropout and stochastic depth replayed)."""
    x = torch.randn(3, 3, 32, 32)
    kw = dict(drop_path_rate=0.1, dropout=0.1)
    model = _ours(**kw).train()
    torch.manual_seed(1)
    _, plain, nodes = _grads(model, x)
    assert "_LinearGeluBackward" in nodes
    for sets in (["train.activation_checkpointing=true"],
                 ["train.activation_checkpointing=true", "train.checkpointed_blocks=1"]):
        model = _ours(*sets, **kw).train()
        torch.manual_seed(1)
        _, grads, nodes = _grads(model, x)
        assert "_LinearGeluBackward" in nodes or "CheckpointFunctionBackward" in nodes, nodes
        assert grads.keys() == plain.keys()
        assert all(torch.equal(grads[n], plain[n]) for n in grads), sets


def zero3_marked():
    """Every weight marked as ZeRO-3's: timm's path everywhere, the Functions absent."""
    ours, _ = _pair()
    for p in ours.parameters():
        p.ds_id = 0
    nodes = _grads(ours.train(), torch.randn(2, 3, 32, 32))[2]
    assert not {"_LinearGeluBackward", "_QkvHeadsBackward"} & set(nodes), nodes


def compiled():
    """torch.compile traces the custom backward (AOTAutograd, the ops' fake kernels) into one
    graph, and the compiled step gives the gradients of timm's model compiled alike (not of
    eager mode: Inductor's own float32 arithmetic differs from eager's by ~3e-4 on a GPU)."""
    ours, stock = _pair(drop_path_rate=0.0)
    x = torch.randn(2, 3, 32, 32)
    explained = torch._dynamo.explain(ours.train())(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
        [str(b.reason) for b in explained.break_reasons]
    backend = "aot_eager" if DEVICE == "cpu" else "inductor"
    grads = []
    for model in (ours, stock):
        run = torch.compile(model.train(), backend=backend, fullgraph=True)
        _, comp, nodes = _grads(model, x, run)
        assert "CompiledFunctionBackward" in nodes, nodes
        grads.append(comp)
    _assert_close_grads(*grads)


if __name__ == "__main__":
    assert block_kernels.INTERPRET == (DEVICE == "cpu")
    {"kernels": kernels, "training": training, "autocast": autocast,
     "checkpointed": checkpointed, "zero3_marked": zero3_marked, "compiled": compiled}[sys.argv[1]]()
    print("ok")

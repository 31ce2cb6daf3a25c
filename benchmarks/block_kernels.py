"""pretrain/block_kernels.py's two backward kernels against what they replace, at ViT-L/16's
shapes (batch 256: 50,432 tokens, width 1024, MLP 4096, 16 heads of 64) and ViT-H/14's (batch
128: 32,896 tokens, width 1280, MLP 5120, 16 heads of 80), bf16 on a CUDA GPU:

- fc1: GELU's gradient and the fc1 bias gradient, ours in one kernel; the reference is the
  same two results through torch.compile (the step's compiled backward makes them in two
  passes: a pointwise kernel and a reduction);
- qkv: dQ, dK, dV from a real SDPA backward (the layout the attention kernel gives them)
  into the qkv layout plus the qkv bias gradient; the reference is torch.compile's copy and
  sum, again two kernels.

Each pair is first checked to agree, then timed (Triton's do_bench, median). Prints ms per
layer and per step (x 24 or 32 layers). ``--sweep`` times our kernels with each candidate tile
of ``TILES`` instead (the tile in use is ``GELU_TILE`` and ``QKV_TILE`` in the module: fixed,
since the bias sums' order follows it): each tile's time, and the best by the time of a
ViT-L/16 plus a ViT-H/14 step.

    python benchmarks/block_kernels.py [--sweep]
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pretrain import block_kernels  # noqa: E402  (also registers the vitscale:: ops)
from pretrain.block_kernels import Tile  # noqa: E402

SHAPES = {  # batch, tokens, width, MLP width, heads, depth
    "ViT-L/16 b256": (256, 197, 1024, 4096, 16, 24),
    "ViT-H/14 b128": (128, 257, 1280, 5120, 16, 32),
}
# (rows, cols, row blocks per program, warps); the module's tile in use is timed first
TILES = [Tile(64, 128, 1, 8), Tile(32, 256, 1, 8), Tile(64, 256, 1, 8), Tile(128, 128, 1, 8),
         Tile(16, 512, 1, 4), Tile(32, 128, 1, 4), Tile(64, 128, 4, 8), Tile(32, 256, 4, 8),
         Tile(64, 256, 4, 8), Tile(16, 512, 8, 4), Tile(32, 256, 16, 8), Tile(64, 128, 16, 8),
         Tile(16, 256, 8, 4), Tile(8, 1024, 8, 4)]


def gelu_reference(dg, h):
    dh = torch.ops.aten.gelu_backward(dg, h)
    return dh, dh.sum(0)


def qkv_reference(dq, dk, dv):
    b, nh, t, d = dq.shape
    out = torch.stack((dq, dk, dv)).permute(1, 3, 0, 2, 4).reshape(b * t, 3 * nh * d)
    return out, out.sum(0)


def check(ours, ref, what):
    if what == "qkv":  # a copy: exact (the GELU gradient's erf may differ in the last bit)
        assert torch.equal(ours[0], ref[0]), f"{what}: gradients differ"
    err = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(ours, ref)]
    assert max(err) < 1e-2, f"{what}: relative errors {err}"
    return err


def inputs(b, t, width, mlp, heads):
    dev, bf = "cuda", torch.bfloat16
    m, hd = b * t, width // heads
    h = torch.randn(m, mlp, device=dev, dtype=bf)
    dg = torch.randn(m, mlp, device=dev, dtype=bf)
    qkv = torch.randn(b, t, 3, heads, hd, device=dev, dtype=bf, requires_grad=True)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    out = F.scaled_dot_product_attention(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    return (dg, h), (dq, dk, dv)


def bench(fn):
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def main():
    torch.manual_seed(0)
    gelu_compiled = torch.compile(gelu_reference)
    qkv_compiled = torch.compile(qkv_reference)
    for name, (b, t, width, mlp, heads, depth) in SHAPES.items():
        (dg, h), (dq, dk, dv) = inputs(b, t, width, mlp, heads)
        cases = {
            "fc1 GELU grad + bias grad": (lambda: torch.ops.vitscale.gelu_grad_and_bias_grad(dg, h),
                                          lambda: gelu_compiled(dg, h), "fc1"),
            "qkv layout + bias grad": (lambda: torch.ops.vitscale.qkv_grad_and_bias_grad(dq, dk, dv),
                                       lambda: qkv_compiled(dq, dk, dv), "qkv"),
        }
        print(f"{name}: dQ strides {tuple(dq.stride())} (batch, heads, tokens, dim); tiles: "
              f"GELU {tuple(block_kernels.GELU_TILE)}, qkv {tuple(block_kernels.QKV_TILE)}")
        for what, (ours, ref, key) in cases.items():
            err = check(ours(), ref(), key)
            t_ours, t_ref = bench(ours), bench(ref)
            print(f"  {what:27} ours {t_ours:6.3f} ms, compiled PyTorch {t_ref:6.3f} ms per "
                  f"layer; x{depth}: {t_ours * depth:5.1f} vs {t_ref * depth:5.1f} ms a step "
                  f"(relative differences {err[0]:.1e}, {err[1]:.1e})")


def sweep():
    """Each kernel with each tile of TILES: ms per layer at both shapes, and per step summed."""
    torch.manual_seed(0)
    data = {name: inputs(*shape[:5]) for name, shape in SHAPES.items()}
    refs = {name: (gelu_reference(*g), qkv_reference(*q)) for name, (g, q) in data.items()}
    for key, attr, op in (("fc1", "GELU_TILE", torch.ops.vitscale.gelu_grad_and_bias_grad),
                          ("qkv", "QKV_TILE", torch.ops.vitscale.qkv_grad_and_bias_grad)):
        rows, in_use = [], getattr(block_kernels, attr)
        for tile in [in_use] + [t for t in TILES if t != in_use]:
            setattr(block_kernels, attr, tile)
            per_layer = []
            for name, (g, q) in data.items():
                args = g if key == "fc1" else q
                check(op(*args), refs[name][0 if key == "fc1" else 1], key)
                per_layer.append(bench(lambda: op(*args)))
            step = sum(ms * SHAPES[n][5] for ms, n in zip(per_layer, SHAPES))
            rows.append((step, tile, per_layer))
            print(f"  {key} {tuple(tile)}: " + ", ".join(f"{ms:.3f}" for ms in per_layer)
                  + f" ms per layer; both steps {step:.1f} ms", flush=True)
        best = min(rows, key=lambda r: r[0])
        setattr(block_kernels, attr, in_use)
        print(f"{key}: best {tuple(best[1])} ({best[0]:.1f} ms for both steps) against "
              f"{rows[0][0]:.1f} with the tile in use, {tuple(in_use)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true",
                        help="time the candidate tiles of TILES instead of comparing with compile")
    sweep() if parser.parse_args().sweep else main()

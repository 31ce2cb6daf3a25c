"""The ViT block's backward with each bias gradient summed where its gradient is written.

Why: in an H100 profile of ViT-L/16's compiled training step (README, Performance) two passes
of the backward only re-read a gradient that the pass before had just written, to sum it over
the tokens into a bias gradient: the MLP's fc1 bias (3.8 ms a step: 24 reads of a 413 MB
gradient) and the qkv bias (3.4 ms), while Inductor's kernels writing those gradients (the
GELU gradient, the copy of dQ, dK, dV into the qkv layout) ran at the memory's speed. Here one
Triton kernel writes the gradient and the column sums of each span of rows it took, and a sum
over those partial rows finishes the bias gradient: those two passes go. Measured on an H100
against torch.compile's two kernels (``benchmarks/block_kernels.py``, the tiles below): 20.4
against 23.0 ms a ViT-L/16 step, 22.2 against 31.8 ms a ViT-H/14 step; end to end ViT-L/16
215.5 -> 212.7 ms. The sums are over fixed tiles in a fixed order (no atomics): they add no
run-to-run variation.

What changes: timm's ``Attention`` and ``Mlp`` modules of the backbone become the subclasses
below (``adopt_block_kernels``): the same parameters, state-dict keys and forward arithmetic;
only the backward of ``qkv`` (with its split into heads) and of ``fc1`` + GELU is ours. The
kernels run where Triton runs (CUDA devices; on the CPU under ``TRITON_INTERPRET=1``, which the
tests use); anywhere else, in eval mode, under ZeRO-3 (whose hooks gather a weight only when its
module is called) and for any layout these do not cover, timm's own forward runs.
"""
import os
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F
from timm.models.vision_transformer import Attention, Mlp

try:
    import triton
    import triton.language as tl
except ImportError:  # torch builds without Triton: timm's forward everywhere
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's own switch: kernels on the CPU


class Tile(NamedTuple):
    """How a kernel cuts its (tokens, features) gradient: each program takes ``cols`` features
    of ``rows x blocks`` tokens, a block of ``rows`` at a time, adds the blocks' column sums in
    registers in order and writes them as one row of partial sums. Fixed here, not autotuned:
    the bias gradient's order of summation follows the tile, so a tile chosen per process by
    timing would make it vary from run to run. ``benchmarks/block_kernels.py --sweep`` times
    the candidates."""
    rows: int
    cols: int
    blocks: int
    warps: int


GELU_TILE = Tile(rows=32, cols=128, blocks=1, warps=4)
QKV_TILE = Tile(rows=128, cols=128, blocks=1, warps=8)


def kernels_run_on(device: torch.device) -> bool:
    return triton is not None and (device.type == "cuda" or INTERPRET)


if triton is not None:
    @triton.jit
    def _gelu_grad_kernel(dg_ptr, h_ptr, dh_ptr, part_ptr, M, N,
                          BM: tl.constexpr, BN: tl.constexpr, LOOP: tl.constexpr):
        """dh = dg * GELU'(h) (the exact, erf form: timm's nn.GELU) and dh's column sums."""
        pm, pn = tl.program_id(0), tl.program_id(1)
        cols = pn * BN + tl.arange(0, BN)
        sums = tl.zeros([BN], dtype=tl.float32)
        for i in range(LOOP):
            rows = (pm * LOOP + i) * BM + tl.arange(0, BM)
            mask = (rows[:, None] < M) & (cols[None, :] < N)
            offs = rows[:, None].to(tl.int64) * N + cols[None, :]
            dg = tl.load(dg_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            cdf = 0.5 * (1.0 + tl.math.erf(h * 0.7071067811865476))
            pdf = tl.exp(-0.5 * h * h) * 0.3989422804014327
            dh = dg * (cdf + h * pdf)
            tl.store(dh_ptr + offs, dh.to(dh_ptr.dtype.element_ty), mask=mask)
            sums += tl.sum(dh, axis=0)
        tl.store(part_ptr + pm * N + cols, sums, mask=cols < N)

    @triton.jit
    def _heads_to_rows_kernel(src_ptr, out_ptr, part_ptr, M, T, HD, D,
                              s_b, s_h, s_t, s_d, out_stride, part_stride,
                              BM: tl.constexpr, BN: tl.constexpr, LOOP: tl.constexpr):
        """One of dQ, dK, dV, (batch, heads, tokens, head dim) with any strides, written as rows
        of (heads x head dim) into its third of the qkv gradient, and its column sums."""
        pm, pn = tl.program_id(0), tl.program_id(1)
        cols = (pn * BN + tl.arange(0, BN)).to(tl.int64)
        col_offs = (cols // D) * s_h + (cols % D) * s_d
        sums = tl.zeros([BN], dtype=tl.float32)
        for i in range(LOOP):
            rows = ((pm * LOOP + i) * BM + tl.arange(0, BM)).to(tl.int64)
            mask = (rows[:, None] < M) & (cols[None, :] < HD)
            src = ((rows // T) * s_b + (rows % T) * s_t)[:, None] + col_offs[None, :]
            g = tl.load(src_ptr + src, mask=mask, other=0.0)
            tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], g, mask=mask)
            sums += tl.sum(g.to(tl.float32), axis=0)
        tl.store(part_ptr + pm * part_stride + cols, sums, mask=cols < HD)


def _launch(kernel, tile: Tile, spans: int, n_cols: int, device, *args):
    """The kernel over (``spans`` spans of rows) x (``n_cols`` columns in tiles)."""
    grid = (spans, triton.cdiv(n_cols, tile.cols))
    consts = dict(BM=tile.rows, BN=tile.cols, LOOP=tile.blocks)
    if device.type == "cuda":
        with torch.cuda.device(device):
            kernel[grid](*args, **consts, num_warps=tile.warps)
    else:
        kernel[grid](*args, **consts)


def _row_spans(m: int, tile: Tile) -> int:
    return triton.cdiv(m, tile.rows * tile.blocks)


@torch.library.custom_op("vitscale::gelu_grad_and_bias_grad", mutates_args=())
def gelu_grad_and_bias_grad(dg: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor,
                                                                       torch.Tensor]:
    """For ``g = gelu(h)``, ``h = x @ W.T + b`` as (tokens, features): dL/dh and dL/db."""
    dg, h = dg.contiguous(), h.contiguous()
    m, n = h.shape
    tile, spans = GELU_TILE, _row_spans(m, GELU_TILE)
    dh = torch.empty_like(h)
    part = torch.empty(spans, n, device=h.device, dtype=torch.float32)
    _launch(_gelu_grad_kernel, tile, spans, n, h.device, dg, h, dh, part, m, n)
    return dh, part.sum(0).to(h.dtype)


@gelu_grad_and_bias_grad.register_fake
def _(dg, h):
    return torch.empty_like(h), h.new_empty(h.shape[-1])


@torch.library.custom_op("vitscale::qkv_grad_and_bias_grad", mutates_args=())
def qkv_grad_and_bias_grad(dq: torch.Tensor, dk: torch.Tensor,
                           dv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dQ, dK, dV as (batch, heads, tokens, head dim) -> the qkv projection's output gradient
    as (batch x tokens, 3 x heads x head dim), timm's layout, and its bias gradient."""
    b, nh, t, d = dq.shape
    m, hd = b * t, nh * d
    tile, spans = QKV_TILE, _row_spans(m, QKV_TILE)
    out = torch.empty(m, 3 * hd, device=dq.device, dtype=dq.dtype)
    part = torch.empty(spans, 3 * hd, device=dq.device, dtype=torch.float32)
    for i, g in enumerate((dq, dk, dv)):
        _launch(_heads_to_rows_kernel, tile, spans, hd, dq.device, g, out[:, i * hd:],
                part[:, i * hd:], m, t, hd, d, *g.stride(), out.stride(0), part.stride(0))
    return out, part.sum(0).to(dq.dtype)


@qkv_grad_and_bias_grad.register_fake
def _(dq, dk, dv):
    b, nh, t, d = dq.shape
    return dq.new_empty(b * t, 3 * nh * d), dq.new_empty(3 * nh * d)


def _as_autocast_would(*tensors):
    """The tensors in autocast's dtype where it is on (the fine-tune stage's bf16 over fp32
    weights), so that the backward's matmuls see what the forward's did; autograd casts the
    gradients back to the inputs' dtypes."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) for t in tensors)


def _linear_input_grads(dy2d, x, weight, needs):
    """dL/dx and dL/dW of ``y = x @ W.T + b`` from dL/dy as (tokens, out features)."""
    dx = (dy2d @ weight).reshape(x.shape) if needs[0] else None
    dw = dy2d.t() @ x.reshape(-1, x.shape[-1]) if needs[1] else None
    return dx, dw


class _LinearGelu(torch.autograd.Function):
    """``gelu(x @ W.T + b)`` with the backward above (forward: the same two ops as timm's)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        x, weight, bias = _as_autocast_would(x, weight, bias)
        h = F.linear(x, weight, bias)
        ctx.save_for_backward(x, weight, h)
        return F.gelu(h)

    @staticmethod
    def backward(ctx, dg):
        x, weight, h = ctx.saved_tensors
        n = h.shape[-1]
        dh, db = torch.ops.vitscale.gelu_grad_and_bias_grad(dg.reshape(-1, n), h.reshape(-1, n))
        return *_linear_input_grads(dh, x, weight, ctx.needs_input_grad), db


class _QkvHeads(torch.autograd.Function):
    """q, k, v as (batch, heads, tokens, head dim) views of ``x @ W.T + b``, as timm splits them."""

    @staticmethod
    def forward(ctx, x, weight, bias, num_heads):
        b, t, _ = x.shape
        x, weight, bias = _as_autocast_would(x, weight, bias)
        ctx.save_for_backward(x, weight)
        qkv = F.linear(x, weight, bias).reshape(b, t, 3, num_heads, -1).permute(2, 0, 3, 1, 4)
        return qkv.unbind(0)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        x, weight = ctx.saved_tensors
        dqkv, db = torch.ops.vitscale.qkv_grad_and_bias_grad(dq, dk, dv)
        return *_linear_input_grads(dqkv, x, weight, ctx.needs_input_grad), db, None


def _ours_to_run(x: torch.Tensor, linear: nn.Linear) -> bool:
    """The kernels apply: a training forward with autograd on, where Triton runs, a biased
    Linear whose weight is in place (ZeRO-3 marks its partitioned weights with ``ds_id``)."""
    return (torch.is_grad_enabled() and kernels_run_on(x.device) and linear.bias is not None
            and not hasattr(linear.weight, "ds_id"))


class BlockAttention(Attention):
    """timm's Attention; in training, the qkv projection's backward is :class:`_QkvHeads`'s."""

    def forward(self, x, *args, **kwargs):
        plain = (not args and all(v is None or v is False for v in kwargs.values())
                 and self.fused_attn and isinstance(self.q_norm, nn.Identity)
                 and isinstance(self.k_norm, nn.Identity)
                 and isinstance(getattr(self, "norm", None), (nn.Identity, type(None)))
                 and getattr(self, "gate", None) is None)
        if not (self.training and plain and _ours_to_run(x, self.qkv)):
            return super().forward(x, *args, **kwargs)
        b, t, _ = x.shape
        q, k, v = _QkvHeads.apply(x, self.qkv.weight, self.qkv.bias, self.num_heads)
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p)
        x = self.proj(x.transpose(1, 2).reshape(b, t, -1))
        return self.proj_drop(x)


class BlockMlp(Mlp):
    """timm's Mlp; in training, fc1 + GELU's backward is :class:`_LinearGelu`'s."""

    def forward(self, x):
        exact_gelu = type(self.act) is nn.GELU and self.act.approximate == "none"
        if not (self.training and exact_gelu and type(self.fc1) is nn.Linear
                and _ours_to_run(x, self.fc1)):
            return super().forward(x)
        x = _LinearGelu.apply(x, self.fc1.weight, self.fc1.bias)
        return self.drop2(self.fc2(self.norm(self.drop1(x))))


def adopt_block_kernels(backbone: nn.Module) -> None:
    """Give the blocks' stock timm Attention and Mlp modules the backward above, in place."""
    for module in backbone.modules():
        if type(module) is Attention:
            module.__class__ = BlockAttention
        elif type(module) is Mlp:
            module.__class__ = BlockMlp

"""Forward and backward of one attention layer through each of PyTorch's SDPA backends, at
ViT-L/16's shape (batch 256) and ViT-H/14's (batch 128), with q, k, v laid out as timm's
Attention makes them (views of one qkv tensor). Needs a CUDA GPU (times with Triton's do_bench,
median of repeated runs after a warm-up). The README's table of backends came from this script.

    python benchmarks/sdpa_backends.py
"""
import torch, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
from triton.testing import do_bench
torch.manual_seed(0)
for name, (B, H, N, d) in {"L16 b256": (256, 16, 197, 64), "H14 b128": (128, 16, 257, 80)}.items():
    qkv = torch.randn(B, N, 3, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16)
    flops_f = 4 * B * H * N * N * d
    ref = None
    for be in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        def fwd():
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            return F.scaled_dot_product_attention(q, k, v)
        def fb():
            qkv.grad = None
            fwd().backward(g)
        try:
            with sdpa_kernel([be]):
                o = fwd().float()
                if ref is None: ref = o
                err = ((o - ref).norm() / ref.norm()).item()
                tf = do_bench(fwd, warmup=50, rep=300, return_mode="median")
                tfb = do_bench(fb, warmup=50, rep=300, return_mode="median")
            print(f"{name:9} {be.name:20} fwd {tf:6.3f} ms ({flops_f/tf/1e9:5.0f} TF/s)  fwd+bwd {tfb:6.3f} ms "
                  f"({3.5*flops_f/tfb/1e9:5.0f} TF/s)  x24/32 layers: {tfb*(24 if name[0]=='L' else 32):6.1f} ms  rel.err {err:.1e}")
        except Exception as e:
            print(f"{name:9} {be.name:20} failed: {str(e).splitlines()[0][:150]}")

"""Can GELU and its gradient ride in the MLP matmuls' epilogues at cuBLAS's speed?

The README's profile of ViT-L/16 puts ~20 ms of a 212 ms step in two passes over the MLP's
4x-wide activation: GELU after fc1 (7.9 ms) and its gradient after fc2's input gradient (12.5
ms, with the fc1 bias gradient's column sums, which an epilogue would have to take along). Both would vanish into the matmuls if a matmul kernel as fast as cuBLAS's applied them as
it writes its output. cuBLASLt's GELU epilogue computes the tanh form (timm's models use the
exact one); Inductor's Triton matmul templates take any epilogue, and on Hopper it has
persistent TMA templates too. This times, at the shapes of one layer (bf16, on a CUDA GPU):

- forward: ``h = x @ W1.T + b1; g = gelu(h)``, both kept (the backward needs h, fc2 needs g);
- backward: ``dh = gelu'(h) * (dy @ W2)``, fc2's input gradient with GELU's gradient applied;

each eager (cuBLAS, then a pointwise kernel), compiled by default (cuBLAS, then Inductor's
pointwise kernel) and compiled with ``max-autotune-no-cudagraphs`` (Triton templates timed
against cuBLAS, the epilogue fused into a template that wins; ``--tma`` adds the persistent
TMA templates). A max-autotune time at or under the default one says the epilogue route is
worth building into the step; above it, it is not, at least not through Inductor.

    python benchmarks/mlp_epilogue.py [--model l16|h14] [--tma]
"""
import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = {"l16": (256 * 197, 1024, 4096), "h14": (128 * 257, 1280, 5120)}  # tokens, width, MLP


def forward(x, w1, b1):
    h = F.linear(x, w1, b1)
    return h, F.gelu(h)


def backward(dy, w2, h):
    return torch.ops.aten.gelu_backward(dy @ w2, h)


def bench(fn, *args):
    from triton.testing import do_bench
    return do_bench(lambda: fn(*args), warmup=25, rep=200, return_mode="median")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="l16",
                        help="the layer's shape: ViT-L/16 at batch 256 or ViT-H/14 at 128")
    parser.add_argument("--tma", action="store_true",
                        help="let max-autotune also try Inductor's persistent TMA templates")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: needs a CUDA GPU (the question is about its matmul kernels)")
    if args.tma:
        import torch._inductor.config as inductor_config
        inductor_config.triton.enable_persistent_tma_matmul = True
    torch.manual_seed(0)
    m, d, f = SHAPES[args.model]
    kw = dict(device="cuda", dtype=torch.bfloat16)
    x, dy = torch.randn(m, d, **kw), torch.randn(m, d, **kw)
    w1, b1, w2 = torch.randn(f, d, **kw) / d ** 0.5, torch.randn(f, **kw), torch.randn(d, f, **kw)
    h = F.linear(x, w1, b1)
    print(f"{args.model}: tokens {m}, width {d}, MLP {f}; {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, TMA templates {'on' if args.tma else 'off'}", flush=True)
    for name, fn, inputs in (("forward (fc1 + GELU)", forward, (x, w1, b1)),
                             ("backward (fc2 dgrad + GELU')", backward, (dy, w2, h))):
        ref = fn(*inputs)
        times = {"eager": bench(fn, *inputs)}
        for mode in ("default", "max-autotune-no-cudagraphs"):
            torch._dynamo.reset()  # else the second mode may reuse the first one's code
            compiled = torch.compile(fn, mode=mode, dynamic=False)
            start = time.perf_counter()
            out = compiled(*inputs)
            built = time.perf_counter() - start
            for a, b in zip(*(o if isinstance(o, tuple) else (o,) for o in (out, ref))):
                err = ((a.float() - b.float()).norm() / b.float().norm()).item()
                assert err < 1e-2, f"{name}, {mode}: relative error {err:.1e}"
            times[f"{mode} (compiled in {built:.0f} s)"] = bench(compiled, *inputs)
        print(f"  {name}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in times.items()), flush=True)


if __name__ == "__main__":
    main()

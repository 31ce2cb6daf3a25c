"""Gradients summed over a step's micro-batches in fp32 under bf16 (pretrain/grad_accum.py), on
two real DeepSpeed ranks (gloo): the update against the exact sum of the same bf16 micro-batch
gradients, at ZeRO-1, -2 and -3, with fp32 and with bf16 accumulation; and the settings
DeepSpeed cannot run, refused in one line before any work."""
from __future__ import annotations

import os
import re

import pytest

from conftest import REPO, run_launcher, spawn_ranks

from pretrain.config import ConfigError, PretrainConfig
from pretrain.config_files import load_config

MICRO, ACCUM = 4, 16


def _worker(rank: int, world: int, port: int, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param

    from pretrain.benchmark import build_engine
    from pretrain.engine import train_micro_batch

    torch.set_num_threads(1)
    deepspeed.init_distributed(verbose=False)
    found = {}
    for zero in (1, 2, 3):
        for summed in ("fp32", "bf16"):
            # plain SGD at lr 1 without decay or clipping: the fp32 weights move by exactly
            # the gradient DeepSpeed summed over the micro-batches and averaged over the ranks
            cfg = load_config(PretrainConfig, REPO / "configs/pretrain/demo.yaml", [
                "train.precision=bf16", f"deepspeed.zero_stage={zero}",
                f"train.micro_batch_size={MICRO}",
                f"train.global_batch_size={MICRO * ACCUM * world}",
                "optimizer.name=sgd", "optimizer.lr=1.0", "optimizer.momentum=0.0",
                "optimizer.weight_decay=0.0", "optimizer.grad_clip=null",
                "schedule.warmup_steps=0", f"deepspeed.grad_accum_dtype={summed}"])
            torch.manual_seed(cfg.seed)
            engine = build_engine(cfg, world)[0]
            named = list(engine.module.named_parameters())
            before = [safe_get_full_fp32_param(p).clone() for _, p in named]
            exact = {}  # each micro-batch's bf16 gradient as the backward pass makes it, in fp64

            def keep(grad, name):
                exact[name] = exact.get(name, 0) + grad.double()
                return grad

            hooks = [p.register_hook(lambda g, n=n: keep(g, n)) for n, p in named]
            g = torch.Generator().manual_seed(1000 * rank + 7)
            for _ in range(ACCUM):
                images = torch.randn(MICRO, 3, 32, 32, generator=g).to(torch.bfloat16)
                labels = torch.randint(0, 10, (MICRO,), generator=g)
                train_micro_batch(engine, images, labels, cfg)
            for h in hooks:
                h.remove()
            after = [safe_get_full_fp32_param(p) for _, p in named]
            moved = torch.cat([(b - a).flatten() for b, a in zip(before, after)]).double()
            want = torch.cat([exact[n].flatten() for n, _ in named])
            dist.all_reduce(want)  # summed over the ranks, then averaged as DeepSpeed does
            want /= world
            found[f"ZeRO-{zero} {summed}"] = (type(engine.optimizer).__name__,
                                              float((moved - want).norm() / want.norm()))
            del engine
    queue.put((rank, found))


@pytest.fixture(scope="module")
def summed():
    return spawn_ranks(_worker, 2, timeout=400)[0]


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_fp32_accumulation_sums_the_micro_batch_gradients_far_closer_than_bf16(summed, zero):
    _, fp32 = summed[f"ZeRO-{zero} fp32"]
    _, bf16 = summed[f"ZeRO-{zero} bf16"]
    # in bf16 each of the 16 additions rounds the sum (6e-3 to 7e-3 here); in fp32 what is left
    # is the bf16 the gradients cross the ranks in (2.3e-3 to 2.7e-3)
    assert bf16 > 5e-3, summed
    assert fp32 < 3.5e-3 and fp32 < bf16 / 2, summed


def test_zero1_keeps_its_own_optimizer_when_it_sums_in_fp32(summed):
    # not DeepSpeed's BF16_Optimizer: the same checkpoint layout as with one micro-batch a step
    assert summed["ZeRO-1 fp32"][0] == summed["ZeRO-1 bf16"][0] == "DeepSpeedZeroOptimizer"


def test_deepspeed_is_told_to_sum_in_fp32_only_where_there_is_something_to_sum():
    from pretrain.deepspeed_json import deepspeed_config

    def data_types(*overrides, accum=4):
        cfg = load_config(PretrainConfig, None, list(overrides))
        return deepspeed_config(cfg, micro=4, accum=accum, world=1).get("data_types")

    assert data_types() == {"grad_accum_dtype": "fp32"}  # bf16 is the default precision
    assert data_types("deepspeed.zero_stage=3") == {"grad_accum_dtype": "fp32"}
    assert data_types(accum=1) is None
    assert data_types("deepspeed.grad_accum_dtype=bf16") is None  # DeepSpeed's own default
    assert data_types("train.precision=fp32") is None  # fp32 gradients: nothing to ask for
    assert data_types("deepspeed.zero_stage=0", accum=1) is None
    assert data_types("deepspeed.zero_stage=0", "deepspeed.grad_accum_dtype=bf16") is None
    with pytest.raises(ConfigError, match=r"deepspeed.grad_accum_dtype=fp32 needs ZeRO stage 1-3: "
                                          r"at ZeRO-0 DeepSpeed sums a step's 4 micro-batch "
                                          r"gradients in bf16 only; set deepspeed.zero_stage=1"):
        data_types("deepspeed.zero_stage=0")
    with pytest.raises(ConfigError, match=r"deepspeed.grad_accum_dtype=bf16 but train.precision="
                                          r"fp32: .*; set deepspeed.grad_accum_dtype=fp32"):
        data_types("deepspeed.grad_accum_dtype=bf16", "train.precision=fp32")


def test_zero0_with_micro_batches_to_sum_in_fp32_is_refused_before_the_demo_data_is_made(
        tmp_path):
    proc = run_launcher("pretrain.py", "--config", "configs/pretrain/demo.yaml",
                        f"output_dir={tmp_path / 'run'}", f"data.root={tmp_path / 'demo'}",
                        "data.generate_demo=true",
                        "train.precision=bf16", "deepspeed.zero_stage=0",
                        "train.micro_batch_size=16")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert re.match(r"error: deepspeed.grad_accum_dtype=fp32 needs ZeRO stage 1-3: .* 4 "
                    r"micro-batch gradients in bf16 only",
                    proc.stderr.strip().splitlines()[-1]), proc.stderr[-2000:]
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize("summed", ["fp32", "bf16"])
def test_the_benchmark_says_which_dtype_the_gradients_were_summed_in(summed):
    done = run_launcher("benchmark.py", "train", "--model", "vit_tiny_patch16_224",
                        "--image-size", "32", "--num-classes", "10", "--batch", "4",
                        "--precision", "bf16", "--accum", "2", "--steps", "1", "--warmup", "0",
                        "--set", f"deepspeed.grad_accum_dtype={summed}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"4 x 1, 2 micro-batches per update summed in {summed}\n" in done.stdout, done.stdout

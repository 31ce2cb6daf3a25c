"""The ``--dry-run`` plan: what a run will cost, computed on the meta device in seconds.

Architecture, parameters and training FLOPs per image; the batch layout for a world size; steps
per epoch and in total; memory per GPU: model states for the ZeRO stage (DeepSpeed's estimators)
and the activations of a micro-batch (a measured constant); and the time to finish at an
assumed MFU.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from pretrain.config import PretrainConfig, RunConfig
from pretrain.metrics import format_duration

# bf16 dense peak of the GPU the time estimate assumes when log.peak_tflops is unset: H100 SXM.
DEFAULT_PEAK_TFLOPS = 989.0


def _m(n: float) -> str:
    """A parameter count: millions with a decimal, or exact below 0.1 M (a CIFAR head's
    7,690, a fine-tune's dropped pre-logits' 0), which would read 0.0 M."""
    return f"{n / 1e6:.1f} M" if n >= 1e5 else f"{int(n):,}"


def _steps_per_epoch(samples: int, batch: int) -> str:
    # not rounded: the total is the epochs' samples over the batch, rounded up once
    return f"{samples // batch:,}" if samples % batch == 0 else f"{samples / batch:,.1f}"


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:.1f} GiB"


def model_state_bytes(params: int, largest_layer: int, stage: int, world: int,
                      fp32_sums: bool = False, fp32: bool = False) -> int:
    """Parameters + gradients + Adam states per GPU, without activations. ``fp32_sums``: a
    step's micro-batch gradients summed in fp32 (see grad_accum); ``fp32``: train.precision=fp32,
    whose parameters and gradients take 4 bytes where mixed precision's take 2."""
    # DeepSpeed's estimators per GPU depend on the number of GPUs alone (nodes x GPUs per node)
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        mixed = estimate_zero3_model_states_mem_needs(
            params, largest_layer, num_gpus_per_node=world, num_nodes=1, cpu_offload=False)[1]
        return mixed + fp32 * 4 * params // world  # params and grads sharded
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
        mixed = estimate_zero2_model_states_mem_needs(
            params, num_gpus_per_node=world, num_nodes=1, cpu_offload=False)[1]
        return mixed + fp32 * (2 * params + 2 * params // world)  # params whole, grads sharded
    # DeepSpeed has no estimator for these: 16-bit params and grads (2 + 2 bytes) replicated,
    # fp32 master weights, fp32 grads and Adam's two moments (16 bytes) sharded (ZeRO-1) or not;
    # summing in fp32, ZeRO-1 keeps an fp32 copy of all the gradients besides (4 bytes)
    return (4 + 4 * fp32 + 4 * fp32_sums) * params + 16 * params // (world if stage == 1 else 1)


# What autograd keeps for the backward, in bytes per token and per unit of width, of one block
# (16-bit; flash attention keeps no attention matrix): measured, ViT-H/14's peak on one H100
# grew from 23.9 to 49.4 GiB between micro-batches 48 and 128 (compiled, benchmarks/train.jsonl),
# 0.319 GiB an image over 32 blocks of 257 tokens x 1280. Counted tensor by tensor, a block keeps
# 18 of those bytes for its norms and attention and 4 per unit of MLP width (its fc1 output and
# GELU output): 34 at the ViT's MLP ratio of 4, which the measured 32.5 scales.
ACTIVATION_BYTES = 32.5
# the GPU memory a plan checks its estimate against when --gpu-memory is not given: the H100
# 80GB's, as torch reports it (DEFAULT_PEAK_TFLOPS is that GPU's too)
DEFAULT_GPU_MEMORY_GIB = 79.0


def activation_bytes(spec, micro: int, precision: str, checkpointed: int = 0) -> int:
    """About what one micro-batch's activations take at their peak, the end of the forward: the
    blocks' (the stem's and the head's are small beside them). A recomputed block
    (``train.activation_checkpointing``) keeps its 16-bit input only, and one at a time holds
    all of its own again in the backward."""
    values = spec.seq_len * spec.embed_dim * micro * (2 if precision == "fp32" else 1)
    per_block = ACTIVATION_BYTES * (18 + 4 * spec.mlp_ratio) / 34 * values
    return round(per_block * (spec.depth - checkpointed + (checkpointed > 0))
                 + 2 * values * checkpointed)  # a recomputed block's 16-bit input


# A plan tries a remote data.root this often: a run's own data.read_attempts can take minutes.
PLAN_READ_ATTEMPTS = 3


def read_dataset(cfg: RunConfig):
    """(data.root's :class:`pretrain.data.info.DatasetInfo`, None) when its info file is
    readable here, else (None, why): the demo's is only made by the run, and a cluster's data
    may not be reachable from where the plan is made. A malformed info file raises
    DatasetInfoError, as it stops the run."""
    from pretrain.data.info import INFO_NAMES, InfoNotRead, join, read_info
    from pretrain.data.remote import RetryPolicy
    from pretrain.data.shards import LoaderError
    if not cfg.data.root:
        if not cfg.data.generate_demo:  # as the run's loader says it
            raise LoaderError("data.root is not set; point it at a directory with _info.json")
        return None, "the demo's data is made by the run"
    retry = RetryPolicy(attempts=min(cfg.data.read_attempts, PLAN_READ_ATTEMPTS),
                        backoff_s=cfg.data.retry_backoff_s,
                        timeout_s=min(cfg.data.read_timeout_s, 30.0))
    try:
        return read_info(cfg.data.root, retry), None
    except InfoNotRead as e:
        if cfg.data.generate_demo and not any(os.path.exists(join(cfg.data.root, n))
                                              for n in INFO_NAMES):
            from pretrain.demo import check_demo_root
            check_demo_root(cfg.data.root)  # refused as the run would refuse it
            return None, f"the run makes the demo data in {cfg.data.root}"
        return None, str(e)


def data_line(cfg: RunConfig, info, why: Optional[str], world: int = 1) -> str:
    """What the run will read; raises DatasetInfoError for a split the info file lacks or
    labels beyond model.num_classes, LoaderError for fewer training shards than the ``world``'s
    readers, which would stop the run."""
    if info is None:
        return f"data: not read here ({why})"
    info.check_labels(cfg.data.root, cfg.model.num_classes, cfg.head_per_class)
    from pretrain.data.shards import ShardSet
    for split in [s for s in (cfg.data.train_split, cfg.data.val_split) if s in info.splits]:
        # local shard files: a missing one stops the run at its start (data.missing_shards)
        ShardSet.from_dataset(cfg.data.root, info, split).check_present(cfg.data.missing_shards)
    if cfg.data.train_split in info.splits:
        from pretrain.data.eval_loader import held_out
        from pretrain.data.loader import reader_slots
        train = ShardSet.from_dataset(cfg.data.root, info, cfg.data.train_split)
        reader_slots(train, world, cfg.data.num_workers, cfg.data.resample)
        holdout = getattr(cfg.data, "dev_fraction", 0.0)  # a fine-tune's dev split, of train
        if holdout:
            held_out(train, holdout, cfg.data.train_split, cfg.data.root)
    sizes = _split_sizes(info, cfg.data.train_split, cfg.data.val_split)
    labels = f", {info.num_labels:,} labels" if info.num_labels else ""
    wider = None if cfg.head_per_class else info.wider_head(cfg.data.root, cfg.model.num_classes)
    return f"data: {cfg.data.root}: {sizes} samples{labels}" + (
        f"\nwarning: {wider}" if wider else "")


def describe(cfg: RunConfig, world: int):
    """Architecture, parameters, FLOPs, batch layout and data lines (both stages); with the
    meta model and data.root's info (None when not readable here).

    Raises ConfigError for an impossible architecture or batch layout, DatasetInfoError for
    data the run would refuse.
    """
    from pretrain.engine import checkpointed_blocks
    from pretrain.model import count_parameters, create_model
    from pretrain.trainer import batch_layout

    micro, accum = batch_layout(cfg, world, on_gpu=True)  # a plan is for GPUs
    info, why = read_dataset(cfg)
    data = data_line(cfg, info, why, world)
    model = create_model(cfg.model, device="meta")  # sizes ViT-H without allocating it
    spec, params = model.spec, count_parameters(model)
    checkpointed_blocks(cfg.train, spec.depth)  # what the run would refuse at its start
    flops = spec.train_flops_per_image()
    lines = [
        f"model: {spec.name}: {spec.img_size} px, patch {spec.patch_size}, width "
        f"{spec.embed_dim}, depth {spec.depth}, heads {spec.num_heads}, MLP {spec.mlp_dim}, "
        f"{spec.seq_len} tokens",
        f"params: {_m(params['total'])} (backbone {_m(params['backbone'])}, "
        f"pre-logits {_m(params['pre_logits'])}, head {_m(params['head'])})",
        f"train FLOPs per image: {flops / 1e12:.3f} TFLOP (3 x forward {flops / 3e9:.1f} GFLOP)",
        f"batch: global {cfg.train.global_batch_size} = {world} rank(s) x micro {micro} "
        f"x accumulation {accum}",
        data,
        *fewshot_line(cfg),
    ]
    import torch
    if cfg.train.precision == "fp16" and not torch.cuda.is_available():
        lines.append("precision: fp16 needs GPUs, which this machine lacks: the plan is for "
                     "the job's GPU nodes (a run started here would stop at once)")
    return lines, model, params, (micro, accum), info


def fewshot_line(cfg: RunConfig) -> list[str]:
    """The few-shot probe's data, as :func:`data_line`: what the run would refuse is raised, a
    root not readable from here (a cluster's storage) is said."""
    from pretrain.data.info import InfoNotRead, read_info
    from pretrain.data.remote import RetryPolicy
    from pretrain.stage import check_fewshot_root, in_probe_keys
    e = cfg.eval
    if not e.fewshot_root:
        return []
    try:
        info = read_info(e.fewshot_root, RetryPolicy(attempts=PLAN_READ_ATTEMPTS, timeout_s=30.0))
    except InfoNotRead as err:
        return [f"few-shot probe: not read here ({in_probe_keys(err)})"]
    check_fewshot_root(cfg, info)
    sizes = _split_sizes(info, e.fewshot_train_split, e.fewshot_test_split)
    return [f"few-shot probe: {e.fewshot_root}: {sizes} samples"]


def resume_line(cfg: RunConfig, world: int, stage: Optional[int] = None,
                steps: Optional[int] = None, step_s: Optional[float] = None) -> Optional[str]:
    """What a run in ``output_dir`` starts from, when a run was there: its newest complete
    checkpoint, with the settings that changed since and (pretraining: ``stage`` known) whether
    DeepSpeed converts it first -- not when it is at or past ``steps`` (known: the run's
    length), which trains nothing, and the steps left (their time, at ``step_s`` seconds a
    step); refused in one line where the run would refuse it."""
    from pretrain.checkpoint import CheckpointStore
    from pretrain.finished_run import FINISHED, nothing_to_do, read_finished
    from pretrain.run_dir import check_same_run

    out = Path(cfg.output_dir)
    latest = CheckpointStore(out / "checkpoints").complete(warn=False) \
        if (out / "checkpoints").is_dir() else []
    if not latest:
        return None
    ckpt = latest[0]
    if not cfg.checkpoint.resume:
        return f"resume: no (checkpoint.resume=false): the run in {out} is moved aside first"
    changed = check_same_run(out, cfg, ckpt)
    line = f"resume: from {ckpt.path} at step {ckpt.step:,}"
    left = None if steps is None else steps - ckpt.step
    finished = read_finished(out)
    if steps is not None and nothing_to_do(finished, cfg, ckpt.step, steps):
        return (f"resume: nothing to do, the run in {out} finished at step {ckpt.step:,} on "
                f"{finished.get('finished', '?')} (delete {out / FINISHED} to do its end "
                f"again)")
    if left is not None and left <= 0:
        line += f": the run has trained its {steps:,} steps, nothing to train"
    elif left is not None:
        line += f" ({left:,} steps left" + (
            f", {format_duration(left * step_s)} at the MFU above" if step_s else "") + ")"
    if stage is not None and (left is None or left > 0):
        from pretrain.checkpoint_layout import conversion
        why = conversion(ckpt, world, stage, cfg.train.precision, cfg.optimizer.name)
        line += f", converted to DeepSpeed's universal checkpoint first ({why})" if why else ""
    return line + (f"; settings changed since: {'; '.join(changed)}" if changed else "")


def _split_sizes(info, *splits: Optional[str]) -> str:
    return ", ".join(f"{info.split(s).num_samples:,} '{s}'" for s in splits if s)


def plan(cfg: PretrainConfig, world: int, mfu: float = 0.45,
         samples_per_epoch: Optional[int] = None,
         gpu_memory_gib: float = DEFAULT_GPU_MEMORY_GIB) -> str:
    """The pretraining report; raises ConfigError for an impossible architecture or batch, and
    ValueError for a world, node size, MFU or epoch size no run can have (the launchers' own
    checks of --world-size, --gpus-per-node, --mfu and --samples reject them first)."""
    from pretrain.deepspeed_json import deepspeed_config, zero_stage
    from pretrain.grad_accum import HALF, summed_in

    if world < 1 or not 0 < mfu <= 1 or (
            samples_per_epoch is not None and samples_per_epoch < 1) or not gpu_memory_gib > 0:
        raise ValueError(f"plan needs world >= 1, 0 < mfu <= 1, samples_per_epoch >= 1 and "
                         f"gpu_memory_gib > 0; got {world}, {mfu}, {samples_per_epoch}, "
                         f"{gpu_memory_gib}")
    from pretrain.engine import checkpointed_blocks

    lines, model, params, (micro, accum), info = describe(cfg, world)
    flops = model.spec.train_flops_per_image()
    ds = deepspeed_config(cfg, micro, accum, world)
    stage = zero_stage(ds)
    fp32_sums = accum > 1 and summed_in(ds, cfg.train.precision) == "fp32" \
        and cfg.train.precision in HALF
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    mem = model_state_bytes(params["total"], largest, stage, world, fp32_sums,
                            fp32=cfg.train.precision == "fp32")
    spec = model.spec
    recomputed = (checkpointed_blocks(cfg.train, spec.depth)
                  if cfg.train.activation_checkpointing else 0)
    act = activation_bytes(spec, micro, cfg.train.precision, recomputed)
    ckpt = f", {recomputed} of {spec.depth} blocks recomputed" if recomputed else ""
    sums = ", the fp32 gradient sums" if fp32_sums and stage <= 1 else ""
    # the two do not peak together (the gradients come as the activations go): measured peaks
    # were 3 to 17 % below the sum (tests/test_cli.py holds it against benchmarks/train.jsonl)
    lines.append(f"memory per GPU, ZeRO-{stage}: {_gib(mem)} of model states (params, "
                 f"grads{sums}, optimizer) + about {_gib(act)} of activations (micro-batch "
                 f"{micro}{ckpt}) = {_gib(mem + act)} of the GPU's {gpu_memory_gib:g} GiB "
                 f"(--gpu-memory)")
    room = gpu_memory_gib * 2 ** 30
    if mem + act > room:
        fits = int((room - mem) // activation_bytes(spec, 1, cfg.train.precision, recomputed))
        lines.append(
            "warning: more than the GPU's memory: " + (
                f"at most {fits} image(s) a micro-batch fit; set train.micro_batch_size (the "
                f"steps accumulate to the same global batch) or train.activation_checkpointing"
                f"=true" if fits >= 1 else
                "the model states alone do not fit; a higher ZeRO stage "
                "(deepspeed.zero_stage) or more GPUs share them"))
    samples = samples_per_epoch or (info.split(cfg.data.train_split).num_samples
                                    if info else None)
    given = ", --samples" if samples_per_epoch else ""  # which may differ from data.root's
    if cfg.train.total_steps:
        steps = cfg.train.total_steps
        per_epoch = (f"{_steps_per_epoch(samples, cfg.train.global_batch_size)} ({samples:,} "
                     f"samples{given})") if samples else "unknown"
        lines.append(f"steps: {steps:,} (steps per epoch: {per_epoch})")
    elif samples:
        steps = int(-(-cfg.train.epochs * samples // cfg.train.global_batch_size))
        lines.append(f"steps: {steps:,} = {cfg.train.epochs:g} epochs x "
                     f"{_steps_per_epoch(samples, cfg.train.global_batch_size)} steps per epoch "
                     f"({samples:,} samples{given})")
    else:
        steps = None
        lines.append("steps: unknown (data.root's info file is not read here; give the "
                     "epoch size with --samples N)")
    seconds = None
    if steps:
        peak = cfg.log.peak_tflops or DEFAULT_PEAK_TFLOPS
        seconds = steps * cfg.train.global_batch_size * flops / (world * peak * 1e12 * mfu)
        # 3 significant digits: a small MFU given on purpose must not read as 0 %
        lines.append(f"time to finish at {100 * mfu:.3g}% MFU of {peak:g} TFLOP/s per GPU: "
                     f"{format_duration(seconds)} on {world} GPU(s)")
    resume = resume_line(cfg, world, stage, steps, seconds / steps if seconds else None)
    if resume:
        lines.append(resume)
    return "\n".join(lines)

"""Steady-state training throughput through the real DeepSpeed engine.

One step here is the trainer's step: ``prepare_batch`` (uint8 on the device -> normalised input
of the run's dtype), :func:`pretrain.engine.train_micro_batch` (forward, loss, the non-finite
check, backward, step -- the very function the trainer calls) and the scheduler update, on the
engine that
``deepspeed.initialize`` builds from :func:`pretrain.deepspeed_json.deepspeed_config`,
:func:`pretrain.engine.build_model` and :func:`pretrain.engine.build_optimizer`.

Input is either synthetic -- a few random uint8 batches made on the device once, so there is no
loader to wait for (the data wait left is the host's time between two steps) and the figure is
the model step alone -- or the real
:class:`pretrain.data.loader.TrainLoader` over shards (``shards=``), when the data-wait share
says whether the loader keeps up.

Figures (:func:`measure`): global images/s, achieved TFLOP/s per device
(images/s x :meth:`ViTSpec.train_flops_per_image` / world), MFU against
:func:`pretrain.throughput.peak_tflops` (None on the CPU: CPU figures are relative only), the
data-wait share, the median step time and each timed step's, and the peak memory of rank 0
(GPU: max allocated; CPU: peak resident set of the process). The timed window starts with the
device idle and ends when it has finished the last step, so its rate is the device's.

Several ranks (:func:`run`, ``ranks > 1``) are spawned with ``torch.multiprocessing`` on one
machine -- each a DeepSpeed rank (NCCL on GPUs, gloo on the CPU) set up exactly as the DeepSpeed
launcher would set it up -- and rank 0's figures are returned.
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from pretrain.config import PretrainConfig
from pretrain.config_files import load_config
from pretrain.distributed import free_port, init_distributed
from pretrain.engine import input_dtype
from pretrain.guard import NonFiniteGuard
from pretrain.interpreter import heap_frozen
from pretrain.throughput import peak_memory_gib

RECIPES = Path(__file__).resolve().parent.parent / "configs" / "pretrain"
DEFAULT_RECIPE = RECIPES / "vit_l16_i21k.yaml"


# the keys the benchmark sets from its own options (a --set of one would fight them)
BENCH_OWNED = {"train.micro_batch_size": "--batch", "train.global_batch_size": "--batch, --accum "
               "and --ranks", "train.grad_accum_steps": "--accum", "train.total_steps": "--steps "
               "and --warmup", "train.epochs": "--steps and --warmup"}


def bench_config(model: Optional[str], batch: int, *, image_size: Optional[int] = None,
                 zero: Optional[int] = None, precision: Optional[str] = None, ranks: int = 1,
                 activation_checkpointing: Optional[bool] = None,
                 num_classes: Optional[int] = None, recipe: Optional[os.PathLike | str] = None,
                 compile: bool = False, accum: int = 1,
                 overrides: Sequence[str] = ()) -> PretrainConfig:
    """The run config to measure: a pretraining recipe (default: the ViT-L/16 i21k one, so
    head, loss, drop-path and optimizer are those of the real run) with the model, per-rank
    micro-batch and the other given settings put in (``compile``: train.compile on, whatever
    the recipe says; ``accum``: micro-batches per update). ``overrides`` are the usual
    ``key=value``. ``model`` None: the recipe's (ViT-L/16 without one)."""
    from pretrain.config import ConfigError

    for override in overrides:  # the config's own fix ("set it to null in the file") is no fix
        key = override.partition("=")[0].strip()
        if key in BENCH_OWNED:
            raise ConfigError(f"--set {key} is the benchmark's to set: give {BENCH_OWNED[key]}")
    try:
        sets = _settings(model, batch, image_size, zero, precision, ranks,
                         activation_checkpointing, num_classes, recipe, compile, accum)
        return load_config(PretrainConfig, recipe or DEFAULT_RECIPE, [*sets, *overrides])
    except ConfigError as e:  # an option's value: named as the command line has it
        text = str(e)
        given = {"--model": model or (None if recipe else "its default"),
                 "--image-size": image_size, "--batch": batch,
                 "--zero": zero, "--precision": precision, "--num-classes": num_classes}
        set_too = {o.partition("=")[0].strip() for o in overrides}
        for key, option in OPTION_KEYS.items():
            if given[option] is not None and key not in set_too:
                text = text.replace(f"config key '{key}'", option)
        raise ConfigError(text) from None


# the config keys the options set, for the errors about their values
OPTION_KEYS = {"model.name": "--model", "model.img_size": "--image-size",
               "train.micro_batch_size": "--batch", "deepspeed.zero_stage": "--zero",
               "train.precision": "--precision", "model.num_classes": "--num-classes"}


def _settings(model, batch, image_size, zero, precision, ranks, activation_checkpointing,
              num_classes, recipe, compile, accum) -> list:
    """bench_config's options as key=value overrides of the recipe."""
    from pretrain.model import _timm_arch
    sets = [f"train.micro_batch_size={batch}",
            f"train.global_batch_size={batch * ranks * accum}", f"train.grad_accum_steps={accum}",
            "train.total_steps=1000000", "data.val_split=null"]
    if recipe is None:
        model = model or "vit_large_patch16_224"
        # The recipe's pre-logits width is ViT-L's; the paper makes it the model's width.
        sets.append(f"model.representation_size={_timm_arch(model)[2]}")
        # ...and its resolution is 224: the named model's own unless --image-size says.
        sets.append(f"model.img_size={_timm_arch(model)[0]}")
    if model is not None:  # (a recipe's own depth, width, patch ... win over the name's)
        sets.insert(0, f"model.name={model}")
    if image_size is not None:
        sets.append(f"model.img_size={image_size}")
    if zero is not None:
        sets.append(f"deepspeed.zero_stage={zero}")
    if precision is not None:
        sets.append(f"train.precision={precision}")
    if activation_checkpointing is not None:
        sets.append(f"train.activation_checkpointing={str(activation_checkpointing).lower()}")
    if num_classes is not None:
        sets.append(f"model.num_classes={num_classes}")
    if compile:
        sets.append("train.compile=true")
    return sets


def build_engine(cfg: PretrainConfig, world: int = 1):
    """``deepspeed.initialize`` on our model, optimizer and DeepSpeed config, as the trainer
    does; returns (engine, optimizer, ds_config)."""
    from pretrain import engine as eng
    from pretrain.deepspeed_json import deepspeed_config
    from pretrain.trainer import batch_layout

    # the trainer's checks too (fp16 needs a GPU, mixup an even micro-batch): one line, not a
    # DeepSpeed traceback
    micro, accum = batch_layout(cfg, world, on_gpu=torch.cuda.is_available())
    ds_config = deepspeed_config(cfg, micro, accum, world)
    model = eng.build_model(cfg, ds_config)
    optimizer = eng.build_optimizer(model, cfg)
    return eng.initialize(cfg, model, optimizer, ds_config), optimizer, ds_config


def synthetic_batches(batch: int, img_size: int, num_classes: int, device, count: int = 2,
                      seed: int = 0) -> list:
    """``count`` random uint8 batches already on ``device`` (loader output, minus the loader)."""
    from pretrain.data.device_batch import Batch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        images = torch.randint(0, 256, (batch, 3, img_size, img_size), dtype=torch.uint8,
                               generator=g)
        labels = torch.randint(0, max(num_classes, 1), (batch,), generator=g)
        out.append(Batch(images.to(device), labels.to(device), [""] * batch,
                         torch.zeros(batch, dtype=torch.int64, device=device)))
    return out


def measure(cfg: PretrainConfig, *, steps: int = 10, warmup: int = 3,
            shards: Optional[str] = None, workers: Optional[int] = None, rank: int = 0,
            world: int = 1, profile: Optional[str] = None, profile_steps: int = 3) -> dict:
    """Train ``warmup + steps`` steps on this rank (distributed already set up), as the trainer
    does for ``cfg`` (train.compile, data.mixup_alpha...); the figures of the last ``steps``.
    A step is one update: ``train.grad_accum_steps`` micro-batches, as in the trainer.
    With ``profile`` (a folder), ``profile_steps`` more steps run under torch.profiler
    afterwards (:mod:`pretrain.profile`), so the profiler's own cost stays out of the figures.
    Collective: every rank of the world must call it."""
    from pretrain import engine as eng
    from pretrain.block_kernels import kernels_run_on
    from pretrain.deepspeed_json import zero_stage
    from pretrain.grad_accum import summed_in
    from pretrain.model import changed_from_stock
    from pretrain import grad_checks
    from pretrain.profile import profiled
    from pretrain.data.device_batch import build_mixup, prepare_batch
    from pretrain.data.loader import build_train_loader
    from pretrain.throughput import StepTimer, peak_tflops

    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got {steps} and {warmup}")
    torch.manual_seed(cfg.seed)
    engine, optimizer, ds_config = build_engine(cfg, world)
    if cfg.train.compile:
        # torch.compile of the module, the way DeepSpeed supports it
        engine.compile(compile_kwargs=eng.compile_options(cfg))
    device = engine.device
    dtype = input_dtype(cfg.train.precision)
    spec = engine.module.spec
    micro, accum = cfg.train.micro_batch_size, ds_config["gradient_accumulation_steps"]
    scheduler = eng.build_scheduler(optimizer, cfg, cfg.train.total_steps)
    mixup = build_mixup(cfg.data, spec.num_classes)  # on the device, timed with the step

    # the heap as the launched trainer's from the loader's start on: frozen, collector on
    with heap_frozen():
        if shards:
            data = cfg.data.model_copy(update={"root": shards, "generate_demo": False,
                                               **({"num_workers": workers} if workers is not None
                                                  else {})})
            loader = build_train_loader(data, img_size=spec.img_size, batch_size=micro,
                                        rank=rank, world_size=world, seed=cfg.seed,
                                        num_classes=spec.num_classes,
                                        pin_memory=device.type == "cuda")
            batches = iter(loader)
            next_batch = lambda: next(batches)  # noqa: E731
        else:
            pool = synthetic_batches(micro, spec.img_size, spec.num_classes, device)
            counter = iter(range(10 ** 12))
            next_batch = lambda: pool[next(counter) % len(pool)]  # noqa: E731

        peak = peak_tflops(cfg.log.peak_tflops)
        timer = StepTimer(spec.train_flops_per_image(), world_size=world, peak_tflops=peak,
                          cuda_sync=device.type == "cuda")
        step_times = []
        # the trainer's check, timed too
        guard = NonFiniteGuard(cfg.train.nonfinite_limit, "stop", 0)
        defer = eng.defers_check(cfg, engine.optimizer)

        def one_step(step: int):
            start = time.perf_counter()
            scheduler.step_update(step)
            for done in range(accum):  # DeepSpeed updates after the last
                timer.fetching()
                images, targets = prepare_batch(next_batch(), device, cfg.data.normalize, mixup,
                                                dtype)
                timer.data_ready()
                loss = eng.train_micro_batch(engine, images, targets, cfg, guard, defer)
            guard.settle()  # a deferred check is read after the update, as the trainer reads it
            if step == warmup + steps - 1 and device.type == "cuda":
                torch.cuda.synchronize(device)  # the window ends where the device does
            timer.step_done(images=micro * accum * world)
            step_times.append(time.perf_counter() - start)
            return loss

        for step in range(warmup + steps):
            if step == warmup:
                if device.type == "cuda":  # the window starts with the device idle
                    torch.cuda.synchronize(device)
                timer.summary()  # drop the warmup window (compilation, allocator growth, JIT ops)
                timer.exclude_elapsed()
            loss = one_step(step)
        perf = timer.summary()
        updates = engine.global_steps  # DeepSpeed's count of optimizer updates made
        profiled_ms = None
        with profiled(profile, rank, device) as breakdown:
            if profile:
                for step in range(warmup + steps, warmup + steps + profile_steps):
                    loss = one_step(step)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                profiled_ms = 1e3 * statistics.median(step_times[-profile_steps:])
    step_times = step_times[:warmup + steps]
    loss_value = float(loss.float().item()) if loss is not None else float("nan")
    result = {
        "model": spec.name, "image_size": spec.img_size, "batch_per_rank": micro,
        "arch_changes": changed_from_stock(spec),  # e.g. --set model.depth=2
        "grad_accum_steps": accum, "updates": updates, "ranks": world,
        # the dtype DeepSpeed summed the micro-batches' gradients in (pretrain/grad_accum.py)
        "grad_sum_dtype": summed_in(ds_config, cfg.train.precision) if accum > 1 else None,
        "zero_stage": zero_stage(ds_config),
        "precision": cfg.train.precision, "compile": engine.is_compiled,  # what DeepSpeed did, not what was asked
        "compile_mode": cfg.train.compile_mode if engine.is_compiled else None,
        "nonfinite_check": "after_update" if defer else "before_backward",
        "one_pass_grad_checks": grad_checks.installed(engine.optimizer),
        "activation_checkpointing": cfg.train.activation_checkpointing,
        "checkpointed_blocks": cfg.train.checkpointed_blocks,  # None: all of them
        # what ran: None where Triton cannot run them (a CPU), the config's choice elsewhere
        "block_kernels": cfg.train.block_kernels if kernels_run_on(device) else None,
        "mixup": mixup is not None,  # data.mixup_alpha / cutmix_alpha, applied on the device
        "device": device_name(device), "steps": steps, "warmup_steps": warmup,
        "images_per_sec": perf["perf/images_per_sec"],
        "tflops_per_device": perf["perf/tflops"],
        "train_flops_per_image": spec.train_flops_per_image(),
        "peak_tflops": peak,
        "mfu": perf.get("perf/mfu"),  # None on the CPU: no peak to compare with
        "data_wait_frac": perf["perf/data_wait_frac"],
        "data": "loader" if shards else "synthetic",
        "loader_workers": data.num_workers if shards else None,
        "step_time_ms_median": 1e3 * statistics.median(step_times[warmup:]),
        # each timed step (an update), host clock: a short run's odd step shows here
        "step_times_ms": [round(1e3 * t, 2) for t in step_times[warmup:]],
        "peak_memory_gib": peak_memory_gib(device),
        "final_loss": loss_value,
    }
    if breakdown:
        result.update(profile_dir=str(profile), profile_steps=profile_steps,
                      profile_step_ms=profiled_ms, profile=breakdown[0])
    return result


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform
    threads = torch.get_num_threads()
    return (f"CPU ({platform.processor() or platform.machine()}, {threads} "
            f"thread{'s' if threads != 1 else ''})")


def _rank_main(rank: int, world: int, port: int, kwargs: dict, queue) -> None:
    """One spawned rank: the environment the DeepSpeed launcher would give it, then measure."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if not torch.cuda.is_available():
        # CPU ranks share the cores: one OpenMP pool per rank sized for the whole machine
        # would oversubscribe them many times over (the DeepSpeed launcher splits them too).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        result = _measure_here(**kwargs)
        if rank == 0:
            queue.put(("ok", result))
    except BaseException as e:  # noqa: BLE001 -- reported to the parent, which raises
        queue.put(("error", f"rank {rank}: {type(e).__name__}: {e}"))
        raise
    # as the trainer's ranks end: torch 2.14's gloo can abort the interpreter's teardown after
    # destroy_process_group (exit -6), which would read as a failed rank
    from pretrain.interpreter import exit_without_teardown
    exit_without_teardown(0)


def _measure_here(cfg_json: str, **kwargs) -> dict:
    import torch.distributed as dist

    cfg = PretrainConfig.model_validate_json(cfg_json)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rank, world = init_distributed()  # a world of one unless a launcher set one up
    try:
        return measure(cfg, rank=rank, world=world, **kwargs)
    finally:
        dist.destroy_process_group()


def as_json(cfg: PretrainConfig) -> str:
    # only what the recipe and overrides set: the keys a rank sees as set are the trainer's
    # (otherwise every optimizer key reads as set, and the one the optimizer does not use is
    # warned about in every benchmark)
    return cfg.model_dump_json(exclude_unset=True)


def run(cfg: PretrainConfig, *, ranks: int = 1, **kwargs) -> dict:
    """:func:`measure` in a world of ``ranks`` processes; rank 0's figures.

    ``ranks == 1`` runs in this process (a world of one, as ``python launch/pretrain.py``);
    more are spawned, one per GPU on a GPU machine, gloo ranks on the CPU.
    """
    if ranks == 1:
        return _measure_here(as_json(cfg), **kwargs)
    if torch.cuda.is_available() and torch.cuda.device_count() < ranks:
        raise ValueError(f"--ranks {ranks} but only {torch.cuda.device_count()} GPU(s)")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    payload = dict(cfg_json=as_json(cfg), **kwargs)
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, ranks, port, payload, queue))
             for r in range(ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    messages = []
    while not queue.empty():
        messages.append(queue.get())
    errors = [m for kind, m in messages if kind == "error"]
    results = [m for kind, m in messages if kind == "ok"]
    if errors or not results or any(p.exitcode for p in procs):
        raise RuntimeError("benchmark ranks failed: " + ("; ".join(errors) or
                           f"exit codes {[p.exitcode for p in procs]}"))
    return results[0]

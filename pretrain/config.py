"""Typed, validated run configuration: the sections every stage's config is built from.

Every stage has one config object (``PretrainConfig`` here, ``FinetuneConfig`` in ``finetune``)
built from the sections below; :mod:`pretrain.config_files` builds it from a YAML recipe plus
dotted ``key=value`` overrides. Validation is strict: an unknown key, a wrong type or an
impossible combination raises :class:`ConfigError` with one line that names the key (and, for a
misspelled key, the closest valid one) before any work starts.
"""
from __future__ import annotations

import re
import typing
from typing import ClassVar, Literal, Optional, Tuple

from pydantic import (BaseModel, ConfigDict, Field, PositiveInt, ValidationInfo,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError


# What MLflow takes in a metric name besides '/' (mlflow.utils.validation's rule; importing it
# costs 1.8 s, too much for reading a config)
METRIC_NAME_CHARS = r"\w\-. :"

class ConfigError(ValueError):
    """A configuration problem, phrased as one line that names the offending key."""


def _types_in(annotation) -> set:
    """The plain types an annotation admits, through Optional, Union, Tuple, list, Annotated;
    a Literal's values' types (``Literal[True]`` admits bool)."""
    if typing.get_origin(annotation) is Literal:
        return {type(v) for v in typing.get_args(annotation)}
    args = typing.get_args(annotation)
    if not args:
        return {annotation}
    return set().union(*(_types_in(a) for a in args))


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are re-validated,
    no number is infinite or NaN (YAML's .inf and .nan pass any bound pydantic checks), no
    number is a boolean (pydantic would read YAML's true, yes or on as 1), and no string is
    empty."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(),
                              validate_default=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value, info: ValidationInfo):
        if isinstance(value, str) and not value.strip():
            # 'init: ""' in a templated recipe fine-tuned from scratch, 'data.val_split: ""'
            # evaluated nothing: an empty string is no setting of any key, and never null
            none = type(None) in _types_in(cls.model_fields[info.field_name].annotation)
            raise PydanticCustomError("empty_string", "an empty string is no value; give one" + (
                ", or null for none" if none else ""))
        # checkpointed_blocks=true recomputed one block, not all; depth=yes built one
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, bool) for v in values):
            types = _types_in(cls.model_fields[info.field_name].annotation)
            if bool not in types and types & {int, float}:
                raise PydanticCustomError(
                    "bool_for_number", "takes a number, not a true/false (YAML reads true, "
                    "false, yes, no, on and off as booleans)")
        return value


# --------------------------------------------------------------------------------------------
# Sections shared by both stages
# --------------------------------------------------------------------------------------------
class ModelConfig(Section):
    """A timm VisionTransformer plus the optional pre-logits layer and the classifier head.

    Architecture fields left at ``None`` come from the timm model ``name``; setting one
    overrides it (e.g. a smaller ``img_size`` for the CPU demo).
    """

    name: str = Field("vit_large_patch16_224", description="timm ViT architecture; the fields "
                      "below left unset come from it")
    img_size: Optional[int] = Field(None, gt=0, description="input resolution in px")
    patch_size: Optional[int] = Field(None, gt=0, description="patch side in px")
    embed_dim: Optional[int] = Field(None, gt=0, description="token width")
    depth: Optional[int] = Field(None, gt=0, description="number of transformer blocks")
    num_heads: Optional[int] = Field(None, gt=0, description="attention heads per block")
    mlp_ratio: Optional[float] = Field(None, gt=0, description="MLP width / token width")
    drop_path_rate: float = Field(0.1, ge=0.0, lt=1.0,
                                  description="stochastic depth, linear over depth up to this")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the embedded tokens, "
                           "in the MLP (hidden and out) and after the attention projection")
    attn_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on attention weights")
    # ViT paper: the i21k models carry a Linear(D, D) + tanh "pre-logits" layer before the head.
    representation_size: Optional[int] = Field(
        None, gt=0, description="width of the Linear+tanh pre-logits layer (unset: none)")
    num_classes: int = Field(21843, ge=0, description="classifier outputs (ImageNet-21k: 21843)")
    # -10 makes the initial sigmoid outputs ~0 for 21k classes (paper, sigmoid loss).
    head_bias_init: float = Field(0.0, description="initial head bias (-10 with the sigmoid loss)")
    # big_vision zero-initialises the classifier kernel; timm uses trunc-normal(0.02).
    head_zero_init: bool = Field(True, description="zero classifier kernel (big_vision); false: "
                                 "timm's trunc-normal(0.02)")


class OptimizerConfig(Section):
    # the settings only one of the optimizers reads
    only_for: ClassVar = {"adamw": ("betas", "eps"), "sgd": ("momentum",)}

    name: Literal["adamw", "sgd"] = Field("adamw", description="adamw, or sgd with momentum")
    lr: float = Field(1e-3, gt=0, description="peak learning rate, reached after warmup")
    # adamw: decoupled (multiplied by lr); sgd: torch's L2 term, added to the gradient before
    # momentum (about 1 / (1 - momentum) times stronger for the same number). Never applied to
    # biases, norms, pos-embed, cls.
    weight_decay: float = Field(0.1, ge=0, description="weight decay (adamw: decoupled; sgd: "
                                "L2 added to the gradient; not on biases, norms, position "
                                "embedding, class token)")
    betas: Tuple[float, float] = Field((0.9, 0.999), description="AdamW's moment decays")
    eps: float = Field(1e-8, gt=0, description="AdamW's denominator epsilon")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD's momentum")
    grad_clip: Optional[float] = Field(1.0, gt=0, description="clip the global gradient norm to "
                                       "this (null: no clipping)")

    @model_validator(mode="after")
    def _check_betas(self) -> "OptimizerConfig":
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optimizer.betas must lie in [0, 1), got {list(self.betas)}")
        return self

    def unused(self) -> list[str]:
        """The keys of the other optimizer: this one never reads them."""
        return [k for name, keys in self.only_for.items() if name != self.name for k in keys]


class ScheduleConfig(Section):
    warmup_steps: int = Field(10_000, ge=0, description="linear warmup from 0 to optimizer.lr")
    # the schedule ends at step train.total_steps, after the last update (as big_vision's):
    # the last step trains one step's decay short of min_lr
    decay: Literal["linear", "cosine"] = Field("linear", description="decay after the warmup, "
                                               "to schedule.min_lr where the run ends")
    min_lr: float = Field(1e-5, ge=0, description="learning rate the decay ends at, after the "
                          "last step")


# timm's RandAugment string: "rand", then sections its parser knows (t<name>: a transform set;
# timm takes any other name for its default set, and p for a probability of up to 1)
RANDAUGMENT_RE = re.compile(r"rand(-(m\d+|n\d+|mstd\d+(\.\d+)?|mmax\d+|inc[01]"
                            r"|p(0(\.\d*)?|1(\.0*)?|\.\d+)|t(weights|3aw|3a)))*")


class DataConfig(Section):
    """Where the WebDataset shards are and how they are read and augmented."""

    # A directory or URL prefix holding ``_info.json``/``info.json`` and the shards.
    root: Optional[str] = Field(None, description="shard directory or URL prefix with _info.json")
    train_split: str = Field("train", description="split trained on")
    val_split: Optional[str] = Field("validation", description="held-out split evaluated "
                                     "(null: none)")
    num_workers: int = Field(8, ge=0, description="decoding processes per rank")
    shuffle_buffer: int = Field(5000, ge=1, description="samples mixed across shards per worker")
    # Sample shards with replacement, forever: for fewer shards than world x workers.
    resample: bool = Field(False, description="sample shards with replacement (no epochs)")
    # "minus_one_one": pixels scaled to [-1, 1] as in the ViT paper; "imagenet": mean/std.
    normalize: Literal["minus_one_one", "imagenet"] = Field(
        "minus_one_one", description="pixel scaling: [-1, 1] (ViT paper) or ImageNet mean/std")
    # Inception crop area range (big_vision uses 5%..100%).
    crop_scale: Tuple[float, float] = Field((0.05, 1.0), description="Inception crop: min and "
                                            "max share of the image area")
    hflip: float = Field(0.5, ge=0, le=1, description="probability of a horizontal flip")
    # Magnitudes above 10 are applied as given, as in the TF RandAugment of the ViT and AugReg
    # papers (their "medium" m15 and "strong" m20 differ); timm alone would cap them at 10
    # unless the string sets -mmax.
    randaugment: Optional[str] = Field(None, description="timm RandAugment string, e.g. "
                                       "rand-m15-n2 (magnitude 15, 2 ops per image; above 10 "
                                       "not capped)")
    mixup_alpha: float = Field(0.0, ge=0, description="mixup Beta(alpha, alpha) (0: off)")
    cutmix_alpha: float = Field(0.0, ge=0, description="cutmix Beta(alpha, alpha) (0: off)")
    label_smoothing: float = Field(0.0, ge=0, lt=1, description="label smoothing of the targets")
    # The built-in demo: procedural images of model.num_classes classes, written in the raw
    # ImageNet-21k layout and prepared like real data, at data.root when it has no _info.json.
    generate_demo: bool = Field(False, description="create the procedural demo dataset at "
                                "data.root if missing (a recipe's true is for its own data.root: "
                                "a data.root override alone sets it false)")
    # Shards listed in _info.json but absent (local paths are checked at start), refused
    # (no read permission), or remote ones that stay unreachable after read_attempts.
    missing_shards: Literal["error", "skip"] = Field(
        "error", description="a shard that is missing, refused or stays unreachable -- error: stop "
        "(local files: refuse to start); skip: warn, count its samples as skipped")
    # Remote shards (s3://, gs://, http(s)://, pipe:): a failed read is retried after a
    # back-off and resumes at the byte it reached, so the stream stays exact.
    read_attempts: int = Field(10, ge=1, description="failed reads in a row before a shard "
                               "counts as unreachable (each retry resumes at the byte reached)")
    retry_backoff_s: float = Field(1.0, ge=0, description="first wait before a retry; doubles "
                                   "each time, at most 60 s")
    read_timeout_s: float = Field(120.0, gt=0, description="a connection or read silent this "
                                  "long has failed (http(s)://, s3://, gs://, pipe:; other "
                                  "fsspec schemes: their driver's timeouts)")

    @field_validator("randaugment")
    @classmethod
    def _check_randaugment(cls, spec: Optional[str]) -> Optional[str]:
        # timm asserts on a wrong prefix or key and silently ignores a section without a number
        # ("rand-mX" keeps its default magnitude): the whole string is checked here instead
        if spec is not None and not RANDAUGMENT_RE.fullmatch(spec):
            raise ValueError(f"data.randaugment={spec!r} is not a timm RandAugment string: "
                             f"'rand' then any of -m<magnitude> -n<ops> -mstd<std> -mmax<max> "
                             f"-inc<0|1> -p<probability 0..1> -t<weights|3aw|3a>, e.g. "
                             f"'rand-m15-n2'")
        return spec

    @model_validator(mode="after")
    def _check_crop(self) -> "DataConfig":
        lo, hi = self.crop_scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"data.crop_scale must satisfy 0 < min <= max <= 1, got {[lo, hi]}")
        return self


class TrainConfig(Section):
    global_batch_size: int = Field(4096, gt=0, description="images per optimizer step, all "
                                   "ranks together")
    # Per-rank batch of one forward/backward; derived from the global batch when unset.
    micro_batch_size: Optional[int] = Field(None, gt=0, description="per-rank batch per pass")
    grad_accum_steps: Optional[int] = Field(None, gt=0, description="micro-batches per step "
                                            "(derived when unset)")
    # The run's length: exactly one of the two (epochs are turned into steps from _info.json).
    total_steps: Optional[int] = Field(None, gt=0, description="run length in optimizer steps")
    epochs: Optional[float] = Field(None, gt=0, description="run length in epochs (or total_steps)")
    precision: Literal["bf16", "fp16", "fp32"] = Field("bf16", description="training precision "
                                                      "(fp16: GPUs only)")
    loss: Literal["softmax", "sigmoid"] = Field("softmax", description="softmax cross-entropy, "
                                                "or per-class sigmoid (the paper's i21k loss)")
    activation_checkpointing: bool = Field(False, description="recompute the transformer "
                                           "blocks' activations in the backward pass")
    # Selective checkpointing: only this many of the blocks (spread evenly over the depth)
    # recompute, the rest keep their activations -- less recompute where memory allows some.
    checkpointed_blocks: Optional[int] = Field(
        None, gt=0, description="with train.activation_checkpointing: how many blocks recompute "
        "their activations (default all)")
    # torch.compile through DeepSpeed (engine.compile()): +13 % img/s for ViT-L/16 on an H100
    # (launch/benchmark.py train --compile); the first steps pay the compilation.
    compile: bool = Field(False, description="torch.compile the model (pays off on GPUs; the "
                          "first steps compile)")
    # Inductor's mode. max-autotune-no-cudagraphs also times Triton matmul templates against
    # cuBLAS for each matmul shape, and where a template wins it can take the bias and GELU
    # after it into the same kernel (GELU is ~10 % of a ViT-L/16 step on an H100). Compiling
    # takes minutes longer (ViT-L/16 on an H100 had not finished after 240 s), and each restart
    # of a job on a node whose Inductor cache is gone pays it again. The modes with CUDA graphs
    # are not offered: DeepSpeed's gradient hooks run Python during the backward pass.
    compile_mode: Literal["default", "max-autotune-no-cudagraphs"] = Field(
        "default", description="with train.compile: Inductor's mode; max-autotune-no-cudagraphs "
        "autotunes the matmuls (GPU; compiles for minutes, over 4 for ViT-L/16 on an H100)")
    # pretrain/block_kernels.py: the qkv and fc1 bias gradients summed by the Triton kernels
    # that write the gradients, instead of in passes of their own over them (on an H100: ViT-L/16
    # 215.5 -> 212.7 ms a step; ViT-H/14 ~10 ms by the kernels' timings). The forward is
    # unchanged; off is timm's own backward.
    block_kernels: bool = Field(True, description="train the blocks' qkv and fc1 backward with "
                                "our Triton kernels where Triton runs (GPUs); false: timm's")
    # A micro-batch with a non-finite loss is dropped on every rank and counted (pretrain/guard.py);
    # this many in a row mean the weights have gone bad: roll back to the newest checkpoint
    # (going on with the data after the bad stretch) or stop.
    nonfinite_limit: int = Field(5, gt=0, description="non-finite losses in a row before "
                                 "train.on_nonfinite acts")
    on_nonfinite: Literal["rollback", "stop"] = Field(
        "rollback", description="rollback: reload the newest checkpoint; stop: end the run")
    max_rollbacks: int = Field(3, ge=0, description="rollbacks per job before stopping instead")
    # When the check is read: after the update costs the GPU no idle wait per micro-batch, and
    # applies where the optimizer itself drops a non-finite update (DeepSpeed's bf16 optimizers,
    # plain PyTorch under Accelerate) and no fp16 loss scaler would count the bad loss as an
    # overflow; elsewhere the check is read before the backward pass.
    nonfinite_check: Literal["after_update", "before_backward"] = Field(
        "after_update", description="after_update (where the optimizer drops non-finite "
        "updates itself, not under fp16; else before_backward): a bad loss drops its whole "
        "step, which is then done again; before_backward: only its micro-batch, at one host "
        "sync per micro-batch")

    # torch waits for a silent loader worker forever and a collective for a stuck peer until
    # its timeout: pretrain/watchdog.py ends such a rank, so the job does not hold its GPUs to
    # the time limit. Long enough for the first steps' compilation and a large checkpoint.
    stall_timeout_s: float = Field(
        1800.0, ge=0, description="end a rank that read no batch, finished no step and wrote no "
        "checkpoint for this long, after writing its stacks to the log (exit code 5: "
        "relaunching resumes); 0: never")

    @model_validator(mode="after")
    def _check_duration(self) -> "TrainConfig":
        if self.total_steps is None and self.epochs is None:
            raise ValueError("set exactly one of train.total_steps and train.epochs")
        if self.total_steps is not None and self.epochs is not None:
            # a recipe's file inheriting the other one meets this: on the command line an
            # override of one clears the other, in a file it must be cleared by hand
            raise ValueError(f"set exactly one of train.total_steps ({self.total_steps}) and "
                             f"train.epochs ({self.epochs}); to replace the one a recipe "
                             f"inherits, set it to null in the file (train: {{epochs: "
                             f"{self.epochs}, total_steps: null}})")
        if self.checkpointed_blocks is not None and not self.activation_checkpointing:
            raise ValueError("train.checkpointed_blocks needs train.activation_checkpointing=true")
        if self.compile_mode != "default" and not self.compile:
            raise ValueError(f"train.compile_mode={self.compile_mode} needs train.compile=true")
        return self

    def batch_layout(self, world_size: int) -> Tuple[int, int]:
        """(micro_batch_size, grad_accum_steps) such that world x micro x accum = global batch."""
        g, w = self.global_batch_size, world_size
        micro, accum = self.micro_batch_size, self.grad_accum_steps
        if micro is None:
            per = w * (accum or 1)
            micro, rem = divmod(g, per)
            if rem or micro == 0:
                by = f"world size {w}" + (f" x train.grad_accum_steps {accum}" if accum else "")
                raise ConfigError(f"train.global_batch_size={g} is not divisible by {by}; "
                                  f"pick a multiple of {per}")
            accum = accum or 1
        if accum is None:
            accum, rem = divmod(g, w * micro)
            if rem or accum == 0:
                fix = f"a train.global_batch_size that is a multiple of {w * micro}"
                if g % w == 0:  # the micro-batch is what does not fit (more ranks than planned)
                    fits = max(d for d in range(1, min(micro, g // w) + 1) if (g // w) % d == 0)
                    fix = (f"set train.micro_batch_size={fits} ({g} / {w} ranks = {g // w} per "
                           f"rank), or " + fix)
                else:
                    fix = "pick " + fix
                raise ConfigError(
                    f"train.global_batch_size={g} is not divisible by world size {w} x "
                    f"train.micro_batch_size {micro}; {fix}")
        if w * micro * accum != g:
            raise ConfigError(
                f"train.global_batch_size={g} != world size {w} x train.micro_batch_size {micro} "
                f"x train.grad_accum_steps {accum} = {w * micro * accum}; unset one of the two")
        return micro, accum


class CheckpointConfig(Section):
    every_steps: int = Field(1000, gt=0, description="save a checkpoint every N steps (and at "
                             "the end)")
    keep_last: int = Field(3, gt=0, description="complete checkpoints kept; older ones are "
                           "deleted")
    # Continue from the newest complete checkpoint in output_dir when there is one. false: a new
    # run starts there; the earlier run's files are moved into output_dir/earlier-<time>/ first
    # (pretrain/run_dir.py), never overwritten or resumed.
    resume: bool = Field(True, description="continue from the newest complete checkpoint; "
                         "false: start a new run, the earlier one moved to earlier-<time>/")
    # A save that fails (full disk, I/O error) leaves the earlier checkpoints as they were.
    on_write_error: Literal["stop", "continue"] = Field(
        "stop", description="stop: end the run with the error; continue: warn, train on, try "
                            "again at the next checkpoint (the last save must succeed)")
    # A scheduler ends a job with a signal and kills it a grace period later (SLURM: SIGTERM,
    # then SIGKILL after KillWait, 30 s by default; --signal=B:USR1@180 asks for an early one;
    # Kubernetes: SIGTERM, terminationGracePeriodSeconds 30; Ctrl-C: SIGINT). On any of these
    # every rank finishes its step, a checkpoint of that step is written and the run exits
    # with code 4; relaunching resumes there (pretrain/stopping.py).
    stop_signals: Tuple[Literal["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP"], ...] = Field(
        ("SIGTERM", "SIGINT", "SIGUSR1"), description="checkpoint and stop on these signals "
        "(exit code 4; [] : die on them as usual)")
    grace_period_s: float = Field(30.0, gt=0, description="the scheduler's time between the "
                                  "signal and SIGKILL: a stop checkpoint taking over half of "
                                  "it is warned about; the end's wait for MLflow stops 5 s "
                                  "before it (at most 25 s after a SIGTERM or SIGINT)")


class DeepSpeedConfig(Section):
    # Unset: 1, or the stage deepspeed.config's file sets.
    zero_stage: Optional[Literal[0, 1, 2, 3]] = Field(
        None, description="ZeRO stage, default 1 (3 partitions the parameters too: ViT-H at "
        "scale)")
    # A JSON file (path, or a name in configs/deepspeed/) for everything else DeepSpeed offers;
    # batch sizes, precision, clipping, optimizer and schedule come from this config (setting
    # them there is refused).
    config: Optional[str] = Field(None, description="DeepSpeed JSON, a path or a name in "
                                  "configs/deepspeed/ (its zero_optimization.stage is the run's; "
                                  "a zero_stage given too must agree)")
    one_pass_grad_checks: bool = Field(
        True, description="ZeRO-1/2: check the gradients for NaN/inf and take their norm in one "
        "multi-tensor pass instead of DeepSpeed's per-tensor loops (the same verdicts, the same "
        "norms up to float64 rounding, ~3,000 fewer kernel launches per ViT-L update; see "
        "pretrain/grad_checks.py)")
    # pretrain/grad_accum.py: why fp32, and what each ZeRO stage does with it.
    grad_accum_dtype: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="under train.precision bf16/fp16, with more than one micro-batch per "
        "step: the dtype their gradients are summed in (fp32: an fp32 copy of the gradients, "
        "nothing lost in the sum; the precision's own: DeepSpeed's default, a rounding to it at "
        "each micro-batch, the only choice at ZeRO-0)")


class LogConfig(Section):
    every_steps: int = Field(10, gt=0, description="log metrics every N steps")
    # MFU denominator; unset: looked up from the device name (bf16 dense peak per GPU).
    peak_tflops: Optional[float] = Field(None, gt=0, description="peak TFLOP/s per device for MFU")


class EvalConfig(Section):
    """Evaluators that run every N steps, aggregated across ranks."""

    # Held-out classification on data.root's data.val_split (top-1/top-5).
    val_name: str = Field("i21k_val", description="metric prefix: eval/<val_name>/top1")
    every_steps: int = Field(1000, gt=0, description="held-out classification every N steps")
    batch_size: int = Field(256, gt=0, description="per-rank evaluation batch")
    max_samples: Optional[int] = Field(None, gt=0, description="evaluate on the first N only")
    # Few-shot linear probe (closed-form ridge on pre-logits), as in the ViT paper/big_vision.
    fewshot_root: Optional[str] = Field(None, description="prepared shards (e.g. CIFAR-100) for "
                                        "the few-shot probe; unset: no probe")
    fewshot_train_split: str = Field("train", description="split the probe's shots come from")
    fewshot_test_split: str = Field("test", description="split the probe is scored on")
    fewshot_shots: Tuple[PositiveInt, ...] = Field((1, 5, 10, 25), min_length=1,
                                                   description="training images per class")
    fewshot_every_steps: int = Field(5000, gt=0, description="few-shot probe every N steps")
    fewshot_l2_reg: float = Field(1024.0, gt=0, description="ridge penalty of the probe")

    @field_validator("val_name")
    @classmethod
    def _metric_name(cls, name: Optional[str]) -> Optional[str]:
        # MLflow refuses a batch holding one bad name: every metric of those steps would go
        if name is not None and (not re.fullmatch(f"[{METRIC_NAME_CHARS}]+", name)
                                 or name in (".", "..")):
            raise ValueError(f"eval.val_name={name!r} cannot be part of an MLflow metric name; "
                             f"use letters, digits, '_', '-', '.', ':' and spaces")
        return name

    @model_validator(mode="after")
    def _check_probe_splits(self) -> "EvalConfig":
        # scored on the images its shots came from, the probe reads as held-out but is not
        if self.fewshot_root and self.fewshot_train_split == self.fewshot_test_split:
            raise ValueError(f"eval.fewshot_test_split={self.fewshot_test_split} is the split "
                             f"the probe's shots come from (eval.fewshot_train_split): its "
                             f"figure would be on its own training images; give another split")
        return self


class TrackingConfig(Section):
    """MLflow tracking (rank 0 logs; see pretrain/tracking.py).

    Where: ``tracking.uri`` when set, else ``MLFLOW_TRACKING_URI``, else MLflow's default store
    in the launch directory (``./mlflow.db``, or ``./mlruns`` if that already holds a file store
    and ``MLFLOW_ALLOW_FILE_STORE=true``) -- what a plain ``mlflow ui`` started there shows.
    """

    enabled: bool = Field(True, description="log to MLflow (false: metrics.jsonl only)")
    uri: Optional[str] = Field(None, description="tracking server/store URI (beats "
                               "MLFLOW_TRACKING_URI; unset: that, else ./mlflow.db)")
    # One experiment for both stages: fine-tunes can then nest under their pretraining run.
    experiment: str = Field("vitscale", min_length=1, description="MLflow experiment name "
                            "(a resumed run stays in its own: another is refused)")
    run_name: Optional[str] = Field(None, description="unset: the output_dir's name (a "
                                    "relaunch that gives another renames the run)")
    system_metrics: bool = Field(True, description="every node's CPU/memory/disk/network/GPU "
                                 "metrics, as MLflow's system/* metrics")
    system_metrics_every_s: float = Field(10.0, ge=0.1, description="sample them this often "
                                          "(MLflow's default)")
    flush_every_s: float = Field(2.0, gt=0, description="send queued metrics this often")
    # At the end of a run, how long to wait for an unreachable server before leaving the rest
    # in the spool (launch/upload_spool.py sends it later).
    close_timeout_s: float = Field(120.0, ge=0, description="wait this long at the end for an "
                                   "unreachable server (after a stop signal: no longer than "
                                   "checkpoint.grace_period_s allows)")
    # The exported model as an MLflow model of the run (pretrain/model_registry.py): a "model
    # from code" whose weights are the timm folder's safetensors, so loading unpickles nothing.
    log_model: Optional[bool] = Field(None, description="log the exported model to the run as "
                                      "an MLflow model (unset: fine-tunes log their best weights, "
                                      "but one that keeps its pre-logits; pretraining logs "
                                      "nothing; true in pretraining: its backbone)")
    register_as: Optional[str] = Field(None, min_length=1, description="also register that model "
                                       "in the MLflow Model Registry as a new version of this "
                                       "name (implies log_model)")

    @model_validator(mode="after")
    def _check_model_logging(self) -> "TrackingConfig":
        if self.register_as and self.log_model is False:
            raise ValueError("tracking.register_as needs the model logged; drop "
                             "tracking.log_model=false")
        if (self.register_as or self.log_model) and not self.enabled:
            raise ValueError("tracking.log_model/register_as need tracking.enabled=true")
        return self

    def logs_model(self, by_default: bool) -> bool:
        """Whether this stage logs its model: ``by_default`` is the stage's own answer."""
        return bool(self.register_as) or (by_default if self.log_model is None
                                          else self.log_model)


class DebugConfig(Section):
    # Every rank writes the __key__ of each consumed sample to DIR/rank{R}.txt.
    log_sample_keys: Optional[str] = Field(None, description="DIR: rank{R}.txt of consumed keys")


class RunConfig(Section):
    """The sections every stage has; each stage's config sets its own defaults."""

    launcher: ClassVar[str] = ""  # the stage's entry point, named when its config is misplaced

    # Alternatives: a command-line override of one clears the other from the recipe.
    exclusive_keys: ClassVar = (("train.total_steps", "train.epochs"),)
    # A recipe's value of the first key is meant for its value of the second: overriding the
    # second alone drops the first back to its default. The demo recipe generates its data into
    # its own data.root; a data.root given on the command line (a mistyped path to one's shards,
    # say) is not filled with demo images to train on and exit 0.
    recipe_bound_keys: ClassVar = {"data.generate_demo": "data.root"}
    # What makes a relaunch the same run: resuming a checkpoint saved with other values of these
    # is refused (pretrain/run_dir.py, check_same_run).
    # data.train_split: the samples trained on, which the loader's saved position is within
    identity_keys: ClassVar = ("model", "data.train_split")
    # One output per class of the dataset (a fine-tune's new head), not at least one: a
    # pretraining head may be wider than the labels a subset of ImageNet-21k uses.
    head_per_class: ClassVar[bool] = False

    output_dir: str = Field("runs/pretrain", min_length=1,
                            description="checkpoints, logs, resolved config")
    seed: int = Field(0, description="initial weights, data order and augmentation")
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    train: TrainConfig = TrainConfig(epochs=90)
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    eval: EvalConfig = EvalConfig()
    debug: DebugConfig = DebugConfig()
    tracking: TrackingConfig = TrackingConfig()

    @model_validator(mode="after")
    def _check_training(self) -> "RunConfig":
        if self.model.num_classes < 1:
            raise ValueError("model.num_classes must be at least 1 to train (0 means a backbone "
                             "without a head, for exports only)")
        if self.data.generate_demo and not self.data.root:
            raise ValueError("data.generate_demo needs data.root: the folder the demo data is "
                             "written to")
        val = self.data.val_split
        if val and val == self.data.train_split:
            raise ValueError(f"data.val_split={val} is the split trained on: its figure would "
                             f"be on training data, logged as held-out; set data.val_split to "
                             f"a held-out split, or null")
        if self.schedule.min_lr > self.optimizer.lr:
            raise ValueError(f"schedule.min_lr={self.schedule.min_lr:g} is above optimizer.lr="
                             f"{self.optimizer.lr:g}: the learning rate would rise after the "
                             f"warmup; lower schedule.min_lr")
        from pretrain.data.info import is_url
        root = self.data.root or ""
        if self.data.generate_demo and is_url(root):
            # the demo writes a local folder: it would land in ./s3:/bucket/... and train on
            # the remote data anyway
            raise ValueError(f"data.generate_demo writes the demo data to a local folder, but "
                             f"data.root={root!r} is a URL; set data.generate_demo=false to "
                             f"train on the data there")
        return self

    def checkpoint_layout(self) -> dict:
        """Settings whose state the checkpoints hold in their own form: a relaunch that changes
        one cannot load them (refused, with the fix, by check_same_run)."""
        return {"optimizer.name": self.optimizer.name}

    def to_yaml(self) -> str:
        # Imported here: pretrain.config_files builds on this module's Section and ConfigError.
        from pretrain.config_files import to_yaml
        return to_yaml(self)


class PretrainConfig(RunConfig):
    """Pretraining (ImageNet-21k recipe defaults: AdamW, warmup + linear decay, 90 epochs)."""

    launcher: ClassVar[str] = "launch/pretrain.py"

    deepspeed: DeepSpeedConfig = DeepSpeedConfig()

    @model_validator(mode="after")
    def _check_accumulation_dtype(self) -> "PretrainConfig":
        summed, precision = self.deepspeed.grad_accum_dtype, self.train.precision
        if summed != "fp32" and summed != precision:
            raise ValueError(f"deepspeed.grad_accum_dtype={summed} but train.precision="
                             f"{precision}: gradients are summed in fp32 or in the precision's "
                             f"own dtype; set deepspeed.grad_accum_dtype=fp32")
        return self

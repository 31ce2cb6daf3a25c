"""The fine-tuning config: the pretraining sections with the ViT paper's transfer defaults
(App. B.1.1): one zero-initialised head at 384 px, SGD with momentum, no weight decay,
batch 512, cosine decay after a short warmup, 20k steps."""
from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import Field, field_validator, model_validator

from pretrain.config import (DataConfig, EvalConfig, ModelConfig, OptimizerConfig, RunConfig,
                             ScheduleConfig, TrainConfig)


class FinetuneModelConfig(ModelConfig):
    img_size: Optional[int] = Field(384, gt=0, description="fine-tuning resolution; position "
                                    "embeddings are resampled in 2-D from the checkpoint's")
    representation_size: Optional[int] = Field(None, gt=0, description="unset: pre-logits "
                                               "dropped, as in the paper's transfer; set: kept, "
                                               "and best/ and final/ hold the backbone only "
                                               "(timm's ViT has no pre-logits)")
    num_classes: int = Field(1000, gt=0, description="classes of the new head (ImageNet-1k: 1000)")
    drop_path_rate: float = Field(0.0, ge=0.0, lt=1.0, description="stochastic depth, linear "
                                  "over depth up to this")


class FinetuneOptimizerConfig(OptimizerConfig):
    name: Literal["adamw", "sgd"] = Field("sgd", description="sgd with momentum (paper), or adamw")
    lr: float = Field(0.01, gt=0, description="peak learning rate, reached after warmup (paper "
                      "grid: 0.003-0.06 ImageNet, 0.001-0.03 CIFAR)")
    weight_decay: float = Field(0.0, ge=0, description="weight decay (paper: none; sgd: L2 "
                                "added to the gradient, adamw: decoupled)")


class FinetuneScheduleConfig(ScheduleConfig):
    warmup_steps: int = Field(500, ge=0, description="linear warmup from 0 to optimizer.lr")
    decay: Literal["linear", "cosine"] = Field("cosine", description="decay after the warmup, "
                                               "to schedule.min_lr where the run ends")
    min_lr: float = Field(0.0, ge=0, description="learning rate the decay ends at, after the "
                          "last step")


class FinetuneDataConfig(DataConfig):
    # Model selection happens on a dev split held out from train; the reported figure on val/test.
    dev_fraction: float = Field(0.01, ge=0, lt=1, description="share of train held out as dev "
                                "(paper: 1% ImageNet, 2% CIFAR)")
    crop_scale: tuple[float, float] = Field((0.08, 1.0), description="Inception crop: min and "
                                            "max share of the image area")


class FinetuneEvalConfig(EvalConfig):
    every_steps: int = Field(1000, gt=0, description="the dev split (data.dev_fraction) every N "
                             "steps; data.val_split is scored once, after the last step")
    # The reported figure is named after its split (eval/test/top1) unless a name is given; the
    # dev split's is always eval/dev/top1, which picks the best weights.
    val_name: Optional[str] = Field(None, description="metric prefix of the data.val_split "
                                    "figure: eval/<val_name>/top1 (unset: the split's name)")

    @field_validator("val_name")
    @classmethod
    def _not_dev(cls, name: Optional[str]) -> Optional[str]:
        if name == "dev":
            raise ValueError("eval.val_name=dev would mix the reported figure into eval/dev/*, "
                             "the dev split's, which picks the best weights; pick another name")
        return name


class FinetuneTrainConfig(TrainConfig):
    # Polyak averaging of the weights (big_vision's "polyak"); when set, the dev/test figures
    # and the exported weights are those of the average.
    ema_decay: Optional[float] = Field(None, gt=0, lt=1, description="EMA of the weights, e.g. "
                                       "0.9999 (unset: none)")


class FinetuneConfig(RunConfig):
    launcher: ClassVar[str] = "launch/finetune.py"
    # a fine-tune resumed with another init would keep the weights it started from; another
    # data.dev_fraction moves images between the dev split and the samples trained on
    identity_keys: ClassVar = ("model", "init", "data.train_split", "data.dev_fraction")
    head_per_class: ClassVar[bool] = True
    # what a fine-tune's recipe (or an override) must say: a pretraining recipe, whose keys the
    # fine-tune's config all has, would otherwise plan a fine-tune from scratch into its run
    recipe_keys: ClassVar = {"init": "a fine-tune starts from a pretraining run (init=runs/NAME) "
                                     "or from scratch (init=null); a pretraining recipe runs "
                                     "with launch/pretrain.py"}
    init: Optional[str] = Field(None, description="pretraining output dir, DeepSpeed checkpoint "
                                "dir, export file, timm folder or state dict, Google .npz; "
                                "null: from scratch")
    output_dir: str = Field("runs/finetune", min_length=1, description="checkpoints, logs, "
                            "exports, resolved config")
    model: FinetuneModelConfig = FinetuneModelConfig()
    data: FinetuneDataConfig = FinetuneDataConfig()
    optimizer: FinetuneOptimizerConfig = FinetuneOptimizerConfig()
    schedule: FinetuneScheduleConfig = FinetuneScheduleConfig()
    train: FinetuneTrainConfig = FinetuneTrainConfig(global_batch_size=512, total_steps=20_000)
    eval: FinetuneEvalConfig = FinetuneEvalConfig()

    def checkpoint_layout(self) -> dict:
        # the EMA weights are one more object in Accelerate's checkpoint, or none
        return {**super().checkpoint_layout(),
                "train.ema_decay": "set" if self.train.ema_decay is not None else "null"}

    @model_validator(mode="after")
    def _check_logged_model(self) -> "FinetuneConfig":
        t = self.tracking
        if self.model.representation_size and (t.register_as or t.log_model):
            raise ValueError(f"tracking.{'register_as' if t.register_as else 'log_model'} logs "
                             f"the timm folder best/, which holds no head when "
                             f"model.representation_size keeps a pre-logits layer (timm's ViT "
                             f"has none); set model.representation_size=null (the paper's "
                             f"transfer) or drop tracking.{'register_as' if t.register_as else 'log_model'}")
        return self

    @model_validator(mode="after")
    def _check_reported_split(self) -> "FinetuneConfig":
        # the reported figure must come from held-out data, under a name of its own
        # (one the same as data.train_split is refused for both stages: RunConfig)
        val = self.data.val_split
        if val == "dev" and not self.eval.val_name and self.data.dev_fraction:
            raise ValueError("data.val_split=dev would report its figure as eval/dev/*, the dev "
                             "split's series, which picks the best weights; set eval.val_name "
                             "to another name")
        return self

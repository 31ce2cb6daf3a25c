"""The ViT family: timm's VisionTransformer backbone + optional pre-logits + classifier head.

``create_model(cfg.model)`` accepts any timm VisionTransformer name (``vit_tiny_patch16_224`` ...
``vit_huge_patch14_224``); architecture fields set in the config override the named model.
``resolve_spec`` checks and describes the architecture without building it, so sizing ViT-H
(parameters, training FLOPs) costs no memory; build on ``device="meta"`` for the same reason.
"""
from __future__ import annotations

import contextlib
import difflib
import functools
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from pretrain.config import ConfigError, ModelConfig

ARCH_FIELDS = ("img_size", "patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio")


@dataclass(frozen=True)
class ViTSpec:
    """Architecture metadata (timm ``pretrained_cfg`` in spirit): enough to size and rebuild."""

    name: str
    img_size: int
    patch_size: int
    embed_dim: int
    depth: int
    num_heads: int
    mlp_ratio: float
    num_prefix_tokens: int
    representation_size: Optional[int]
    num_classes: int
    in_chans: int = 3

    @property
    def grid(self) -> int:
        return self.img_size // self.patch_size

    @property
    def seq_len(self) -> int:
        return self.grid ** 2 + self.num_prefix_tokens

    @property
    def mlp_dim(self) -> int:
        return int(self.embed_dim * self.mlp_ratio)  # timm's rounding

    def forward_macs(self) -> int:
        """Multiply-accumulates of one image's forward pass (matmuls and the patch conv)."""
        d, t, m = self.embed_dim, self.seq_len, self.mlp_dim
        patch = self.grid ** 2 * self.in_chans * self.patch_size ** 2 * d
        # qkv + output projection (4 t d^2), scores and weighted sum (2 t^2 d), the MLP (2 t d m)
        block = 4 * t * d * d + 2 * t * t * d + 2 * t * d * m
        width = d
        head = 0
        if self.representation_size:
            head += d * self.representation_size
            width = self.representation_size
        head += width * self.num_classes
        return patch + self.depth * block + head

    def train_flops_per_image(self) -> float:
        """Forward + backward ~ 3 x forward, 2 FLOPs per MAC (the usual MFU convention)."""
        return 3.0 * 2.0 * self.forward_macs()


@functools.lru_cache(maxsize=None)
def timm_stock(name: str) -> nn.Module:
    """The model timm registers under ``name``, built on the meta device (nothing allocated;
    built once per name: the spec, the plan and the export all ask)."""
    import timm
    from timm.models.vision_transformer import VisionTransformer

    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models("vit_*"), n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else "; see timm.list_models('vit_*')"
        raise ConfigError(f"config key 'model.name': '{name}' is not a timm model{hint}")
    with torch.device("meta"):
        vit = timm.create_model(name, pretrained=False, num_classes=0)
    if not isinstance(vit, VisionTransformer):
        raise ConfigError(f"config key 'model.name': '{name}' is a {type(vit).__name__}, "
                          f"not a timm VisionTransformer; pick a vit_* model")
    return vit


def _timm_arch(name: str) -> tuple:
    """The architecture timm registers under ``name``."""
    vit = timm_stock(name)
    block = vit.blocks[0]
    return (vit.patch_embed.img_size[0], vit.patch_embed.patch_size[0], vit.embed_dim,
            len(vit.blocks), block.attn.num_heads, block.mlp.fc1.out_features / vit.embed_dim,
            vit.num_reg_tokens)


def resolve_spec(cfg: ModelConfig) -> ViTSpec:
    """Merge the named timm architecture with the config's overrides and check the result."""
    base = dict(zip(ARCH_FIELDS, _timm_arch(cfg.name)[:-1]))
    arch = {k: getattr(cfg, k) if getattr(cfg, k) is not None else base[k] for k in ARCH_FIELDS}
    if arch["embed_dim"] % arch["num_heads"]:
        raise ConfigError(f"config key 'model.num_heads': width {arch['embed_dim']} is not "
                          f"divisible by {arch['num_heads']} heads")
    if int(arch["embed_dim"] * arch["mlp_ratio"]) < 1:  # timm builds an MLP of no width
        raise ConfigError(f"config key 'model.mlp_ratio': {arch['mlp_ratio']:g} gives width "
                          f"{arch['embed_dim']} an MLP of width 0; ViTs use 4 (timm's default)")
    size, patch = arch["img_size"], arch["patch_size"]
    if size % patch:
        near = sorted({max(patch, size // patch * patch), (size // patch + 1) * patch})
        raise ConfigError(f"config key 'model.img_size': {size} is not divisible by the patch "
                          f"size {patch}; use {' or '.join(map(str, near))}")
    return ViTSpec(name=cfg.name, num_prefix_tokens=1 + _timm_arch(cfg.name)[-1],
                   representation_size=cfg.representation_size, num_classes=cfg.num_classes,
                   **arch)


def changed_from_stock(spec: ViTSpec) -> dict:
    """The architecture fields (but the image size) in which ``spec`` differs from the timm
    model it is named for: a label of ``spec.name`` alone would pass off a 2-block model as
    the 24-block one."""
    stock = dict(zip(ARCH_FIELDS, _timm_arch(spec.name)[:-1]))
    return {k: getattr(spec, k) for k in ARCH_FIELDS
            if k != "img_size" and getattr(spec, k) != stock[k]}


class PatchConv2d(nn.Conv2d):
    """The patch embedding's convolution (kernel = stride, no padding) as one matmul in training.

    Same parameters and state-dict keys as timm's ``nn.Conv2d`` (checkpoints and exported
    weights do not change). Why: cuDNN ran ViT-L/16's patch convolution on an H100 at ~40
    TFLOP/s, and with its weight gradient and the NCHW/NHWC conversions around both it took
    4.2 ms of a 225 ms step (README, Performance); as a matmul the same FLOPs go through
    cuBLAS after one copy of the images into patch order (measured: the step 225.4 -> 215.5
    ms). In eval mode the convolution stays, so the model evaluates exactly as timm's does with
    the exported weights; the two differ by rounding only.
    """

    @classmethod
    def replacing(cls, conv: nn.Conv2d) -> nn.Conv2d:
        """``conv`` as a PatchConv2d sharing its parameters, where it is a patchify convolution."""
        if (conv.stride != conv.kernel_size or any(conv.padding) or conv.groups != 1
                or conv.dilation != (1, 1) or conv.padding_mode != "zeros"):
            return conv
        new = cls(conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride,
                  bias=conv.bias is not None, device="meta")
        new.weight, new.bias = conv.weight, conv.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        ph, pw = self.kernel_size
        if not self.training or h % ph or w % pw:  # timm refuses sizes the patches don't tile
            return super().forward(x)
        gh, gw = h // ph, w // pw
        patches = (x.reshape(b, c, gh, ph, gw, pw).permute(0, 2, 4, 1, 3, 5)
                   .reshape(b * gh * gw, c * ph * pw))  # each row one patch, as (c, ph, pw)
        out = F.linear(patches, self.weight.reshape(self.out_channels, -1), self.bias)
        return out.reshape(b, gh, gw, self.out_channels).permute(0, 3, 1, 2)  # NCHW, as a view


class ViTClassifier(nn.Module):
    """``head(pre_logits(backbone(x)))`` where backbone returns the class-token features."""

    def __init__(self, backbone: nn.Module, spec: ViTSpec, head_bias_init: float = 0.0,
                 head_zero_init: bool = True):
        super().__init__()
        self.spec = spec
        self.backbone = backbone
        width = spec.embed_dim
        if spec.representation_size:
            self.pre_logits = nn.Sequential(OrderedDict(
                fc=nn.Linear(width, spec.representation_size), act=nn.Tanh()))
            width = spec.representation_size
        else:
            self.pre_logits = nn.Identity()
        self.head = nn.Linear(width, spec.num_classes) if spec.num_classes else nn.Identity()
        self.init_head(bias=head_bias_init, zero=head_zero_init)

    @torch.no_grad()
    def init_head(self, bias: float = 0.0, zero: bool = True) -> None:
        # Runs again under ZeRO-3's GatheredParameters: on a partitioned model it must be re-done.
        if isinstance(self.head, nn.Linear):
            if zero:
                nn.init.zeros_(self.head.weight)
            else:
                nn.init.trunc_normal_(self.head.weight, std=0.02)
            nn.init.constant_(self.head.bias, bias)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Pooled class-token features of the backbone (after its final norm)."""
        return self.backbone(x)

    def forward_pre_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The representation the few-shot probe and the paper's transfer use."""
        return self.pre_logits(self.backbone(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_pre_logits(x))

    def swap_head(self, num_classes: int) -> None:
        """Fine-tuning head (ViT paper): drop pre-logits, attach one zero-initialised Linear."""
        ref = self.backbone.cls_token
        self.pre_logits = nn.Identity()
        self.head = nn.Linear(self.spec.embed_dim, num_classes, device=ref.device, dtype=ref.dtype)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.spec = ViTSpec(**{**asdict(self.spec), "representation_size": None,
                               "num_classes": num_classes})


def create_model(cfg: ModelConfig, device: torch.device | str | None = None) -> ViTClassifier:
    """Build the configured model; ``device="meta"`` allocates nothing (for sizing)."""
    import timm

    spec = resolve_spec(cfg)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        backbone = timm.create_model(
            cfg.name, pretrained=False, num_classes=0, global_pool="token", class_token=True,
            img_size=spec.img_size, patch_size=spec.patch_size, embed_dim=spec.embed_dim,
            depth=spec.depth, num_heads=spec.num_heads, mlp_ratio=spec.mlp_ratio,
            drop_path_rate=cfg.drop_path_rate, proj_drop_rate=cfg.dropout,
            pos_drop_rate=cfg.dropout, attn_drop_rate=cfg.attn_dropout)
        backbone.patch_embed.proj = PatchConv2d.replacing(backbone.patch_embed.proj)
        return ViTClassifier(backbone, spec, head_bias_init=cfg.head_bias_init,
                             head_zero_init=cfg.head_zero_init)


def count_parameters(model: ViTClassifier) -> dict:
    """Parameter counts by part: backbone, pre_logits, head and total (works on meta)."""
    parts = {name: sum(p.numel() for p in getattr(model, name).parameters())
             for name in ("backbone", "pre_logits", "head")}
    parts["total"] = sum(parts.values())
    return parts


def measure_train_flops(model: nn.Module, img_size: int, batch: int = 1) -> int:
    """FLOPs of one forward + backward counted by PyTorch's FlopCounterMode.

    On the CPU the fused attention kernel is invisible to the counter, so the math backend is
    forced; on ``meta`` attention decomposes into counted matmuls anyway.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    param = next(model.parameters())
    x = torch.randn(batch, 3, img_size, img_size, device=param.device, dtype=param.dtype)
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        model(x).float().sum().backward()
    return counter.get_total_flops()

"""The batch both loaders yield, and what becomes of it on the training device.

The loaders hand over uint8 images so that the CPU workers, the usual bottleneck, never convert
or normalise: the float conversion, normalisation and mixup run on the device, in
:func:`prepare_batch`.
"""
from __future__ import annotations

import functools
from typing import List, NamedTuple, Tuple

import torch


class Batch(NamedTuple):
    images: torch.Tensor   # uint8 (B, 3, S, S); normalise on the device with normalize()
    labels: torch.Tensor   # int64 (B,); -1 marks padding in eval batches
    keys: List[str]        # the samples' __key__ ("" for eval padding)
    epochs: torch.Tensor   # int64 (B,), the epoch each sample belongs to


def normalize(images: torch.Tensor, mode: str = "minus_one_one",
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 (B, 3, H, W) -> float: [-1, 1] ("minus_one_one") or ImageNet mean/std ("imagenet")."""
    x = images.to(dtype)
    if mode == "minus_one_one":
        return x.div_(127.5).sub_(1.0)
    if mode == "imagenet":
        mean, std = _imagenet_mean_std(x.device, dtype)
        return x.sub_(mean).div_(std)
    from pretrain.data.shards import LoaderError  # here: model exports import this module
    raise LoaderError(f"data.normalize='{mode}' is unknown; use 'minus_one_one' or 'imagenet'")


@functools.lru_cache(maxsize=None)
def _imagenet_mean_std(device: torch.device, dtype: torch.dtype):
    """Made once per device: a tensor built from a list on a GPU is a blocking copy, which
    would make the host wait for the device at every batch."""
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    def make(values):  # in the input dtype, then x 255: the arithmetic runs always had
        return torch.tensor(values, dtype=dtype).view(1, 3, 1, 1).mul(255).to(device)
    return make(IMAGENET_DEFAULT_MEAN), make(IMAGENET_DEFAULT_STD)


def build_mixup(data, num_classes: int):
    """timm ``Mixup`` for data.mixup_alpha / cutmix_alpha (None when both are 0).

    Apply it to the normalised float batch on the device: ``x, y = mixup(x, labels)``; ``y``
    becomes soft targets (B, num_classes) with data.label_smoothing. Needs an even batch.
    """
    if data.mixup_alpha <= 0 and data.cutmix_alpha <= 0:
        return None
    from timm.data import Mixup
    return Mixup(mixup_alpha=data.mixup_alpha, cutmix_alpha=data.cutmix_alpha,
                 label_smoothing=data.label_smoothing, num_classes=num_classes)


def prepare_batch(batch: Batch, device: torch.device | str, mode: str = "minus_one_one",
                  mixup=None, dtype: torch.dtype = torch.float32
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Move a batch to ``device``, normalise it there and apply mixup: (images, targets)."""
    images = normalize(batch.images.to(device, non_blocking=True), mode, dtype)
    labels = batch.labels.to(device, non_blocking=True)
    if mixup is not None:
        images, labels = mixup(images, labels)
    return images, labels

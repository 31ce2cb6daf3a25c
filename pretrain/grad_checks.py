"""DeepSpeed ZeRO-1/2's two checks of the gradients before an update, each in one pass, and
the clipping after them without waiting for the device.

Before each update, DeepSpeed's ZeRO-1/2 optimizer looks at the gradients twice, one tensor at
a time: whether any holds a NaN or an infinity (about seven small operations per tensor, then
one read on the host), and their norm for clipping (about five more). ViT-L/16 has 298 such
tensors, so that is ~4,500 operations per update. On a GPU each is a kernel launch that the
device finishes in microseconds and then waits for the host to launch the next one:
`benchmark.py train --profile` counts them ("launches in DeepSpeed's step").

Here both come from one multi-tensor pass (torch's ``_foreach_norm``, the one
``clip_grad_norm_`` uses) over all the gradients: each tensor's norm accumulated in DeepSpeed's
norm dtype, float64, as its own loop takes it. Such a norm is non-finite exactly when the tensor
holds a NaN or an infinity (a finite value squares to at most ~1.2e77: the sum cannot overflow
float64), so the overflow check reads its verdict off the norms, and the norm DeepSpeed asks for
next reuses them instead of reading the gradients again. On the CPU the norms agree with
DeepSpeed's bit for bit (a test checks it); on a GPU the multi-tensor kernel sums in another
order, so the last float64 bits may differ. The all-reduces stay DeepSpeed's.

Neither the norm nor the clipping after it reads anything on the host. On a GPU each such read
(``.item()``, ``bool()`` of a tensor, a ``torch.tensor`` made on the device from a Python
number) waits until the device has run everything queued; while the host waits and then
queues the next kernels one by one, the device idles. DeepSpeed's own norm masks a NaN with a
``torch.tensor(-1.0, device=...)`` (two waits per parameter group) and its clipping asks
``bool()`` whether the norm is valid (one more per group), although its step asked just
before: here the same masking and the same clip factor are computed on the device, with the
same values. What is left per update are DeepSpeed's two reads that decide whether to drop it:
the overflow flag and whether the norm is finite (``launch/benchmark.py train --profile``
counts them, as "host reads in DeepSpeed's step" on a CPU and "host waits" on a GPU).

Only the plain data-parallel case is taken over: no model, pipeline or expert parallelism, no
optimizer offload, no sparse gradients, a device with float64. Anything else keeps DeepSpeed's
loops.
"""
from __future__ import annotations

import types
import weakref

import torch


def install(optimizer) -> bool:
    """Give a DeepSpeed ZeRO-1/2 optimizer the one-pass checks; False where it keeps its own
    (another optimizer, a DeepSpeed without these methods, or a case listed above)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.runtime.zero.utils import get_norm_dtype
    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return False
    needed = ("has_overflow_partitioned_grads_serial", "get_grad_norm_direct", "averaged_gradients",
              "bit16_groups", "dp_process_group", "mpu", "cpu_offload", "has_moe_layers",
              "unscale_and_clip_grads", "clip_grad", "loss_scale")
    if not all(hasattr(optimizer, name) for name in needed):
        return False
    if optimizer.mpu is not None or optimizer.cpu_offload or optimizer.has_moe_layers or \
            get_norm_dtype() != torch.float64:
        return False
    optimizer._one_pass_norms = []  # (weak refs to gradients, their norms): last check's
    optimizer.has_overflow_partitioned_grads_serial = types.MethodType(_any_nonfinite, optimizer)
    optimizer.get_grad_norm_direct = types.MethodType(_grad_norm, optimizer)
    optimizer.unscale_and_clip_grads = types.MethodType(_unscale_and_clip, optimizer)
    return True


def installed(optimizer) -> bool:
    return "get_grad_norm_direct" in vars(optimizer)


def _measured(grads) -> list:
    """The gradients worth a norm: none of DeepSpeed's marked zero padding, none empty."""
    return [g for g in grads if g is not None and g.numel() and
            not getattr(g, "_zero_padding", False)]


def _any_nonfinite(self) -> torch.Tensor:
    """Whether some gradient of this rank holds a NaN or an infinity (a bool tensor of one
    element on the device, as DeepSpeed's own returns); keeps each group's norms for
    :func:`_grad_norm`. DeepSpeed's zero padding is left out: it holds zeros."""
    groups = [_measured(self.averaged_gradients[i]) for i in range(len(self.bit16_groups))]
    grads = [g for group in groups for g in group]
    self._one_pass_norms = []  # weak references: a dropped update's gradients are freed
    if any(g.is_sparse for g in grads):
        return type(self).has_overflow_partitioned_grads_serial(self)
    from deepspeed.accelerator import get_accelerator
    flag = torch.zeros([1], dtype=torch.float, device=get_accelerator().current_device_name())
    if grads:
        norms = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64))
        flag += (~torch.isfinite(norms)).any()
        start = 0
        for group in groups:  # views of the one result, no copies
            self._one_pass_norms.append(([weakref.ref(g) for g in group],
                                         norms[start:start + len(group)]))
            start += len(group)
    return flag.bool()


def _grad_norm(self, gradients, params, norm_type=2):
    """The L2 norm of this rank's gradients, summed over the data-parallel ranks; a NaN or an
    infinity comes back as -1, which DeepSpeed reads as an overflow (as its own does)."""
    # DeepSpeed's own pairing: the gradients but its marked padding, zipped with the parameters
    # (the zip drops the unmarked zeros that pad the last rank's partition to its size)
    paired = [g for g in gradients if not getattr(g, "_zero_padding", False)][:len(params)]
    grads = _measured(paired)
    if float(norm_type) != 2.0 or any(g.is_sparse for g in grads):
        return type(self).get_grad_norm_direct(self, gradients, params, norm_type)
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    device = get_accelerator().current_device_name()
    norms = _take_kept_norms(self, grads)
    if norms is None and grads:
        norms = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64))
    if grads:
        total = norms.pow(2).sum().float()
    else:
        total = torch.zeros((), dtype=torch.float32, device=device)  # no copy from the host
    if dist.get_world_size(group=self.dp_process_group) > 1:  # one GPU: a launch for nothing
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_process_group)
    total = total.pow(0.5)
    # DeepSpeed's mask_nan_or_inf_with_val_inplace, without its tensor made from -1.0
    total.masked_fill_(~torch.isfinite(total), -1.0)
    return total


def _unscale_and_clip(self, grad_groups_flat, total_norm):
    """DeepSpeed's ``unscale_and_clip_grads`` with its validity check of the norm on the device:
    an invalid norm (not finite, or DeepSpeed's -1) clips with an infinite one, as there."""
    if not torch.is_tensor(total_norm) or self.clip_grad <= 0.:
        # no clipping: DeepSpeed's own reads nothing either
        return type(self).unscale_and_clip_grads(self, grad_groups_flat, total_norm)
    valid = torch.isfinite(total_norm) & (total_norm >= 0)
    clip_norm = torch.where(valid, total_norm, torch.full_like(total_norm, float("inf")))
    # the norm is the norm times the loss scale
    clip = torch.clamp(((clip_norm / self.loss_scale) + 1e-6) / self.clip_grad, min=1.0)
    combined_scale = clip * self.loss_scale
    for grad in grad_groups_flat:
        for g in grad if isinstance(grad, list) else [grad]:
            g.data.mul_(1. / combined_scale)


def _take_kept_norms(self, grads):
    """The norms the overflow check took of these very tensors a moment ago (each group's used
    once), or None. ``grads`` may leave out a group's last tensors (the padding of a partition)."""
    if not grads:
        return None
    for k, (group, norms) in enumerate(self._one_pass_norms):
        if len(grads) <= len(group) and all(ref() is g for ref, g in zip(group, grads)):
            del self._one_pass_norms[k]
            return norms[:len(grads)]
    return None

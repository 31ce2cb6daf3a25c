"""DeepSpeed ZeRO-1/2 points every bf16 weight at its slice of the flat buffer again after each
update; here only the weights that are not there any more are.

ZeRO-1/2 keeps the model's weights as views into one flat buffer per parameter group, which the
update writes in place. After each update DeepSpeed nevertheless makes each weight that view
anew (``_update_model_bit16_weights``, commented "we probably don't need this? just to be
safe"): a ``narrow``, a ``view`` and a ``.data`` assignment per tensor, in Python. Nothing is
queued on the device meanwhile, so it idles: in the H100 profile of ``benchmark.py train
--profile`` (commit 5de917d) 4.4 ms of each ViT-L/16 step (298 tensors) and 9.9 ms of each
ViT-H/14 step (394 tensors), the largest gaps in the step, though the profiler slows such loops.
Without a profiler, on the 2-core CPU machine, the loop took 2.7 ms per update for ViT-L/16 and
4.5 ms for ViT-H/14, the check below 0.2 and 0.4 ms; on the H100 the median ViT-H/14 step went
from 312.4 to 310.2 ms (README, Performance).

Instead, each weight's address, shape and layout are compared with the slice it should be: a
tensor whose memory starts there lies inside the live flat buffer, which no other allocation can
share, so it is that slice. Only when some weight is not (other code replaced its ``.data``,
DeepSpeed moved the buffer to offload it) does DeepSpeed's own loop run, so the guarantee it
gave stays.
"""
from __future__ import annotations

import types


def install(optimizer) -> bool:
    """Give a DeepSpeed ZeRO-1/2 optimizer the check; False where it keeps its own loop (another
    optimizer, or a DeepSpeed whose groups are not laid out as this module expects)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return False
    needed = ("_update_model_bit16_weights", "bit16_groups", "bit16_groups_flat",
              "round_robin_bit16_groups", "round_robin_bit16_meta", "round_robin_bit16_offsets")
    if not all(hasattr(optimizer, name) for name in needed):
        return False
    # DeepSpeed's second loop points each weight at the round-robin list's entry for it: the
    # same tensor objects (its reordering keeps them), so that loop only assigns each to itself
    for ordered, reordered in zip(optimizer.bit16_groups, optimizer.round_robin_bit16_groups):
        if {id(p) for p in ordered} != {id(p) for p in reordered}:
            return False
    optimizer._update_model_bit16_weights = types.MethodType(_update_if_moved, optimizer)
    return True


def installed(optimizer) -> bool:
    return "_update_model_bit16_weights" in vars(optimizer)


def _update_if_moved(self, group_index: int) -> None:
    flat = self.bit16_groups_flat[group_index]
    base, size, device = flat.data_ptr(), flat.element_size(), flat.device
    for p, meta, offset in zip(self.round_robin_bit16_groups[group_index],
                               self.round_robin_bit16_meta[group_index],
                               self.round_robin_bit16_offsets[group_index]):
        if p.data_ptr() != base + offset * size or p.shape != meta.shape or \
                p.device != device or not p.is_contiguous():
            type(self)._update_model_bit16_weights(self, group_index)
            return

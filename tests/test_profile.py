"""Where a step's time goes (`benchmark.py train --profile`). CI has no GPU, so the device side
is checked on profiler events put together the way torch's kineto parser links them: each
kernel is an event of its own AND hangs, with the same duration, on the host event that
launched it (the innermost aten op or profiler range). The CPU side runs the real profiler
on the real engine (test_benchmark_train.py).
"""
from __future__ import annotations

import pytest
from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList, FunctionEvent

from pretrain.profile import BOOKKEEPING, ENGINE_STEP, OPTIMIZER, OTHER, kind_of, summarize


@pytest.mark.parametrize("name, kind", [
    ("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNT", "matmul"),  # cuBLAS 12.8+ on Hopper
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "matmul"),
    ("triton_tem_fused_mm_0", "matmul"),  # an Inductor matmul template
    ("triton_poi_fused_addmm_gelu_view_3", OTHER),  # the bias + GELU after a cuBLAS matmul
    ("triton_per_fused__to_copy_native_layer_norm_2", "norms"),
    ("triton_poi_fused__to_copy_add_mul_5", OTHER),  # not the optimizer, not a copy
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16>",
     "norms"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "communication"),
    ("Memcpy HtoD (Pinned -> Device)", "copies"),
    ("aten::addmm", "matmul"),  # host operators on a CPU
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>", OTHER),
])
def test_kernels_are_sorted_by_name(name, kind):
    assert kind_of(name) == kind


class _Trace:
    """Profiler events built by hand; summarize reads them as it reads a torch.profiler.profile."""

    def __init__(self):
        self.made = []

    def events(self):
        return EventList(self.made, use_device="cuda")

    def host(self, name, start, end, parent=None, kernels=()):
        """A host event; ``kernels`` (name, us) are the ones it launched."""
        e = FunctionEvent(id=len(self.made), name=name, thread=1, start_us=start, end_us=end,
                          use_device="cuda")
        if parent is not None:
            e.set_cpu_parent(parent)
            parent.append_cpu_child(e)
        for kernel, duration in kernels:
            e.append_kernel(kernel, 0, duration)
        self.made.append(e)
        return e

    def device(self, name, start, duration, annotation=False):
        self.made.append(FunctionEvent(
            id=len(self.made), name=name, thread=7, start_us=start, end_us=start + duration,
            use_device="cuda", device_type=DeviceType.CUDA, is_user_annotation=annotation))


def test_each_kernel_counts_once_and_the_engine_step_is_split_into_update_and_bookkeeping():
    """One step: a forward matmul, then DeepSpeed's step (a flattening copy and a gradient norm
    around the fused AdamW kernel, and a host sync), a layer norm, and a backward kernel
    launched on the autograd thread (no host parent of ours). Summing every profiler entry
    counted each kernel twice -- as itself and on the host event that launched it -- and the
    step's range on the GPU row once more."""
    mm = "nvjet_tst_192x192_64x4_1x2_h_bz_TNT"
    cat = "void at::native::CatArrayBatchedCopy<at::native::OpaqueType<2u>>"
    adam = "void at::native::multi_tensor_apply_kernel<at::native::FusedAdamMathFunctor>"
    norm = "void at::native::reduce_kernel<512, 1, at::native::NormTwoOps<float>>"
    gelu_bwd = "triton_poi_fused_gelu_backward_4"
    fill = "Memset (Device)"

    # torch 2.15 hangs a kernel on the innermost frontend event whose correlation it carries
    # (an aten op, or a record_function range); the runtime call below it carries none
    t = _Trace()
    t.host("cudaLaunchKernel", 1, 2, t.host("aten::mm", 0, 10, kernels=[(mm, 8.0)]))
    step = t.host(ENGINE_STEP, 20, 70, kernels=[(fill, 1.0)])  # launched from the step itself
    t.host("cudaLaunchKernel", 22, 23, t.host("aten::cat", 21, 25, step, [(cat, 3.0)]))
    update = t.host("Optimizer.step#AdamW.step", 30, 50, step)
    t.host("cudaLaunchKernel", 32, 33,
           t.host("aten::_fused_adamw_", 31, 49, update, [(adam, 5.0)]))
    t.host("cudaLaunchKernel", 52, 53,
           t.host("aten::linalg_vector_norm", 51, 55, step, [(norm, 2.0)]))
    t.host("cudaStreamSynchronize", 56, 66, step)
    # the same norm kernel outside the step is a layer's norm, not bookkeeping
    t.host("cudaLaunchKernel", 80, 81,
           t.host("aten::native_layer_norm", 79, 82, kernels=[(norm, 1.0)]))
    for name, start, us in [(mm, 100, 8.0), (fill, 109, 1.0), (cat, 110, 3.0), (adam, 115, 5.0),
                            (norm, 121, 2.0), (norm, 130, 1.0), (gelu_bwd, 140, 4.0)]:
        t.device(name, start, us)
    t.device(ENGINE_STEP, 110, 14.0, annotation=True)  # the step's range on the GPU row

    b = summarize(t, on_device=True)
    assert b["ms"] == pytest.approx({"matmul": 0.008, OPTIMIZER: 0.005, BOOKKEEPING: 0.006,
                                     OTHER: 0.004, "norms": 0.001})
    assert b["busy_ms"] == pytest.approx(0.024)  # 8 + 1 + 3 + 5 + 2 + 1 + 4 us, once each
    assert sum(b["share"].values()) == pytest.approx(1, abs=1e-3)
    assert (b["host_syncs"], b["host_sync_ms"]) == (1, pytest.approx(0.010))
    assert b["engine_step_host_ms"] == pytest.approx(0.050)
    assert b["engine_step_launches"] == 4  # the fill, the copy, the update and the norm


def test_on_a_cpu_host_operators_inside_the_step_are_the_update_or_bookkeeping():
    t = _Trace()
    step = t.host(ENGINE_STEP, 0, 100)
    t.host("aten::_foreach_mul_", 15, 45, t.host("Optimizer.step#AdamW.step", 10, 60, step))
    t.host("aten::empty", 65, 66, t.host("aten::cat", 60, 80, step))  # called by aten::cat
    t.host("aten::addmm", 200, 300)
    b = summarize(t, on_device=False)
    # the update: 20 us in its own range + 30 in the foreach op; bookkeeping: the step's own
    # 30 us + the flattening's 20 (19 of its own, 1 in what it called)
    assert b["ms"] == pytest.approx({"matmul": 0.1, OPTIMIZER: 0.05, BOOKKEEPING: 0.05})
    assert b["engine_step_launches"] == 2  # _foreach_mul_ and cat; not the empty inside cat

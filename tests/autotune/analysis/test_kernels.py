"""GPU traces: every kernel's class, and FSDP2's backward labels found on autograd's thread."""

from __future__ import annotations

import pytest

from autotune.analysis import KERNEL_CLASSES, FsdpTraceAnalysis, get_kernel_class
from tests._gpu_traces import L8B4, get_gpu_trial


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        (
            "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1",
            "attention_forward",
        ),
        (
            "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x4x1_cga1x1",
            "attention_backward",
        ),
        ("void cudnn::fusion::compute_dot_do_o_specialized<true, 128>(void const*)", "attention_backward"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "attention_forward"),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous", "optimizer"),
        ("void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda(at", "copy"),
        ("void at::native::detail::chunk_cat_cuda_kernel<float, c10::BFloat16>(c10::BFloat16**, floa", "copy"),
        ("Memcpy DtoD (Device -> Device)", "copy"),
        ("void at::native::(anonymous namespace)::cunn_SoftMaxBackward<4, float, float, float>", "loss"),
        ("Memset (Device)", "memset"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "memset"),
        ("void at::native::vectorized_elementwise_kernel<8, at::native::(anonymous namespace)::silu_", "elementwise"),
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ],
)
def test_kernel_class_by_name(name, cls):
    assert get_kernel_class(name) == cls
    assert cls in KERNEL_CLASSES


def test_a_gpu_trace_has_its_device_ops_classed_and_its_backward_labels():
    trial = get_gpu_trial(L8B4)
    events = FsdpTraceAnalysis([trial / "trace_rank0.json.gz"]).events[0]
    ops = events.device_ops
    assert set(ops["cls"].astype(str)) <= set(KERNEL_CLASSES)
    # Every launched kernel, memcpy and memset: more than the compute kernels (no memcpy/memset there).
    assert len(ops) > len(events.compute) and {"copy", "memset", "gemm", "optimizer"} <= set(ops["cls"].astype(str))
    per_class = (ops["end"] - ops["start"]).groupby(ops["cls"].astype(str)).sum() / 1e3  # ms over 2 steps
    assert 330 < per_class["gemm"] < 370 and 75 < per_class["optimizer"] < 90
    # The backward's hooks run on autograd's device thread: their labels are read there too.
    phases = set(events.labels["phase"])
    assert {"pre_forward", "pre_backward", "post_backward_reduce", "root_post_backward_callback"} <= phases

"""step_profile.py: one step under torch.profiler, summed up as where its time went (the
phases' wall and busy time, the device's idle stretches and what the host ran then, the
busy time by kind). On this CPU for real; a GPU's events (kernels on the device, the host's
calls beside them) as torch.profiler gives them, made by hand."""
import gzip
import json
import time
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

import step_profile


def test_a_cpu_step_shows_its_phases_its_host_stretch_and_its_kinds_of_work(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(512, 256)   # (operators long beside the Python between them, as a real step's: with 64
    #                              rows, a busy machine's gaps had taken half of forward + backward)

    def step(phase):
        with phase("forward + backward"):
            model(x).square().mean().backward()
        with phase("host"):   # the host busy with something that is no operator
            time.sleep(0.03)
        with phase("optimizer"):
            opt.step()
            opt.zero_grad()
    step(step_profile.no_phase)
    s = step_profile.profile_step(step, "cpu", trace=tmp_path / "step.json.gz")
    rows = {r["phase"]: r for r in s["phases"]}
    assert [r["phase"] for r in s["phases"]] == ["whole step", "forward + backward", "host", "optimizer"]
    whole = rows["whole step"]
    assert abs(whole["busy_ms"] + whole["idle_ms"] - whole["wall_ms"]) < 1e-2
    assert sum(rows[p]["busy_ms"] for p in ("forward + backward", "host", "optimizer")) <= whole["busy_ms"] + 1e-2
    assert rows["host"]["wall_ms"] >= 29 and rows["host"]["busy_ms"] < 0.1 * rows["host"]["wall_ms"]
    assert rows["forward + backward"]["busy_ms"] > 0.5 * rows["forward + backward"]["wall_ms"]
    longest = s["gaps"][0]
    assert longest["phase"] == "host" and longest["host_in"] == "Python between operators" and longest["gap_ms"] >= 25
    kinds = {r["category"] for r in s["categories"]}
    assert {"matmul", "optimizer"} <= kinds   # (AdamW's operators, by the optimizer's span around them)
    assert any(k["name"] == "aten::linear" and k["calls"] == 2 for k in s["kernels"])
    trace = json.loads(gzip.decompress((tmp_path / "step.json.gz").read_bytes()))
    assert any(e.get("name") == "host" for e in trace["traceEvents"])
    with pytest.raises(ValueError, match="ran no phase"):
        step_profile.profile_step(lambda phase: model(x), "cpu")


def _event(name, start, end, device=DeviceType.CPU, thread=1, annotation=False, parent=None):
    return SimpleNamespace(name=name, device_type=device, is_async=False, thread=thread, is_user_annotation=annotation,
                           cpu_parent=parent, activity_type="", time_range=SimpleNamespace(start=start, end=end))


def test_a_gpu_step_counts_the_device_busy_and_names_what_held_the_host_in_its_gaps():
    """Microseconds: the step 0-1000 on the host's thread 1 (forward 0-600, optimizer
    600-1000); the device's kernels leave 0-10 idle (the host in Python), 200-500
    while the host waits in a synchronize, and 700-900 while the host is in Python inside the optimizer's span; the
    device's mirror of a phase (a GPU user annotation) is not work."""
    fwd, opt = _event("forward", 0, 600, annotation=True), _event("optimizer", 600, 1000, annotation=True)
    adam = _event("Optimizer.step#AdamW.step", 650, 990, annotation=True, parent=opt)
    gpu = DeviceType.CUDA
    events = [fwd, opt, adam,
              _event("cudaStreamSynchronize", 150, 560, parent=fwd),
              _event("forward", 0, 600, device=gpu, thread=7, annotation=True),
              _event("Optimizer.step#AdamW.step", 650, 990, device=gpu, thread=7),   # (a mirror, not flagged)
              _event("sm90_xmma_gemm_bf16bf16_bf16f32", 10, 120, device=gpu, thread=7),
              _event("ncclDevKernel_AllGather_RING_LL", 100, 200, device=gpu, thread=8),
              _event("triton_poi_fused_mul_0", 500, 600, device=gpu, thread=7),
              _event("multi_tensor_apply_kernel", 600, 700, device=gpu, thread=7),
              _event("Memcpy DtoD (Device -> Device)", 900, 1000, device=gpu, thread=7)]
    s = step_profile.summarize(events, ["forward", "optimizer"], gpu=True)
    assert [(r["phase"], r["wall_ms"], r["busy_ms"]) for r in s["phases"]] == [
        ("whole step", 1.0, 0.49), ("forward", 0.6, 0.29), ("optimizer", 0.4, 0.2)]
    assert [(g["at_ms"], g["gap_ms"], g["phase"], g["host_in"]) for g in s["gaps"]] == [
        (0.2, 0.3, "forward", "cudaStreamSynchronize"),
        (0.7, 0.2, "optimizer", "Python in Optimizer.step#AdamW.step"),
        (0.0, 0.01, "forward", "Python between operators")]
    assert {r["category"]: r["ms"] for r in s["categories"]} == {
        "matmul": 0.11, "communication": 0.1, "compiled kernels": 0.1, "optimizer": 0.1, "copy": 0.1}
    assert s["idle_over_100us"] == 2


@pytest.mark.parametrize("name, kind", [
    ("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_tn", "matmul"), ("nvjet_tst_192x192_64x3_1x2_h_bz_coopA_NTT", "matmul"),
    ("autograd::engine::evaluate_function: MmBackward0", "matmul"), ("flash_fwd_kernel", "attention"),
    ("pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", "attention"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "communication"), ("gloo:all_reduce", "communication"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel", "optimizer"),
    ("Memset (Device)", "copy"), ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "copy"),
    ("triton_per_fused_add_mul_0", "compiled kernels"), ("aten::gelu", "other")])
def test_kernels_and_operators_are_told_apart_by_kind(name, kind):
    assert step_profile.category(name) == kind


def test_a_kernels_long_cpp_name_is_shown_short():
    add = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, "
           "at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<float>, at::detail::Array<char*, 3>)")
    assert step_profile.short_name(add) == "vectorized_elementwise_kernel<4, ...ctor_add<float>, Array<char*, 3> >"
    assert step_profile.short_name("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == \
        "ncclDevKernel_AllGather_RING_LL"
    assert step_profile.short_name("Memcpy HtoD (Pageable -> Device)") == "Memcpy HtoD (Pageable -> Device)"
    assert step_profile.short_name("triton_poi_fused_add_0") == "triton_poi_fused_add_0"

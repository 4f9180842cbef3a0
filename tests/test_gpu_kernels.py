"""The CUDA kernels that only a GPU reaches, as tests (make gpu-check runs this file first):
11's context-parallel attention through its context_parallel context manager, in bf16 (a
GPU's flash kernel) and float32 (memory-efficient), against one process's SDPA on the whole
sequence, every method x layout x causal/full x grouped-query heads; and 12's grouped
experts in bf16 (torch._grouped_mm on sm80 or later) against one call per expert. Each
check runs small on the CPU too (its fused flash kernel, its grouped GEMM), so the checks
themselves are tested everywhere; the CUDA ones are skipped with the reason where no GPU
is. Each records its error (the junit property max_error), which gpu-check's summary shows."""
import argparse

import pytest
import torch

import common
import workers
from conftest import load

ep_mod = load("12_expert_parallel")
CUDA = torch.cuda.is_available()
NO_GPU = "needs a CUDA GPU (make gpu-check on a lent machine runs it)"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason=NO_GPU))]
# the attention's sizes: a few tiles on the CPU; on a GPU the probe's 1024 tokens of head dim 64
CP_SIZES = {"cpu": (64, 16), "cuda": (1024, 64)}
_cp_cache = {}


def cp_errors(device):
    """Every case's errors, from one job of 2 ranks (over gloo: on a GPU they share it)."""
    if device not in _cp_cache:
        t, d = CP_SIZES[device]
        args = argparse.Namespace(world_size=2, backend="gloo", device=device, timeout=120.0, tokens=t, head_dim=d)
        _cp_cache[device] = common.launch(workers.cp_kernel_errors, args)
    return _cp_cache[device]


CP_CASES = [f"{dt}, {m}, {lay}, {c}, 8/{hk} heads" for dt in ("bf16", "float32") for hk in (8, 2)
            for c in ("causal", "full") for m in ("ring", "allgather", "ulysses") for lay in ("zigzag", "contiguous")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CP_CASES)
def test_context_parallel_attention_equals_sdpa_on_the_whole_sequence(device, case, record_property):
    """Ours against the exact result (float64, one process) within twice one process's own
    SDPA error in the same dtype, + 1e-3 in bf16 and 1e-5 in float32; the kernel a GPU runs:
    flash in bf16, memory-efficient in float32 (the ring and all-gather call them per block;
    Ulysses through SDPA, which picks)."""
    err, own, kernels = cp_errors(device)[case]
    record_property("max_error", f"{err:.2e}")
    record_property("sdpa_error", f"{own:.2e}")
    record_property("kernel", ", ".join(kernels))
    bf16 = case.startswith("bf16")
    assert err <= 2 * own + (1e-3 if bf16 else 1e-5), f"error {err:.2e}, one process's {own:.2e}"
    if device == "cuda" and "ulysses" not in case:
        assert kernels == (["flash"] if bf16 else ["efficient"]), kernels
    if device == "cpu":
        assert kernels == ["flash (CPU)"], kernels


MOE_SIZES = {"cpu": (32, 64, 256), "cuda": (1024, 4096, 16384)}   # d_model, d_ff, tokens


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("experts, top_k", [(8, 1), (8, 2), (32, 1), (32, 2)])
def test_grouped_experts_in_bf16_equal_one_call_per_expert(device, experts, top_k, record_property):
    """One MoE layer in bf16 autocast, its experts grouped (grouped_mlp) and one call each:
    the output and every gradient within bf16's rounding (the largest relative error), and
    torch._grouped_mm dispatched (on CUDA: sm80 or later)."""
    d, d_ff, tokens = MOE_SIZES[device]
    torch.manual_seed(0)
    with torch.device(device):
        loop = ep_mod.MoE(d, d_ff, experts, top_k=top_k, grouped=False)
        grouped = ep_mod.MoE(d, d_ff, experts, top_k=top_k, grouped=ep_mod.grouped_mlp)
    grouped.load_state_dict(loop.state_dict())
    x = torch.randn(tokens, d, device=device)
    got = {}
    for name, moe in (("loop", loop), ("grouped", grouped)):
        xi = x.clone().requires_grad_()
        with common.count_collectives() as seen, common.autocast(device, "bf16"):
            y = moe(xi)
        y.float().square().mean().backward()
        got[name] = ([y.detach().float(), xi.grad] + [p.grad for p in moe.parameters()], seen.kernels)
    err = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
              for a, b in zip(got["grouped"][0], got["loop"][0]))
    record_property("max_error", f"{err:.2e}")
    record_property("kernel", ", ".join(sorted(got["grouped"][1])))
    assert err < 2e-2, f"largest relative error {err:.2e}"
    sm80 = device == "cpu" or torch.cuda.get_device_capability() >= (8, 0)
    assert ("grouped_mm" in got["grouped"][1]) == sm80 and "grouped_mm" not in got["loop"][1]

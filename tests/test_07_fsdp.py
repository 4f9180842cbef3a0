import json

import pytest
import torch

import common
from conftest import load, run_script, verification

fsdp = load("07_fsdp")
CASES = ["fp32", "fp32 tied", "float16", "float16 tied"]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_fsdp_matches_single_process(world_size, case):
    r = verification("07_fsdp", world_size)[case]
    assert r["ok"], f"{case} at {world_size} ranks: max diff {r['max_diff']}"
    assert r["shapes_ok"], "a gradient does not have its (shard) parameter's shape and dtype"
    assert r["replicated_identical"], "1-D parameters' gradients differ between ranks"
    assert r["names_match"], "gather_full_params() does not return every original parameter name"
    if case.startswith("fp32"):
        assert r["max_diff"] < 1e-5


def test_full_weights_are_freed_after_forward_and_back_for_backward(one_rank):
    torch.manual_seed(0)
    model = fsdp.FSDP(common.ToyModel())
    handles = list(model._handles.values())
    assert len(handles) == 4 and all(p.dim() == 1 for p in model.parameters())   # shards are flat
    out = model(torch.randn(4, 20))
    assert all(len(h.bufs) == 1 for h in handles)
    assert all(h.bufs[0].untyped_storage().nbytes() == 0 for h in handles)      # freed after forward
    out.sum().backward()
    assert all(h.bufs == [] for h in handles)                                   # released after backward
    assert all(p.grad is not None for p in model.parameters())
    with torch.no_grad():                                                       # no graph: nothing kept
        model(torch.randn(4, 20))
    assert all(h.bufs == [] for h in handles)


def test_master_shards_stay_fp32_with_low_precision_compute(one_rank):
    model = fsdp.FSDP(common.ToyModel(), compute_dtype=torch.bfloat16)
    model(torch.randn(4, 20)).float().sum().backward()
    for p in model.parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32


def test_script_writes_memory_and_timing(tmp_path):
    p = run_script("07_fsdp.py", "--world-size", "2", "--model-size", "nano", "--steps", "2", "--warmup", "1",
                   "--no-verify", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    rows = json.loads((tmp_path / "07_fsdp.json").read_text())["rows"]
    assert len(rows) == 3 and all(r["step_ms"] > 0 for r in rows)
    n_layers = common.MODEL_SIZES["nano"][2]
    assert rows[2]["collectives"] >= 2 * (4 * n_layers + 3)   # a gather in forward and a reduce-scatter per weight
    mem = {(r["method"], r["rank"]): r for r in json.loads((tmp_path / "07_fsdp_memory.json").read_text())["rows"]}
    ddp_name, _, fsdp_name = [r["method"] for r in rows]
    for rank in (0, 1):
        ddp, full = mem[(ddp_name, rank)], mem[(fsdp_name, rank)]
        assert full["params_MB"] < 0.55 * ddp["params_MB"] and full["opt_state_MB"] < 0.55 * ddp["opt_state_MB"]

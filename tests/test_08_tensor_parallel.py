import json

import pytest
import torch

import common
from conftest import load, refused, run_inline, verify_args

tp = load("08_tensor_parallel")
_cache = {}


def verification(world_size, tps):
    key = (world_size, tuple(tps))
    if key not in _cache:
        _cache[key] = common.launch(tp.verify, verify_args(world_size, sp=True), tps)
    return _cache[key]


@pytest.mark.parametrize("world_size, tps, case", [
    (2, [2], "toy MLP, TP 2"), (2, [2], "micro LM, TP 2"),
    (4, [2, 4], "toy MLP, TP 4"), (4, [2, 4], "micro LM, TP 4"),
    (4, [2, 4], "toy MLP, TP 2 x DP 2"), (4, [2, 4], "micro LM, TP 2 x DP 2"),
    (2, [2], "micro LM, naive TP 2 (all-gather per layer)"), (4, [2, 4], "micro LM, naive TP 4 (all-gather per layer)"),
    (2, [2], "micro LM, TP 2, sequence parallel"), (4, [2, 4], "micro LM, TP 4, sequence parallel"),
    (4, [2, 4], "micro LM, TP 2 x DP 2, sequence parallel"),
    (2, [2], "micro LM, TP 2, sequence parallel keeping the gathered inputs"),
    (4, [2, 4], "micro LM, TP 4, sequence parallel keeping the gathered inputs"),
])
def test_tensor_parallel_training_matches_one_process(world_size, tps, case):
    r = verification(world_size, tps)[case]
    assert r["ok"], f"{case}: max diff {r['max_diff']}"


def test_without_the_backward_all_reduce_the_check_fails():
    import workers
    res = common.launch(workers.tp_without_backward_all_reduce, verify_args(2))
    assert not res["micro LM, TP 2"]["ok"] and res["micro LM, TP 2"]["max_diff"] > 1e-4


def test_sequence_parallel_without_the_norms_gradient_sum_fails():
    import workers
    r = common.launch(workers.sp_without_norm_gradient_sum, verify_args(2, sp=True))
    assert r["micro LM, TP 2"]["ok"]   # plain TP has no such sum
    assert not r["micro LM, TP 2, sequence parallel"]["ok"] and r["micro LM, TP 2, sequence parallel"]["max_diff"] > 1e-4


def test_one_rank_layers_are_the_linear_layers(one_rank):
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 8)
    x = torch.randn(3, 6)
    for layer in (tp.ColumnParallelLinear.from_linear(lin), tp.RowParallelLinear.from_linear(lin),
                  tp.ColumnParallelLinear.from_linear(lin, gather_output=True)):
        assert torch.equal(layer(x), lin(x))
        full = layer.full_parameters()
        assert torch.equal(full["weight"], lin.weight) and torch.equal(full["bias"], lin.bias)


def test_heads_by_rank_gives_each_rank_whole_heads_of_q_k_and_v():
    n_heads, head_dim, world = 4, 3, 2
    order = tp.heads_by_rank(n_heads, head_dim, world)
    assert sorted(order.tolist()) == list(range(3 * n_heads * head_dim))
    for r in range(world):   # feature i of the fused projection: (which of q/k/v, head, channel)
        mine = order[r * 3 * 2 * head_dim:(r + 1) * 3 * 2 * head_dim].view(3, 2, head_dim)
        for c in range(3):
            heads = (mine[c] % (n_heads * head_dim)) // head_dim
            assert (mine[c] // (n_heads * head_dim) == c).all() and heads[:, 0].tolist() == [2 * r, 2 * r + 1]


def test_script_counts_the_bytes_the_formula_predicts(tmp_path):
    p = run_inline("08_tensor_parallel.py", "--world-sizes", "2", "--model-size", "nano", "--steps", "1",
                   "--warmup", "0", "--no-verify", "--sp", "--context-length", "32", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    rows = {r["method"]: r for r in json.loads((tmp_path / "08_tensor_parallel.json").read_text())["rows"]}
    assert list(rows) == ["DP 2 (DDPBucketed)", "TP 2 (ours)", "TP 2 (torch parallelize_module)",
                          "TP 2 + SP (ours)", "TP 2 + SP (torch SequenceParallel)",
                          "TP 2, naive (all-gather per layer)"]
    n_layers = common.MODEL_SIZES["nano"][2]
    for name, r in rows.items():
        assert r["comm_MB"] == pytest.approx(r["predicted_MB"], rel=1e-3), name   # counted = formula
        assert r["step_ms"] > 0 and r["comm_ms"] > 0
    assert rows["TP 2 (ours)"]["collectives"] == rows["TP 2 (torch parallelize_module)"]["collectives"] == 4 * n_layers
    # SP: 4 gathers or scatters a block forward, 6 backward (2 gathers again), 2 norm sums, the 2 ends
    assert rows["TP 2 + SP (ours)"]["collectives"] == 12 * n_layers + 2
    assert rows["TP 2, naive (all-gather per layer)"]["collectives"] == 8 * n_layers
    assert rows["TP 2 (ours)"]["param_MB"] < rows["DP 2 (DDPBucketed)"]["param_MB"]
    for ours in (rows["TP 2 (ours)"], rows["TP 2 + SP (ours)"]):   # paired: step i of ours over step i of torch's
        assert ours["vs_torch_min"] <= ours["vs_torch"] <= ours["vs_torch_max"]
    sp = {r["method"]: r for r in json.loads((tmp_path / "08_sequence_parallel.json").read_text())["rows"]}
    for name, r in sp.items():
        if r["act_formula_MB"] is not None:   # ours and one process: counted = formula
            assert r["act_MB"] == pytest.approx(r["act_formula_MB"], rel=1e-6), name
            assert r["sent_MB"] == pytest.approx(r["sent_formula_MB"], rel=1e-6), name
    one, tp2, sp2 = sp["one process"], sp["TP 2 (ours)"], sp["TP 2 + SP (ours)"]
    keep = sp["TP 2 + SP, gathered inputs kept (ours)"]
    assert sp2["act_MB"] < keep["act_MB"] < tp2["act_MB"] < one["act_MB"]
    assert keep["sent_MB"] < sp2["sent_MB"]   # re-gathering costs bytes
    # torch's SequenceParallel keeps the gathered inputs, as ours with keep (and gathers the last
    # block's output there, where ours gathers it at the final norm)
    assert keep["act_MB"] <= sp["TP 2 + SP (torch SequenceParallel)"]["act_MB"] <= 1.05 * keep["act_MB"]


@pytest.mark.parametrize("argv, words", [
    (["--tp", "3"], "--tp 3 must be at least 2 and divide a world size"),
    (["--world-sizes", "2", "--model-size", "nano", "--tp", "2", "4"], "must be at least 2 and divide"),
    (["--world-sizes", "4", "--model-size", "nano", "--tp", "4"], "does not divide the 2 heads of nano"),
    (["--world-sizes", "4", "--sp", "--context-length", "30", "--tp", "4"], "does not divide the sequence"),
    (["--world-sizes", "6", "--tp", "6", "--batch-size", "12"], "does not divide the 4 heads of mini"),
    (["--world-sizes", "2", "4", "--batch-size", "6"], "does not divide into 4 ranks"),
])
def test_bad_input_exits_2_with_one_line(argv, words):
    assert words in refused("08_tensor_parallel.py", *argv)


def test_torch_baseline_steps_with_foreach_optimizers_like_on_a_gpu():
    import workers   # foreach=True, CUDA's default: a list mixing DTensors and plain tensors fails
    r = common.launch(workers.torch_tp_with_foreach, verify_args(2))
    assert r["names_match"] and r["max_diff"] < 1e-5, r


def test_a_refusal_concerns_only_what_the_command_runs():
    # nano's 2 heads do not split over 4 ranks: a verification-only run (micro LM) is fine
    assert "heads of nano" in refused("08_tensor_parallel.py", "--world-sizes", "4", "--model-size", "nano",
                                      "--tp", "4")
    p = run_inline("08_tensor_parallel.py", "--world-sizes", "4", "--model-size", "nano", "--tp", "4", "--no-bench",
                   launch=lambda *a, **k: {"case": {"ok": True, "max_diff": 0.0}})
    assert p.returncode == 0, p.stderr


def test_torch_sequence_parallel_is_left_out_only_where_it_crashes():
    """Over gloo with CUDA tensors torch's SequenceParallel all-gather segfaults the rank (the
    H200 at 0c463d5, torch 2.11): left out there with its reason, run everywhere else."""
    assert "segmentation fault" in tp.torch_sp_skip("gloo", "cuda")
    assert tp.torch_sp_skip("gloo", "cpu") is None and tp.torch_sp_skip("nccl", "cuda") is None

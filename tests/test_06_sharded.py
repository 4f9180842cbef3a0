import json

import pytest
import torch
import torch.distributed as dist

import common
from conftest import load, run_inline, verification

sharded = load("06_sharded_optimizer")
CASES = list(sharded.CASES)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("case", CASES)
def test_sharded_optimizer_matches_unsharded_training(world_size, case):
    r = verification("06_sharded_optimizer", world_size)[case]
    assert r["stale_grads"] == 0, "zero_grad() left gradients on parameters another rank owns"
    assert r["ok"], f"{case} at {world_size} ranks: max diff {r['max_diff']}"
    if world_size == 1:
        assert r["bitwise"]
    model, *_ = sharded._build(sharded.CASES[case], False)
    assert sum(r["owned"]) == len(list(model.parameters()))   # every parameter owned exactly once


ZERO2 = [f"ZeRO-2: {c}" for c in CASES] + [f"ZeRO-2, DDP case: {c}" for c in common.VERIFY_CASES]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("case", ZERO2)
def test_zero2_matches_unsharded_training(world_size, case):
    r = verification("06_sharded_optimizer", world_size)[case]
    assert r["ok"], f"{case} at {world_size} ranks: max diff {r['max_diff']}"
    if case.startswith("ZeRO-2: "):
        assert r["stale_grads"] == 0   # no whole gradient is ever left on a parameter
        if world_size == 1:
            assert r["bitwise"]


def test_zero2_keeps_a_slice_of_the_gradients_and_reduce_scatters_during_backward():
    from conftest import verify_args
    import workers
    r = common.launch(workers.zero2_during_backward, verify_args(2))
    assert r["launched_in_backward"] >= 2 and r["whole_grads_after_backward"] == 0
    assert r["slice_numel"] * 2 == r["padded_numel"] and r["pieces_cover"]


def test_zero2_without_the_reduce_scatter_fails():
    from conftest import verify_args
    import workers
    r = common.launch(workers.zero2_without_reduction, verify_args(2))
    assert not r["ok"] and r["max_diff"] > 1e-4


@pytest.mark.parametrize("world_size", [3, 4])
def test_a_rank_that_owns_nothing_still_steps(world_size):
    r = verification("06_sharded_optimizer", world_size)["rank_owns_nothing"]
    assert r["ok"] and 0 in r["owned"] and sum(r["owned"]) == 2


def test_is_a_real_optimizer_with_full_hyperparameters(one_rank):
    model = torch.nn.Linear(3, 2)
    opt = sharded.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups[0]["lr"] == 0.01 and "betas" in opt.param_groups[0]  # inner defaults visible
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched.step()
    assert opt.optim.param_groups[0]["lr"] == pytest.approx(0.01)    # copied at the next step
    opt.step()
    assert opt.optim.param_groups[0]["lr"] == pytest.approx(0.001)


def test_zero2_reads_the_gradient_flags_back_only_where_this_rank_lacked_a_gradient(one_rank, monkeypatch):
    """ZeRO-2's step reads a bucket's summed "gave a gradient" flags (a copy to the host: on
    a GPU a wait that idles it before the optimizer) only where this rank gave no gradient
    for some parameter; a parameter none gave keeps .grad None and is not stepped."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    opt = sharded.ShardedGradientOptimizer(model.parameters(), torch.optim.SGD, module=model, lr=0.1)
    reads, real = [], torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.numel()) or real(t))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    assert reads == []
    opt.zero_grad()
    before = model[1].weight.detach().clone()
    model[0](torch.randn(4, 3)).sum().backward()   # the second layer gets no gradient
    opt.step()
    assert len(reads) == len(opt.buckets) and torch.equal(model[1].weight, before)
    assert all(piece.grad is None for p, piece, _ in opt.grad_shards() if p is model[1].weight)


@pytest.mark.parametrize("kind", ["ShardedOptimizer", "ShardedGradientOptimizer"])
def test_a_group_of_one_makes_no_collective_and_steps_bitwise_as_the_plain_optimizer(one_rank, kind):
    """On one rank (a GPU's usual benchmark) each rank owns everything: ZeRO-1 broadcasts
    nothing, ZeRO-2 neither reduce-scatters, all-reduces its flags nor all-gathers; the
    weights stay bitwise the plain AdamW's, with a layer that gets no gradient."""
    import copy
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 6), torch.nn.Linear(6, 2))
    ref = copy.deepcopy(model)
    extra = {"module": model} if kind == "ShardedGradientOptimizer" else {}
    opt = getattr(sharded, kind)(model.parameters(), torch.optim.AdamW, lr=1e-2, **extra)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with common.count_collectives() as seen:
        for step in range(3):
            x = torch.randn(4, 6)
            for m, o in ((model, opt), (ref, ref_opt)):
                out = m[2](m[0](x)) if step == 1 else m(x)   # step 1: the middle layer gets no gradient
                out.pow(2).sum().backward()
                o.step()
                o.zero_grad()
    assert seen.calls == 0
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_greedy_assignment_balances_bytes(monkeypatch):
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 7, 5, 4, 3, 1)]
    opt = sharded.ShardedOptimizer(params, torch.optim.SGD, lr=0.1)
    loads = [sum(p.numel() for p in opt.owned_params(r)) for r in (0, 1)]
    assert sorted(loads) == [15, 15]


def test_state_dict_belongs_to_one_rank(one_rank):
    model = torch.nn.Linear(3, 2)
    opt = sharded.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01)
    state = opt.state_dict()
    state["rank"] = 1
    with pytest.raises(ValueError, match="own file.*consolidate_state_dict"):
        opt.load_state_dict(state)


def test_script_writes_memory_and_timing(tmp_path):
    p = run_inline("06_sharded_optimizer.py", "--world-size", "2", "--model-size", "nano", "--steps", "2",
                   "--warmup", "1", "--no-verify", "--context-length", "16", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert "deprecated" not in p.stderr   # only the kit's own lines (torch >= 2.14 renamed two collectives)
    rows = json.loads((tmp_path / "06_sharded_optimizer.json").read_text())["rows"]
    assert [r["method"] for r in rows] == list(sharded.NAMES.values())
    mem = json.loads((tmp_path / "06_sharded_memory.json").read_text())
    after = {(r["optimizer"], r["rank"]): r for r in mem["rows"] if r["point"] == "after optimizer step"}
    for rank in (0, 1):  # AdamW keeps 2 floats per parameter; sharded about half of that per rank
        plain, shard = after[("plain", rank)], after[("sharded", rank)]
        assert plain["opt_state_MB"] == pytest.approx(2 * plain["params_MB"], rel=0.01)
        assert shard["opt_state_MB"] < 0.6 * plain["opt_state_MB"]
    assert mem["summary"]["opt_state_ratio"] <= mem["summary"]["opt_state_bar"]
    stages = {r["method"]: r for r in json.loads((tmp_path / "06_zero_stages.json").read_text())["rows"]}
    assert [r["stage"] for r in stages.values()] == [0, 1, 1, 2, 2, 2, 3, 3]
    plain, one = stages["DDPBucketed + AdamW"], stages["DDPBucketed + ShardedOptimizer (ours)"]
    two, three = stages["ShardedGradientOptimizer, 4 MB buckets (ours)"], stages["FSDP (07, ours)"]
    # what each stage keeps between steps: optimizer state, then gradients, then parameters halved
    assert one["opt_state_MB"] < 0.6 * plain["opt_state_MB"] and one["grads_MB"] == pytest.approx(plain["grads_MB"])
    assert two["grads_MB"] < 0.6 * one["grads_MB"] and two["params_MB"] == pytest.approx(one["params_MB"])
    assert three["params_MB"] < 0.6 * two["params_MB"]
    for name, r in stages.items():
        assert r["step_peak_MB"] > r["state_MB"] * 0.5 and r["step_ms"] > 0
        if name in sharded.TWINS:
            assert r["vs_torch_min"] <= r["vs_torch"] <= r["vs_torch_max"]


@pytest.mark.parametrize("worker", ["resume_run", "resume_run_zero2"])
@pytest.mark.parametrize("first, then", [(2, 4), (4, 2)])
def test_a_consolidated_checkpoint_resumes_on_another_world_size(tmp_path, first, then, worker):
    from conftest import verify_args
    run = getattr(sharded, worker)
    path = str(tmp_path / "checkpoint.pt")
    whole = common.launch(run, verify_args(first), path, 0, 6, 3, 16)
    saved = torch.load(path, weights_only=True)
    assert saved["optim"]["consolidated"] and len(saved["optim"]["state"]) == len(whole)   # every parameter's state
    resumed = common.launch(run, verify_args(then), path, 3, 6, None, 16)
    for k in whole:
        torch.testing.assert_close(resumed[k], whole[k])
    saved["optim"]["state"] = {}   # the control: AdamW starting its moments again ends elsewhere
    torch.save(saved, path)
    fresh = common.launch(run, verify_args(then), path, 3, 6, None, 16)
    assert max((fresh[k] - whole[k]).abs().max().item() for k in whole) > 1e-4

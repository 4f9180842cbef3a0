import itertools
import json
import os
import random
import time

import pytest
import torch

import common
from conftest import ROOT, load, refused, run_inline, run_script, seconds, workers_left, verify_args

pp = load("09_pipeline_parallel")
_cache = {}


def verification(world_size, n_stages, microbatches=(1, 4, 8)):
    key = (world_size, n_stages)
    if key not in _cache:
        _cache[key] = common.launch(pp.verify, verify_args(world_size), n_stages, list(microbatches),
                                    list(pp.SCHEDULES), 2, list(pp.RECOMPUTE))
    return _cache[key]


@pytest.mark.parametrize("world_size, n_stages", [(2, 2), (4, 4), (4, 2)])
@pytest.mark.parametrize("schedule", list(pp.SCHEDULES))
@pytest.mark.parametrize("m", [1, 4, 8])
def test_every_stage_matches_one_process(world_size, n_stages, schedule, m):
    """The LM tied and clipped by the whole model's norm, every schedule (interleaved with 2
    chunks a stage: 9 blocks cut by cost into 4 or 8 chunks), against one process."""
    if not pp.runs(schedule, m, n_stages):
        assert not any(k.startswith(f"{schedule}") and k.endswith(f", m {m}") for k in verification(world_size, n_stages))
        return   # interleaved needs m a multiple of p: not run (main refuses it when asked for)
    res = verification(world_size, n_stages)
    [(case, r)] = [(k, v) for k, v in res.items() if k.split(",")[0].split()[0] == schedule
                   and k.split(", m ")[1].split()[0] == str(m) and "recompute" not in k]
    assert r["ok"], f"{case}: max diff {r['max_diff']}"
    if (world_size, n_stages) == (4, 2):
        assert "2 replicas" in case   # pipeline x data: DDPBucketed over each stage's replicas


@pytest.mark.parametrize("world_size, n_stages", [(2, 2), (4, 4), (4, 2)])
@pytest.mark.parametrize("schedule", list(pp.SCHEDULES))
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_changes_no_bit(world_size, n_stages, schedule, mode):
    res = verification(world_size, n_stages)
    cases = [k for k in res if k.startswith(schedule) and f"recompute {mode}" in k]
    if not pp.recompute_runs(mode, schedule):
        assert not cases
        return
    [case] = cases
    assert ", m 8," in case and res[case]["ok"], f"{case}: max diff {res[case]['max_diff']}"
    plain = res[case.split(", recompute")[0]]
    assert res[case]["digest"] == plain["digest"]


def test_a_recomputation_that_differs_from_the_forward_fails():
    import workers
    r = common.launch(workers.pipeline_recompute_perturbed, verify_args(2))
    assert all(not v["ok"] for k, v in r.items() if "recompute full" in k) and any("recompute full" in k for k in r)


ORDERS = [(s, p, m, v) for p in (2, 3, 4) for m in (1, 2, 3, 4, 6, 8) for s in pp.SCHEDULES
          for v in ((2, 3) if s == "interleaved" else (1,)) if pp.runs(s, m, p)]


@pytest.mark.parametrize("schedule, p, m, v", ORDERS)
def test_every_schedule_order_keeps_the_dependency_rules(schedule, p, m, v):
    """Every action once; F before B before W on a rank; the previous chunk's F before a
    chunk's F and the next chunk's B before its B (a simulation in which every rank runs
    its list: no deadlock); sends and receives between two ranks in the same order."""
    orders = [pp.SCHEDULES[schedule](m, s, p, v) for s in range(p)]
    assert pp.check_orders(orders, m, v) == []
    held = [pp.held_peak(o, [1.0 / v] * v, [1.0 / v] * v) for o in orders]   # in micro-batches
    if schedule == "1f1b":
        assert held == [min(p - s, m) for s in range(p)]   # 1F1B holds at most p - s micro-batches
    if schedule == "interleaved":
        assert held == pytest.approx([min(2 * (p - s - 1) + (v - 1) * p + 1, m * v) / v for s in range(p)])
    if schedule == "zb1":
        assert max(held) <= p   # forwarded and not yet W'd: 1F1B's peak, on every stage


@pytest.mark.parametrize("wrong, problem", [
    (lambda o: [o[0], [a for a in o[1] if a[0] == "B"] + [a for a in o[1] if a[0] != "B"]], "out of order"),
    (lambda o: [o[0][:-1], o[1]], "not every action once"),
    (lambda o: [[("B", 0, 0)] + [a for a in o[0] if a != ("B", 0, 0)], o[1]], "out of order"),
    (lambda o: [o[0], o[1][1:2] + o[1][:1] + o[1][2:]], "deadlock"),
])
def test_the_order_check_fails_a_wrong_order(wrong, problem):
    orders = [pp.one_f_one_b_order(4, s, 2) for s in range(2)]
    assert any(problem in msg for msg in pp.check_orders(wrong(orders), 4))


def test_sends_in_another_order_than_the_receives_are_caught():
    orders = [pp.one_f_one_b_order(4, s, 2) for s in range(2)]
    orders[0] = [("F", 0, 1), ("F", 0, 0)] + [a for a in orders[0] if a[0] != "F" or a[2] > 1]   # F1 sent first
    assert any("different orders" in msg for msg in pp.check_orders(orders, 4))


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (3, 6), (4, 4)])
def test_the_bubble_on_paper_is_the_closed_form(p, m):
    assert pp.bubble_on_paper("gpipe", m, p) == pytest.approx([(p - 1) / (m + p - 1)] * p)
    assert pp.bubble_on_paper("1f1b", m, p) == pytest.approx([(p - 1) / (m + p - 1)] * p)
    for v in (2, 3):
        assert pp.bubble_on_paper("interleaved", m, p, v) == pytest.approx([(p - 1) / (v * m + p - 1)] * p)
    assert pp.bubble_on_paper("zb1", m, p) == pytest.approx([(p - 1) / (3 * m + p - 1)] * p)   # a third of 1F1B's


def test_interleaved_chunks_follow_the_model_order_and_keep_names():
    model = common.TransformerLM(32, 64, 9, 2, context_length=8)
    stages = [pp.LMStage(model, s, 2, 2) for s in range(2)]
    # chunks 0..3 are stage 0 chunk 0, stage 1 chunk 0, stage 0 chunk 1, stage 1 chunk 1
    ranges = [stages[k % 2].ranges[k // 2] for k in range(4)]
    assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])) and ranges[-1][1] == 9
    names = sorted(n for st in stages for n, _ in st.named_parameters())
    assert names == sorted(n for n, _ in model.named_parameters())


def test_balanced_split_minimizes_the_largest_stage():
    rng = random.Random(0)
    for _ in range(50):
        costs = [rng.uniform(1, 10) for _ in range(rng.randint(2, 9))]
        p = rng.randint(1, len(costs))
        cuts = pp.balanced_split(costs, p)
        assert cuts[0] == 0 and cuts[-1] == len(costs) and all(a < b for a, b in zip(cuts, cuts[1:]))
        worst = max(sum(costs[a:b]) for a, b in zip(cuts, cuts[1:]))
        best = min(max(sum(costs[a:b]) for a, b in zip((0,) + c, c + (len(costs),)))
                   for c in itertools.combinations(range(1, len(costs)), p - 1))
        assert worst == pytest.approx(best)


def test_one_stage_counts_activations_held_gpipe_m_and_1f1b_one(one_rank):
    torch.manual_seed(0)
    stage = pp.LMStage(common.build_lm("nano", 16, "cpu"), 0, 1)
    x, y = common.lm_batch(8, 16, 0, 0, "cpu")
    peaks = {}
    for schedule in pp.SCHEDULES:
        pipe = pp.Pipeline(stage, 4, pp.lm_loss, schedule, count_activations=True)
        loss = pipe.step(x, y)
        assert loss.item() == pytest.approx(common.build_lm("nano", 16, "cpu")(x, y).item(), rel=1e-5)
        peaks[schedule] = pipe.peak_activation_bytes
    assert peaks["gpipe"] == pytest.approx(4 * peaks["1f1b"], rel=0.01)   # 4 micro-batches held against 1


def test_zb1_frees_what_w_kept_once_w_has_run(one_rank, monkeypatch):
    """Each deferred linear keeps its input and output gradient for W; once W has run and
    the step is over, none of them is alive. (Each linear's node held the stash that held
    the inputs whose graph leads back to those nodes: a cycle through autograd's C++ graph
    that no garbage collection frees, a step's inputs and gradients leaked each step.)"""
    import gc
    import weakref
    kept, weight_gradients = [], pp._weight_gradients

    def spy(stash, through_autograd=False):
        kept.extend(weakref.ref(t) for entry in stash for t in entry[2:])
        return weight_gradients(stash, through_autograd)
    monkeypatch.setattr(pp, "_weight_gradients", spy)
    pipe = pp.Pipeline(pp.LMStage(common.build_lm("nano", 16, "cpu"), 0, 1), 2, pp.lm_loss, "zb1")
    x, y = torch.randint(0, 100, (2, 2, 16))
    pipe.step(x, y)
    gc.collect()
    # 2 micro-batches x (2 blocks x 4 linears + the head) x (input, output gradient)
    assert len(kept) == 2 * (2 * 4 + 1) * 2 and not [r for r in kept if r() is not None]


def test_a_failing_stage_ends_the_job_while_its_neighbour_waits_in_recv(tmp_path):
    p = run_script(str(ROOT / "tests" / "workers.py"), str(tmp_path), "pipeline_stage_fails", timeout=120)
    assert time.time() - float((tmp_path / "failed_at").read_text()) < seconds(20)   # from the failure to the end
    assert p.returncode == 1 and "rank 1 failed" in p.stderr and "stage 1 broke on purpose" in p.stderr
    for f in tmp_path.glob("*.pid"):
        with pytest.raises(ProcessLookupError):
            os.kill(int(f.read_text()), 0)


def test_script_writes_table_timelines_and_memory(tmp_path):
    p = run_inline("09_pipeline_parallel.py", "--stages", "2", "--microbatches", "1", "2", "--model-size", "mini",
                   "--steps", "1", "--warmup", "0", "--no-verify", "--recompute", "selective", "full",
                   "--context-length", "32", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    rc = {r["recompute"]: r for r in json.loads((tmp_path / "09_recompute.json").read_text())["rows"]}
    assert list(rc) == ["none", "selective", "full"]
    for mode, r in rc.items():   # one micro-batch: counted = formula (to a scalar); the 1F1B peak near it
        assert r["mb_act_MB"] == pytest.approx(r["mb_formula_MB"], rel=1e-5), mode
        assert r["peak_act_MB"] == pytest.approx(r["peak_formula_MB"], rel=0.01), mode
        assert r["step_ms"] > 0 and (mode == "none" or r["vs_none_min"] <= r["vs_none"] <= r["vs_none_max"])
    assert rc["full"]["mb_act_MB"][0] < rc["selective"]["mb_act_MB"][0] < rc["none"]["mb_act_MB"][0]
    rows = {r["method"]: r for r in json.loads((tmp_path / "09_pipeline_parallel.json").read_text())["rows"]}
    ours = lambda s, m, split="measured": rows[pp.ours_name(s, m, split)]  # noqa: E731
    assert set(rows) == {pp.ours_name(s, m, sp) for s in ("gpipe", "1f1b", "zb1") for m in (1, 2) for sp in pp.SPLITS} \
        | {pp.ours_name("interleaved", 2, sp) for sp in pp.SPLITS} \
        | {"gpipe, m 1 (torch)", "zb1, m 1 (torch)"} | {f"{s}, m 2 (torch)" for s in pp.SCHEDULES}
    for name, r in rows.items():   # torch's 1F1B needs m >= p, interleaved groups of p micro-batches
        assert r["step_ms"] > 0 and r["theory"] == pytest.approx(sum(pp.bubble_on_paper(r["schedule"], r["microbatches"], 2,
                                                                                  r["chunks"])) / 2)
        if name.endswith("(ours)"):   # the schedule on paper with these stages' times: profiled, and as they ran
            assert 0 <= r["bubble"] < 1 and len(r["bubble_per_stage"]) == 2 and len(r["cuts"]) == 2 * r["chunks"] + 1
            assert r["theory_profiled"] == pytest.approx(sum(pp.bubble_on_paper(r["schedule"], r["microbatches"], 2,
                                                                        r["chunks"], r["chunk_costs"])) / 2)
            assert 0 <= r["theory_split"] < 1 and len(r["theory_split_per_stage"]) == 2 and r["message_ms"] >= 0
        if name.endswith("measured split (ours)"):
            assert r["peak_act_MB"] > 0 and r["p2p_MB"] == pytest.approx(r["p2p_formula_MB"])   # counted = formula
            assert r["peak_act_MB"] == pytest.approx(r["act_formula_MB"], rel=0.05)
    assert ours("interleaved", 2)["p2p_MB"] == pytest.approx(3 * ours("1f1b", 2)["p2p_MB"])
    assert ours("gpipe", 2)["vs_torch_min"] <= ours("gpipe", 2)["vs_torch"]
    assert rows["gpipe, m 2 (torch)"]["cuts"] == ours("gpipe", 2)["cuts"]   # torch's stages on the same split
    for r in json.loads((tmp_path / "09_split.json").read_text())["rows"]:   # the slowest chunk: as fast as it can be
        flops = ours("interleaved" if r["chunks"] > 1 else "1f1b", r["microbatches"], "flops")
        measured = ours("interleaved" if r["chunks"] > 1 else "1f1b", r["microbatches"])
        assert max(measured["chunk_ms"]) <= max(flops["chunk_ms"]) + 1e-9
    for schedule in pp.SCHEDULES:
        assert (tmp_path / f"09_timeline_{schedule}.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv, words", [
    (["--stages", "5"], "--stages 5 x --chunks 2 is more chunks than blocks"),
    (["--stages", "10", "--schedule", "1f1b"], "--stages x --replicas: 10 processes on"),
    (["--stages", "8", "--schedule", "1f1b", "--model-size", "mini", "--no-verify"],
     "--stages 8 is more chunks than blocks"),
    (["--stages", "1"], "argument --stages: must be at least 2"),
    (["--stages", "4", "--model-size", "nano", "--schedule", "1f1b"], "nano has 2 blocks"),
    (["--stages", "4", "--chunks", "3", "--schedule", "interleaved", "--microbatches", "4"],
     "--stages 4 x --chunks 3 is more chunks than blocks: mini8 has 8 blocks"),
    (["--schedule", "interleaved", "--microbatches", "1", "2"], "--microbatches 1 is not a multiple of 2"),
    (["--schedule", "zb2"], "unknown --schedule 'zb2'"),
    (["--chunks", "0"], "argument --chunks: must be at least 1"),
    (["--microbatches", "3", "--batch-size", "8"], "does not split into 1 x 3 micro-batches"),
    (["--replicas", "3", "--stages", "2", "--batch-size", "8"], "does not divide into 3 ranks"),
    (["--recompute", "full", "--schedule", "zb1"], "--recompute full with --schedule zb1"),
])
def test_bad_input_exits_2_with_one_line(argv, words):
    assert words in refused("09_pipeline_parallel.py", *argv)


def test_under_torchrun_a_depth_that_does_not_divide_the_world_is_refused():
    p = run_script("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "09_pipeline_parallel.py",
                   "--stages", "4", timeout=120)
    assert p.returncode != 0 and "--stages 4 does not divide the world size 2" in p.stderr
    assert not workers_left()


def test_staging_through_host_memory_gives_the_same_gradients():
    import workers   # forced on the CPU: on a GPU, gloo's send/recv need it; every schedule
    assert common.launch(workers.pipeline_staged_equals_direct, verify_args(2)) == {s: [True, True] for s in pp.SCHEDULES}


def test_a_refusal_concerns_only_what_the_command_runs():
    # nano has 2 blocks, the verification LM 9: 4 stages verify, but cannot be timed on nano
    assert "nano has 2 blocks" in refused("09_pipeline_parallel.py", "--stages", "4", "--model-size", "nano")
    p = run_inline("09_pipeline_parallel.py", "--stages", "4", "--model-size", "nano", "--no-bench",
                   launch=lambda *a, **k: {"case": {"ok": True, "max_diff": 0.0}})
    assert p.returncode == 0, p.stderr


def test_the_split_makes_the_slowest_stage_as_fast_as_it_can_be_counting_the_ends():
    """balanced_split with what the first and last runs carry besides their layers (the
    embedding; the head and loss): against every way of cutting, by brute force."""
    import itertools
    costs, first, last = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0], 7.0, 11.0
    for k in (2, 3, 4):
        cuts = pp.balanced_split(costs, k, first, last)
        worst = lambda cs: max(sum(costs[a:b]) + first * (a == 0) + last * (b == len(costs))  # noqa: E731
                               for a, b in zip(cs, cs[1:]))
        best = min(worst([0, *c, len(costs)]) for c in itertools.combinations(range(1, len(costs)), k - 1))
        assert cuts[0] == 0 and cuts[-1] == len(costs) and worst(cuts) == best
    assert pp.balanced_split([1.0] * 8, 2, first=0.0, last=3.0) == [0, 5, 8]   # the head weighs on the last stage


def test_measured_costs_cut_the_lm_and_give_its_chunks_times():
    """measure_costs on the LM's pieces (one process: nothing to agree on), the stages cut by
    them, each chunk's F and B for the schedule on paper; cuts given outright; and what the
    measurement leaves: no gradient."""
    model = common.build_lm("nano", 16, "cpu")
    tokens = torch.randint(0, common.VOCAB_SIZE, (2, 16))
    costs = pp.measure_costs(pp.lm_pieces(model, pp.lm_loss), (tokens, tokens), repeats=2)
    n = len(model.blocks)
    assert len(costs) == n + 2 and all(f > 0 and b > 0 for f, b in costs)
    assert all(p.grad is None for p in model.parameters()) is False   # the pieces' backward left gradients ...
    model.zero_grad(set_to_none=True)
    stage = pp.LMStage(model, 1, 2, costs=costs)
    assert stage.costs == costs and len(stage.cuts) == 3 and stage.ranges == [(stage.cuts[1], 2)]
    assert stage.cuts == pp.balanced_split([f + b for f, b in costs[1:]], 2, first=sum(costs[0]))
    times = pp.chunk_costs(costs, [0, 1, 2])
    assert times["F"][0] == pytest.approx(costs[0][0] + costs[1][0]) and \
        times["B"][1] == pytest.approx(costs[2][1] + costs[3][1])
    alone = pp.chunk_costs(costs, [0, 2, 3])   # the head alone on the last stage
    assert alone["F"][1] == costs[3][0] and alone["F"][0] == pytest.approx(sum(f for f, _ in costs[:3]))
    assert pp.LMStage(model, 0, 2, cuts=[0, 1, 2]).ranges == [(0, 1)]
    with pytest.raises(ValueError, match="cuts"):
        pp.LMStage(model, 0, 2, cuts=[0, 2, 2])
    with pytest.raises(ValueError, match="pieces"):
        pp.LMStage(model, 0, 2, costs=costs[1:])
    measured = pp.LMStage(model, 0, 2, costs="measure", microbatch=(2, 16))
    assert len(measured.costs) == n + 2 and all(p.grad is None for p in model.parameters())


def test_unequal_stages_on_paper_give_the_bubble_of_their_slowest():
    """theory with each chunk's times: equal stages give the equal-stage formula; a stage
    twice as slow leaves the other idle as long again, which the formula counts."""
    equal = {"F": [1.0, 1.0], "B": [2.0, 2.0]}
    assert pp.bubble_on_paper("1f1b", 8, 2, 1, equal) == pytest.approx(pp.bubble_on_paper("1f1b", 8, 2))
    slow = pp.bubble_on_paper("1f1b", 8, 2, 1, {"F": [2.0, 1.0], "B": [4.0, 2.0]})
    assert slow[1] > 0.4 > slow[0]   # stage 1 waits on stage 0 at every micro-batch


@pytest.mark.parametrize("schedule, chunks", [("1f1b", 1), ("interleaved", 2), ("zb1", 1)])
def test_a_step_on_paper_replays_the_run_its_timelines_and_message_time_describe(schedule, chunks):
    """A run made on paper (unequal stages, each message 0.3 units in flight) gives timelines
    like a Pipeline's: message_time finds the 0.3 from the actions that waited, and
    bubble_on_paper_of_step rebuilds every stage's idle share from them."""
    p, m = 2, 4
    cost = {"F": [1.0, 1.5, 0.7, 1.2][:p * chunks], "B": [2.0, 2.4, 1.5, 2.2][:p * chunks], "send": 0.3}
    if schedule == "zb1":
        cost["W"] = [0.5, 0.9]
    orders = [pp.SCHEDULES[schedule](m, s, p, chunks) for s in range(p)]
    spans = pp.simulate(orders, chunks, cost)
    end = max(a[-1] for lane in spans for a in lane)
    idle = [1 - sum(b - a for *_, a, b in lane) / end for lane in spans]
    timelines = [[(k, c, i, a, b) for k, c, i, a, b in lane] for lane in spans]
    waits = []   # an action waited where it started later than its rank was free
    for lane in spans:
        free, mine = 0.0, {}
        for k, c, i, a, b in lane:
            mine[(k, c, i)] = a - free
            free = b
        waits.append(mine)
    steps = [(0.0, tl, w) for tl, w in zip(timelines, waits)]
    assert pp.message_time(steps, p, chunks) == pytest.approx(0.3)
    assert pp.bubble_on_paper_of_step(schedule, m, p, chunks, timelines, 0.3) == pytest.approx(idle)
    assert sum(pp.bubble_on_paper_of_step(schedule, m, p, chunks, timelines)) < sum(idle)   # free sends: less idle

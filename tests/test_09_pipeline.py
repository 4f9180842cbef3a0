import itertools
import json
import os
import random
import time

import pytest
import torch

import common
from conftest import ROOT, load, refused, run_inline, run_script, spawned_workers, verify_args

pp = load("09_pipeline_parallel")
_cache = {}


def verification(world_size, n_stages, microbatches=(1, 4, 8)):
    key = (world_size, n_stages)
    if key not in _cache:
        _cache[key] = common.launch(pp.verify, verify_args(world_size), n_stages, list(microbatches))
    return _cache[key]


@pytest.mark.parametrize("world_size, n_stages", [(2, 2), (4, 4), (4, 2)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_every_stage_matches_one_process(world_size, n_stages, schedule, m):
    res = verification(world_size, n_stages)
    [(case, r)] = [(k, v) for k, v in res.items() if k.startswith(f"{schedule}, ") and k.split(", m ")[1].startswith(f"{m}")
                   and f" {m}" == " " + k.split(", m ")[1].split()[0]]
    assert r["ok"], f"{case}: max diff {r['max_diff']}"
    if (world_size, n_stages) == (4, 2):
        assert "2 replicas" in case   # pipeline x data: DDPBucketed over each stage's replicas


@pytest.mark.parametrize("p, m", [(2, 1), (2, 4), (4, 8), (4, 2), (3, 5)])
def test_schedules_run_every_micro_batch_once_and_1f1b_bounds_what_a_stage_holds(p, m):
    for s in range(p):
        for name, order in pp.SCHEDULES.items():
            acts = order(m, s, p)
            assert sorted(acts) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
            held, peak = set(), 0
            for kind, i in acts:
                if kind == "F":
                    held.add(i)
                else:
                    assert i in held   # a micro-batch's backward comes after its forward
                    held.remove(i)
                peak = max(peak, len(held))
            assert peak == (m if name == "gpipe" else min(p - s, m))


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


def test_a_failing_stage_ends_the_job_while_its_neighbour_waits_in_recv(tmp_path):
    t0 = time.time()
    p = run_script(str(ROOT / "tests" / "workers.py"), str(tmp_path), "pipeline_stage_fails", timeout=60)
    assert time.time() - t0 < 30
    assert p.returncode == 1 and "rank 1 failed" in p.stderr and "stage 1 broke on purpose" in p.stderr
    for f in tmp_path.glob("*.pid"):
        with pytest.raises(ProcessLookupError):
            os.kill(int(f.read_text()), 0)


def test_script_writes_table_timelines_and_memory(tmp_path):
    p = run_inline("09_pipeline_parallel.py", "--stages", "2", "--microbatches", "1", "2", "--model-size", "nano",
                   "--steps", "1", "--warmup", "0", "--no-verify", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    rows = {r["method"]: r for r in json.loads((tmp_path / "09_pipeline_parallel.json").read_text())["rows"]}
    assert set(rows) == {"gpipe, m 1 (ours)", "gpipe, m 1 (torch)", "1f1b, m 1 (ours)", "gpipe, m 2 (ours)",
                         "gpipe, m 2 (torch)", "1f1b, m 2 (ours)", "1f1b, m 2 (torch)"}   # torch's 1F1B needs m >= p
    for name, r in rows.items():
        assert r["step_ms"] > 0 and r["theory"] == pytest.approx(1 / (r["microbatches"] + 1))
        if name.endswith("(ours)"):
            assert 0 <= r["bubble"] < 1 and len(r["bubble_per_stage"]) == 2 and r["peak_act_MB"] > 0
    assert rows["gpipe, m 2 (ours)"]["vs_torch_min"] <= rows["gpipe, m 2 (ours)"]["vs_torch"]
    for schedule in ("gpipe", "1f1b"):
        assert (tmp_path / f"09_timeline_{schedule}.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv, words", [
    (["--stages", "5"], "a pipeline needs 2 to 4 stages"),
    (["--stages", "1"], "a pipeline needs 2 to"),
    (["--stages", "4", "--model-size", "nano"], "nano has 2 blocks"),
    (["--microbatches", "3"], "does not split into 1 x 3 micro-batches"),
    (["--replicas", "3"], "does not divide into 3 ranks"),
])
def test_bad_input_exits_2_with_one_line(argv, words):
    assert words in refused("09_pipeline_parallel.py", *argv)


def test_under_torchrun_a_depth_that_does_not_divide_the_world_is_refused():
    p = run_script("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "09_pipeline_parallel.py",
                   "--stages", "4", timeout=120)
    assert p.returncode != 0 and "--stages 4 does not divide the world size 2" in p.stderr
    assert not spawned_workers()


def test_staging_through_host_memory_gives_the_same_gradients():
    import workers   # forced on the CPU: on a GPU, gloo's send/recv need it
    assert common.launch(workers.pipeline_staged_equals_direct, verify_args(2)) == [True, True]


def test_a_refusal_concerns_only_what_the_command_runs():
    # nano has 2 blocks, the verification LM 4: 4 stages verify, but cannot be timed on nano
    assert "nano has 2 blocks" in refused("09_pipeline_parallel.py", "--stages", "4", "--model-size", "nano")
    p = run_inline("09_pipeline_parallel.py", "--stages", "4", "--model-size", "nano", "--no-bench",
                   launch=lambda *a, **k: {"case": {"ok": True, "max_diff": 0.0}})
    assert p.returncode == 0, p.stderr

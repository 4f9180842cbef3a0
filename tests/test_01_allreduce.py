import json

import pytest

from conftest import load, refused, verify_args

bench = load("01_allreduce_bench")


def test_tiny_grid_checks_sums_and_writes_results(tmp_path):
    # the worker checks every all-reduce against n(n+1)/2 and raises otherwise
    bench.main(["--world-sizes", "2", "4", "--sizes-mb", "0.01", "0.1", "--iters", "3", "--warmup", "1",
                "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "01_allreduce.json").read_text())
    rows = doc["rows"]
    assert {(r["ranks"], r["size_mb"]) for r in rows} == {(2, 0.01), (2, 0.1), (4, 0.01), (4, 0.1)}
    for r in rows:
        assert r["iters"] == 3 and len(r["all_ms"]) == 3
        assert 0 < r["min_ms"] <= r["time_ms"] <= r["max_ms"]
        n = r["ranks"]
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (n - 1) / n)
        assert r["algbw_GBps"] == pytest.approx(r["size_mb"] * 1e6 / (r["time_ms"] / 1e3) / 1e9)
    assert doc["machine"]["torch"] and doc["settings"]["sizes_mb"] == [0.01, 0.1]
    assert (tmp_path / "01_allreduce.json").stat().st_mode & 0o777 == 0o666 & ~bench.common.result_files.UMASK  # not private
    md = (tmp_path / "01_allreduce.md").read_text()
    assert "| gloo" in md and "busbw_GBps" in md
    for png in ("01_allreduce_time.png", "01_allreduce_busbw.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_nccl_without_gpus_is_skipped_with_a_note(capsys, tmp_path):
    jobs, notes = bench.plan(type("A", (), {"configs": ["nccl-cuda", "gloo-cpu"], "world_sizes": [2],
                                     "ops": ["all_reduce"]})(), 0)
    assert jobs == [("gloo", "cpu", 2, ["all_reduce"])]
    assert notes and "GPU" in notes[0]


def test_time_box_stops_early_but_keeps_measurements(tmp_path):
    bench.main(["--world-sizes", "2", "--sizes-mb", "0.01", "0.1", "--iters", "10000", "--warmup", "0",
                "--time-box", "0.5", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "01_allreduce.json").read_text())["rows"]
    assert rows[0]["time_boxed"] and 1 <= rows[0]["iters"] < 10000


def test_one_gpu_plan_runs_nccl_at_one_rank_and_gloo_cuda_at_all(capsys):
    # the plan `make gpu-01` asks for on a one-GPU machine; repeated configs run once
    args = type("A", (), {"configs": ["nccl-cuda", "gloo-cuda"], "world_sizes": [1, 2, 4, 6],
                          "ops": ["all_reduce"]})()
    jobs, notes = bench.plan(args, 1)
    assert jobs == [("nccl", "cuda", 1, ["all_reduce"])] + [("gloo", "cuda", n, ["all_reduce"]) for n in (1, 2, 4, 6)]
    assert len(notes) == 3 and all("NCCL needs" in n for n in notes)


def test_results_name_the_gpu_when_it_did_the_work(monkeypatch):
    common = bench.common
    monkeypatch.setattr(common.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(common.torch.cuda, "get_device_name", lambda i=0: "Fake GPU 80GB")
    monkeypatch.setattr(common.torch.cuda, "device_count", lambda: 1)
    assert common.machine_info("cuda")["device"] == "Fake GPU 80GB"
    assert common.machine_info("cpu")["device"].endswith("cores)")
    mixed = common.machine_info(None)["device"]   # 01 mixes CPU and GPU rows: both named
    assert "cores) + 1x Fake GPU 80GB" in mixed


def test_every_op_is_checked_and_reported_with_its_bus_factor_at_2_and_4_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("KIT_DEVICE_AUDIT", "1")   # 01's smoke job: every op under the device audit
    bench.main(["--ops", "all", "--world-sizes", "2", "4", "--sizes-mb", "0.0001", "0.001001", "--iters", "2",
                "--warmup", "0", "--out", str(tmp_path)])   # each op's result is checked in the worker
    doc = json.loads((tmp_path / "01_collectives.json").read_text())
    rows = doc["rows"]
    assert {(r["op"], r["ranks"]) for r in rows} == \
        {(op, n) for op in bench.OPS for n in (2, 4)} - {("all_reduce_2_groups", 2)}   # halves of one rank: nothing
    factor = {"all_reduce": lambda n: 2 * (n - 1) / n, "broadcast": lambda n: 1, "reduce": lambda n: 1,
              "all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_to_all": lambda n: (n - 1) / n, "ping_pong": lambda n: 1}
    for r in rows:
        n = r["ranks"] // 2 if r["op"] == "all_reduce_2_groups" else r["ranks"]
        f = factor.get(r["op"], factor["all_reduce"])(n)   # ring/tree/2 groups: all-reduce's
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * f)
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / (r["time_ms"] / 1e3) / 1e9)
        if r["op"] in ("all_gather", "reduce_scatter", "all_to_all"):   # rounded down to n parts
            assert r["bytes"] % (4 * r["ranks"]) == 0 and r["bytes"] <= r["size_mb"] * 1e6
    assert set(doc["ring_tree"]["gloo+cpu"]) == {"2", "4"}   # an alpha-beta fit per rank count
    for fit in doc["ring_tree"]["gloo+cpu"].values():
        assert fit["ring_all_reduce"]["alpha_us"] >= 0 and fit["model"]["small"] in ("ring", "tree")
    md = (tmp_path / "01_collectives.md").read_text()
    assert "| op" in md and "ring_all_reduce" in md and "alpha" in md
    for png in ("_time", "_busbw", "_ring_tree"):
        assert (tmp_path / f"01_collectives{png}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((tmp_path / "01_collectives_summary.json").read_text())["rows"]
    assert len(summary) == len({(r["op"], r["ranks"]) for r in rows})   # one row per op and rank count
    first = next(r for r in rows if r["op"] == "reduce" and r["ranks"] == 4 and r["size_mb"] == 0.0001)
    s4 = next(r for r in summary if r["op"] == "reduce" and r["ranks"] == 4)
    assert s4["time_ms_0.0001MB"] == first["time_ms"] and "busbw_0.001001MB" in s4
    assert not (tmp_path / "01_allreduce.json").exists()   # the all-reduce-only results are not touched


def test_from_scratch_all_reduce_at_3_and_6_ranks_with_sizes_the_ranks_do_not_divide(tmp_path):
    # 7 floats and 1001: neither divides by 3 or 6; the worker also compares both with
    # dist.all_reduce on random integers and floats, on the world and on a subgroup
    bench.main(["--ops", "ring_all_reduce", "tree_all_reduce", "ping_pong", "all_reduce_2_groups",
                "--world-sizes", "3", "6", "--sizes-mb", "0.000028", "0.004004", "--iters", "1", "--warmup", "0",
                "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "01_collectives.json").read_text())
    got = {(r["op"], r["ranks"], r["bytes"]) for r in doc["rows"]}
    for n in (3, 6):
        for op in ("ring_all_reduce", "tree_all_reduce", "ping_pong"):   # ping-pong at 3: rank 2 sits out
            assert {(op, n, 28), (op, n, 4004)} <= got
    assert {r["ranks"] for r in doc["rows"] if r["op"] == "all_reduce_2_groups"} == {6}
    assert "skipped all_reduce_2_groups at 3 ranks" in (tmp_path / "01_collectives.md").read_text()
    assert all(0 <= r["check_max_diff"] <= 1e-5 for r in doc["rows"] if r["op"].endswith("_all_reduce"))


def test_each_check_fails_when_the_op_does_not_run():
    import workers
    caught = bench.common.launch(workers.unrun_cases_fail_their_check, verify_args(4), bench.OPS)
    assert caught == {op: True for op in bench.OPS}


def test_the_copied_ring_and_tree_alone_equal_dist_all_reduce_at_3_ranks():
    import workers
    # rank 0: world and subgroup x ring and tree x direct and staged x 3 sizes, and 2 ping-pongs
    assert bench.common.launch(workers.copied_ring_and_tree, verify_args(3)) == 2 * 2 * 2 * 3 + 2


def test_unknown_op_is_refused():
    line = refused("01_allreduce_bench.py", "--ops", "all_reduce", "gossip")
    assert "unknown op(s) gossip" in line


def test_plan_drops_ops_a_world_size_cannot_run_with_a_note():
    args = type("A", (), {"configs": ["gloo-cpu"], "world_sizes": [1, 2, 3, 4],
                          "ops": ["all_reduce", "ping_pong", "all_reduce_2_groups"]})()
    jobs, notes = bench.plan(args, 0)
    assert jobs == [("gloo", "cpu", 1, ["all_reduce"]), ("gloo", "cpu", 2, ["all_reduce", "ping_pong"]),
                    ("gloo", "cpu", 3, ["all_reduce", "ping_pong"]),
                    ("gloo", "cpu", 4, ["all_reduce", "ping_pong", "all_reduce_2_groups"])]
    assert len(notes) == 4


def test_cost_model_and_fit_recover_known_alpha_and_beta():
    s = 1e6
    assert bench.ring_cost(4, s) == (6, 1.5 * s) and bench.ring_cost(2, s) == (2, s)
    assert bench.tree_cost(1, s) == (0, 0) and bench.tree_cost(2, s) == (2, 2 * s)
    assert bench.tree_cost(3, s) == (2, 4 * s) and bench.tree_cost(6, s) == (4, 8 * s)
    assert bench.tree_cost(4, s) == (4, 6 * s)   # level 0: 2 children, level 1: rank 1 has one (3)
    alpha, beta = 50e-6, 2e9
    rows = [{"op": op, "backend": "gloo", "device": "cpu", "ranks": n, "bytes": b, "size_mb": b / 1e6,
             "time_ms": 1e3 * (alpha * bench.COST[op](n, b)[0] + bench.COST[op](n, b)[1] / beta)}
            for op in bench.COST for n in (2, 4, 6) for b in (1e3, 1e5, 1e7)]
    a = bench.analyse(rows)["gloo+cpu"]
    assert set(a) == {2, 4, 6}
    for by_n in a.values():
        for op in bench.COST:
            f = by_n[op]
            assert f["alpha_us"] == pytest.approx(50) and f["beta_GBps"] == pytest.approx(2)
            assert f["max_rel_err"] < 1e-9
    assert a[6]["model"]["small"] == "tree" and a[6]["measured_tree_faster_at_mb"] == [0.001]
    # equal time: alpha (10 - 4) = (8 - 5/3) S / beta
    assert a[6]["model"]["equal_at_mb"] == pytest.approx(alpha * 6 * beta / (8 - 5 / 3) / 1e6)
    assert a[2]["model"] == {"small": "ring", "equal_at_mb": None}   # same steps, fewer bytes
    # falling times: no size term; the constant is the mean weighted by 1/t^2 (relative error)
    assert bench.fit_line([(1.0, 2.0), (3.0, 1.0)]) == (pytest.approx((2 / 4 + 1) / (1 / 4 + 1)), 0.0)

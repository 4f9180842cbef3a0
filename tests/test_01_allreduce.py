import json

import pytest

from conftest import load

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
    assert (tmp_path / "01_allreduce.json").stat().st_mode & 0o777 == 0o666 & ~bench.common._UMASK  # not private
    md = (tmp_path / "01_allreduce.md").read_text()
    assert "| gloo" in md and "busbw_GBps" in md
    for png in ("01_allreduce_time.png", "01_allreduce_busbw.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_nccl_without_gpus_is_skipped_with_a_note(capsys, tmp_path):
    jobs, notes = bench.plan(type("A", (), {"configs": ["nccl-cuda", "gloo-cpu"], "world_sizes": [2]})(), 0)
    assert jobs == [("gloo", "cpu", 2)]
    assert notes and "GPU" in notes[0]


def test_time_box_stops_early_but_keeps_measurements(tmp_path):
    bench.main(["--world-sizes", "2", "--sizes-mb", "0.01", "0.1", "--iters", "10000", "--warmup", "0",
                "--time-box", "0.5", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "01_allreduce.json").read_text())["rows"]
    assert rows[0]["time_boxed"] and 1 <= rows[0]["iters"] < 10000


def test_one_gpu_plan_runs_nccl_at_one_rank_and_gloo_cuda_at_all(capsys):
    # the plan `make gpu-01` asks for on a one-GPU machine; repeated configs run once
    args = type("A", (), {"configs": ["nccl-cuda", "gloo-cuda"], "world_sizes": [1, 2, 4, 6]})()
    jobs, notes = bench.plan(args, 1)
    assert jobs == [("nccl", "cuda", 1)] + [("gloo", "cuda", n) for n in (1, 2, 4, 6)]
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

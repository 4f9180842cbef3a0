import argparse
import json

import pytest

import common
from conftest import check_equivalence, load, run_inline

CASES = list(common.VERIFY_CASES)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("case", CASES)
def test_overlapped_ddp_matches_single_process(world_size, case):
    check_equivalence("04_overlap_ddp", world_size, case)


def event_logs(script, cls, cls_args=(), world_size=2, unused=False, uneven=False):
    import workers
    args = argparse.Namespace(script=script, cls=cls, cls_args=cls_args, unused=unused, uneven=uneven)
    return common.launch(workers.record_event_order, args, world_size=world_size, backend="gloo",
                         device="cpu", timeout=60)


def launches_during_backward(log):
    """For each step: how many all-reduces were launched before backward computed its last gradient."""
    counts, n, inside = [], 0, False
    for ev in log:
        if ev.startswith("step:"):
            n, inside = 0, True
        elif ev == "input_grad":
            counts.append(n)
            inside = False
        elif ev.startswith("all_reduce") and inside:
            n += 1
    return counts


def test_overlap_is_real_first_all_reduce_starts_before_backward_ends():
    for log in event_logs("04_overlap_ddp", "DDPIndividualParameters"):
        assert all(c >= 1 for c in launches_during_backward(log)), log
    # the control: naive DDP launches nothing until backward has returned
    for log in event_logs("02_naive_ddp", "NaiveDDP"):
        assert launches_during_backward(log) == [0, 0], log


def test_same_collectives_in_the_same_order_when_only_one_rank_uses_a_layer():
    logs = event_logs("04_overlap_ddp", "DDPIndividualParameters", unused=True, uneven=True)
    calls = [[e for e in log if e.startswith("all_reduce")] for log in logs]
    assert calls[0] == calls[1] and len(calls[0]) > 4


def test_script_writes_table_and_both_timelines(tmp_path):
    p = run_inline("04_overlap_ddp.py", "--world-size", "2", "--model-size", "nano", "--steps", "2",
                   "--warmup", "1", "--no-verify", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    rows = json.loads((tmp_path / "04_overlap_ddp.json").read_text())["rows"]
    assert [r["method"].split()[0] for r in rows] == ["naive", "flat", "overlapped"]
    for name in ("naive", "overlap"):
        assert (tmp_path / f"04_timeline_{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_timeline_draws_a_gpu_lane_from_cuda_events(tmp_path, monkeypatch):
    # what trace_step returns on a GPU: CPU phases, kernels, and communication
    overlap = load("04_overlap_ddp")
    events = [("compute", "forward", 0.0, 1.0), ("compute", "backward", 1.0, 3.0)] + \
             [("gpu", f"sm90_gemm_{i}", 0.1 * i, 0.1 * i + 0.05) for i in range(30)] + \
             [("comm", "ncclDevKernel_AllReduce", 2.0, 3.5)]
    saved = {}
    real_save = common.save_figure
    monkeypatch.setattr(common, "save_figure", lambda fig, path: (saved.update(fig=fig), real_save(fig, path)))
    overlap.draw_timeline(events, "test", str(tmp_path / "t.png"))
    ax = saved["fig"].axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["compute (CPU thread)", "GPU kernels", "communication"]
    gpu_bars = [c for c in ax.collections if len(c.get_paths()) == 30]
    assert len(gpu_bars) == 1   # the 30 kernels drawn as one collection, in the GPU lane
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"

"""common.py's helpers that every script leans on (the launcher's own behaviour is tested in
test_02_naive: failures, signals, torchrun)."""
import argparse

import torch

import common


def test_a_time_box_starts_no_further_method_one_after_another(one_rank):
    """time_methods one method after another (a GPU's way): past the box, the next method
    does not start; the first always runs; without a box every one runs."""
    ctx = common.Ctx(0, 1, 0, "gloo", torch.device("cpu"))
    args = argparse.Namespace(batch_size=2, context_length=8, seed=0, warmup=2, steps=1)
    built = []

    def method(name):
        def make():
            built.append(name)
            def step(batch, clock):
                with clock.phase("comm"):
                    pass
            return step
        return make
    methods = {name: method(name) for name in ("a", "b", "c")}
    rows = common.time_methods(ctx, args, methods, interleave=False, time_box=0.0)
    assert [r["method"] for r in rows] == ["a"] and built == ["a"]
    rows = common.time_methods(ctx, args, methods, interleave=False)
    assert [r["method"] for r in rows] == ["a", "b", "c"]


def test_steps_started_together_wait_for_the_slowest_rank_of_the_step_before():
    """start_together (09's and 10's pipelines: the bubble is the schedule's, not what the
    step before left): no rank begins a step before every rank has ended the one before;
    without it, rank 0 runs ahead of rank 1's 0.3 s steps."""
    import workers
    args = argparse.Namespace(batch_size=2, context_length=8, seed=0, warmup=2, steps=2, world_size=2,
                              backend="gloo", device="cpu")
    got = common.launch(workers.steps_start_together, args)
    for together, ranks in got.items():
        n = len(ranks[0])
        ahead = [any(ranks[r][k + 1][0] < ranks[q][k][1] for r in range(2) for q in range(2)) for k in range(n - 1)]
        assert n == 4 and (not any(ahead) if together else all(ahead)), (together, ahead)

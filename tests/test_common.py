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

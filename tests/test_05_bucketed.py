import json
import math
import types

import pytest
import torch
import torch.nn as nn

import common
from conftest import load, run_inline, run_script, verification
from test_04_overlap import event_logs, launches_during_backward

bucketed = load("05_bucketed_ddp")
CASES = [f"{case} [{cap}]" for cap in {**bucketed.TOY_CAPS, **bucketed.TOY_IN_PLACE} for case in common.VERIFY_CASES]


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("case", CASES)
def test_bucketed_ddp_matches_single_process(world_size, case):
    r = verification("05_bucketed_ddp", world_size)[case]
    assert r["ok"], f"{case} at {world_size} ranks: max diff {r['max_diff']}"
    if world_size == 1 and "accum" not in case and "everything" not in case:
        assert r["bitwise"]


@pytest.mark.parametrize("cap, expected", [("1 bucket", 1), ("2 buckets", 2), ("3 buckets", 3),
                                           ("cap < every parameter", 7)])
def test_bucket_caps_give_the_intended_bucket_counts(one_rank, cap, expected):
    model = common.ToyModel()
    ddp = bucketed.DDPBucketed(model, bucketed.TOY_CAPS[cap])
    assert len(ddp.buckets) == expected
    order = [p for b in ddp.buckets for p in b.params]
    assert order == list(model.parameters())[::-1]       # reverse parameters() order
    cap_bytes = bucketed.TOY_CAPS[cap] * 2**20
    for b in ddp.buckets:
        assert b.nbytes <= cap_bytes or len(b.params) == 1  # only a lone oversized parameter exceeds it


def test_buckets_split_by_dtype_skip_frozen_and_hold_tied_once(one_rank):
    model = common.ToyModel(tied=True, frozen=True, mixed=True)
    ddp = bucketed.DDPBucketed(model, 1000)
    params = [p for b in ddp.buckets for p in b.params]
    assert len(params) == len({id(p) for p in params})            # the tied weight once
    assert all(p is not model.fc1.bias for p in params)             # frozen: left out
    assert [b.buffer.dtype for b in ddp.buckets].count(torch.float64) == 1 and len(ddp.buckets) == 2
    for b in ddp.buckets:
        assert all(p.dtype == b.buffer.dtype for p in b.params)


@pytest.mark.parametrize("in_place", [None, 4096 / 2**20])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_are_views_into_bucket_storage(one_rank, set_to_none, in_place):
    """Each gradient is a view into its bucket's buffer; with ``in_place_mb``, one of that
    size or more stays the tensor autograd made (reduced where it lies, in the same call)."""
    torch.manual_seed(0)
    model = common.ToyModel()
    ddp = bucketed.DDPBucketed(model, bucketed.TOY_CAPS["2 buckets"], in_place_mb=in_place)
    big = {id(p) for p in model.parameters() if in_place is not None and p.numel() * 4 >= 4096}
    assert len(big) == (0 if in_place is None else 2)   # fc2's and fc3's weights
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad(set_to_none=set_to_none)
        torch.nn.functional.cross_entropy(ddp(torch.randn(4, 20)), torch.randint(0, 10, (4,))).backward()
        made = {id(p): p.grad.data_ptr() for p in model.parameters()}
        ddp.finish_gradient_synchronization()
        for b in ddp.buckets:
            assert b.buffer.numel() == sum(p.numel() for p in b.params if id(p) not in big) + len(b.params)
            for p, view in zip(b.params, b.views):
                if id(p) in big:
                    assert view is None and p.grad.data_ptr() == made[id(p)]
                    assert p.grad.untyped_storage().data_ptr() != b.buffer.untyped_storage().data_ptr()
                else:
                    assert p.grad.untyped_storage().data_ptr() == b.buffer.untyped_storage().data_ptr()
                    assert p.grad.data_ptr() == view.data_ptr()
        opt.step()


def test_in_place_buckets_wait_on_a_work_each_traced_once(one_rank):
    """A bucket that reduces gradients where they lie starts them with its group's own
    coalesced call and keeps that call's Work (torch's function hands back a Future instead,
    whose wait leaves NCCL's hold on the gradients to NCCL's watchdog: a GPU's next backward
    then allocates them anew). The flight recorder's hook sees each such call once, with its
    group, as asynchronous; and a call of torch's function once, as it was made."""
    import warnings

    import diagnostics
    import torch.distributed as dist
    seen = []

    class Watch:
        def enter(self, op, args, kwargs, group=None, async_op=False):
            seen.append((op, group, async_op))

        def exit(self, token, result):
            pass
    group = dist.new_group([0])   # not the world
    torch.manual_seed(0)
    model = common.ToyModel()
    ddp = bucketed.DDPBucketed(model, bucketed.TOY_CAPS["2 buckets"], process_group=group, in_place_mb=4096 / 2**20)

    def backward():
        model.zero_grad()
        torch.nn.functional.cross_entropy(ddp(torch.randn(4, 20)), torch.randint(0, 10, (4,))).backward()
    backward()
    ddp.finish_gradient_synchronization()   # (the first step rebuilds the buckets)
    with diagnostics.traced_calls(Watch()):
        backward()
        works = [b.work for b in ddp.buckets]
        ddp.finish_gradient_synchronization()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)   # torch's "will be deprecated"
            dist.all_reduce_coalesced([torch.ones(2)], async_op=False)
    coalesced = [b for b in ddp.buckets if b.in_place]
    assert coalesced and all(isinstance(w, dist.Work) for w in works)
    assert seen == [("all_reduce_coalesced" if b.in_place else "all_reduce", group, True) for b in ddp.buckets] + \
        [("all_reduce_coalesced", dist.group.WORLD, False)]
    assert not getattr(dist.ProcessGroup.allreduce_coalesced, "_kit_traced", False)   # taken away after,
    assert group.allreduce_coalesced([torch.ones(2)]).wait()                           # torch's own again


def test_bad_bucket_size(one_rank):
    with pytest.raises(ValueError, match="positive"):
        bucketed.DDPBucketed(common.ToyModel(), 0)
    with pytest.raises(ValueError, match="in_place_mb"):
        bucketed.DDPBucketed(common.ToyModel(), 1, in_place_mb=-1)
    p = run_inline("05_bucketed_ddp.py", "--bucket-mb", "10", "-1")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "--bucket-mb" in p.stderr


@pytest.mark.parametrize("set_to_none", [True, False])
def test_in_place_over_fsdp_inside_trains_as_copies_do(one_rank, set_to_none):
    """Hybrid sharding (07's FSDP inside, which hands its gradients over at its finish),
    micro-batches under no_sync, a parameter never used: every gradient reduced where it
    lies trains the same weights, bit for bit, as every gradient copied into its bucket."""
    fsdp = load("07_fsdp")

    def run(in_place):
        torch.manual_seed(0)
        ddp = bucketed.DDPBucketed(fsdp.FSDP(common.ToyModel(unused=True)), 1000, in_place_mb=in_place)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            batch = torch.randn(8, 20, generator=g), torch.randint(0, 10, (8,), generator=g)
            bucketed.train_step(ddp, opt, batch, common.StepClock(torch.device("cpu")), micro_batches=2,
                                set_to_none=set_to_none)
        assert [len(b.in_place) for b in ddp.buckets] == [0 if in_place is None else len(b.params)
                                                          for b in ddp.buckets]
        return [p.detach().clone() for p in ddp.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(run(None), run(0.0)))


def test_in_place_trains_the_tests_llama_as_copies_do(one_rank):
    """The tests' Llama-style model, its own source unchanged, AdamW clipped by the global
    norm: every gradient reduced where it lies trains the same weights as copies, bit for bit."""
    import llama

    def run(in_place):
        torch.manual_seed(0)
        model = llama.Transformer(llama.ModelArgs())
        ddp = bucketed.DDPBucketed(model, 0.01, in_place_mb=in_place)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            x, y = torch.randint(0, 256, (4, 16), generator=g), torch.randint(0, 256, (4, 16), generator=g)
            opt.zero_grad()
            llama.loss_fn(ddp(x), y).backward()
            ddp.finish_gradient_synchronization()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
        assert sum(len(b.in_place) for b in ddp.buckets) == (0 if in_place is None else len(list(model.parameters())))
        return [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(run(None), run(0.0)))


def test_in_place_is_skipped_where_gloo_holds_gpu_gradients(one_rank):
    """gloo's coalesced all-reduce refuses CUDA tensors: on a GPU the in-place configurations
    verify only under NCCL, and print a SKIP line each under gloo (nothing runs there)."""
    assert bucketed.in_place_skip("gloo", "cuda") and not bucketed.in_place_skip("nccl", "cuda")
    assert not bucketed.in_place_skip("gloo", "cpu")
    ctx = types.SimpleNamespace(device=torch.device("cuda"), rank=0, world_size=1)
    r = bucketed.verify(ctx, None, caps=bucketed.TOY_IN_PLACE)
    assert list(r) == [f"every case [{label}]" for label in bucketed.TOY_IN_PLACE]
    assert all(v["ok"] and "CPU tensors only" in v["skip"] for v in r.values())
    p = run_inline("05_bucketed_ddp.py", "--in-place-mb", "-1")
    assert p.returncode == 2 and "--in-place-mb" in p.stderr


def test_backward_twice_without_finish_is_refused(one_rank):
    ddp = bucketed.DDPBucketed(common.ToyModel(), 1000)
    x = torch.randn(4, 20)
    ddp(x).sum().backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        ddp(x).sum().backward()


def test_overlap_is_real_first_bucket_starts_before_backward_ends():
    for log in event_logs("05_bucketed_ddp", "DDPBucketed", (bucketed.TOY_CAPS["3 buckets"],)):
        assert all(c >= 1 for c in launches_during_backward(log)), log


def test_launch_order_is_identical_on_all_ranks_even_when_one_rank_lacks_a_gradient():
    logs = event_logs("05_bucketed_ddp", "DDPBucketed", (bucketed.TOY_CAPS["cap < every parameter"],),
                      world_size=4, unused=True, uneven=True)
    calls = [[e for e in log if e.startswith("all_reduce")] for log in logs]
    n_params = len(list(common.ToyModel(unused=True).parameters()))
    assert all(c == calls[0] for c in calls) and len(calls[0]) == 2 * n_params  # a bucket each, 2 steps


def test_script_sweeps_against_torch_ddp_and_fits_the_model(tmp_path):
    p = run_inline("05_bucketed_ddp.py", "--world-size", "2", "--model-size", "nano", "--bucket-mb", "0.1", "10",
                   "--steps", "2", "--warmup", "1", "--verify-steps", "2", "--dtype", "bf16", "--context-length", "16",
                   "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert "PASS" in p.stdout and "predicted best bucket" in p.stdout
    assert "verify 05_bucketed_ddp, bf16, at 2 rank(s): PASS" in p.stdout   # same autocast, and float32's losses
    mp = {r["method"]: r for r in json.loads((tmp_path / "05_mixed_precision.json").read_text())["rows"]}
    assert set(mp) == {f"{w} {d}" for w in ("DDPBucketed", "torch DDP") for d in ("float32", "bf16")}
    for d in ("float32", "bf16"):   # the gradients stay float32: the same bytes
        assert mp[f"DDPBucketed {d}"]["comm_MB"] == pytest.approx(mp["DDPBucketed float32"]["comm_MB"])
        assert mp[f"DDPBucketed {d}"]["act_MB"] == pytest.approx(mp[f"torch DDP {d}"]["act_MB"])
        assert mp[f"DDPBucketed {d}"]["vs_torch_ddp_min"] <= mp[f"DDPBucketed {d}"]["vs_torch_ddp"]
    assert json.loads((tmp_path / "05_bucketed_ddp.json").read_text())["settings"]["dtype"] == "bf16"
    rows = json.loads((tmp_path / "05_bucketed_ddp.json").read_text())["rows"]
    ours = {(r["model"], r["bucket_mb"]): r for r in rows if r["method"].startswith("DDPBucketed")}
    torch_rows = {(r["model"], r["bucket_mb"]): r for r in rows if r["method"].startswith("torch DDP")}
    assert set(ours) == set(torch_rows) == {(m, b) for m in ("lm", "encoder") for b in (0.1, 10)}
    assert [r["method"] for r in rows if r.get("bucket_mb") is None] == \
        ["per-parameter overlapped (04)", "flat after backward (03)"]
    for m in ("lm", "encoder"):
        assert ours[m, 10]["n_buckets"] < ours[m, 0.1]["n_buckets"]
        for b in (0.1, 10):
            r = ours[m, b]
            assert r["collectives"] == r["n_buckets"] and torch_rows[m, b]["collectives"] >= 1
            # paired with torch DDP's row at the same cap: the median of the pairs' ratios and the ratio
            # of the medians (a median is monotone) both lie within the pairs' smallest and largest ratio
            assert r["vs_torch_ddp_min"] <= r["vs_torch_ddp"] <= r["vs_torch_ddp_max"]
            of_medians = r["step_ms"] / torch_rows[m, b]["step_ms"]
            assert r["vs_torch_ddp_min"] * (1 - 1e-9) <= of_medians <= r["vs_torch_ddp_max"] * (1 + 1e-9)
    model = json.loads((tmp_path / "05_overhead_model.json").read_text())
    assert model["analysis"]["bucket_opt_mb"] > 0 and model["fit"]["o_s"] > 0
    best = ours["lm", model["analysis"]["measured_best_mb"]]   # the closing line's ratio is the table's
    assert f"{best['vs_torch_ddp']:.3f}x torch DDP at that cap" in p.stdout
    assert (tmp_path / "05_bucket_sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_no_baselines_times_the_sweep_only(tmp_path):
    p = run_inline("05_bucketed_ddp.py", "--world-size", "2", "--model-size", "nano", "--models", "lm",
                   "--bucket-mb", "10",
                   "--steps", "1", "--warmup", "0", "--no-verify", "--no-baselines", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    rows = json.loads((tmp_path / "05_bucketed_ddp.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["DDPBucketed 10 MB", "torch DDP 10 MB", "plain (no wrapper)"]
    plain = rows[2]
    assert plain["collectives"] == 0 and plain["bucket_mb"] == 10
    for r in rows[:2]:   # each wrapper's cost over plain training measured in the same job
        assert r["vs_plain"] == pytest.approx(r["step_ms"] / plain["step_ms"])


def test_overhead_model_optimum_and_its_limits():
    args = type("A", (), {"model_size": "nano", "context_length": 128})()
    s = common.lm_param_count("nano", 128) * 4
    rows = [{"method": "DDPBucketed 1 MB", "bucket_mb": 1, "n_buckets": 3, "step_ms": 5.0, "vs_torch_ddp": 1.0},
            {"method": "torch DDP 1 MB", "bucket_mb": 1, "step_ms": 5.0}]
    w, o = 1e9, 1e-4
    a = bucketed.analyse(rows, {"w_Bps": w, "o_s": o}, args)
    n = math.sqrt(s / (w * o))
    assert a["n_b_opt"] == pytest.approx(n) and a["bucket_opt_mb"] == pytest.approx(math.sqrt(s * w * o) / 2**20)
    assert a["overhead_opt_ms"] == pytest.approx(2 * math.sqrt(s * o / w) * 1e3)
    assert a["predicted_overhead_ms"][1] == pytest.approx((s / (3 * w) + 3 * o) * 1e3)
    # one rank: the all-reduce time does not grow with size, so one bucket is best
    a = bucketed.analyse(rows, {"w_Bps": None, "o_s": o}, args)
    assert a["n_b_opt"] == 1 and a["w_GBps"] is None and a["overhead_opt_ms"] == pytest.approx(o * 1e3)
    # a per-call cost too small to matter: at most one bucket per parameter tensor
    a = bucketed.analyse(rows, {"w_Bps": w, "o_s": 1e-15}, args)
    assert a["n_b_opt"] == bucketed.lm_param_tensors("nano") == len(list(common.build_lm("nano", 128, "cpu").parameters()))


def test_a_failing_later_job_keeps_the_rows_measured_before_it(tmp_path, monkeypatch):
    real, started = common.launch, []

    def launch(worker, args, *job, **kw):   # the third bucket size's job fails
        if worker.__name__ == "benchmark":
            started.append(job[0])
            if len(started) == 3:
                raise common.LaunchError("rank 1 failed: job failed on purpose")
        return real(worker, args, *job, **kw)
    monkeypatch.setattr(common, "launch", launch)
    with pytest.raises(common.LaunchError, match="on purpose"):
        bucketed.main(["--world-size", "2", "--model-size", "nano", "--models", "lm",
                   "--bucket-mb", "10", "1", "0.5", "2",
                       "--steps", "1", "--warmup", "0", "--no-verify", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "05_bucketed_ddp.json").read_text())["rows"]
    assert [r["bucket_mb"] for r in rows] == [10, 10, 10, 1, 1, 1]
    assert "partial: 2 of 5" in (tmp_path / "05_bucketed_ddp.md").read_text()


def test_time_box_stops_starting_bucket_sizes_and_saves_what_ran(tmp_path):
    p = run_inline("05_bucketed_ddp.py", "--world-size", "2", "--model-size", "nano", "--models", "lm",
                   "--bucket-mb", "10", "1",
                   "--steps", "1", "--warmup", "0", "--no-verify", "--time-box", "0.001", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert "not run: lm 1, baselines" in p.stdout and "predicted best bucket" in p.stdout
    rows = json.loads((tmp_path / "05_bucketed_ddp.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["DDPBucketed 10 MB", "torch DDP 10 MB", "plain (no wrapper)"]
    plain = rows[2]
    assert plain["collectives"] == 0 and plain["bucket_mb"] == 10
    for r in rows[:2]:   # each wrapper's cost over plain training measured in the same job
        assert r["vs_plain"] == pytest.approx(r["step_ms"] / plain["step_ms"])
    assert "Time box" in (tmp_path / "05_bucketed_ddp.md").read_text()


def test_time_box_under_torchrun_is_decided_by_rank_0(tmp_path):
    p = run_script("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   "05_bucketed_ddp.py", "--model-size", "nano", "--models", "lm", "--bucket-mb", "10", "1",
                   "--steps", "1",
                   "--warmup", "0", "--no-verify", "--time-box", "0.001", "--out", str(tmp_path), timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("not run: lm 1, baselines") == 1   # printed by rank 0 only
    rows = json.loads((tmp_path / "05_bucketed_ddp.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["DDPBucketed 10 MB", "torch DDP 10 MB", "plain (no wrapper)"]
    plain = rows[2]
    assert plain["collectives"] == 0 and plain["bucket_mb"] == 10
    for r in rows[:2]:   # each wrapper's cost over plain training measured in the same job
        assert r["vs_plain"] == pytest.approx(r["step_ms"] / plain["step_ms"])


def test_after_the_first_step_buckets_follow_the_order_gradients_arrive_in(one_rank):
    torch.manual_seed(0)
    model = common.ToyModel(scrambled=True, unused=True)
    params = list(model.parameters())
    arrived = []   # the order backward produces gradients in, seen from outside
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda p, i=i: arrived.append(i))
    ddp = bucketed.DDPBucketed(model, 1e-6)   # one parameter per bucket: the bucket order is visible
    place = {id(p): i for i, p in enumerate(params)}
    order = lambda: [place[id(b.params[0])] for b in ddp.buckets]  # noqa: E731
    assert order() == list(range(len(params)))[::-1]   # before: reverse registration order
    x, y = torch.randn(4, 20), torch.randint(0, 10, (4,))
    ddp(x, y, use_extra=False).backward()              # `extra` and `never` get no gradient
    first = list(arrived)                              # the first step's order only
    grads = {i: p.grad.clone() for i, p in enumerate(params) if p.grad is not None}
    ddp.finish_gradient_synchronization()
    unused = [i for i in range(len(params))[::-1] if i not in first]
    assert order() == first + unused and len(unused) == 3   # extra.weight, extra.bias, never: last
    assert first != list(range(len(params)))[::-1]          # the rebuild changed something
    for i, p in enumerate(params):                           # gradients moved into the new buckets
        assert (p.grad is None) == (i not in grads)
        if p.grad is not None:
            slot_bucket, j = ddp._slot[i]
            assert p.grad.data_ptr() == slot_bucket.views[j].data_ptr() and torch.equal(p.grad, grads[i])
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    ddp(x, y, use_extra=True).backward()                     # the next step uses the rebuilt buckets
    ddp.finish_gradient_synchronization()
    assert all((p.grad is None) == (p is model.never) for p in params) and order() == first + unused


def test_the_first_bucket_is_small(one_rank):
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(20)])   # 257 KiB a layer
    sizes = bucketed.DDPBucketed(model, 25).bucket_sizes_mb
    assert 0.75 < sizes[0] <= 1 < sizes[1] and len(sizes) == 2       # 3 layers, then the other 17
    assert bucketed.DDPBucketed(model, 25, first_bucket_mb=25).bucket_sizes_mb == [sum(sizes)]
    assert bucketed.DDPBucketed(model, 0.5).bucket_sizes_mb[0] <= 0.5                  # never above the cap
    big = common.build_lm("nano", 128, "cpu")   # a first tensor larger than 1 MiB gets a bucket of its own
    first = next(p for p in reversed(list(big.parameters())))
    assert bucketed.DDPBucketed(big, 25).buckets[0].params == [first]


def test_per_parameter_work_is_one_copy_and_the_rest_is_per_bucket():
    """At 2 ranks, what DDPBucketed adds to a step beside the plain model's: one copy per
    parameter (none where autograd accumulated into the bucket's views, zero_grad keeping
    them), the division by the world size once per bucket, and nothing else per parameter;
    the same for ZeRO-2's ShardedGradientOptimizer (no flag written per parameter). The
    average is one process's."""
    import argparse
    import workers
    r = common.launch(workers.per_parameter_work, argparse.Namespace(world_size=2, backend="gloo", device="cpu",
                                                                     timeout=60.0))
    n, buckets = r["params"], r["buckets"]
    assert buckets < n and r["close"]
    fresh, kept = r[("DDPBucketed", True)], r[("DDPBucketed", False)]
    assert fresh.pop("copy_.default") == n and "copy_.default" not in kept
    for ops in (fresh, kept):
        assert ops.pop("div_.Tensor") == buckets and all(v <= buckets for v in ops.values()), ops
    zero2 = r[("ShardedGradientOptimizer", True)]
    assert zero2["div_.Tensor"] == r["sharded_buckets"] and zero2["copy_.default"] >= n
    assert not [k for k in zero2 if k.split(".")[0] in ("fill_", "index_put_", "div", "mul", "mul_")], zero2


def test_per_param_times_every_hook_driven_class_beside_torchs_at_1_rank_and_2(tmp_path):
    """--per-param on its smallest probe, 2 steps: a row per class and rank count, what each
    adds a parameter under each recorder setting, ours against torch DDP or FSDP2."""
    p = run_inline("05_bucketed_ddp.py", "--per-param", "41", "--no-verify", "--steps", "2", "--warmup", "2",
                   "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    rows = json.loads((tmp_path / "05_per_param.json").read_text())["rows"]
    methods = ["plain training", "torch DDP", "DDPIndividualParameters (04)", "DDPBucketed",
               "ShardedGradientOptimizer (06)", "FSDP2", "FSDP (07)"]
    assert [(r["ranks"], r["method"]) for r in rows] == [(n, m) for n in (1, 2) for m in methods]
    for r in rows:
        assert r["params"] == 41 and all(isinstance(r[k], float) for k in ("us_off", "us_on", "us_checking")) \
            or r["method"] == "plain training" and r["us_on"] == 0.0 and r["us_off"] is None
        assert r.get("against") == {"torch DDP": None, "FSDP2": None, "plain training": None,
                                    "FSDP (07)": "FSDP2"}.get(r["method"], "torch DDP")
        if r.get("against"):
            assert r["vs_min"] <= r["vs"] <= r["vs_max"]
    by = {(r["ranks"], r["method"]): r for r in rows}
    assert by[(2, "DDPIndividualParameters (04)")]["collectives"] > 41 >= by[(2, "DDPBucketed")]["collectives"]
    assert "wrote " in p.stdout and "05_per_param" in p.stdout


def test_recorder_cost_times_the_recorder_off_on_and_checking(tmp_path):
    """--recorder-cost (common.recorder_modes, out of diagnostics.py): three rows, the same
    method's steps alternating, each traced call's cost beside the calls a step makes."""
    p = run_inline("05_bucketed_ddp.py", "--recorder-cost", "--model-size", "nano", "--bucket-mb", "25", "--no-verify",
                   "--steps", "2", "--warmup", "2", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    rows = json.loads((tmp_path / "05_recorder_cost.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["recorder off", "recorder on", "recorder on, --check-collectives"]
    assert rows[0]["vs_off"] == 1.0 and rows[0]["call_cost_us"] == 0.0
    assert all(r["traced_calls_per_step"] == rows[0]["traced_calls_per_step"] > 0 for r in rows)

import json
import os

import pytest

import common
from conftest import load, refused, run_inline, verify_args

nd = load("10_nd_parallel")
_cache = {}


def suite(world_size):
    """The verification suite's job at this world size (the 8-rank job saves the checkpoint
    the 4-rank job resumes: it runs first)."""
    if world_size not in _cache:
        import atexit
        import shutil
        import tempfile
        if "folder" not in _cache:
            _cache["folder"] = tempfile.mkdtemp(prefix="nd_test_")
            atexit.register(shutil.rmtree, _cache["folder"], True)   # the checkpoints go with the session
        path = os.path.join(_cache["folder"], "checkpoint.pt")
        if world_size == 4:
            suite(8)
        resume = {8: (path, "save"), 4: (path, "resume")}.get(world_size)
        _cache[world_size] = common.launch(nd.verify, verify_args(world_size), nd.SUITE[world_size], resume,
                                           world_size=world_size)
    return _cache[world_size]


CASES = [(w, nd.label(shape, tie, schedule, nd.SUITE_CHUNKS)) for w, cases in nd.SUITE.items()
         for shape, tie, schedule in cases] + \
    [(w, f"{nd.label(shape)}, ep {ep}") for w, cases in nd.SUITE_EP.items() for shape, ep in cases] + \
    [(w, f"{nd.label(shape, tie)}{f', ep {ep}' if ep > 1 else ''}, built on meta")   # ParallelLM.materialize
     for w, cases in nd.SUITE_META.items() for shape, tie, ep in cases]


@pytest.mark.parametrize("world_size, case", CASES)
def test_every_mesh_trains_like_one_process(world_size, case):
    r = suite(world_size)[case]
    assert r["ok"], f"{case}: max diff {r['max_diff']}"
    assert r["meta_same"]   # set up from a meta-built model, the same tensors on every rank, bit for bit


def test_a_checkpoint_saved_on_one_mesh_resumes_on_another():
    cases = {k: v for k, v in suite(4).items() if k.startswith("checkpoint")}
    assert set(cases) == {"checkpoint of pp 2 x fsdp 2 x tp 2 (tied) after step 2, resumed on pp 2 x dp 2",
                          "checkpoint of dp 4 x tp 2, ep 4 after step 2, resumed on dp 2 x tp 2, ep 2"}
    for case, r in cases.items():
        assert r["ok"], f"{case}: max diff {r['max_diff']}"
        assert r["sharded"]   # its sharded checkpoint (tp's head order, FSDP's shards, experts) loads the same


def test_the_checks_fail_without_the_tied_copies_sum_or_with_a_norm_counted_twice():
    import workers
    r = common.launch(workers.nd_controls, verify_args(4))
    assert not r["untied sum"]["ok"] and r["untied sum"]["max_diff"] > 1e-5
    assert not r["norm counted on every tp rank"]["ok"]
    assert r["clipped"]   # the global norm exceeds the limit: clipping is exercised


ACCOUNTED = [(nd.mesh_of(dp=2, tp=2), "1f1b"), (nd.mesh_of(pp=2, fsdp=2), "1f1b"), (nd.mesh_of(dp=2, fsdp=2), "1f1b"),
             (nd.mesh_of(pp=2, tp=2), "1f1b"), (nd.mesh_of(pp=2, fsdp=2), "interleaved"),
             (nd.mesh_of(pp=2, tp=2), "zb1"), (nd.mesh_of(cp=2, tp=2), "1f1b"), (nd.mesh_of(pp=2, cp=2), "1f1b"),
             (nd.mesh_of(dp=4), "1f1b", 2), (nd.mesh_of(fsdp=2, tp=2), "1f1b", 2)]   # 12's experts over ep 2


# 08's sequence parallelism, 09's recomputation and bf16 autocast on meshes of 4 ranks: each
# against one process without them (bf16: under the same autocast), its bytes and memory (in
# float32) beside the formulas.
LEVERS = [(nd.mesh_of(pp=2, tp=2), "1f1b", {"sp": True, "recompute": "selective", "dtype": "bf16"}),
          (nd.mesh_of(dp=2, tp=2), "1f1b", {"sp": True}), (nd.mesh_of(pp=2, tp=2), "1f1b", {"sp": True}),
          (nd.mesh_of(cp=2, tp=2), "1f1b", {"sp": True}),
          (nd.mesh_of(pp=2, tp=2), "interleaved", {"sp": True, "recompute": "full"}),
          (nd.mesh_of(pp=2, dp=2), "1f1b", {"recompute": "full"}), (nd.mesh_of(dp=2, tp=2), "1f1b", {"recompute": "full"}),
          (nd.mesh_of(fsdp=2, tp=2), "1f1b", {"recompute": "selective"}),
          (nd.mesh_of(dp=2, fsdp=2), "1f1b", {"recompute": "full"}),   # 07's units whole again for the recomputation
          (nd.mesh_of(dp=2, cp=2), "1f1b", {"recompute": "full"}),     # 11's exchange again in the recomputed forward
          (nd.mesh_of(cp=2, tp=2), "1f1b", {"recompute": "selective"}),
          (nd.mesh_of(fsdp=2, tp=2), "1f1b", {"sp": True}),   # 08's norm-gradient hook run by 07's FSDP
          (nd.mesh_of(pp=2, fsdp=2), "1f1b", {"dtype": "bf16"})]


def levers():
    if "levers" not in _cache:
        import workers
        _cache["levers"] = common.launch(workers.nd_levers, verify_args(4, context_length=16), LEVERS)
    return _cache["levers"]


@pytest.mark.parametrize("i", range(len(LEVERS)))
def test_the_memory_levers_train_like_one_process_and_count_as_predicted(i):
    shape, schedule, lever = LEVERS[i]
    name = nd.label(shape, False, schedule) + nd.lever_label(nd.Levers(**lever))
    verified, accounting = levers()
    assert verified[name]["ok"], f"{name}: max diff {verified[name]['max_diff']}"
    if lever.get("dtype") == "bf16":
        assert verified[name]["loss_gap"] <= common.BF16_LOSS_BOUND
        return
    for r in accounting[name]:
        for axis in set(r["counted"]) | set(r["predicted"]):
            assert r["counted"].get(axis, 0.0) == pytest.approx(r["predicted"].get(axis, 0.0), rel=1e-9, abs=1e-9), \
                (name, r["coords"], axis)
        # (abs: the first stage's token ids are views of the whole global batch, whose storage
        # the count takes once, whole: 4 KB here, beside full recomputation's few KB)
        assert r["memory"]["activations"] == pytest.approx(r["memory_predicted"]["activations"], rel=0.02,
                                                           abs=4096), name


def test_sequence_parallelism_and_recomputation_lower_the_activations_they_should():
    import workers
    _, accounting = levers()
    first = lambda rows: max(r["memory"]["activations"] for r in rows if r["coords"]["pp"] == 0)  # noqa: E731 (blocks only)
    plain = common.launch(workers.nd_accounting, verify_args(4, context_length=16),
                          [(nd.mesh_of(pp=2, tp=2), "1f1b"), (nd.mesh_of(pp=2, dp=2), "1f1b")])
    assert first(accounting["pp 2 x tp 2, sequence parallel"]) < 0.8 * first(plain[0])
    assert first(accounting["pp 2 x dp 2, recompute full"]) < 0.2 * first(plain[1])


def test_bytes_each_axis_sends_equal_the_formula_and_memory_its_prediction():
    import workers
    jobs = common.launch(workers.nd_accounting, verify_args(4, context_length=16), ACCOUNTED)
    axes_seen = set()
    for job in jobs:
        for r in job:
            for axis in set(r["counted"]) | set(r["predicted"]):
                counted, predicted = r["counted"].get(axis, 0.0), r["predicted"].get(axis, 0.0)
                assert counted == pytest.approx(predicted, rel=1e-9, abs=1e-9), (r["coords"], axis)
                axes_seen |= {axis} if counted else set()
            if "ep" in r["counted"]:
                continue   # the memory formula is the dense LM's
            for k in ("params", "grads", "opt_state"):
                assert r["memory"][k] == r["memory_predicted"][k], (r["coords"], k)
            assert r["memory"]["activations"] == pytest.approx(r["memory_predicted"]["activations"], rel=0.02)
    assert axes_seen == {"dp", "fsdp", "tp", "pp", "cp", "ep", "ep copies", "tie", "clip"}
    interleaved, one_f_one_b = jobs[4], jobs[1]   # pp 2 x fsdp 2: v chunks, v times the boundaries
    assert interleaved[0]["counted"]["pp"] == 3 * one_f_one_b[0]["counted"]["pp"]


def test_mesh_lays_tp_innermost_and_groups_follow_the_coordinates():
    import workers
    for rank, got in enumerate(common.launch(workers.nd_mesh_groups, verify_args(8))):
        coords = got["coords"]
        assert rank == ((coords["pp"] * 2 + coords["dp"]) * 1 + coords["fsdp"]) * 2 + coords["tp"]
        assert got["tp"] == [rank - rank % 2, rank - rank % 2 + 1]        # consecutive ranks
        assert got["pp"] == [rank % 4, rank % 4 + 4]
        assert got["sums"] == {"tp": sum(got["tp"]), "dp": sum(got["dp"]), "pp": sum(got["pp"])}
        assert got["ends"] == (got["pp"] if coords["pp"] in (0, 1) else None)


def test_the_planner_answers_the_accounting_questions(tmp_path):
    args = nd.main.__globals__["common"]   # noqa: F841  (the module is loaded)
    out = nd.report_plan(type("A", (), {"model_size": "xxl", "devices": 64, "hardware": "v5p", "device_memory": None,
                                        "act_tokens": [0, 4096], "fsdp": 16, "tp": 4, "out": str(tmp_path),
                                        "plan_rows": 10})())
    a = out["answers"]
    assert a["state_gb"] == pytest.approx(3517.6, abs=0.1) and a["h100s_for_state"] == pytest.approx(44.0, abs=0.05)
    assert a["activation_bytes_per_token"] == pytest.approx(17.55e6, rel=1e-3)
    assert a["n_fsdp"] == {0: 38, 4096: 61}
    assert a["alpha"] == pytest.approx(2555.6, abs=0.1) and a["tokens_per_device"] == pytest.approx(319.4, abs=0.1)
    assert a["overall_tokens"] == pytest.approx(20444, abs=1) and a["tp_met"]
    pick = out["pick"]
    assert pick["fits"] and pick["bound_tokens"] < float("inf")
    assert all(r["bound_tokens"] >= pick["bound_tokens"] for r in out["meshes"] if r["fits"])
    fsdp16_tp4 = next(r for r in out["meshes"] if r["mesh"] == "fsdp 16 x tp 4")
    assert fsdp16_tp4["bound_tokens"] == pytest.approx(a["overall_tokens"], rel=1e-6)   # the table agrees with (c)
    assert (tmp_path / "10_plan.md").read_text().count("(b)") == 2


def test_script_verifies_times_against_torch_counts_and_draws(tmp_path):
    p = run_inline("10_nd_parallel.py", "--dp", "2", "--pp", "2", "--model-size", "nano", "--steps", "1",
                   "--warmup", "0", "--context-length", "16", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert "verify 10_nd_parallel at 4 ranks: PASS" in p.stdout
    rows = {r["method"]: r for r in json.loads((tmp_path / "10_nd_parallel.json").read_text())["rows"]}
    assert set(rows) == {"pp 2 x dp 2 (ours)", "pp 2 x dp 2 (torch)"}
    ours = rows["pp 2 x dp 2 (ours)"]
    assert ours["vs_torch_min"] <= ours["vs_torch"] <= ours["vs_torch_max"] and ours["tokens_per_s_per_rank"] > 0
    traffic = json.loads((tmp_path / "10_accounting.json").read_text())["rows"]
    assert {r["axis"] for r in traffic} == {"pp", "dp", "clip"} and all(r["equal"] and r["ranks_agree"] for r in traffic)
    assert (tmp_path / "10_timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_the_suites_benchmark_saves_after_each_job_and_prints_its_tables_once(tmp_path):
    """The suite's benchmark (jobs of 4 and 8 ranks, played): the three tables are saved
    after each job, marked partial until the last, and printed once, after it (each had
    been printed again with every job's rows)."""
    saved = []

    def launch(worker, args, group, dims, trace, world_size=None):
        md = tmp_path / "10_nd_parallel.md"
        saved.append(md.read_text() if md.exists() else None)
        acc = [{"mesh": f"mesh of {world_size}", "shape": {"pp": 1}, "ranks": [
            {"coords": {"pp": 0}, "counted": {"dp": 1.0}, "predicted": {"dp": 1.0}, "memory": {"activations": 1.0},
             "memory_predicted": {"activations": 1.0}}]}]
        return [{"method": f"{nd.label(s)} (ours)", "world_size": world_size, "step_ms": 1.0} for s in group], acc, None
    p = run_inline("10_nd_parallel.py", "--no-verify", "--model-size", "nano", "--out", str(tmp_path), launch=launch)
    assert p.returncode == 0, p.stderr
    assert saved[0] is None and "(partial: 1 of 2 benchmark jobs done)" in saved[1], saved
    for name in ("10_nd_parallel", "10_accounting", "10_memory"):
        assert "partial" not in (tmp_path / f"{name}.md").read_text()
    assert {r["world_size"] for r in json.loads((tmp_path / "10_nd_parallel.json").read_text())["rows"]} == {4, 8}
    for line in ("N-D parallelism: ours against torch's composition", "Bytes each axis sends per step",
                 "Memory per rank (MiB)", "10_accounting.*, 10_memory.*"):
        assert p.stdout.count(line) == 1, p.stdout


def test_bad_input_exits_2_with_one_line():
    assert "--tp 3 does not divide the verification LM's 4 heads" in refused("10_nd_parallel.py", "--tp", "3")


@pytest.mark.parametrize("argv, words", [
    (["--dp", "0"], "argument --dp: must be at least 1"),
    (["--pp", "5"], "--pp 5 is more stages than the verification LM's 4 blocks"),
    (["--pp", "3", "--model-size", "micro"], "--pp 3 is more stages than the model's 2 blocks"),
    (["--dp", "2", "--batch-size", "3"], "does not split into 2 replicas x 1 micro-batches"),
    (["--pp", "2", "--microbatches", "0"], "argument --microbatches: must be at least 1"),
    (["--plan", "--model-size", "huge"], "unknown --model-size 'huge'"),
    (["--pp", "2", "--fsdp", "2", "--schedule", "zb1"], "zb1 defers the weights' gradients past FSDP"),
    (["--pp", "2", "--dp", "2", "--schedule", "interleaved", "--microbatches", "3", "--model-size", "mini"],
     "not a multiple of 2"),
    (["--pp", "4", "--schedule", "interleaved"], "--pp 4 x --chunks 2 is more chunks than the verification LM's 4"),
    (["--dp", "2", "--schedule", "zb1"], "it needs --pp 2 or more"),
    (["--pp", "2", "--schedule", "gpipe"], "argument --schedule: invalid choice: 'gpipe'"),
    (["--schedule", "zb1"], "--schedule zb1 without a mesh"),
    (["--dp", "3", "--tp", "2", "--ep", "2"], "3 here, which it must divide: use --ep 3"),
    (["--dp", "2", "--cp", "2", "--ep", "2"], "--ep with --cp"),
    (["--dp", "2", "--ep", "2", "--experts", "3"], "--ep 2 does not divide --experts 3"),
    (["--dp", "2", "--ep", "2", "--top-k", "5"], "--top-k 5 must be at most --experts 4"),
    (["--dp", "2", "--sp"], "--sp splits the sequence over the tp ranks"),
    (["--pp", "2", "--tp", "2", "--schedule", "zb1", "--sp"], "--sp with --schedule zb1"),
    (["--pp", "2", "--schedule", "zb1", "--recompute", "full"], "--recompute full with --schedule zb1"),
    (["--tp", "2", "--sp", "--context-length", "31"], "--sp gives each of the 2 cp x tp ranks"),
    (["--sp"], "apply to one mesh"),
    (["--dp", "2", "--ep", "2", "--dtype", "bf16"], "not verified with --ep"),
])
def test_bad_input_is_refused_before_any_worker_starts(argv, words, monkeypatch):
    monkeypatch.setattr(common, "launch", lambda *a, **k: pytest.fail("a job started"))
    with pytest.raises(common.UsageError, match=words):
        nd.main(argv)


class _Started(Exception):
    pass


@pytest.mark.parametrize("argv", [[], ["--warmup", "3"], ["--no-verify"], ["--no-bench"]])
def test_the_suite_as_make_runs_it_passes_its_own_checks(argv, monkeypatch):
    """The suite's interleaved meshes verify on the verification LM; only its 1f1b meshes
    are timed on the (2-block) model, so its chunks are not held against that model."""
    def started(*a, **k):
        raise _Started
    monkeypatch.setattr(common, "launch", started)
    with pytest.raises(_Started):
        nd.main(argv)


@pytest.mark.parametrize("argv, words", [
    (["--dp", "2", "--tp", "2", "--world-size", "3"], "--world-size 3 but the mesh dp 2 x tp 2 holds 4 ranks"),
    (["--world-size", "4"], "--world-size 4 without a mesh"),
    (["--plan", "--device-memory", "-5"], "argument --device-memory: must be more than 0, got -5"),
    (["--plan", "--act-tokens", "-1"], "argument --act-tokens: must be at least 0"),
    (["--dp", "2", "--peak-tflops", "0"], "argument --peak-tflops: must be more than 0"),
])
def test_settings_it_would_ignore_or_misread_are_refused(argv, words):
    assert words in refused("10_nd_parallel.py", *argv)


def test_a_refusal_concerns_only_what_the_command_runs():
    """The benchmark's model (micro: 2 blocks) does not limit a verification-only run, which
    uses the 4-block verification LM; the reverse for a benchmark-only run."""
    jobs = []

    def launch(worker, args, *job, **kw):
        jobs.append((worker.__name__, kw.get("world_size")))
        return {"case": {"ok": True, "max_diff": 0.0}}
    p = run_inline("10_nd_parallel.py", "--dp", "2", "--pp", "3", "--no-bench", launch=launch)
    assert p.returncode == 0, p.stderr
    assert jobs == [("verify", 6)]
    assert "--pp 3 is more stages than the model's 2 blocks" in refused("10_nd_parallel.py", "--dp", "2", "--pp", "3")
    tp8 = refused("10_nd_parallel.py", "--tp", "8", "--model-size", "mini", "--no-verify")
    assert "the model's 4 heads" in tp8   # the verification LM is not named: it does not run


def test_flags_that_moved_to_13_name_where_they_went():
    """--train (and its checkpoint flags), --setup-memory and --hf-checkpoint are 13's now:
    a command written for 10 is told where each went."""
    assert "--train moved out of 10_nd_parallel.py: a training run with sharded checkpoints and resume is " \
           "13_train.py's" in refused("10_nd_parallel.py", "--pp", "2", "--dp", "2", "--train", "40")
    assert "--checkpoint-dir moved out" in refused("10_nd_parallel.py", "--pp", "2", "--checkpoint-dir=D")
    assert "it is 13_train.py --hf-checkpoint" in refused("10_nd_parallel.py", "--hf-checkpoint")


def test_torch_s_composition_is_left_out_with_its_reason_where_it_cannot_run():
    plain, sp = nd.Levers(), nd.Levers(sp=True)
    assert nd.torch_skip(nd.mesh_of(pp=2, dp=2), plain, 1, "gloo", "cpu") is None
    assert nd.torch_skip(nd.mesh_of(dp=2, tp=2), plain, 1, "gloo", "cuda") is None
    assert "gloo cannot carry" in nd.torch_skip(nd.mesh_of(pp=2, dp=2), plain, 1, "gloo", "cuda")
    assert "context_parallel" in nd.torch_skip(nd.mesh_of(dp=2, cp=2), plain, 1, "nccl", "cuda")
    assert "no expert parallelism" in nd.torch_skip(nd.mesh_of(dp=2), plain, 2, "gloo", "cpu")
    assert "SequenceParallel" in nd.torch_skip(nd.mesh_of(pp=2, tp=2), sp, 1, "gloo", "cpu")

"""Bad input, as a new user types it: every numbered script refuses it with one line on
stderr and exit status 2, within moments, before any worker starts, and leaves the results
folder as it was; natural commands that a check used to refuse over a value they never use
run; --help states the defaults the scripts really use."""
import argparse
import os
import time

import pytest

import common
from conftest import ROOT, load, refused, run_inline, seconds

TOO_MANY = str(common.max_ranks("gloo") + 1)   # one process more than this machine may spawn

CASES = [   # (script, argv, words the one line must hold)
    ("01_allreduce_bench.py", ["--world-sizes", "2", TOO_MANY], f"--world-sizes: {TOO_MANY} processes on"),
    ("01_allreduce_bench.py", ["--sizes-mb", "nan"], "argument --sizes-mb: a finite number expected"),
    ("01_allreduce_bench.py", ["--iters", "0"], "argument --iters: must be at least 1"),
    ("01_allreduce_bench.py", ["--time-box", "inf"], "argument --time-box: a finite number expected"),
    ("01_allreduce_bench.py", ["--iter", "3"], "unrecognized arguments: --iter"),
    ("02_naive_ddp.py", ["--timeout", "nan"], "argument --timeout: a finite number expected, got 'nan'"),
    ("02_naive_ddp.py", ["--timeout", "inf"], "argument --timeout: a finite number expected, got 'inf'"),
    ("02_naive_ddp.py", ["--timeout", "0"], "argument --timeout: must be more than 0"),
    ("02_naive_ddp.py", ["--steps", "0"], "argument --steps: must be at least 1"),
    ("02_naive_ddp.py", ["--warmup", "-1"], "argument --warmup: must be at least 0"),
    ("02_naive_ddp.py", ["--batch-size", "2.5"], "argument --batch-size: a whole number expected"),
    ("02_naive_ddp.py", ["--world-size", TOO_MANY], f"--world-size: {TOO_MANY} processes on"),
    ("02_naive_ddp.py", ["--world", "2"], "unrecognized arguments: --world"),
    ("03_flat_ddp.py", ["--verify-steps", "0"], "argument --verify-steps: must be at least 1"),
    ("04_overlap_ddp.py", ["--context-length", "-4"], "argument --context-length: must be at least 1"),
    ("05_bucketed_ddp.py", ["--bucket-mb", "nan"], "argument --bucket-mb: a finite number expected"),
    ("05_bucketed_ddp.py", ["--bucket-mb", "0"], "argument --bucket-mb: must be more than 0"),
    ("05_bucketed_ddp.py", ["--time-box", "-1"], "argument --time-box: must be more than 0"),
    ("05_bucketed_ddp.py", ["--bucket", "10"], "unrecognized arguments: --bucket"),
    ("05_bucketed_ddp.py", ["--per-param", "801", "42"], "--per-param 42: the probe has 1 + 40 k parameters"),
    ("06_sharded_optimizer.py", ["--seed", "-1"], "argument --seed: must be at least 0"),
    ("07_fsdp.py", ["--steps", "inf"], "argument --steps: a whole number expected"),
    ("08_tensor_parallel.py", ["--world-sizes", TOO_MANY], f"{TOO_MANY} processes on"),
    ("08_tensor_parallel.py", ["--tp", "1"], "argument --tp: must be at least 2"),
    ("08_tensor_parallel.py", ["--world-size", "2", "--world-sizes", "4"], "--world-size and --world-sizes"),
    ("09_pipeline_parallel.py", ["--stages", "1"], "argument --stages: must be at least 2"),
    ("09_pipeline_parallel.py", ["--stages", TOO_MANY], f"{TOO_MANY} processes on"),
    ("09_pipeline_parallel.py", ["--replicas", "0"], "argument --replicas: must be at least 1"),
    ("09_pipeline_parallel.py", ["--microbatches", "0"], "argument --microbatches: must be at least 1"),
    ("09_pipeline_parallel.py", ["--world-size", "3", "--stages", "2"], "--stages 2 x --replicas 1 is 2 ranks"),
    ("09_pipeline_parallel.py", ["--chunks", "nan"], "argument --chunks: a whole number expected"),
    ("10_nd_parallel.py", ["--experts", "0", "--dp", "2", "--ep", "2"], "argument --experts: must be at least 1"),
    ("10_nd_parallel.py", ["--dp", "64"], "the mesh dp 64: 64 processes on"),
    ("10_nd_parallel.py", ["--cp", "2", "--ep", "2", "--dp", "2"], "--ep with --cp"),
    ("10_nd_parallel.py", ["--cp", "3"], "the verification LM's 16 tokens do not; use --cp 2, 4 or 8"),
    ("10_nd_parallel.py", ["--cp", "3", "--no-verify"], "use a --context-length that is a multiple of 6"),
    ("10_nd_parallel.py", ["--dp", "3", "--ep", "2"], "3 here, which it must divide"),
    ("10_nd_parallel.py", ["--ex", "4"], "unrecognized arguments: --ex"),
    ("10_nd_parallel.py", ["--schedule", "gossip"], "argument --schedule: invalid choice"),
    ("10_nd_parallel.py", ["--peak-tflops", "nan", "--dp", "2"], "argument --peak-tflops: a finite number"),
    ("10_nd_parallel.py", ["--plan", "--devices", "0"], "argument --devices: must be at least 1"),
    ("11_context_parallel.py", ["--timeout", "nan"], "argument --timeout: a finite number expected"),
    ("11_context_parallel.py", ["--timeout", "inf"], "argument --timeout: a finite number expected"),
    ("11_context_parallel.py", ["--cp", "5", "--seq-lens", "10"],
     "the verification LM's 48 tokens do not; use --cp 2 or 3 or 4 or 6, or --context-length 50"),
    ("11_context_parallel.py", ["--cp", "64"], "--cp: 64 processes on"),
    ("11_context_parallel.py", ["--world-size", TOO_MANY], f"--world-size: {TOO_MANY} processes on"),
    ("11_context_parallel.py", ["--cp", "3", "--world-size", "2"], "so the world is cp"),
    ("11_context_parallel.py", ["--seq-lens", "102"], "a sequence of 102 tokens"),
    ("11_context_parallel.py", ["--method", "gossip"], "argument --method: invalid choice"),
    ("12_expert_parallel.py", ["--capacity-factor", "inf"], "a finite number expected, got 'inf'; 0 means no dropping"),
    ("12_expert_parallel.py", ["--capacity-factor", "nan"], "a finite number expected, got 'nan'"),
    ("12_expert_parallel.py", ["--capacity-factor", "-1"], "must be at least 0"),
    ("12_expert_parallel.py", ["--aux-coef", "nan"], "argument --aux-coef: a finite number expected"),
    ("12_expert_parallel.py", ["--world-size", "64"], "--world-size: 64 processes on"),
    ("12_expert_parallel.py", ["--experts", "0"], "argument --experts: must be at least 1"),
    ("12_expert_parallel.py", ["--ep", "2", "--experts", "3"], "--ep 2 does not divide --experts 3"),
    ("12_expert_parallel.py", ["--top-k", "5", "--experts", "4"], "--top-k 5 must be at most --experts 4"),
    ("12_expert_parallel.py", ["--ep", "2", "--world-size", "3"], "--ep 2 does not divide the world size 3"),
    ("12_expert_parallel.py", ["--ex", "4"], "unrecognized arguments: --ex"),
]


@pytest.mark.parametrize("script, argv, words", CASES, ids=[f"{s[:2]} {' '.join(a)}" for s, a, _ in CASES])
def test_bad_input_is_refused_at_once_and_leaves_no_trace(tmp_path, script, argv, words):
    out = tmp_path / "results"
    t0 = time.perf_counter()
    line = refused(script, *argv, "--out", str(out))   # exit 2, one line on stderr, no job, nothing printed
    assert time.perf_counter() - t0 < seconds(5)   # in this process: parsing alone, no worker starting up
    assert words in line, line
    assert not out.exists()   # a refused run leaves the results folder as it was


@pytest.mark.parametrize("script, argv, words", [
    ("11_context_parallel.py", ["--cp", "4"], "--cp 4 but torchrun started 2 processes"),
    ("12_expert_parallel.py", ["--ep", "4"], "--ep 4 does not divide the world size 2 (torchrun's world)"),
])
def test_a_torchrun_world_that_contradicts_the_flags_is_refused(monkeypatch, tmp_path, script, argv, words):
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(var, value)
    assert words in refused(script, *argv, "--out", str(tmp_path))


def test_an_out_that_is_a_file_is_named_as_such(tmp_path):
    f = tmp_path / "hostname"
    f.write_text("x")
    assert "is a file, not a folder" in refused("02_naive_ddp.py", "--out", str(f))


@pytest.mark.parametrize("script, argv, says", [   # each once refused over a value it does not use
    ("09_pipeline_parallel.py", ["--stages", "4", "--schedule", "interleaved", "--chunks", "2"],
     "verify 09_pipeline_parallel, 4 stages on 4 ranks: PASS"),
    ("09_pipeline_parallel.py", ["--stages", "3", "--schedule", "zb1", "--world-size", "3"],
     "verify 09_pipeline_parallel, 3 stages on 3 ranks: PASS"),
    ("11_context_parallel.py", ["--cp", "3", "--method", "ring", "--context-length", "96", "--world-size", "3"],
     "verify 11_context_parallel at cp 3: PASS"),
])
def test_natural_commands_run(tmp_path, script, argv, says):
    p = run_inline(script, *argv, "--no-bench", "--verify-steps", "2", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("running: ") and says in p.stdout


def test_a_case_that_does_not_apply_is_skipped_with_its_reason(tmp_path):
    p = run_inline("11_context_parallel.py", "--cp", "3", "--method", "ulysses", "ring", "--no-bench",
                   "--verify-steps", "1", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    skips = [ln for ln in p.stdout.splitlines() if ln.strip().startswith("SKIP")]
    assert skips and all("does not divide" in ln for ln in skips)
    assert not any(ln.strip().startswith("PASS") and "refused" in ln for ln in p.stdout.splitlines())
    assert "verify 11_context_parallel at cp 3: PASS (" in p.stdout and "skipped)" in p.stdout


# ---- --help from the real defaults
SCRIPTS = sorted(p.name for p in ROOT.glob("[01][0-9]_*.py"))


def _parser_of(script):
    """The parser a script's main() builds, caught as it parses (nothing runs)."""
    caught = {}
    real = argparse.ArgumentParser.parse_args

    def grab(self, *a, **kw):
        caught.setdefault("parser", self)
        raise SystemExit(0)
    argparse.ArgumentParser.parse_args = grab
    try:
        with pytest.raises(SystemExit):
            load(script[:-3]).main([])
    finally:
        argparse.ArgumentParser.parse_args = real
    return caught["parser"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_states_each_fixed_default_and_refuses_abbreviations(script):
    p = _parser_of(script)
    assert isinstance(p, common.KitParser) and not p.allow_abbrev
    text = " ".join(p.format_help().split())
    for a in p._actions:
        if a.help in (None, argparse.SUPPRESS) or a.default is None or a.default is False or a.default is argparse.SUPPRESS:
            continue
        shown = f"(default: {common.default_text(a.default)})"
        assert shown in text, (a.option_strings, shown)


@pytest.mark.parametrize("script", [s for s in SCRIPTS if not s.startswith(("01", "13", "14"))])
# (13: a model folder; 14: the nano LM wherever it runs, in replicas it starts itself)
def test_help_names_the_model_size_and_world_a_plain_run_gets(monkeypatch, tmp_path, script):
    """What --help says a plain run on this CPU gets is what parse() gives it."""
    for var in common.TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(common.torch.cuda, "is_available", lambda: False)
    seen = {}

    def stop(worker, args, *job, **kw):
        seen["args"] = args
        raise KeyboardInterrupt
    p = run_inline(script, "--out", str(tmp_path), launch=stop)
    assert p.returncode == 130, p.stderr
    args = seen["args"]
    text = " ".join(_parser_of(script).format_help().split())
    assert f"(default: {args.model_size} on CPU" in text
    if script[:2] in ("02", "03", "04", "05", "06", "07"):
        assert "(default: GPUs if 2 or more, else 2;" in text and args.world_size == 2
    if script[:2] in ("11", "12"):   # the world is the cp or ep group's: 2 unless told
        assert args.world_size == 2


def test_a_long_table_is_split_to_fit_the_terminal():
    rows = [{"method": f"m{i}", **{f"column_number_{j}": 1.5 * j for j in range(16)}} for i in range(3)]
    whole = common.markdown_table(rows)
    assert max(map(len, whole.splitlines())) > common.TABLE_WIDTH
    split = common.fit_width(rows)
    assert max(map(len, split.splitlines())) <= common.TABLE_WIDTH
    parts = split.split("\n\n")
    assert len(parts) > 1 and all(part.startswith("| method") for part in parts)
    for h in rows[0]:   # every column is in one of them
        assert any(h in part.splitlines()[0] for part in parts)


def test_the_failure_report_puts_the_first_failure_first(tmp_path):
    base = str(tmp_path / "job")
    t = time.time()
    (tmp_path / "job.rank3.err").write_text(f"{t!r}\nTraceback (most recent call last):\n  File x\n"
                                            f"ValueError: the real cause\n")
    (tmp_path / "job.rank0.err").write_text(f"{t + 1!r}\nTraceback (most recent call last):\n"
                                            f"RuntimeError: Connection closed by peer\n")
    msg = common._failure_report(base, 4, (t + 0.5, 2, "died (signal 6) without a Python error"))
    lines = msg.splitlines()
    assert lines[0] == "rank 3 failed first: ValueError: the real cause"
    assert lines[1] == ("  then, as a consequence: rank 2 died (signal 6) without a Python error; rank 0 failed: "
                        "RuntimeError: Connection closed by peer")
    log = lines[2].split(": ", 1)[1]
    (tmp_path / "job.rank1.err").write_text(f"{t + 2!r}\nValueError: the real cause\n")   # raised on its own too
    again = common._failure_report(base, 4).splitlines()
    os.unlink(again[-1].split(": ", 1)[1])
    assert again[1] == "  rank 1 failed the same way"
    text = open(log).read()
    os.unlink(log)
    assert "==== rank 3" in text and "File x" in text and "==== rank 0" in text

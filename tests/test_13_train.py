"""13_train.py: a Hugging Face model folder and a text in, a folder from_pretrained loads
out. The folder is the script's own tiny Llama-style model (its byte-level BPE tokenizer
trained on Python's help text), written once for the file; the runs are short (6 steps of
8 sequences of 32 tokens), each through the command line as a user types it."""
import contextlib
import io
import json
import os
import re
import shutil
import signal
import socket
import time
import uuid
from pathlib import Path

import pytest

import common as kit
from conftest import load, refused, run_inline, run_script, verify_args

SHORT = ["--steps", "6", "--eval-every", "3", "--log-every", "3", "--checkpoint-every", "3", "--context-length", "32",
         "--batch-size", "8", "--verify-steps", "2", "--sample-tokens", "8"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The script's own model writer: its tokenizer trained on a part of Python's help
    text, its config and initial weights; and that text."""
    train = load("13_train")
    root = tmp_path_factory.mktemp("m13")
    text = train.pydoc_text()[:150_000]
    (root / "text.txt").write_text(text)
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in text[:60_000].split("\n\n")
                                             if d.strip()))   # the text's paragraphs as documents
    train.write_tiny_model(root / "model", text, 64)
    train.write_tiny_model(root / "tied", text, 64, tied=True)
    return root


def tensors_in(folder: Path) -> dict:
    """{name: shape} of every tensor in a checkpoint folder's safetensors files."""
    from safetensors import safe_open
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
    return out


def sha(p) -> str:
    found = [line for line in p.stdout.splitlines() if line.startswith("final weights sha256 ")]
    assert len(found) == 1, p.stdout
    return found[0]


def test_pipeline_and_tp_run_checks_trains_evaluates_and_saves_a_folder_transformers_loads(tiny, tmp_path):
    """pp 2 x tp 2 on a model whose head is tied to its embedding, from the folder
    save_pretrained wrote (which holds the embedding only; the last stage's head is read from
    it): the model's own pipeline stages and tp plan; checked against one process first,
    then trained with an eval loss on the held-out sequences (the pipeline's forward-only
    evaluate), checkpoints, a progress file and plot, and a folder that from_pretrained
    loads and generate() continues, with the source's tensors, names and shapes, and no
    head of its own."""
    run = tmp_path / "run"   # (a process of its own: the first rank's progress lines come out on its stdout)
    p = run_script("13_train.py", "--model", str(tiny / "tied"), "--data", str(tiny / "text.txt"), "--pp", "2",
                   "--tp", "2", *SHORT, "--run-dir", str(run), "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "PASS  first 2 steps against one process" in p.stdout and "verify 13_train on pp 2 x tp 2: PASS" in p.stdout
    steps = re.findall(r"^step +(\d+)/6 \| loss ([\d.]+) \| eval ([\d.]+|-) \| lr ", p.stdout, re.M)
    assert [s for s, _, _ in steps] == ["3", "6"] and all(e != "-" for _, _, e in steps)
    history = [json.loads(line) for line in (run / "progress.jsonl").read_text().splitlines()]
    assert [r["step"] for r in history] == list(range(7)) and [r["step"] for r in history if "eval" in r] == [0, 3, 6]
    assert history[-1]["eval"] < history[0]["eval"]   # the held-out loss fell from where it started
    assert (run / "loss.png").stat().st_size > 1000
    assert sorted(os.listdir(run / "checkpoints")) == ["step-000000003", "step-000000006"]
    final = run / "final"
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(final))
    assert tensors_in(final) == tensors_in(tiny / "tied") and "lm_head.weight" not in tensors_in(final)
    assert "sample: 'The for statement" in p.stdout   # from_pretrained on the folder, then generate()
    assert "Loading weights" not in p.stderr   # transformers' progress bars (one a rank) kept out of the run's lines
    train = load("13_train")   # the same command with fewer --steps than its checkpoint's: said before it starts
    again = train.parser().parse_args(["--model", str(tiny / "tied"), "--data", str(tiny / "text.txt"), "--pp", "2",
                                       "--tp", "2", *SHORT, "--steps", "3", "--run-dir", str(run)])
    train.check(again)
    assert again.resume_from.endswith("--steps 3 already reached, nothing left to train (give more --steps, "
                                      "or another --run-dir to start again)"), again.resume_from
    summary = json.loads((tmp_path / "13_train.json").read_text())
    assert summary["rows"][0]["mesh"] == "pp 2 x tp 2" and summary["rows"][0]["steps"] == 6
    cached = os.listdir(tiny / "13_data")
    assert len(cached) == 1 and cached[0].startswith("text.txt-")   # prepared once, beside the text


def test_a_run_killed_by_kill_9_resumes_to_the_weights_of_one_never_killed(tiny, tmp_path):
    """cp 2 (each rank half of every sequence): rank 1 kills itself (SIGKILL) at step 5,
    after the checkpoint of step 3; the same command again resumes from step 3, now under
    torchrun with one restart and a checkpoint every step written in the background, and
    rank 1 kills itself again at step 6 of that first attempt (the corpus a mixture, 0.7 of
    the text and 0.3 of JSON lines); torchrun restarts both, they
    resume from the newest published checkpoint (step 4 or 5: a save waits for the one
    before it) and end with the sha256 of a run never killed (the batches of step i depend
    on i alone; the optimizer's state and each rank's RNG come back with the weights)."""
    args = ["--model", str(tiny / "model"), "--data", f"{tiny / 'text.txt'}:0.7", "--data", f"{tiny / 'docs.jsonl'}:0.3",
            "--cp", "2", *SHORT, "--no-verify", "--out", str(tmp_path)]   # (a mixture of a text and JSON lines)
    whole = run_inline("13_train.py", *args, "--run-dir", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = run_inline("13_train.py", *args, "--run-dir", str(tmp_path / "killed"), "--fault-at", "4:1")
    assert killed.returncode != 0 and "rank 1 died (signal 9)" in killed.stderr, killed.stderr[-2000:]
    again = run_script("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                       "13_train.py",
                       *args, "--run-dir", str(tmp_path / "killed"), "--checkpoint-every", "1", "--checkpoint-async",
                       "--fault-at", "5:1", timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "failed (exitcode: -9) local_rank: 1" in again.stderr   # the kill happened, and torchrun restarted
    resumed = re.findall(r"^resumed from step (\d+) ", again.stdout, re.M)
    assert resumed[0] == "3" and resumed[1] in ("4", "5") and len(resumed) == 2, again.stdout
    assert sha(again) == sha(whole)


def test_two_nodes_under_torchrun_train_one_mesh_checked_against_one_process(tiny, tmp_path):
    """torchrun as on two machines (--nnodes 2, a node rank each, the first node's address;
    here both on loopback, one process a node, the run folder shared as it must be):
    fsdp 2 across the nodes passes the check against one process and trains."""
    import socket
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])

    def node(rank):
        return ["-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1",
                "--master-addr", "127.0.0.1", "--master-port", port, "13_train.py", "--model", str(tiny / "model"),
                "--data", str(tiny / "text.txt"), "--steps", "2", "--eval-every", "2", "--checkpoint-every", "2",
                "--context-length", "32", "--batch-size", "8", "--verify-steps", "1", "--sample-tokens", "2",
                "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path)]
    second = subprocess.Popen([sys.executable, *node(1)], cwd=Path(__file__).parent.parent,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = run_script(*node(0), timeout=240)
        out, err = second.communicate(timeout=60)
    finally:
        second.kill()
    assert first.returncode == 0 and second.returncode == 0, first.stderr[-2000:] + err[-2000:]
    assert "verify 13_train on fsdp 2: PASS" in first.stdout and "final weights sha256" in first.stdout
    assert "PASS" not in out   # only the first node's first rank prints
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["step-000000002"]


def _gpt2_folder(tiny, root: Path) -> Path:
    """GPT-2 as its config builds it (dropout 0.1 everywhere, no tp or pp plan)."""
    import transformers
    return _folder(tiny, root / "gpt2", transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=512, n_embd=32, n_layer=2, n_head=4)))


def _folder(tiny, folder: Path, model) -> Path:
    """``model`` saved as save_pretrained writes it, with the tiny model's tokenizer."""
    model.save_pretrained(folder)
    for f in os.listdir(tiny / "model"):
        if f.startswith("tokenizer"):
            shutil.copy(tiny / "model" / f, folder / f)
    return folder


def test_bad_input_is_refused_in_one_line_before_any_worker_starts(tiny, tmp_path):
    model, text = str(tiny / "model"), str(tiny / "text.txt")
    (tmp_path / "empty").mkdir()
    assert "no config.json there" in refused("13_train.py", "--model", str(tmp_path / "empty"), "--data", text)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny / "model" / "config.json", bare / "config.json")
    assert "no weights there" in refused("13_train.py", "--model", str(bare), "--data", text)
    short = tmp_path / "short.txt"
    short.write_text("def f(x):\n    return x\n" * 20)
    assert "a sequence needs 129 of each: give a longer text" in refused("13_train.py", "--model", model, "--data",
                                                                        str(short))
    binary, latin, blank = tmp_path / "weights.bin", tmp_path / "latin.txt", tmp_path / "blank.txt"
    binary.write_bytes(b"\x00\x01" * 100)
    latin.write_bytes("caf\u00e9 au lait\n".encode("latin-1") * 50)
    blank.write_text("")
    assert "a binary file, not text (a NUL byte at offset 0" in refused("13_train.py", "--model", model, "--data",
                                                                        str(binary))
    assert "not UTF-8 text (byte 0xe9 at offset 3)" in refused("13_train.py", "--model", model, "--data", str(latin))
    assert "the file is empty" in refused("13_train.py", "--model", model, "--data", str(blank))
    assert not (tmp_path / "13_data").exists()   # no refused text leaves its tokens behind
    p = run_script("-X", "importtime", "13_train.py", "--model", model, "--data", str(binary))   # as typed: before
    assert p.returncode == 2 and p.stderr.splitlines()[-1].startswith("13_train.py: error: --data ")  # torch loads
    assert not [line for line in p.stderr.splitlines() if line.rstrip().endswith("| torch")], p.stderr[-2000:]
    train = load("13_train")   # a text inside the model's folder: its tokens kept beside --run-dir, not in it
    inside = tmp_path / "folder"
    inside.mkdir()
    run = tmp_path / "runs" / "run"
    assert train.data_cache({"path": str(inside / "notes.txt")}, inside, run) == tmp_path / "runs" / "13_data"
    assert train.data_cache({"path": str(tmp_path / "notes.txt")}, inside, run) == tmp_path / "13_data"
    # a DatasetDict's train split: beside the DatasetDict, not inside it among its splits
    assert train.data_cache({"path": str(tmp_path / "dd"), "split": "train"}, inside, run) == tmp_path / "13_data"
    assert "--tp 3 does not divide the model's 4 attention heads" in refused("13_train.py", "--model", model, "--data",
                                                                             text, "--tp", "3")
    assert "--pp 8 x --chunks 1 stages for the model's 4 layers" in refused("13_train.py", "--model", model, "--data",
                                                                            text, "--pp", "8")
    gpt2 = _gpt2_folder(tiny, tmp_path)
    assert "gpt2 ships no tensor-parallel plan: give --plan FILE" in refused("13_train.py", "--model", str(gpt2),
                                                                            "--data", text, "--tp", "2")
    assert "--cp: the model's attention dropout (attn_pdrop=0.1) does not split over the ranks: set it to 0" in \
        refused("13_train.py", "--model", str(gpt2), "--data", text, "--cp", "2")
    import transformers
    bloom = _folder(tiny, tmp_path / "bloom", transformers.BloomForCausalLM(transformers.BloomConfig(
        vocab_size=512, hidden_size=32, n_layer=2, n_head=4)))   # (no SDPA: transformers' own attention)
    assert "--cp: bloom has no SDPA attention (transformers runs its own for it), and context parallelism splits " \
        "SDPA's" in refused("13_train.py", "--model", str(bloom), "--data", text, "--cp", "2")
    granite = _folder(tiny, tmp_path / "granitemoe", transformers.GraniteMoeForCausalLM(transformers.GraniteMoeConfig(
        vocab_size=512, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)))   # (its plan names its experts alone)
    assert "--tp: granitemoe's tensor-parallel plan splits none of its layers' modules (experts" in \
        refused("13_train.py", "--model", str(granite), "--data", text, "--tp", "2")
    assert "--batch-size 6 must divide by the data ranks" in refused("13_train.py", "--model", model, "--data", text,
                                                                     "--dp", "4", "--batch-size", "6")


def test_a_checkpoint_of_another_model_is_refused(tiny, tmp_path):
    """A run folder whose newest checkpoint was saved from another config: refused before any
    worker starts, naming the checkpoint (here: the same weights, another rms_norm_eps).
    The run that saved it had too little memory a rank (given: 1 MB) for the check's
    one-process model: a SKIP line saying so, and the run goes on."""
    run = tmp_path / "run"
    p = run_inline("13_train.py", "--model", str(tiny / "model"), "--data", str(tiny / "text.txt"), "--steps", "1",
                   "--checkpoint-every", "1", "--context-length", "32", "--batch-size", "8", "--room", "1000000",
                   "--sample-tokens", "2", "--run-dir", str(run), "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr[-2000:]
    n = sum(t.numel() for t in load("13_train").build_on_meta(tiny / "model").parameters())
    assert f"SKIP  the check against one process: the model whole in one process with AdamW's state " \
           f"({20 * n / 2**30:.2f} GiB a rank, {n:,} parameters) does not fit the 0.00 GiB a rank has here: the run goes on unchecked" in p.stdout
    assert "PASS" not in p.stdout and "final weights sha256" in p.stdout
    other = tmp_path / "other"
    shutil.copytree(tiny / "model", other)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (other / "config.json").write_text(json.dumps(config))
    line = refused("13_train.py", "--model", str(other), "--data", str(tiny / "text.txt"), "--context-length", "32",
                   "--batch-size", "8", "--run-dir", str(run))
    assert "step-000000001 is a checkpoint of another model" in line


def test_bench_sets_ours_beside_fsdp2_and_dcp_or_says_why_not(tiny, tmp_path):
    """--bench at fsdp 2: ours and torch's FSDP2 (fully_shard by decoder layers) on the same
    batches, steps alternating, at the model as given and one twice as wide and deep: a row
    each with step time, tokens/s, each rank's step peak and a checkpoint save (ours and
    torch.distributed.checkpoint's); with --profile, one more step each under torch.profiler:
    each phase's wall and busy time, the idle stretches, the kinds of work, every rank's
    summary, rank 0's traces in --out; and a mesh torch's side cannot take here (pp) is a SKIP
    line with its reason, the script not failing."""
    base = ["--model", str(tiny / "model"), "--data", str(tiny / "text.txt"), "--context-length", "32", "--batch-size",
            "8", "--bench", "--bench-steps", "2", "--out", str(tmp_path), "--run-dir", str(tmp_path / "run")]
    p = run_inline("13_train.py", *base, "--profile")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads((tmp_path / "13_train_bench.json").read_text())["rows"]
    assert all(r["mfu"] == "" for r in rows)   # (no peak known for a CPU: blank, not a guess)
    assert [(r["setting"], r["method"]) for r in rows] == [
        (s, m) for s in ("as given", "2x wide, 2x deep") for m in ("ours (13's mesh)", "torch FSDP2")]
    assert all(r["step_ms"] > 0 and r["save_ms"] > 0 and len(r["peak_MB"].split(" / ")) == 2 for r in rows)
    prof = json.loads((tmp_path / "13_train_profile.json").read_text())
    phases = ["whole step", "forward + backward", "clip", "optimizer"]
    assert [(r["setting"], r["method"], r["phase"]) for r in prof["rows"]] == [
        (s, m, ph) for s in ("as given", "2x wide, 2x deep") for m in ("ours (13's mesh)", "torch FSDP2") for ph in phases]
    assert all(0 < r["busy_ms"] <= r["wall_ms"] for r in prof["rows"])
    assert [len(prof["ranks"][s][m]) for s in prof["ranks"] for m in ("ours", "torch")] == [2] * 4   # every rank's
    kinds = {r["category"] for sec in prof["sections"] if sec["heading"].startswith("The busy") for r in sec["rows"]}
    assert {"matmul", "communication"} <= kinds
    assert "The device's longest idle stretches" in p.stdout
    assert sorted(f.name for f in tmp_path.glob("13_train_profile_*.json.gz")) == [
        f"13_train_profile_{s}_{m}.json.gz" for s in ("given", "larger") for m in ("ours", "torch")]
    assert not list((tmp_path / "run" / "profile").iterdir())
    skipped = run_inline("13_train.py", *base, "--pp", "2")
    assert skipped.returncode == 0 and "SKIP  torch's composition on pp 2" in skipped.stdout, skipped.stdout


def test_torchs_side_compiles_each_decoder_layer_it_shards(tiny, one_rank):
    """--bench --compile: torch's FSDP2 side compiles each decoder layer, as ours (found by
    the model's _no_split_modules before fully_shard renames their class: none had been,
    its rows eager under "+ compile")."""
    import torch
    train = load("13_train")
    ctx = kit.Ctx(0, 1, 0, "gloo", torch.device("cpu"))
    sizes = dict.fromkeys(train.AXES, 1)
    model = train.torch_composition(ctx, tiny / "model", sizes, {}, compile_layers=True)
    layers = [m for m in model.modules() if type(m).__name__.startswith("FSDPLlamaDecoderLayer")]
    assert len(layers) == 4 and all(m._compiled_call_impl is not None for m in layers)   # (Module.compile's)
    eager = train.torch_composition(ctx, tiny / "model", sizes, {})
    assert not any(m._compiled_call_impl is not None for m in eager.modules())


def test_each_sides_optimizer_steps_every_parameter_in_one_fused_adamw(tiny, one_rank, monkeypatch):
    """--bench's two sides (ours, torch's FSDP2) and the run step AdamW fused, as torchtitan
    trains: one op for every parameter of a device and dtype (the default, foreach, makes a
    pass over the state per operation; on a GPU each is a kernel over 4.4 GB at 1 B)."""
    import torch
    train = load("13_train")
    ctx = kit.Ctx(0, 1, 0, "gloo", torch.device("cpu"))
    sizes = dict.fromkeys(train.AXES, 1)
    args = train.parser().parse_args(["--model", str(tiny / "model"), "--data", str(tiny / "text.txt"),
                                      "--context-length", "32", "--batch-size", "2"])

    class Ops(torch.utils._python_dispatch.TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, a=(), kw=None):
            self.seen.append(func.overloadpacket.__name__)
            return func(*a, **(kw or {}))
    x = torch.randint(0, 100, (2, 32))
    losses, made = [], train.loss_of
    monkeypatch.setattr(train, "loss_of", lambda a: made(a) if a is not args else
                        (lambda *t: losses.append(t) or train.lm_loss(*t)))
    for method in ("ours", "torch"):
        step, module, opt = train.bench_method(ctx, args, sizes, tiny / "model", method, {})
        ops = Ops()

        @contextlib.contextmanager
        def phase(name, ops=ops):
            with ops if name == "optimizer" else contextlib.nullcontext():
                yield
        step(x, x, phase)
        foreach = {o for o in ops.seen if o.startswith("_foreach")} - {"_foreach_add_"}   # (the step counts)
        assert ops.seen.count("_fused_adamw_") == 1 and not foreach, (method, sorted(set(ops.seen)))
        assert all(s["exp_avg"].abs().sum() > 0 for s in opt.state.values())   # every parameter stepped
        assert len(losses) == 1, method   # each side's loss is the run's loss_of(args)
        losses.clear()


def test_under_compile_the_loss_never_makes_its_float32_copies_of_the_logits():
    """--compile puts the loss through torch.compile, as torchtitan does, on both sides of
    --bench: the bf16 logits' float32 upcast, log-softmax and their gradients (tokens x
    vocabulary each: 1 GB at gpu-train's 1 B model) are fused away. The peak of live bytes
    of the loss's forward and backward falls below half of eager's; the loss and the
    gradients stay eager's."""
    import torch
    train, fsdp = load("13_train"), load("07_fsdp")
    args = train.parser().parse_args(["--compile"])
    assert train.loss_of(train.parser().parse_args([])) is train.lm_loss
    torch.manual_seed(0)
    h, w = torch.randn(2, 128, 32, requires_grad=True), torch.randn(4096, 32, requires_grad=True)
    y = torch.randint(0, 4096, (2, 128))
    peaks, got = {}, {}
    for name, fn in (("eager", train.lm_loss), ("compiled", train.loss_of(args))):
        for i in range(2):   # (the second as measured: compiled by the first)
            with fsdp.StepPeak(torch.device("cpu")) as mem:
                h.grad = w.grad = None
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = h @ w.t()
                with mem.step():
                    loss = fn(logits, y)
                    del logits
                    loss.backward()
        peaks[name], got[name] = mem.peak, (loss.detach(), h.grad, w.grad)
    fp32_logits = 2 * 128 * 4096 * 4
    assert peaks["eager"] > 2 * fp32_logits and peaks["compiled"] < 0.5 * peaks["eager"], peaks
    for a, b in zip(got["eager"], got["compiled"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bf16_and_recomputation_pass_the_check_against_one_process(tiny, tmp_path):
    """--dtype bf16 (autocast; the one process under the same autocast) with each decoder
    layer recomputed in backward (the model's own activation checkpointing) at fsdp 2."""
    p = run_inline("13_train.py", "--model", str(tiny / "model"), "--data", str(tiny / "text.txt"), "--dtype", "bf16",
                   "--recompute", "--steps", "2", "--eval-every", "2", "--context-length", "32", "--batch-size", "8",
                   "--verify-steps", "2", "--sample-tokens", "2", "--run-dir", str(tmp_path / "run"),
                   "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "verify 13_train on fsdp 2: PASS" in p.stdout


def test_a_family_without_sdpa_or_a_pipeline_plan_and_with_dropout_passes_the_check_on_pp_and_fsdp(tiny, tmp_path):
    """BLOOM as its config builds it (its head tied to its embedding) with dropout, on
    pp 2 x fsdp 2 in float32. It has no SDPA: the run gives it transformers' own attention
    (SDPA's refusal had ended the run in a traceback). It ships no pipeline plan: the stages
    follow the plan read from the model (refused before). The check turns the dropout off on
    both sides and says so (each side's masks are random: on, it failed at float32's
    bound); the run trains with it on. The tied weight's two copies, FSDP's shards on the
    first and last stage, add their gradients (the copies the stage had listed before FSDP
    replaced them got none: any tied model on pp x fsdp failed the check, 9e-4 apart)."""
    import transformers
    bloom = _folder(tiny, tmp_path / "bloom", transformers.BloomForCausalLM(transformers.BloomConfig(
        vocab_size=512, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.1, attention_dropout=0.1)))
    p = run_inline("13_train.py", "--model", str(bloom), "--data", str(tiny / "text.txt"), "--pp", "2", "--fsdp", "2",
                   "--steps", "1", "--eval-every", "1", "--eval-batches", "1", "--context-length", "32",
                   "--batch-size", "8", "--verify-steps", "2", "--sample-tokens", "2", "--run-dir", str(tmp_path / "run"),
                   "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "first 2 steps against one process (attention_dropout=0.1, hidden_dropout=0.1 off in both: drawn at " \
        "random)" in p.stdout
    assert "verify 13_train on pp 2 x fsdp 2: PASS" in p.stdout


def test_recompute_is_the_models_own_checkpointing_without_a_deprecation_warning():
    """--recompute through transformers' current name for it (5.24 warns on the old one,
    in every rank's output)."""
    import warnings
    import transformers
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load("13_train").recompute_layers(model)
    assert model.is_activation_checkpointing and not [w for w in caught if w.category is FutureWarning]


def test_randomness_is_turned_off_for_the_check_by_name_in_the_config_and_on_the_modules():
    """random_off on transformers' models as their configs build them: GPT-2's dropouts,
    PhiMoE's router jitter, an attention module's own copy of its rate; train mode then
    gives eval mode's logits. A model with none reports none."""
    import torch
    import transformers
    train = load("13_train")
    x = torch.randint(0, 64, (2, 8))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2))
    phimoe = transformers.PhimoeForCausalLM(transformers.PhimoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1, attention_dropout=0.25))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2))
    for model, want in ((gpt2, ["attn_pdrop=0.1", "embd_pdrop=0.1", "resid_pdrop=0.1", "summary_first_dropout=0.1"]),
                        (phimoe, ["attention_dropout=0.25", "router_jitter_noise=0.01"]), (llama, [])):
        model.train()
        torch.manual_seed(0)
        before = model(input_ids=x).logits
        assert bool(want) == (not torch.equal(before, model(input_ids=x).logits))   # (random, where it draws)
        assert train.random_off(model) == want
        model.train()
        got = model(input_ids=x).logits
        model.eval()
        assert torch.equal(got, model(input_ids=x).logits), type(model).__name__
    attn = phimoe.model.layers[0].self_attn
    assert attn.attention_dropout == 0.0 and phimoe.config.router_jitter_noise == 0.0
    assert all(m.p == 0.0 for m in gpt2.modules() if isinstance(m, torch.nn.Dropout))


def test_a_plain_run_writes_its_own_model_and_takes_fsdp_over_two_ranks(monkeypatch, tmp_path):
    """No --model: the tiny model and Python's help text written beside the run folder, and
    --fsdp, as its help says, the ranks the other axes leave: 2 on a CPU."""
    import common
    for var in common.TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(common.torch.cuda, "is_available", lambda: False)
    seen = {}

    def stop(worker, args, *job, **kw):
        seen["args"], seen["sizes"] = args, job[0]
        raise KeyboardInterrupt
    p = run_inline("13_train.py", "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path), launch=stop)
    assert p.returncode == 130, p.stderr
    assert seen["args"].world_size == 2 and seen["sizes"] == {"pp": 1, "dp": 1, "fsdp": 2, "cp": 1, "tp": 1}
    assert (tmp_path / "13_tiny_model" / "tokenizer.json").exists() and (tmp_path / "13_pydoc_topics.txt").exists()
    help_text = " ".join(load("13_train").parser().format_help().split())
    assert "the ranks the other axes leave: --world-size, or 2 GPUs or more, else 2" in help_text


# ---- --setup-memory and --hf-checkpoint (moved from 10): their workers on 2 ranks --------
@pytest.mark.parametrize("method", ["ours", "torch's DCP (FSDP2)"])
def test_hf_checkpoint_rows_load_and_save_the_folder_exactly(tmp_path, method):
    """--hf-checkpoint's worker on fsdp 2 (the script's table runs 8 ranks): 10's nano LM
    from a sharded safetensors folder, saved again; the saved folder holds the same
    tensors bit for bit, each rank held half the weights."""
    train = load("13_train")
    args = verify_args(2, context_length=16, model_size="nano")
    source, out = str(tmp_path / "source"), str(tmp_path / "saved")
    largest = train.write_hf_source(args, source)
    rows = kit.launch(train.hf_checkpoint_memory, args, train.nd.mesh_of(fsdp=2), method, source, out, world_size=2)
    whole = kit.lm_param_count("nano", 16) * 4 / 2**20
    assert [r["phase"] for r in rows] == ["load", "save"] and largest > 0
    for r in rows:
        assert whole / 2 <= r["held_mib"] < whole / 2 * 1.05, r
        assert r["peak_mib"] >= r["start_mib"] and r["seconds"] > 0
    assert train.same_tensors(source, out) == "exact"


def test_setup_memory_rows_hold_the_ranks_part_and_the_meta_path_trains():
    """--setup-memory's worker on fsdp 2 (the script's table runs 8 ranks): each way of
    setting 10's LM up leaves each rank half the weights; ours from meta then trains a step."""
    train = load("13_train")
    args = verify_args(2, context_length=16)
    whole = kit.lm_param_count("nano", 16) * 4 / 2**20
    rows = [kit.launch(train.setup_memory, args, train.nd.mesh_of(fsdp=2), method, "nano", 1 if "ours" in method else 0,
                       world_size=2) for method in train.SETUP_METHODS]
    for r in rows:
        assert r["whole_mib"] == pytest.approx(whole)
        assert whole / 2 <= r["held_mib"] < whole / 2 * 1.05, r   # FSDP's padding aside
        assert r["setup_peak_mib"] >= r["start_mib"] and r["above_start_mib"] >= 0
    ours = rows[1]
    assert ours["step_s"] > 0 and 8.0 < ours["loss"] < 10.5   # ln(10000) = 9.2: a fresh LM's loss


def test_setup_memory_saves_each_row_as_it_comes_and_prints_its_table_once(tmp_path):
    """--setup-memory's report, its 8-rank jobs played: the results file is written after
    each setup (marked partial until the last), a setup that fails is a SKIP line, and the
    table is printed once, at the end (it had been printed again after every row)."""
    train = load("13_train")
    runs, md = [], tmp_path / "13_setup_memory.md"

    def launch(worker, args, shape, method, size, steps, world_size=None):
        runs.append(md.read_text() if md.exists() else None)
        if len(runs) == 2:
            raise kit.LaunchError("rank 3 failed: played")
        return {**dict.fromkeys(train.SETUP_HEADERS, 1.0), "mesh": train.nd.label(shape), "setup": method}
    p = run_inline("13_train.py", "--setup-memory", "--big-size", "none", "--out", str(tmp_path), launch=launch)
    n = len(train.SETUP_MESHES) * len(train.SETUP_METHODS)
    assert p.returncode == 0, p.stderr
    assert len(runs) == n and runs[0] is None and f"(partial: {n - 1} of {n} setups done)" in runs[-1], runs
    assert "(partial: 1 of" in runs[1] and "partial" not in md.read_text()
    assert p.stdout.count("Each rank's peak host memory while it sets up") == 1, p.stdout
    assert p.stdout.count("13_setup_memory.json and .md") == 1 and p.stdout.count("setup-memory: SKIP") == 1
    assert len(json.loads((tmp_path / "13_setup_memory.json").read_text())["rows"]) == n - 1


def test_the_measurements_take_their_own_flags(tmp_path):
    """--setup-memory and --hf-checkpoint parse their own flags (10's LM, 8 ranks): a flag of
    the training run is refused, and so are both at once."""
    assert "unrecognized arguments: --pp 2" in refused("13_train.py", "--hf-checkpoint", "--pp", "2")
    assert "two measurements: give one" in refused("13_train.py", "--hf-checkpoint", "--setup-memory",
                                                   "--out", str(tmp_path))


# ---- on replicas that survive a loss (14's manager around 13's mesh) ---------------------------
def test_replicas_go_through_14s_failures_and_every_step_replays_in_one_process(tiny, tmp_path):
    """--replicas 3 (one rank each: the torchrun test below heals a mesh of 2 rank by rank)
    through 14's scenario (--faults): replica 1 killed and its heal's source killed midway,
    a SIGSTOP, two replicas killed at once at five points of a step. The committed steps
    replayed in one process (each member's batches) from checkpoint to checkpoint match the
    run's checkpoints and its final folder; the replicas end alike; the folder is written
    once; the timeline is drawn beside loss.png; the progress lines name the quorum."""
    run = tmp_path / "run"
    p = run_script("13_train.py", "--model", str(tiny / "model"), "--data", str(tiny / "text.txt"), "--replicas", "3",
                   "--fsdp", "1", "--faults", "--steps", "400", "--pace-ms", "200", "--context-length", "32",
                   "--batch-size", "8",
                   "--eval-every", "400", "--eval-batches", "1", "--log-every", "10", "--verify-steps", "1",
                   "--sample-tokens", "2", "--run-dir", str(run), "--out", str(tmp_path / "out"), timeout=400)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    out = p.stdout
    assert re.search(r"PASS  \d+ committed steps replayed in one process in \d+ stretches from checkpoint to "
                     r"checkpoint, the last against the final folder \(\d+ heals; the 3 replicas at the last step "
                     r"alike: True\)", out), out
    assert "verify 13_train on 3 replicas of one rank: PASS" in out
    armed = re.findall(r"armed after step +\d+: (.*)", out)
    assert len(armed) == 8 and armed[-1] == "stop" and armed[1] == "SIGSTOP replica 2", armed
    rows = dict(re.findall(r"replica (\d)  ([#H.]+)", out))
    assert len(rows) == 3 and all(r[-1] != "." for r in rows.values()) and sum(r.count("H") for r in rows.values()) >= 9
    assert re.search(r"replica \d: step +\d+/400 \| loss [\d.]+ .* \| quorum \[[\d, ]+\] \| this start: \d+ committed",
                     out), out
    finals = re.findall(r"the final folder (written to \S+|written by another replica)", out)
    assert sorted(finals)[:2] == ["written by another replica"] * 2 and finals.count(f"written to {run}/final") == 1
    assert (run / "timeline.png").stat().st_size > 5000 and (run / "loss.png").exists()
    assert (tmp_path / "out" / "13_train_replicas_timeline.png").exists()
    commits = [json.loads(ln) for ln in (run / "record.jsonl").read_text().splitlines()]
    steps = [e["commit"] for e in commits if "commit" in e]
    assert steps == list(range(len(steps))) and any(len(e["members"]) == 1 for e in commits if "commit" in e)
    assert "Traceback" not in out   # (a dying rank's stays in its replica's log)


def test_replicas_under_torchrun_a_job_killed_whole_comes_back_healed_and_the_run_replays(tiny, tmp_path):
    """The torchrun form: 13's coordinator alone, each replica a torchrun job of 2 ranks
    (fsdp 2). Replica 1's job killed whole (kill -9 of its agent's process group and of its
    ranks, each a session of its own): replica 0 trains on alone; the same command started
    again heals from it rank by rank and both train on; the coordinator told to stop, one
    replica writes the final folder; --replay RUN_DIR passes; nothing is left running."""
    from test_14_fault_tolerant_dp import own_processes, start, status
    tag, run = uuid.uuid4().hex, tmp_path / "run"
    coord = start("13_train.py", "--coordinator", "--port", "0", "--run-dir", str(run),
                  "--detect", "2", tag=tag, start_new_session=True)
    address = coord.stdout.readline().split()[2]
    flags = ["--model", str(tiny / "model"), "--data", str(tiny / "text.txt"), "--replicas", "2", "--steps", "400",
             "--context-length", "32", "--batch-size", "8", "--eval-every", "400", "--eval-batches", "1",
             "--checkpoint-every", "4", "--log-every", "4", "--pace-ms", "150", "--run-dir", str(run), "--out",
             str(tmp_path / "out")]

    def replica(r):
        return start("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "13_train.py", *flags,
                     "--join", address,
                     "--replica-id", str(r), tag=tag, start_new_session=True)

    def reached(pred, within=120.0):
        deadline = time.time() + within
        while time.time() < deadline:
            st = status(address)
            if st["last_commit"] and pred(st):
                return st["last_commit"]["step"]
            time.sleep(0.2)
        raise AssertionError(f"not reached in {within:.0f} s: {status(address)}")
    try:
        jobs = {r: replica(r) for r in (0, 1)}
        step = reached(lambda st: st["last_commit"]["members"] == [0, 1])
        victims = [pid for pid in own_processes(tag) if b"--replica-id\x001" in open(f"/proc/{pid}/cmdline", "rb").read()]
        os.killpg(jobs[1].pid, signal.SIGKILL)
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        jobs[1].communicate(timeout=60)
        alone = reached(lambda st: st["last_commit"]["members"] == [0] and st["last_commit"]["step"] > step + 2)
        jobs[1] = replica(1)
        back = reached(lambda st: st["last_commit"]["members"] == [0, 1] and st["last_commit"]["step"] > alone + 3)
        with socket.create_connection(address.rsplit(":", 1)) as s:   # the run ends 2 steps on
            s.sendall((json.dumps({"op": "arm", "stop_at": back + 2}) + "\n").encode())
            s.makefile("r").readline()
        outs = {r: j.communicate(timeout=120) for r, j in jobs.items()}
    finally:
        os.killpg(coord.pid, signal.SIGKILL)
        said, _ = coord.communicate(timeout=60)
    for r, (out, err) in outs.items():
        assert jobs[r].returncode == 0, out[-2000:] + err[-3000:]
    assert re.search(r"replica 1: done at step \d+; this start committed \d+ step\(s\) \(0 aborted; healed from "
                     r"replica 0 at step \d+; 0 heal\(s\) served\)", outs[1][0]), outs[1][0]
    assert "replica 1 heals from replica 0" in said and "replica 1 lost" in said, said
    assert sum("written to" in out for out, _ in outs.values()) == 1 and (run / "final" / "config.json").exists()
    p = run_inline("13_train.py", "--model", str(tiny / "model"), "--data", str(tiny / "text.txt"), "--replay", str(run),
                   "--out", str(tmp_path / "out"))
    assert p.returncode == 0 and f"verify 13_train replay of {run}: PASS" in p.stdout, p.stdout + p.stderr
    assert "past float32's horizon" not in p.stdout   # (stretches of 4 steps: each within 1e-4 of the run)
    # the control: the record says one step had replica 0 alone where both took part; its stretch,
    # replayed again from nudged weights, ends near the replay (float32 did not move it), so it fails
    lines = (run / "record.jsonl").read_text().splitlines()
    k = next(i for i, ln in enumerate(lines) if '"members": [0, 1]' in ln and json.loads(ln).get("commit", 0) > 5)
    lines[k] = lines[k].replace('"members": [0, 1]', '"members": [0]')
    (run / "record.jsonl").write_text("\n".join(lines) + "\n")
    p = run_inline("13_train.py", "--model", str(tiny / "model"), "--data", str(tiny / "text.txt"), "--replay", str(run),
                   "--out", str(tmp_path / "out"))
    assert p.returncode != 0 and f"verify 13_train replay of {run}: FAIL" in p.stdout, p.stdout + p.stderr
    time.sleep(0.5)
    assert own_processes(tag) == []


def test_bench_on_replicas_sets_ours_beside_one_job_and_torchft_or_says_why_not(tiny, tmp_path):
    """--bench --replicas 2 (one rank each): the mesh as one job (dp 2) and ours, each a row:
    the step, and ours through a kill -9 of replica 1 (to the next commit, the heal's bytes,
    the replacement's hello to its first commit); torchft's row where it is installed, else a
    SKIP line that says how to install it; its run folders removed."""
    import importlib.util
    run, out = tmp_path / "run", tmp_path / "out"
    p = run_script("13_train.py", "--model", str(tiny / "model"), "--data", str(tiny / "text.txt"), "--replicas", "2",
                   "--fsdp", "1", "--bench", "--bench-steps", "1", "--context-length", "32", "--batch-size", "4",
                   "--run-dir", str(run), "--out", str(out))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = {r["method"]: r for r in json.loads((out / "13_train_replicas_bench.json").read_text())["rows"]}
    has = importlib.util.find_spec("torchft") is not None
    assert list(rows) == ["one job", "ours"] + ["torchft"] * has
    assert has or "SKIP torchft's Manager: torchft is not installed here (make torchft-bench installs it" in p.stdout
    for name in list(rows)[1:]:
        r = rows[name]
        assert r["step_ms"] > 0 and 0 < r["kill_to_commit_s"] < 60 and r["heal_MB"] > 1 and r["rejoin_to_commit_s"] > 0
    assert rows["one job"]["vs_one_job"] == 1.0 and not (run / "bench-replicas").exists()


def test_bad_input_on_replicas_is_one_line(tiny, tmp_path):
    flags = ["--model", str(tiny / "model"), "--data", str(tiny / "text.txt"), "--run-dir", str(tmp_path / "run"),
             "--out", str(tmp_path)]
    assert "24 processes on" in refused("13_train.py", *flags, "--replicas", "3", "--tp", "2", "--pp", "2", "--fsdp", "2")
    assert "give the coordinator's HOST:PORT" in refused("13_train.py", *flags, "--replicas", "2", "--join", "nohost",
                                                         "--replica-id", "0")
    assert "a port is 1 to 65535" in refused("13_train.py", *flags, "--replicas", "2", "--join", "127.0.0.1:99999",
                                             "--replica-id", "0")
    with socket.socket() as s:   # a port where nothing listens (held bound, no other socket takes it): a bounded
        s.bind(("127.0.0.1", 0))  # wait, then one line
        port = s.getsockname()[1]
        assert f"nothing answers at 127.0.0.1:{port}" in refused("13_train.py", *flags, "--replicas", "2", "--join",
                                                                f"127.0.0.1:{port}", "--replica-id", "0",
                                                                "--connect-wait", "0.5")
    assert "the run's replicas are 0 to 1" in refused("13_train.py", *flags, "--replicas", "2", "--join",
                                                      "127.0.0.1:1", "--replica-id", "2")
    assert "--join needs --replicas N" in refused("13_train.py", *flags, "--join", "127.0.0.1:1", "--replica-id", "0")
    assert "needs a third to go on" in refused("13_train.py", *flags, "--replicas", "2", "--faults")
    assert "--replica-id applies to --join" in refused("13_train.py", *flags, "--replica-id", "0")
    assert "--bench --faults: the benchmark starts its replicas itself" in refused(
        "13_train.py", *flags, "--replicas", "3", "--bench", "--faults")
    assert "--torchft applies to --join" in refused("13_train.py", *flags, "--replicas", "2", "--torchft")
    assert "--profile profiles --bench's steps on one job: add --bench" in refused("13_train.py", *flags, "--profile")
    assert "--profile with --replicas" in refused("13_train.py", *flags, "--replicas", "2", "--bench", "--profile")
    assert "no record.jsonl there" in refused("13_train.py", *flags, "--replay", str(tmp_path))


def test_a_family_that_counts_its_experts_by_another_name_is_split_by_ep():
    """Ernie 4.5's MoE counts its experts in moe_num_experts (refused as having none, before)."""
    import argparse
    train = load("13_train")
    config = {"model_type": "ernie4_5_moe", "num_attention_heads": 4, "num_hidden_layers": 2, "moe_num_experts": 4}
    sizes = {"pp": 1, "dp": 2, "fsdp": 1, "cp": 1, "tp": 1}
    train.check_mesh_fits(config, sizes, argparse.Namespace(ep=2, plan=None, chunks=1))
    with pytest.raises(kit.UsageError, match="--ep 3 does not divide the model's 4 experts"):
        train.check_mesh_fits(config, sizes, argparse.Namespace(ep=3, plan=None, chunks=1))


def test_intermediate_sizes_given_a_layer_each_are_each_checked_against_tp():
    """Gemma 3n's config gives its intermediate size as a list, one a layer: --tp ended in a
    TypeError (a list modulo an int) before any worker started; each layer's is checked."""
    import argparse
    train = load("13_train")
    config = {"model_type": "gemma3n_text", "base_model_tp_plan": {"layers.*.mlp.up_proj": "colwise"},
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3,
              "intermediate_size": [128, 128, 96]}
    flags = argparse.Namespace(ep=1, plan=None, chunks=1)
    train.check_mesh_fits(config, {"pp": 1, "dp": 1, "fsdp": 1, "cp": 1, "tp": 2}, flags)
    with pytest.raises(kit.UsageError, match=r"^--tp 64 does not divide the model's 96 intermediate size \(layer 2\)$"):
        train.check_mesh_fits({**config, "num_attention_heads": 64, "num_key_value_heads": 64},
                              {"pp": 1, "dp": 1, "fsdp": 1, "cp": 1, "tp": 64}, flags)


def test_a_config_with_values_of_its_own_a_layer_is_read_layer_by_layer():
    """Gemma 4's config is heterogeneous (transformers' per_layer_config): its full-attention
    layers have a head_dim and key/value heads of their own, and reading config.head_dim
    raises. 13 on a Gemma 4 folder ended in that traceback on every axis (in the FLOPs a
    token, before any worker); now the attention term sums each layer's heads' width, and
    --tp is checked against each layer's own head counts."""
    import argparse
    import transformers
    train = load("13_train")
    model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True,
        hidden_size_per_layer_input=0, sliding_window=16))
    weights = sum(p.numel() for n, p in model.named_parameters() if n != "model.embed_tokens.weight") + \
        model.model.embed_tokens.weight.numel()   # (its head tied: the embedding counted once, as the head)
    assert train.train_flops_per_token(model, 32) == 6.0 * weights + 12.0 * 32 * (4 * 8 + 4 * 16)
    config = model.config.to_dict()
    assert config["per_layer_config"] == {"1": {"head_dim": 16, "num_key_value_heads": 1}}
    flags = argparse.Namespace(ep=1, plan=None, chunks=1)
    with pytest.raises(kit.UsageError, match=r"^--tp 2 does not divide the model's 1 key/value heads \(layer 1\)$"):
        train.check_mesh_fits(config, {"pp": 1, "dp": 1, "fsdp": 1, "cp": 1, "tp": 2}, flags)


def test_tp_takes_the_plan_of_a_decoder_off_its_prefix_and_refuses_one_that_splits_only_the_embedding():
    """Llama 4's decoder is under "model", not its base_model_prefix ("language_model", its
    multimodal sibling's): its plan matched nothing, and --tp was refused as splitting
    nothing. Hunyuan's plan (as Bamba's and Falcon-H1's) splits only the embedding: --tp
    trained with every layer whole on every rank, the check passing at a difference of 0;
    now refused, naming what stays whole."""
    import transformers
    train = load("13_train")
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8)
    llama4 = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
        **small, intermediate_size_mlp=64, num_local_experts=2, interleave_moe_layer_step=2))
    split, _ = train.tp.model_plan(llama4)
    assert split["model.layers.*.self_attn.q_proj"] == "column" and train.tp_plan_problem(llama4) is None
    hunyuan = transformers.HunYuanDenseV1ForCausalLM(transformers.HunYuanDenseV1Config(**small))
    assert train.tp_plan_problem(hunyuan).startswith(
        "--tp: hunyuan_v1_dense's tensor-parallel plan splits none of its layers' modules (only model.embed_tokens; "
        "gate_proj, up_proj, down_proj: not in the model's plan")


def test_cp_refuses_a_model_whose_tokens_meet_outside_its_attention():
    """Context parallelism splits attention; a Mamba layer's scan or a convolution over the
    sequence would see only a rank's part. Bamba, Falcon-H1, GraniteMoeHybrid, Jamba, LFM2,
    MiniMax, NemotronH, Qwen3-Next and RecurrentGemma trained so on --cp 2 until 2026-11-30,
    caught only by the check against one process (9e-04); now refused before any worker
    starts, naming what mixes the tokens. A decoder of attention alone is not refused, nor
    one whose sliding window or attention chunk holds the whole sequence."""
    import torch
    import transformers
    train = load("13_train")
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    with torch.device("meta"):
        bamba = transformers.BambaForCausalLM(transformers.BambaConfig(
            **small, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1))
        minimax = transformers.MiniMaxForCausalLM(transformers.MiniMaxConfig(
            **small, head_dim=8, num_local_experts=2, layer_types=["linear_attention", "full_attention"]))
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**small))
        llama4 = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
            **small, head_dim=8, intermediate_size_mlp=64, num_local_experts=2, attention_chunk_size=16))
    assert train.cp_problem(bamba, {"model_type": "bamba"}, "sdpa", 32) == (
        "--cp: bamba mixes tokens outside its attention (BambaMixer, its 'linear_attention' layers): context "
        "parallelism splits attention alone, and each rank's part of the sequence would miss the rest")
    assert "(its 'linear_attention' layers)" in train.cp_problem(minimax, {"model_type": "minimax"}, "sdpa", 32)
    assert train.cp_problem(llama, {"model_type": "llama"}, "sdpa", 32) is None
    assert "no SDPA attention" in train.cp_problem(llama, {"model_type": "llama"}, "eager", 32)
    # Llama 4's chunked attention (a mask that is no longer causal past its chunk): refused up front, where it had
    # been refused by 11 at the first step in every rank; a sequence within one chunk is causal and trains
    assert train.cp_problem(llama4, {"model_type": "llama4_text"}, "sdpa", 32).startswith(
        "--cp: llama4_text's attention_chunk_size=16 is shorter than --context-length 32")
    assert train.cp_problem(llama4, {"model_type": "llama4_text"}, "sdpa", 16) is None


def test_the_larger_bench_model_repeats_per_layer_patterns_or_says_why_it_cannot(tmp_path):
    """--bench's second setting doubles the width and the layers. Llama 4's no_rope_layers
    (a flag a layer) stayed at its length and building the model failed (IndexError), and
    Bamba's config refuses twice the width (its Mamba heads are tied to it): --bench ended
    in a traceback. Now the per-layer patterns are repeated (Gemma 3n's intermediate sizes,
    a list, each doubled; Gemma 4's values of a layer's own), and a config that does not take
    it is a ValueError naming why (report_bench: a SKIP line), nothing written."""
    import argparse
    import transformers
    train = load("13_train")
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
        **small, head_dim=8, intermediate_size_mlp=64, num_local_experts=2)).save_pretrained(tmp_path / "llama4")
    folder = train.larger_model(argparse.Namespace(model=str(tmp_path / "llama4"), seed=0), tmp_path / "run1")
    config = transformers.AutoConfig.from_pretrained(folder)
    assert (config.hidden_size, config.num_hidden_layers, len(config.no_rope_layers), len(config.layer_types)) == \
        (64, 4, 4, 4)
    # Gemma 3n: an intermediate size a layer (a list, repeated whole before) and a fraction of
    # sparsity a layer (not repeated: IndexError, a SKIP line where the setting could run)
    transformers.Gemma3nForCausalLM(transformers.Gemma3nTextConfig(
        **{**small, "intermediate_size": [64, 48]}, head_dim=8, hidden_size_per_layer_input=4,
        vocab_size_per_layer_input=64, laurel_rank=4, num_kv_shared_layers=0, activation_sparsity_pattern=[0.95, 0.0],
        layer_types=["sliding_attention", "full_attention"], sliding_window=16)).save_pretrained(tmp_path / "gemma3n")
    folder = train.larger_model(argparse.Namespace(model=str(tmp_path / "gemma3n"), seed=0), tmp_path / "run3")
    config = transformers.AutoConfig.from_pretrained(folder)
    assert (config.hidden_size, config.intermediate_size, config.activation_sparsity_pattern) == \
        (64, [128, 96, 128, 96], [0.95, 0.0, 0.95, 0.0])
    # Gemma 4: values of its own a layer (per_layer_config: its full-attention layers' head_dim),
    # at layer 1 alone before: layer 3, of full attention too, differed ("not homogeneous")
    transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(
        **small, head_dim=8, global_head_dim=16, hidden_size_per_layer_input=0, sliding_window=16)).save_pretrained(
        tmp_path / "gemma4")
    folder = train.larger_model(argparse.Namespace(model=str(tmp_path / "gemma4"), seed=0), tmp_path / "run4")
    config = transformers.AutoConfig.from_pretrained(folder)
    assert [(c.head_dim, t) for c, t in zip(config.per_layer_config, config.layer_types)] == \
        [(8, "sliding_attention"), (16, "full_attention")] * 2 and config.hidden_size == 64
    transformers.BambaForCausalLM(transformers.BambaConfig(
        **small, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
        mamba_n_groups=1)).save_pretrained(tmp_path / "bamba")
    with pytest.raises(ValueError, match=re.escape("bamba's config does not take twice the width and depth "
                                                   "(ValueError: The dimensions for the Mamba head state")):
        train.larger_model(argparse.Namespace(model=str(tmp_path / "bamba"), seed=0), tmp_path / "run2")
    assert not (tmp_path / "run2").exists()


def test_bench_sets_a_skip_line_where_torchs_side_cannot_take_the_model(tiny, tmp_path, one_rank, monkeypatch):
    """torch's side failing in its first steps (Llama 4's shared expert under torch's TP:
    "Output 0 of _ToTorchTensor is a view and is being modified inplace") ended --bench in
    every rank's traceback, ours' numbers lost; now bench_steps returns the reason, the same
    on every rank, for report_bench's SKIP line. Ours failing still raises."""
    import argparse
    import torch
    import corpus
    train = load("13_train")
    index = corpus.prepare(corpus.parse_sources([str(tiny / "text.txt")]), str(tiny / "model"), str(tmp_path / "c"),
                           say=lambda line: None)
    args = argparse.Namespace(corpus=index, context_length=16, batch_size=2, seed=0)
    ctx, stepped = argparse.Namespace(device=torch.device("cpu"), rank=0, world_size=1), []

    def method(ctx, args, sizes, folder, m, plan):
        if m == "torch":
            raise RuntimeError("Output 0 of _ToTorchTensor is a view and is being modified inplace.\n(more)")
        return lambda x, y: stepped.append(tuple(x.shape)), None, None
    monkeypatch.setattr(train, "bench_method", method)
    monkeypatch.setattr(train, "bench_plan", lambda *a: {})
    assert train.bench_steps(ctx, args, {}, str(tiny / "model")) == {
        "skip": "RuntimeError: Output 0 of _ToTorchTensor is a view and is being modified inplace."}
    assert stepped == [(2, 16)] * 3   # ours was built and stepped
    monkeypatch.setattr(train, "bench_method", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        train.bench_steps(ctx, args, {}, str(tiny / "model"))


def qwen3_vl_moe(vocab=512, layers=2):
    """A tiny Qwen3-VL-MoE as its config builds it (its experts 8 wide, its hidden 32: every
    expert tensor's two inner dims differ, so a transposed one cannot pass for the other)."""
    import transformers
    return transformers.Qwen3VLMoeForConditionalGeneration(transformers.Qwen3VLMoeConfig(
        text_config=dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=8, num_experts=4,
                         num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                  "mrope_section": [1, 1, 2], "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=14,
                           deepstack_visual_indexes=[0], num_position_embeddings=16),
        image_token_id=vocab - 1, video_token_id=vocab - 2, vision_start_token_id=vocab - 3, vision_end_token_id=vocab - 4))


def test_a_multimodal_folder_trains_its_language_model_and_comes_back_in_its_own_layout(tiny, tmp_path):
    """The folders people fine-tune on text are often multimodal (Gemma 3 from 4B up, Mistral
    Small 3, Qwen-VL, Llama 4). Before 2026-11-30 13 ended every one in a traceback: Gemma
    3's config has no num_attention_heads (its text config has), the others are no causal LM
    to AutoModelForCausalLM (and Llama 4's whole folder was built as its language model
    alone), and Qwen3-VL-MoE's experts, transposed in the Hub's files, were refused. Here
    Qwen3-VL-MoE as the Hub holds it, on pp 2 (its vision tower on the first stage): the
    check against one process passes, the folder written back has the source's names and
    shapes (its experts transposed as they came), the vision tower bit for bit as it was
    (text never reaches it: no gradient), every tensor of the language model trained."""
    import torch
    from safetensors.torch import load_file, save_file
    source = _folder(tiny, tmp_path / "qwen3-vl-moe", qwen3_vl_moe())
    stored = load_file(source / "model.safetensors")
    save_file({k: v.transpose(1, 2).contiguous() if ".experts." in k else v for k, v in stored.items()},
              source / "model.safetensors", metadata={"format": "pt"})   # [E, in, out], as on the Hub
    run = tmp_path / "run"
    p = run_inline("13_train.py", "--model", str(source), "--data", str(tiny / "text.txt"), "--pp", "2",
                   "--steps", "1", "--eval-every", "1", "--eval-batches", "1", "--context-length", "32",
                   "--batch-size", "8", "--verify-steps", "2", "--sample-tokens", "2", "--run-dir", str(run),
                   "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "verify 13_train on pp 2: PASS" in p.stdout
    final = run / "final"
    assert tensors_in(final) == tensors_in(source)
    assert tensors_in(final)["model.language_model.layers.0.mlp.experts.down_proj"] == (4, 8, 32)
    got = {}
    for f in final.glob("*.safetensors"):
        got.update(load_file(f))
    was = load_file(source / "model.safetensors")
    vision = [k for k in was if k.startswith("model.visual.")]
    assert vision and all(torch.equal(got[k], was[k]) for k in vision)
    assert not [k for k in was if k not in vision and torch.equal(got[k], was[k])]
    assert "sample: " in p.stdout   # generate() on the folder, loaded as its own class


def test_a_multimodal_model_is_built_as_its_folder_names_it_and_measured_by_its_language_model():
    """auto_class: the class a folder's config.json names (Llama 4's whole folder is no
    Llama4ForCausalLM, which AutoModelForCausalLM builds from its config, its weights' names
    then not found; Gemma 3's multimodal class is what AutoModelForCausalLM maps it to;
    Mistral 3 names none here: its image-text-to-text class; Voxtral's, with an audio tower,
    only AutoModelForMultimodalLM maps: "Unrecognized configuration class", before). MFU's
    FLOPs count the language model and its head alone (a vision or audio tower does no work
    on text: the same count as the language model's own causal LM), and --cp reads the text
    config's sliding window (Gemma 3's multimodal config has none of its own: AttributeError,
    before) and looks for tokens mixed outside attention in the decoder alone (Voxtral's audio
    tower's convolutions had refused it)."""
    import torch
    import transformers
    train = load("13_train")
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    gemma = transformers.Gemma3Config(text_config=dict(text, model_type="gemma3_text", sliding_window=16),
                                      vision_config=dict(vision, model_type="siglip_vision_model"), mm_tokens_per_image=4,
                                      image_token_id=63, boi_token_index=62, eoi_token_index=61)
    llama4 = transformers.Llama4Config(text_config=dict(text, intermediate_size_mlp=64, num_local_experts=2),
                                       vision_config=dict(vision, vision_output_dim=32, projector_input_dim=32,
                                                          projector_output_dim=32, pixel_shuffle_ratio=0.5),
                                       image_token_index=63, architectures=["Llama4ForConditionalGeneration"])
    mistral3 = transformers.Mistral3Config(text_config=dict(text, model_type="mistral"))
    assert train.auto_class(llama4) is transformers.AutoModelForImageTextToText
    assert train.auto_class(mistral3) is transformers.AutoModelForImageTextToText
    assert train.auto_class(gemma) is transformers.AutoModelForCausalLM
    assert train.auto_class(gemma.text_config) is transformers.AutoModelForCausalLM
    with torch.device("meta"):
        whole = train.auto_class(gemma).from_config(gemma)
        alone = transformers.Gemma3ForCausalLM(gemma.text_config)
    assert type(whole).__name__ == "Gemma3ForConditionalGeneration"
    assert train.train_flops_per_token(whole, 32) == train.train_flops_per_token(alone, 32)
    assert train.cp_problem(whole, gemma.to_dict(), "sdpa", 32).startswith(
        "--cp: gemma3's sliding_window=16 is shorter than --context-length 32")
    assert train.cp_problem(whole, gemma.to_dict(), "sdpa", 16) is None
    voxtral = transformers.VoxtralConfig(text_config=dict(text, model_type="llama"),
                                         audio_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                           num_attention_heads=2, num_mel_bins=16))
    assert train.auto_class(voxtral) is transformers.AutoModelForMultimodalLM
    with torch.device("meta"):
        whole, alone = train.auto_class(voxtral).from_config(voxtral), transformers.LlamaForCausalLM(voxtral.text_config)
    assert type(whole).__name__ == "VoxtralForConditionalGeneration"
    assert train.train_flops_per_token(whole, 32) == train.train_flops_per_token(alone, 32)
    # its audio tower's convolutions mix no text: --cp looks at the decoder alone (refused, before)
    assert train.cp_problem(whole, voxtral.to_dict(), "sdpa", 32) is None


def test_a_sample_transformers_cannot_generate_is_said_and_the_runs_row_is_still_written(tiny, tmp_path, monkeypatch):
    """The run's end (summarize) on a folder that loads but whose generate() fails in
    transformers on text alone (Qwen2.5-Omni's thinker reads a vision token its config does
    not hold: AttributeError): the sample line says so, and the run's row and table are
    written, the reason with them; before, the traceback ended the run after training, its
    summary lost. A folder that does not load still fails the run."""
    import transformers
    train = load("13_train")
    args = train.parser().parse_args(["--model", str(tiny / "model"), "--data", str(tiny / "text.txt"), "--run-dir",
                                      str(tmp_path / "run"), "--out", str(tmp_path / "out"), "--sample-tokens", "2"])
    result = {"final": str(tiny / "model"), "sha256": "0" * 64,
              "history": [{"step": 1, "loss": 5.0, "seconds": 0.1}, {"step": 1, "eval": 4.0}]}

    def fails(self, *a, **kw):
        raise AttributeError("'Qwen2_5OmniThinkerConfig' object has no attribute 'vision_start_token_id'")
    monkeypatch.setattr(transformers.GenerationMixin, "generate", fails)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.summarize(args, {"fsdp": 1}, result, "13_train")
    assert ("sample: none: the folder loads, and transformers' LlamaForCausalLM.generate() fails on text "
            "(AttributeError: 'Qwen2_5OmniThinkerConfig' object has no attribute 'vision_start_token_id')") \
        in out.getvalue(), out.getvalue()
    saved = json.loads((tmp_path / "out" / "13_train.json").read_text())
    assert saved["rows"][0]["last loss"] == 5.0 and "generate() fails" in saved["sample"]
    with pytest.raises(OSError):   # (the folder itself must load)
        train.sample(tmp_path / "nothing", "x", 2)


def test_what_a_multimodal_models_language_model_cannot_take_is_refused_before_any_worker_starts(tiny, tmp_path):
    """Gemma 4's per-layer embeddings (beside its decoder layers, outside its pipeline plan)
    on --pp: refused by every rank's stage at the first step, after the workers started; now
    before, in one line. Qwen3-VL's plan splits only its embedding, under
    model.language_model: --tp is refused, naming it."""
    import transformers
    text = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8)
    gemma4 = _folder(tiny, tmp_path / "gemma4", transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(
        text_config=dict(text, vocab_size_per_layer_input=512, hidden_size_per_layer_input=8, global_head_dim=8,
                         layer_types=["sliding_attention", "full_attention"]),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=8, patch_size=14, position_embedding_size=64),
        image_token_id=511, boi_token_id=510, eoi_token_id=509)))
    assert refused("13_train.py", "--model", str(gemma4), "--data", str(tiny / "text.txt"), "--pp", "2").startswith(
        "13_train.py: error: --pp: Gemma4ForConditionalGeneration's model.language_model.embed_tokens_per_layer, ")
    qwen3_vl = _folder(tiny, tmp_path / "qwen3-vl", transformers.Qwen3VLForConditionalGeneration(transformers.Qwen3VLConfig(
        text_config=dict(text, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "mrope_section": [1, 1, 2], "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=14,
                           deepstack_visual_indexes=[0], num_position_embeddings=16),
        image_token_id=511, video_token_id=510, vision_start_token_id=509, vision_end_token_id=508)))
    assert "--tp: qwen3_vl's tensor-parallel plan splits none of its layers' modules (only " \
        "model.language_model.embed_tokens;" in refused("13_train.py", "--model", str(qwen3_vl), "--data",
                                                        str(tiny / "text.txt"), "--tp", "2")

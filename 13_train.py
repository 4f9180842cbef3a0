"""Train the model you have on your own text, on any mesh: a Hugging Face model folder (its
config, its weights, its tokenizer) and a text file in, a folder from_pretrained loads out.

The model is built on meta, put on the mesh by the calls of 10's "A Hugging Face model"
(its own tensor-parallel plan, its own pipeline stages, FSDP by its decoder layers,
DDPBucketed over the data ranks, context parallelism, its experts split), and each rank
reads only its slices of the folder's weights. The text is tokenized once by the folder's
tokenizer into a token file cached beside it, packed into sequences of --context-length,
the last of them held out; step i's global batch depends on i alone (a permutation per
epoch, seeded), so a resumed run sees the same batches as one that never stopped. The loop
is what a training run needs: warmup and cosine decay, gradient accumulation, clipping by
the global norm, a progress line every few steps, an eval loss on the held-out sequences, a
loss plot kept up to date, a sharded checkpoint every K steps (resume after kill -9 to the
same weights), and at the end a Hugging Face folder (weights, config, tokenizer) that
from_pretrained loads, with a sample generate() continues. Before the run, its first steps
on the mesh are checked against the same model trained in one process on the same batches.

With no --model, the run writes its own: a Llama-style config, its initial weights and a
byte-level BPE tokenizer trained on Python's own help text (pydoc_data's topics, on every
machine), and trains on that text: a run of about a minute with nothing downloaded.

Run:
    python 13_train.py                                             # the tiny model, fsdp 2
    python 13_train.py --model FOLDER --data FILE --pp 2 --fsdp 2 --tp 2 --steps 200
    python 13_train.py --model FOLDER --data FILE --dp 2 --cp 2 --steps 100 --run-dir runs/mine
    torchrun --nproc-per-node 8 13_train.py --model FOLDER --data FILE --pp 2 --fsdp 2 --tp 2

Prints the check (PASS/FAIL), a progress line every --log-every steps and a sample from the
saved folder. Writes <run-dir>/: progress.jsonl, loss.png, checkpoints/, final/ (the
Hugging Face folder); and <out>/13_train.{json,md} (the run's summary) with
<out>/13_train_loss.png; --bench instead writes <out>/13_train_bench.{json,md}.
"""
import argparse
import contextlib
import hashlib
import json
import math
import os
import shutil
import statistics
import time
from pathlib import Path

import common

import torch
import torch.distributed as dist

import hf_checkpoint as hfc
import placement
import result_files
import sharded_checkpoint

nd = common.load_script(common.ROOT / "10_nd_parallel.py")   # the mesh, and the scripts it composes:
ddp, fsdp, tp, pp, cpm, ep = nd.ddp_mod, nd.fsdp_mod, nd.tp_mod, nd.pp_mod, nd.cp_mod, nd.ep_mod   # 05 07 08 09 11 12

NAME, TITLE = "13_train", "A training run of your own model on your own text"
AXES = ("pp", "dp", "fsdp", "cp", "tp")
TINY = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False)   # the model written when none is given
TINY_VOCAB = 512


# ---- the model and the text written when none is given --------------------------------
def tokenizer_files(folder) -> list:
    """The names of a model folder's tokenizer files (they go with the weights)."""
    return sorted(n for n in os.listdir(folder) if n.startswith(("tokenizer", "vocab", "merges", "special_tokens")))


def written_aside(folder: Path, fill):
    """``fill(tmp)`` writes a folder beside ``folder``, then it is renamed into place: a
    reader never sees half of one, and where another process (torchrun's ranks) got there
    first, its folder stays and this one goes."""
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.partial")
    fill(tmp)
    try:
        os.rename(tmp, folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def pydoc_text() -> str:
    """Python's own help text (pydoc_data.topics: every Python has it)."""
    from pydoc_data import topics
    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def write_tiny_model(folder: Path, text: str, context: int, seed: int = 0):
    """A model folder as save_pretrained writes it: a byte-level BPE tokenizer trained on
    ``text`` (tokenizer.json with its config), a LlamaConfig (TINY) and its initial weights
    (safetensors), seeded."""
    import tokenizers
    import transformers
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator([text], vocab_size=TINY_VOCAB, min_frequency=2, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                                               bos_token="<|endoftext|>")
    tok.save_pretrained(folder)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=len(tok), max_position_embeddings=context, eos_token_id=0,
                                      bos_token_id=0, **TINY)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


# ---- the text: tokenized once, packed, held out, each step's batch ---------------------
def token_file(data: Path, model: Path) -> Path:
    """Where the tokens of ``data`` by ``model``'s tokenizer are kept: beside the text,
    named by the tokenizer's hash and the text's size and time (a change makes a new one)."""
    h = hashlib.sha256()
    for name in tokenizer_files(model):
        h.update(name.encode() + (model / name).read_bytes())
    st = data.stat()
    h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return data.with_name(f"{data.name}.tokens-{h.hexdigest()[:12]}.pt")


def tokenize(data: Path, model: Path) -> tuple:
    """The text's token ids (int32), from the cache beside it or tokenized now (and cached,
    where the folder is writable; else in memory only). Returns (tokens, where, cached)."""
    path = token_file(data, model)
    if path.exists():
        return torch.load(path), path, True
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(model)
    text = data.read_text(encoding="utf-8", errors="replace")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    tokens = torch.tensor(ids, dtype=torch.int32)
    return tokens, path, _saved(path, tokens)


def _saved(path: Path, tensor) -> bool:
    """torch.save to ``path`` atomically (result_files.atomic_write); False where the
    folder does not take it (read-only, full)."""
    try:
        result_files.atomic_write(path, lambda f: torch.save(tensor, f))
        return True
    except OSError:
        return False


class Packed:
    """The tokens cut into sequences of ``context`` + 1 (inputs and their next tokens), the
    last ``held`` held out for evaluation; step i's global batch of ``batch`` sequences:
    the epochs' permutations (seeded by ``seed`` and the epoch) laid end to end, so it
    depends on i alone."""

    def __init__(self, tokens, context: int, batch: int, seed: int, held: int):
        n = (tokens.numel() - 1) // context
        self.seqs = tokens[:n * context + 1].unfold(0, context + 1, context).long()   # (overlapping by one token)
        self.context, self.batch, self.seed = context, batch, seed
        self.train_n, self.held = n - held, held

    def batch_of(self, step: int):
        first = step * self.batch
        ids = []
        while len(ids) < self.batch:
            epoch, at = divmod(first + len(ids), self.train_n)
            perm = torch.randperm(self.train_n, generator=torch.Generator().manual_seed(self.seed * 7919 + epoch))
            ids += perm[at:at + self.batch - len(ids)].tolist()
        s = self.seqs[ids]
        return s[:, :-1], s[:, 1:]

    def held_out(self, i: int):
        s = self.seqs[self.train_n + i * self.batch:self.train_n + (i + 1) * self.batch]
        return s[:, :-1], s[:, 1:]


def lr_at(step: int, args) -> float:
    """Linear warmup over --warmup-steps, then cosine decay to --min-lr (a fraction of --lr)
    at --steps."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    t = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (args.min_lr + (1 - args.min_lr) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


# ---- the model on the mesh -------------------------------------------------------------
def experts_of(model) -> str | None:
    """The pattern of the model's own experts (modules with num_experts and 3D tensors)."""
    for name, m in model.named_modules():
        if isinstance(getattr(m, "num_experts", None), int) and any(p.dim() == 3 for p in m.parameters(recurse=False)):
            return ".".join("*" if part.isdigit() else part for part in name.split("."))
    return None


class OnMesh:
    """A transformers model on a mesh, by the calls of docs/10 (innermost first): tp by the
    model's own plan (or ``plan``), its experts split over the data ranks (ep), pipeline
    stages by its own plan and forward, FSDP by its decoder layers, DDPBucketed over the
    data ranks (and cp's), the schedule. ``stage``: the module under the model's own names
    (what checkpoints and clipping take); ``module``: what the optimizer steps."""

    def __init__(self, model, sizes: dict, args, device, plan=None):
        self.mesh, self.sizes, self.device = nd.Mesh(sizes), sizes, device
        P, D, F_, C, T = (sizes[a] for a in AXES)
        mesh, self.model = self.mesh, model
        if T > 1:
            tp.parallelize(model, plan or tp.model_plan(model)[0], mesh.group("tp"))
        if args.recompute:   # the model's own activation checkpointing, non-reentrant: each layer redone in backward
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if args.compile:     # each decoder layer through torch.compile (the model's _no_split_modules)
            for m in model.modules():
                if type(m).__name__ in (model._no_split_modules or ()):
                    m.compile()
        self.autocast = lambda: common.autocast(device, args.dtype)   # noqa: E731
        self.experts = None
        if args.ep > 1:
            self.experts = experts_of(model)
            ep.split_experts(model, self.experts, mesh.group("dp"))
        ignore = ep.expert_parameters(model) if self.experts else None
        self.stage = pp.ModelStage(model, mesh.coord("pp"), P, args.chunks) if P > 1 else model
        units = self.stage.held_layers() if P > 1 else None
        module = self.stage
        if F_ > 1:
            module = fsdp.FSDP(module, process_group=mesh.group("fsdp"), units=units, ignore=ignore or ())
        if D * C > 1:
            module = ddp.DDPBucketed(module, args.bucket_mb, process_group=mesh.joint(("dp", "cp")) if C > 1
                                     else mesh.group("dp"), ignore_parameters=ignore or ())
        self.module, self.pipe = module, None
        if P > 1:
            self.pipe = pp.Pipeline(module, args.microbatches, lambda out, y: lm_loss(out["logits"], y),
                                    args.schedule, mesh.group("pp"), chunks=args.chunks)
        self.tied_group = None
        if P > 1 and getattr(model.config, "tie_word_embeddings", False):
            self.tied_group = pp.tied_group(mesh.slices("pp"))
            pp.tie(self.stage.tied, self.tied_group)
        self.replicas = D * F_
        self.replica = mesh.coord("dp") * F_ + mesh.coord("fsdp")

    def share(self, t):
        """This rank's share of a global batch (its data replica's)."""
        return common.shard(t, self.replica, self.replicas).clone()

    def context(self, x, y):
        """Under cp: context_parallel over the group, x and y cut to this rank's part of each
        sequence (in place), and the model's own positions and a mask of ones (without one,
        transformers takes a rank's skipping positions for packed sequences and builds a
        mask): the extra inputs to give the model. Else nothing and none."""
        if self.sizes["cp"] == 1:
            return contextlib.nullcontext(), ()
        pos = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1).contiguous()
        ones = torch.ones_like(x)
        return cpm.context_parallel(self.mesh.group("cp"), buffers=[x, y, pos, ones], seq_dims=[1, 1, 1, 1]), (pos, ones)

    def forward_loss(self, x, y, scale=None):
        """The LM loss of this rank's share (under cp: of its part of each sequence, the
        buffers whole again afterwards); with ``scale``, its backward of loss x scale too,
        inside the same context (the cut buffers are what autograd saved)."""
        within, extra = self.context(x, y)
        with within:
            kw = dict(zip(("position_ids", "attention_mask"), extra))
            with self.autocast():
                logits = self.module(input_ids=x, use_cache=False, **kw)["logits"]
            loss = lm_loss(logits, y)
            if scale is not None:
                (loss * scale).backward()
            return loss.detach()

    def train_step(self, x, y, accumulate: int) -> torch.Tensor:
        """Backward of this rank's share (in ``accumulate`` parts, synchronized once, or the
        pipeline's micro-batches), gradients synchronized; the share's loss (None off the
        pipeline's last stage)."""
        x, y = self.share(x), self.share(y)
        if self.pipe is not None:
            within, extra = self.context(x, y)
            with within, self.autocast():
                loss = self.pipe.step(*self._ends(x, y, extra))
        else:
            loss = 0.0
            for k, (xk, yk) in enumerate(zip(x.chunk(accumulate), y.chunk(accumulate))):
                sync = self.module.no_sync() if k < accumulate - 1 and hasattr(self.module, "no_sync") else \
                    contextlib.nullcontext()
                with sync:
                    loss = loss + self.forward_loss(xk.clone(), yk.clone(), 1 / accumulate) / accumulate
        if hasattr(self.module, "finish_gradient_synchronization"):
            self.module.finish_gradient_synchronization()
        if self.experts:
            ep.reduce_expert_gradients(self.model, data_ranks=self.replicas)
        if self.tied_group is not None:
            pp.sum_tied_gradients(self.stage.tied, self.tied_group)
        return loss

    @torch.no_grad()
    def eval_loss(self, x, y):
        x, y = self.share(x), self.share(y)
        if self.pipe is not None:
            within, extra = self.context(x, y)
            with within, self.autocast():
                return self.pipe.evaluate(*self._ends(x, y, extra))
        return self.forward_loss(x, y)

    def _ends(self, x, y, extra):
        """What the pipeline's step takes: the first stage's inputs (the ids, and cp's extra
        inputs), the last stage's targets; None elsewhere."""
        return ((x, *extra) if extra else x) if self.pipe.first else None, y if self.pipe.last else None

    def mean_over_mesh(self, loss) -> float:
        """The global batch's loss: the mean over the data replicas of the losses their last
        stages computed (every rank calls it)."""
        owner = self.pipe is None or self.pipe.last
        t = torch.tensor([float(loss) if owner and loss is not None else 0.0, float(owner)], dtype=torch.float64,
                         device=self.device)
        if self.sizes["tp"] > 1 and self.mesh.coord("tp") > 0:   # (every tp rank holds the same loss: count one)
            t.zero_()
        dist.all_reduce(t)
        return (t[0] / t[1]).item()


lm_loss = pp.lm_loss   # cross-entropy over every token, in float32


def build_on_meta(folder, device=None):
    """The folder's model, its parameters on meta (placement.meta_parameters), its config
    as saved, SDPA attention; the buffers its constructor computed (rotary tables) moved to
    ``device`` (the data-parallel wrappers broadcast them as they wrap)."""
    import transformers
    config = transformers.AutoConfig.from_pretrained(folder)
    config._attn_implementation = "sdpa"
    with placement.meta_parameters():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for m in model.modules() if device is not None else ():
        for name, b in m._buffers.items():
            if b is not None and not b.is_meta:
                m._buffers[name] = b.to(device)
    return model


def on_mesh(ctx, args, sizes, folder, plan=None) -> "OnMesh":
    """``folder``'s model built on meta, put on the mesh (OnMesh) and filled from the folder,
    each rank reading its slices."""
    model = build_on_meta(folder, ctx.device)
    layout = hfc.model_layout(model)
    run = OnMesh(model, sizes, args, ctx.device, plan or read_plan(args.plan))
    hfc.load_hf_checkpoint(run.stage, folder, ctx.device, pieces=layout)
    return run


def read_plan(path):
    if not path:
        return None
    plan = json.loads(Path(path).read_text())
    return {k: tuple(v) if isinstance(v, list) else v for k, v in plan.items()}


# ---- the workers ----------------------------------------------------------------------
def verify(ctx, args, sizes):
    """The first --verify-steps steps of the run on the mesh against the same model trained
    in one process on the same global batches (each rank builds it whole: the check needs a
    model one process holds): the largest weight difference and whether every step's loss
    agreed."""
    data = Packed(torch.load(args.tokens), args.context_length, args.batch_size, args.seed, args.held)
    run = on_mesh(ctx, args, sizes, args.model)
    import transformers
    ref = transformers.AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa",
                                                            dtype=torch.float32).to(ctx.device)
    opts = [torch.optim.AdamW(m.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                              weight_decay=args.weight_decay) for m in (run.module, ref)]
    worst = 0.0
    for i in range(args.verify_steps):
        x, y = (t.to(ctx.device) for t in data.batch_of(i))
        for opt in opts:
            for g in opt.param_groups:
                g["lr"] = lr_at(i, args)
            opt.zero_grad(set_to_none=True)
        loss = run.mean_over_mesh(run.train_step(x, y, args.accumulate))
        placement.clip_grad_norm_(run.stage, args.clip)
        opts[0].step()
        with common.autocast(ctx.device, args.dtype):
            logits = ref(input_ids=x, use_cache=False).logits
        want = lm_loss(logits, y)
        want.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), args.clip)
        opts[1].step()
        worst = max(worst, abs(loss - want.item()) / max(1e-12, abs(want.item())))
    full = placement.full_state_dict(run.stage, all_ranks=True)
    diff = max((full[n].float() - p.detach().cpu().float()).abs().max().item() for n, p in ref.state_dict().items()
               if n in full)
    tol = (1e-4, 1e-4) if args.dtype == "float32" else (common.TOLERANCE["autocast"]["atol"] * 10, 1e-2)
    return {"max_diff": diff, "loss_rel": worst, "ok": diff < tol[0] and worst < tol[1]}


def train(ctx, args, sizes):
    """The run: from the newest complete checkpoint in <run-dir>/checkpoints (or the
    folder's weights) to --steps; a line every --log-every steps, the eval loss every
    --eval-every, a checkpoint every --checkpoint-every; at the end the Hugging Face folder.
    Returns the summary on the first rank."""
    data = Packed(torch.load(args.tokens), args.context_length, args.batch_size, args.seed, args.held)
    run = on_mesh(ctx, args, sizes, args.model)
    config = run.model.config
    opt = torch.optim.AdamW(run.module.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=args.weight_decay)
    run_dir = Path(args.run_dir)
    ckpts = run_dir / "checkpoints"
    start, history = 0, []
    folder = sharded_checkpoint.latest_checkpoint(str(ckpts)) if ckpts.exists() else None
    if folder:
        extra = sharded_checkpoint.load_sharded(run.stage, opt, folder)
        start, history = extra["step"], extra.get("history", [])   # (main said so before the workers started)
    fault = args.fault_at or os.environ.get(common.FAULT_ENV)   # (the tests' kill -9: STEP:RANK)
    kill_at, kill_rank = (int(v) for v in fault.split(":")) if fault else (None, None)
    n_params = sum(p.numel() for p in build_on_meta(args.model).parameters())
    tokens_per_step = args.batch_size * args.context_length
    peak = nd.peak_flops(ctx.device)
    def evaluate():
        losses = [run.mean_over_mesh(run.eval_loss(*(t.to(ctx.device) for t in data.held_out(k))))
                  for k in range(args.held // args.batch_size)]
        return sum(losses) / len(losses)
    if start == 0:   # where the eval loss starts from
        history.append({"step": 0, "eval": evaluate()})
    began, done = time.perf_counter(), 0
    last_eval = next((r["eval"] for r in reversed(history) if "eval" in r), None)
    for i in range(start, args.steps):
        if i == kill_at and ctx.rank == kill_rank:
            os.kill(os.getpid(), 9)
        lr = lr_at(i, args)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        x, y = (t.to(ctx.device) for t in data.batch_of(i))
        t0 = time.perf_counter()
        loss = run.mean_over_mesh(run.train_step(x, y, args.accumulate))
        norm = placement.clip_grad_norm_(run.stage, args.clip).item()
        opt.step()
        common.sync(ctx.device)
        dt, done = time.perf_counter() - t0, done + 1
        row = {"step": i + 1, "loss": loss, "lr": lr, "grad_norm": norm, "seconds": dt}
        if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
            last_eval = row["eval"] = evaluate()
        history.append(row)
        if ctx.rank == 0 and ((i + 1) % args.log_every == 0 or i + 1 == args.steps or "eval" in row):
            elapsed = time.perf_counter() - began
            tok_s = tokens_per_step * done / elapsed
            mfu = f" | mfu {6 * n_params * tok_s / peak / ctx.world_size:.1%}" if peak else ""
            mem = torch.cuda.max_memory_allocated(ctx.device) / 2**20 if ctx.device.type == "cuda" else _rss_mib()
            eta = elapsed / done * (args.steps - i - 1)
            print(f"step {i + 1:>5}/{args.steps} | loss {loss:.4f} | eval "
                  f"{'-' if last_eval is None else f'{last_eval:.4f}'} | lr {lr:.2e} | {tok_s:,.0f} tok/s{mfu} | "
                  f"mem {mem:,.0f} MiB | {eta:,.0f} s left", flush=True)
            _progress(run_dir, history)
        if args.checkpoint_every and ((i + 1) % args.checkpoint_every == 0 or i + 1 == args.steps):
            sharded_checkpoint.save_sharded(run.stage, opt, str(ckpts), i + 1,
                                            extra={"step": i + 1, "model": args.fingerprint, "history": history})
    sharded_checkpoint.wait_for_saves()
    digest = common.weights_sha256(placement.full_state_dict(run.stage, all_ranks=True))
    final = run_dir / "final"
    hfc.save_hf_checkpoint(run.stage, str(final), config=config)
    if ctx.rank == 0:
        for name in tokenizer_files(args.model):   # the tokenizer's files beside the weights
            shutil.copy(Path(args.model) / name, final / name)
        if (Path(args.model) / "generation_config.json").exists():
            shutil.copy(Path(args.model) / "generation_config.json", final / "generation_config.json")
        _progress(run_dir, history)
        return {"history": history, "sha256": digest, "final": str(final), "start": start}
    return None


# ---- --bench: beside torch's own on the same model and batches ---------------------------
def torch_skip(sizes: dict, plan) -> str | None:
    """Why torch's own composition of a transformers model cannot run this mesh here, or
    None: FSDP2 over the data ranks, with torch's TP (ColwiseParallel, RowwiseParallel) where
    the mesh has tp and the plan is column and row layers only."""
    if sizes["pp"] > 1 or sizes["cp"] > 1:
        return "torch's side here is FSDP2 with torch's TP: no pipeline or context-parallel composition of a " \
               "transformers model to set beside ours"
    if sizes["tp"] > 1 and any(v not in ("column", "row") for v in plan.values()):
        return "the model's plan has words torch's ColwiseParallel and RowwiseParallel do not say (" + \
            ", ".join(sorted({str(v) for v in plan.values()} - {"column", "row"})) + ")"
    return None


def torch_composition(ctx, folder, sizes, plan):
    """The same model as transformers loads it (whole, on every rank), torch's TP over tp by
    ``plan`` (column -> ColwiseParallel, row -> RowwiseParallel), then FSDP2's fully_shard on
    each decoder layer and the root over the data ranks."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa",
                                                              dtype=torch.float32).to(ctx.device)
    data, T = sizes["dp"] * sizes["fsdp"], sizes["tp"]
    mesh = init_device_mesh(ctx.device.type, (data, T), mesh_dim_names=("data", "tp"))
    if T > 1:
        styles = {k: ColwiseParallel() if v == "column" else RowwiseParallel() for k, v in plan.items()}
        for name, m in model.named_modules():
            for key, style in styles.items():
                if placement.path_matches(name, key):
                    parallelize_module(m, mesh["tp"], style)
    for m in model.modules():
        if type(m).__name__ in (model._no_split_modules or ()):
            fully_shard(m, mesh=mesh["data"])
    fully_shard(model, mesh=mesh["data"])
    return model


def torch_clip(parameters, max_norm):
    """torch's clip by the global norm where FSDP2 and TP leave the gradients on DTensors of
    different meshes (clip_grad_norm_ stacks their norms and fails): each mesh's norm made
    whole, then the total, then clip_grads_with_norm_."""
    from torch.distributed.tensor import DTensor
    groups = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(id(getattr(p.grad, "device_mesh", None)), []).append(p)
    norms = []
    for ps in groups.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in ps])
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = torch.stack(norms).norm()
    for ps in groups.values():
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)
    return total


def bench_method(ctx, args, sizes, folder, method, plan):
    """``method`` ("ours" or "torch") on ``folder``'s model: a training step on a global
    batch (this rank's share), clipped by the global norm, and the (module, optimizer) it
    steps."""
    if method == "ours":
        run = on_mesh(ctx, args, sizes, folder, plan or None)
        opt = torch.optim.AdamW(run.module.parameters(), lr=args.lr)

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            run.train_step(x, y, 1)
            placement.clip_grad_norm_(run.stage, args.clip)
            opt.step()
        return step, run.stage, opt
    model = torch_composition(ctx, folder, sizes, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    mesh = nd.Mesh(sizes)
    replicas, replica = sizes["dp"] * sizes["fsdp"], mesh.coord("dp") * sizes["fsdp"] + mesh.coord("fsdp")

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        x, y = common.shard(x, replica, replicas), common.shard(y, replica, replicas)
        lm_loss(model(input_ids=x, use_cache=False).logits, y).backward()
        torch_clip(model.parameters(), args.clip)
        opt.step()
    return step, model, opt


def bench_plan(args, sizes, folder) -> dict:
    return read_plan(args.plan) or (tp.model_plan(build_on_meta(folder))[0] if sizes["tp"] > 1 else {})


def bench_steps(ctx, args, sizes, folder):
    """Ours and torch's on ``folder``'s model: each rank's peak of live tensor bytes during a
    step (each method's third, under 07's StepPeak); their steps alternating on the same
    batches (--bench-steps after 2 warm-up, the slowest rank's time); each method's
    checkpoint save (ours: save_sharded; torch's: torch.distributed.checkpoint.save), three
    each, alternating. {"times": {method: [seconds]}, "saves": ..., "peaks": {method: [MiB
    a rank]}}."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    data = Packed(torch.load(args.tokens), args.context_length, args.batch_size, args.seed, args.held)
    plan = bench_plan(args, sizes, folder)
    built, peaks = {}, {}
    for m in ("ours", "torch"):   # each built and stepped three times under 07's StepPeak: the third's peak
        with fsdp.StepPeak(ctx.device) as mem:   # (live tensor bytes above what was alive before: the other's too)
            built[m] = bench_method(ctx, args, sizes, folder, m, plan)
            for i in range(3):
                with mem.step() if i == 2 else contextlib.nullcontext():
                    built[m][0](*(t.to(ctx.device) for t in data.batch_of(i)))
        peaks[m] = mem.peak / 2**20 if mem.peak is not None else None
    (ours_step, stage, opt), (theirs_step, theirs, topt) = built["ours"], built["torch"]
    steps, times = {"ours": ours_step, "torch": theirs_step}, {"ours": [], "torch": []}
    for i in range(2 + args.bench_steps):
        x, y = (t.to(ctx.device) for t in data.batch_of(i))
        for name in (("ours", "torch") if i % 2 == 0 else ("torch", "ours")):
            dist.barrier()
            t0 = time.perf_counter()
            steps[name](x, y)
            common.sync(ctx.device)
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    saves = {"ours": [], "torch": []}
    where = Path(args.run_dir) / "bench-checkpoints"
    for k in range(3):
        for name in (("ours", "torch") if k % 2 == 0 else ("torch", "ours")):
            dist.barrier()
            t0 = time.perf_counter()
            if name == "ours":
                sharded_checkpoint.save_sharded(stage, opt, str(where / "ours"), k)
            else:
                msd, osd = get_state_dict(theirs, topt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(where / f"torch-{k}"))
            dist.barrier()
            saves[name].append(time.perf_counter() - t0)
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, (times, peaks))
    slowest = {n: [max(r[n][i] for r, _ in everyone) for i in range(args.bench_steps)] for n in times}
    if ctx.rank == 0:
        shutil.rmtree(where, ignore_errors=True)
    return {"times": slowest, "saves": saves, "peaks": {n: [p[n] for _, p in everyone] for n in peaks}}


def larger_model(args, run_dir: Path) -> Path:
    """The --bench larger setting: the model's config with twice the width and twice the
    layers, its weights initialised (seeded), the tokenizer copied: a folder beside the run."""
    import transformers
    folder = run_dir / "bench-larger-model"
    if (folder / "config.json").exists():
        return folder
    config = transformers.AutoConfig.from_pretrained(args.model)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers"):
        setattr(config, key, 2 * getattr(config, key))
    torch.manual_seed(args.seed)

    def fill(tmp):
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
        for name in tokenizer_files(args.model):
            shutil.copy(Path(args.model) / name, tmp / name)
    written_aside(folder, fill)
    return folder


BENCH_HEADERS = ["setting", "method", "step_ms", "tokens_per_s", "vs_torch", "peak_MB", "save_ms"]


def report_bench(args, sizes):
    """--bench: ours beside torch's at the model as given and at a larger one, each a table
    row per method: step time (median of the slowest rank's), tokens/s, our step over
    theirs paired (median [min-max]), each rank's step peak, a checkpoint save."""
    plan = bench_plan(args, sizes, args.model)
    why = torch_skip(sizes, plan)
    if why:
        print(f"  SKIP  torch's composition on {mesh_label(sizes)}: {why}", flush=True)
        return
    rows = []
    for setting, folder in (("as given", Path(args.model)), ("2x wide, 2x deep", larger_model(args, Path(args.run_dir)))):
        r = common.launch(bench_steps, args, sizes, str(folder))
        peaks = r["peaks"]
        tokens = args.batch_size * args.context_length
        ratios = [a / b for a, b in zip(r["times"]["ours"], r["times"]["torch"])]
        for method in ("ours", "torch"):
            t = statistics.median(r["times"][method])
            rows.append({"setting": setting, "method": {"ours": "ours (13's mesh)",
                                                        "torch": "torch FSDP2" + (" + TP" if sizes["tp"] > 1 else "")
                                                        }[method],
                         "step_ms": t * 1e3, "tokens_per_s": round(tokens / t),
                         "vs_torch": f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
                         if method == "ours" else "",
                         "peak_MB": " / ".join(f"{p:.1f}" for p in peaks[method]) if peaks[method][0] is not None
                         else "", "save_ms": statistics.median(r["saves"][method]) * 1e3})
    title = f"13's training step beside torch's own on {mesh_label(sizes)}"
    table = common.save_results(args.out, f"{NAME}_bench", rows, {"model": args.model, "mesh": mesh_label(sizes),
                                                                   "batch": args.batch_size,
                                                                   "context": args.context_length,
                                                                   "steps": args.bench_steps, "device": args.device},
                                headers=BENCH_HEADERS, title=title,
                                note="peak_MB: each rank's peak of live tensor bytes during a step (07's StepPeak); "
                                     "save_ms: one sharded checkpoint (ours: save_sharded; torch's: "
                                     "torch.distributed.checkpoint.save), median of three")
    print(f"\n{title} ({args.world_size} x {args.backend}/{args.device}, {args.batch_size} x {args.context_length} "
          f"tokens a step; median of {args.bench_steps} steps, alternating)\n{table}\n"
          f"{common.wrote(args.out, f'{NAME}_bench.json and .md')}", flush=True)


def _rss_mib() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _progress(run_dir: Path, history: list):
    """progress.jsonl and loss.png (train and eval loss by step), rewritten each time."""
    common.save_file(run_dir / "progress.jsonl", lambda f: f.write("".join(json.dumps(r) + "\n"
                                                                            for r in history).encode()))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    trained = [r for r in history if "loss" in r]
    ax.plot([r["step"] for r in trained], [r["loss"] for r in trained], label="train", lw=1)
    ev = [r for r in history if "eval" in r]
    if ev:
        ax.plot([r["step"] for r in ev], [r["eval"] for r in ev], "o-", label="eval (held out)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    common.save_file(run_dir / "loss.png", lambda f: fig.savefig(f, format="png", dpi=100))
    plt.close(fig)


def sample(folder: Path, prompt: str, tokens: int) -> str:
    """The saved folder through transformers as a user loads it: from_pretrained, then
    generate() continues ``prompt`` greedily."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    ids = tok(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=tokens, do_sample=False, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0], skip_special_tokens=True)


# ---- flags, and what is refused before any worker starts -------------------------------
def parser():
    p = common.KitParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", default=None, help="a Hugging Face model folder (config, safetensors weights, tokenizer); "
                                                 "default: a tiny Llama-style model written in --run-dir's parent")
    p.add_argument("--data", default=None, help="a text file (default: Python's own help text, written beside the model)")
    for axis in AXES:
        p.add_argument(f"--{axis}", type=common.COUNT, default=None if axis == "fsdp" else 1,
                       help="the mesh's fsdp size (default: the ranks the other axes leave: --world-size, or 2 GPUs "
                            "or more, else 2, over the rest)" if axis == "fsdp" else f"the mesh's {axis} size")
    p.add_argument("--ep", type=common.COUNT, default=1, help="the model's own experts split over the data ranks (= dp)")
    p.add_argument("--plan", default=None, help="a JSON tensor-parallel plan (08's words) for a model that ships none")
    p.add_argument("--schedule", choices=list(pp.SCHEDULES), default="1f1b", help="the pipeline's schedule")
    p.add_argument("--chunks", type=common.COUNT, default=1, help="pipeline chunks a stage (interleaved: 2 or more)")
    p.add_argument("--microbatches", type=common.COUNT, default=None, help="the pipeline's micro-batches (default: 2 x pp)")
    p.add_argument("--steps", type=common.COUNT, default=300, help="training steps")
    p.add_argument("--batch-size", type=common.COUNT, default=16, help="global batch, in sequences")
    p.add_argument("--accumulate", type=common.COUNT, default=1,
                   help="gradient accumulation: each data rank's share in this many backwards (no pp)")
    p.add_argument("--context-length", type=common.COUNT, default=128, help="tokens a sequence")
    p.add_argument("--lr", type=common.number(float, above=0), default=3e-3, help="peak learning rate")
    p.add_argument("--min-lr", type=common.number(float, lo=0, hi=1), default=0.1,
                   help="the learning rate at the end, a fraction of --lr (cosine decay)")
    p.add_argument("--warmup-steps", type=common.COUNT, default=20, help="linear warmup")
    p.add_argument("--weight-decay", type=common.number(float, lo=0), default=0.1, help="AdamW's")
    p.add_argument("--clip", type=common.number(float, above=0), default=1.0, help="clip by the global norm")
    p.add_argument("--eval-every", type=common.COUNT, default=50, help="eval loss on the held-out sequences")
    p.add_argument("--log-every", type=common.COUNT, default=10, help="a progress line")
    p.add_argument("--checkpoint-every", type=common.COUNT, default=100, help="a sharded checkpoint")
    p.add_argument("--run-dir", default=str(common.ROOT / "runs" / "13_train"),
                   help="the run's folder: checkpoints, progress, the final model (and the tiny model beside it)")
    p.add_argument("--prompt", default="The for statement", help="the sample's start")
    p.add_argument("--sample-tokens", type=common.COUNT, default=40, help="tokens generate() adds to the prompt")
    p.add_argument("--dtype", choices=common.AUTOCAST_DTYPES, default="float32",
                   help="bf16: forward and backward in bf16 autocast (weights, gradients' reduction and optimizer "
                        "state float32); checked against one process under the same autocast")
    p.add_argument("--recompute", action="store_true",
                   help="each decoder layer recomputed in backward (the model's own gradient checkpointing, "
                        "non-reentrant): activation memory for compute")
    p.add_argument("--compile", action="store_true", help="each decoder layer through torch.compile")
    p.add_argument("--bucket-mb", type=common.number(float, above=0), default=25.0, help="DDPBucketed's buckets")
    p.add_argument("--verify-steps", type=common.COUNT, default=3, help="steps checked against one process")
    p.add_argument("--no-verify", action="store_true", help="skip the check against one process")
    p.add_argument("--world-size", type=common.COUNT, default=None, help="the mesh's size (default: its product)")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="default: nccl with a GPU a rank")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda for nccl, cpu for gloo")
    p.add_argument("--seed", type=common.COUNT0, default=0, help="the data's order (and the tiny model's weights)")
    p.add_argument("--out", default=common.DEFAULT_OUT, help="folder for the run's summary (make all: results/)")
    p.add_argument("--timeout", type=common.SECONDS, default=300.0, help="seconds a collective may wait")
    common.add_stall_flags(p)
    p.add_argument("--bench", action="store_true",
                   help="instead of training: ours beside torch's own (FSDP2, with torch's TP where the mesh has tp; "
                        "torch.distributed.checkpoint) on the model and on one twice as wide and deep, steps "
                        "alternating: step time, tokens/s, each rank's step peak, a checkpoint save")
    p.add_argument("--bench-steps", type=common.COUNT, default=8, help="--bench: measured steps a method")
    p.add_argument("--fault-at", default=None, help=argparse.SUPPRESS)   # STEP:RANK: that rank kill -9s itself there
    return p


def check(args):
    """Everything refused before a worker starts (UsageError, exit 2): flags, the folder,
    the text, the mesh against the model, a checkpoint of another model."""
    others = args.pp * args.dp * args.cp * args.tp
    if args.fsdp is None:   # the ranks the other axes leave
        world = int(os.environ["WORLD_SIZE"]) if common.under_torchrun() else args.world_size or (
            others if others > 1 else max(2, common.gpu_count()))
        if world % others:
            raise common.UsageError(f"{world} ranks do not divide into the other axes' {others}")
        args.fsdp = world // others
    sizes = {a: getattr(args, a) for a in AXES}
    world = math.prod(sizes.values())
    if common.under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world:
            raise common.UsageError(f"the mesh {mesh_label(sizes)} is {world} ranks, torchrun started "
                                    f"{os.environ['WORLD_SIZE']}")
    elif args.world_size not in (None, world):
        raise common.UsageError(f"--world-size {args.world_size}, but the mesh {mesh_label(sizes)} is {world} ranks")
    args.world_size = world
    n_gpus = common.gpu_count()
    args.backend = args.backend or ("nccl" if n_gpus >= world and args.device != "cpu" else "gloo")
    args.device = args.device or ("cuda" if args.backend == "nccl" else "cpu")
    if args.backend == "nccl" and not common.nccl_fits("nccl", world):
        raise common.UsageError(f"nccl needs one GPU per rank: {world} ranks, {n_gpus} GPU(s); {common.NCCL_HINT}")
    common.check_ranks(world, args.backend, "the mesh")
    args.microbatches = args.microbatches or 2 * args.pp
    args.no_bench, args.train = not args.bench, None if not args.no_verify or args.bench else args.steps
    if args.bench:   # (what the first line announces)
        args.no_verify = True
    if args.chunks > 1 and args.schedule != "interleaved":
        raise common.UsageError("--chunks applies to --schedule interleaved")
    if args.accumulate > 1 and args.pp > 1:
        raise common.UsageError("--accumulate with --pp: the pipeline's --microbatches are its accumulation")
    replicas = args.dp * args.fsdp
    unit = replicas * args.accumulate * (args.microbatches if args.pp > 1 else 1)
    if args.batch_size % unit:
        raise common.UsageError(f"--batch-size {args.batch_size} must divide by the data ranks x accumulation "
                                f"(x micro-batches) = {unit}")
    if args.ep > 1 and (args.ep != args.dp or args.fsdp > 1):
        raise common.UsageError("--ep splits the experts over the data ranks: give --ep equal to --dp, without --fsdp")
    if args.context_length % (2 * args.cp):
        raise common.UsageError(f"--context-length {args.context_length} must divide by 2 x --cp ({2 * args.cp}): "
                                f"each cp rank holds two chunks of each sequence")
    common.check_out(args.out)
    common.check_out(args.run_dir, "--run-dir")
    run_dir = Path(args.run_dir)
    if args.model is None:   # the tiny model and Python's help text, written once beside the run
        home = run_dir.parent / "13_tiny_model"
        args.model, data = str(home), run_dir.parent / "13_pydoc_topics.txt"
        if not (home / "config.json").exists() or not data.exists():
            text = pydoc_text()
            home.parent.mkdir(parents=True, exist_ok=True)
            if not data.exists():
                result_files.atomic_write(data, lambda f: f.write(text.encode()))
            if not (home / "config.json").exists():   # (torchrun's ranks may race: one folder stays)
                written_aside(home, lambda tmp: write_tiny_model(tmp, text, args.context_length, args.seed))
        args.data = args.data or str(data)
    model = Path(args.model)
    if not (model / "config.json").exists():
        raise common.UsageError(f"--model {model}: no config.json there (a folder save_pretrained wrote)")
    if not (model / "model.safetensors").exists() and not (model / "model.safetensors.index.json").exists():
        raise common.UsageError(f"--model {model}: no weights there (model.safetensors or its index)")
    if not any(n.startswith("tokenizer") for n in os.listdir(model)):
        raise common.UsageError(f"--model {model}: no tokenizer there (tokenizer.json and its config)")
    if args.data is None:
        raise common.UsageError("--data: the text file to train on (with --model)")
    data = Path(args.data)
    if not data.is_file():
        raise common.UsageError(f"--data {data}: no such file")
    config = json.loads((model / "config.json").read_text())
    check_mesh_fits(config, sizes, args)
    tokens, path, cached = tokenize(data, model)
    args.tokens = str(path)
    if not cached:   # (the text's folder does not take it: the run's own copy)
        run_dir.mkdir(parents=True, exist_ok=True)
        args.tokens = str(run_dir / path.name)
        if not _saved(Path(args.tokens), tokens):
            raise common.UsageError(f"--run-dir {run_dir}: cannot write the token file there")
    seqs = (tokens.numel() - 1) // args.context_length
    args.held = max(args.batch_size, (seqs // 20) // args.batch_size * args.batch_size)   # ~5 %, whole batches
    if seqs - args.held < args.batch_size:
        raise common.UsageError(f"--data {data}: {tokens.numel():,} tokens make {seqs} sequences of "
                                f"{args.context_length}; a batch of {args.batch_size} and its held-out batch need "
                                f"{2 * args.batch_size}")
    args.fingerprint = hashlib.sha256(json.dumps({k: v for k, v in config.items() if k != "transformers_version"},
                                                 sort_keys=True).encode()).hexdigest()[:16]
    ckpts = run_dir / "checkpoints"
    latest = sharded_checkpoint.latest_checkpoint(str(ckpts)) if ckpts.exists() else None
    if latest:
        meta = json.loads((Path(latest) / "metadata.json").read_text())
        saved = (meta.get("extra") or {}).get("model")
        if saved != args.fingerprint:
            raise common.UsageError(f"{latest} is a checkpoint of another model (its config differs from "
                                    f"{model}'s): give another --run-dir, or remove it")
        args.resume_from = f"resumed from step {meta['step']} ({latest})"
    return sizes, tokens.numel(), seqs


def check_mesh_fits(config: dict, sizes: dict, args):
    """The mesh against the model's config: heads and key/value heads for tp, layers for
    pp (and its chunks), experts for ep; a family with no tp plan needs --plan."""
    T, P = sizes["tp"], sizes["pp"]
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads") or config.get("num_attention_heads")
    if T > 1:
        if not config.get("base_model_tp_plan") and not _class_has_plan(config, "base_model_tp_plan") and not args.plan:
            raise common.UsageError(f"{config.get('model_type')} ships no tensor-parallel plan: give --plan FILE "
                                    f"(a JSON plan in 08's words) for --tp")
        for what, n in (("attention heads", heads), ("key/value heads", kv), ("intermediate size",
                                                                              config.get("intermediate_size"))):
            if n and n % T:
                raise common.UsageError(f"--tp {T} does not divide the model's {n} {what}")
    layers = config.get("num_hidden_layers")
    if P > 1:
        if not _class_has_plan(config, "base_model_pp_plan"):
            raise common.UsageError(f"{config.get('model_type')} ships no pipeline plan: --pp needs one")
        if layers and P * args.chunks > layers:
            raise common.UsageError(f"--pp {P} x --chunks {args.chunks} stages for the model's {layers} layers: at "
                                    f"most one stage a layer")
    if args.ep > 1:
        experts = next((config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if config.get(k)),
                       None)
        if not experts:
            raise common.UsageError("--ep: the model has no experts of its own")
        if experts % args.ep:
            raise common.UsageError(f"--ep {args.ep} does not divide the model's {experts} experts")


def _class_has_plan(config: dict, attr: str) -> bool:
    import transformers
    cfg = transformers.AutoConfig.for_model(config["model_type"])
    return bool(getattr(cfg, attr, None))


def mesh_label(sizes: dict, ep: int = 1) -> str:
    label = " x ".join(f"{a} {n}" for a, n in sizes.items() if n > 1) or "one rank"
    return f"{label} (its experts at ep {ep})" if ep > 1 else label


def main(argv=None):
    args = parser().parse_args(argv)
    sizes, n_tokens, seqs = check(args)
    if common.is_reporter():
        print(f"{args.model} on {mesh_label(sizes, args.ep)} ({args.world_size} x {args.backend}/{args.device}): "
              f"{args.data}, {n_tokens:,} tokens, {seqs - args.held} sequences of {args.context_length} to train on, "
              f"{args.held} held out", flush=True)
    if common.is_reporter() and getattr(args, "resume_from", None):
        print(args.resume_from, flush=True)
    if args.bench:
        report_bench(args, sizes)
        return
    if not args.no_verify:
        r = common.launch(verify, args, sizes)
        common.check_verification({f"first {args.verify_steps} steps against one process": r},
                                  f"{NAME} on {mesh_label(sizes, args.ep)}")
    result = common.launch(train, args, sizes)
    if not common.is_reporter():
        return
    evals = [r for r in result["history"] if "eval" in r]
    hist = [r for r in result["history"] if "loss" in r]
    text = sample(Path(result["final"]), args.prompt, args.sample_tokens)
    print(f"final weights sha256 {result['sha256']}\n{common.wrote(result['final'])} (from_pretrained loads it)\n"
          f"sample: {text!r}", flush=True)
    row = {"mesh": mesh_label(sizes, args.ep), "steps": args.steps, "first loss": hist[0]["loss"] if hist else None,
           "last loss": hist[-1]["loss"] if hist else None, "first eval": evals[0]["eval"] if evals else None,
           "last eval": evals[-1]["eval"] if evals else None,
           "tokens/s": round(args.batch_size * args.context_length / (sum(r["seconds"] for r in hist) / len(hist)))
           if hist else None}
    plot = Path(args.run_dir) / "loss.png"
    if plot.exists():   # the loss plot beside the summary
        common.save_file(Path(args.out) / f"{NAME}_loss.png", lambda f: f.write(plot.read_bytes()))
    table = common.save_results(args.out, NAME, [row], {"model": args.model, "data": args.data,
                                                        "context": args.context_length, "batch": args.batch_size,
                                                        "device": args.device, "backend": args.backend,
                                                        "world_size": args.world_size},
                                title=TITLE, extra={"sample": text, "sha256": result["sha256"]})
    print(f"\n{TITLE}\n{table}\n{common.wrote(args.out, f'{NAME}.json and .md')}", flush=True)


if __name__ == "__main__":
    common.run_main(main)

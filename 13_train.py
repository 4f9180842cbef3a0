"""Train the model you have on your own text, on any mesh: a Hugging Face model folder (its
config, its weights, its tokenizer) and a text file in, a folder from_pretrained loads out.

The model is built on meta, put on the mesh by the calls of 10's "A Hugging Face model"
(its own tensor-parallel plan, its own pipeline stages, FSDP by its decoder layers,
DDPBucketed over the data ranks, context parallelism, its experts split), and each rank
reads only its slices of the folder's weights. The corpus (text files or folders of them,
JSON lines, Parquet, a datasets folder, several mixed by weight: --data PATH[:WEIGHT]) is
prepared once by every core into token shards beside it (corpus.py), each source's last
5 % (whole documents) held out; step i's global batch is drawn from (--seed, i) alone, so a
resumed run, on any number of data ranks, sees the same batches as one that never stopped,
and each rank reads its rows and nothing more, whatever the corpus's size. The loop
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
    python 13_train.py --model FOLDER --data books/:0.7 --data web.jsonl:0.3 --text-field text
    torchrun --nproc-per-node 8 13_train.py --model FOLDER --data FILE --pp 2 --fsdp 2 --tp 2
    python 13_train.py --setup-memory        # each rank's memory while a model is set up (make setup-memory)
    python 13_train.py --hf-checkpoint       # a Hugging Face folder in and out, beside DCP (make hf-checkpoint)

Prints the check (PASS/FAIL), a progress line every --log-every steps and a sample from the
saved folder. Writes <run-dir>/: progress.jsonl, loss.png, checkpoints/, final/ (the
Hugging Face folder); and <out>/13_train.{json,md} (the run's summary) with
<out>/13_train_loss.png; --bench instead writes <out>/13_train_bench.{json,md};
--setup-memory <out>/13_setup_memory and 13_setup_big, --hf-checkpoint <out>/13_hf_checkpoint
(10's LM on 8 ranks, each with flags of its own: 13_train.py --setup-memory --help).
"""
import argparse
import contextlib
import copy
import gc
import hashlib
import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path


if "--join" in sys.argv:   # a replica's rank (14's): a store whose server went is not a C++ trace a call
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


# ---- what is refused before torch loads (no torch: a refusal takes a second, not ten) ----
import corpus  # noqa: E402   (numpy and the standard library: the data, at any size; docs/13)


def missing_libraries() -> str | None:
    """What 13 needs beyond torch to read a model folder and its tokenizer, if missing."""
    import importlib.util
    gone = [m for m in ("transformers", "tokenizers", "safetensors") if importlib.util.find_spec(m) is None]
    if gone:
        return (f"{' and '.join(gone)} not installed: 13 reads a transformers model folder and its tokenizer "
                f"(pip install -r requirements-test.txt, or make train, which installs them)")
    return None


def early_check(argv):
    """The checks that need no torch, as ``python 13_train.py ARGV`` starts: the libraries,
    and --data (corpus.check_sources: a missing path, a binary or non-UTF-8 text, a record
    without the text field, a weight that does not parse). One line, exit 2."""
    p = argparse.ArgumentParser(prog="13_train.py", add_help=False, allow_abbrev=False)
    p.add_argument("--data", action="append")
    p.add_argument("--model")
    p.add_argument("--text-field", default="text")
    known, _ = p.parse_known_args(argv)
    if "-h" in argv or "--help" in argv or "--setup-memory" in argv or "--hf-checkpoint" in argv:
        return
    problem = missing_libraries() if known.model or known.data else None
    if known.data and not problem:
        try:
            corpus.check_sources(corpus.parse_sources(known.data, known.text_field))
        except corpus.CorpusError as e:
            problem = str(e)
    if problem:
        print(f"13_train.py: error: {problem}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    early_check(sys.argv[1:])

import common  # noqa: E402

# run as a command, each rank forks with transformers' model code imported once in the fork server
# (0.8 s of CPU a rank here; a replaced replica's ranks start again and again); the server skips
# it where it fails (a process that loads 13, the tests', keeps its own list)
if __name__ == "__main__":
    import multiprocessing
    multiprocessing.set_forkserver_preload([*common.PRELOAD, "transformers.models.llama.modeling_llama"])

# transformers' own progress bars (loading and writing a folder's weights), one a rank, would
# interleave with the run's progress lines; set HF_HUB_DISABLE_PROGRESS_BARS=0 to see them
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch
import torch.distributed as dist

import hf_checkpoint as hfc
import placement
import result_files
import sharded_checkpoint
import step_profile

ft = common.load_script(common.ROOT / "14_fault_tolerant_dp.py")   # replicas that survive a loss
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


def write_tiny_model(folder: Path, text: str, context: int, seed: int = 0, tied: bool = False):
    """A model folder as save_pretrained writes it: a byte-level BPE tokenizer trained on
    ``text`` (tokenizer.json with its config), a LlamaConfig (TINY; ``tied``: its head tied to
    its embedding, which the files then hold once) and its initial weights (safetensors),
    seeded."""
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
                                      bos_token_id=0, **{**TINY, "tie_word_embeddings": tied})
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def data_cache(first: dict, model: Path, run_dir: Path) -> Path:
    """Where the prepared corpus goes by default: a 13_data folder beside the first source
    (corpus.parse_sources' dict: a file's folder, a folder's parent, never inside a datasets
    folder among its splits), unless that is inside the model's folder or cannot be written:
    then beside --run-dir."""
    home = Path(first["path"]).parent
    inside = model.resolve() == home.resolve() or model.resolve() in home.resolve().parents
    return run_dir.parent / "13_data" if inside or not os.access(home, os.W_OK) else home / "13_data"


def lr_at(step: int, args) -> float:
    """Linear warmup over --warmup-steps, then cosine decay to --min-lr (a fraction of --lr)
    at --steps."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    t = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (args.min_lr + (1 - args.min_lr) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


# ---- the model on the mesh -------------------------------------------------------------
def cp_problem(model, config: dict, attention: str, context: int) -> str | None:
    """Why --cp cannot train ``model`` (built on meta; ``config``: its config.json;
    ``attention``: attention_of's) on sequences of ``context`` tokens, or None: no SDPA
    attention (transformers computes its own: context parallelism splits SDPA's), attention
    dropout (its masks do not split over the ranks), a sliding window or attention chunk
    shorter than the sequence (a mask that is no longer causal: refused by 11 at the first
    step, after the workers started), or tokens that meet outside attention (11's
    token_mixers: a Mamba layer's scan, a convolution over the sequence, linear attention),
    which would meet only within each rank's part of the sequence: Bamba, Jamba and the
    other hybrids trained so until 2026-11-30, caught only by the check against one
    process. Only the decoder is looked at: an audio tower's convolutions (Voxtral's,
    Granite Speech's), which text never reaches, had refused those models."""
    kind, own = config.get("model_type"), model.config.get_text_config()   # (a multimodal model's: its text's)
    types = set(getattr(own, "layer_types", None) or ())
    if attention != "sdpa":
        return (f"--cp: {kind} has no SDPA attention (transformers runs its own for it), and context parallelism "
                f"splits SDPA's")
    dropout = attention_dropout(config)
    if dropout:
        return (f"--cp: the model's attention dropout ({', '.join(dropout)}) does not split over the ranks: set it "
                f"to 0 in its config.json to train it on cp")
    for name, used in (("sliding_window", not types or "sliding_attention" in types),
                       ("attention_chunk_size", not types or "chunked_attention" in types)):
        window = getattr(own, name, None)
        if used and isinstance(window, int) and window < context:
            return (f"--cp: {kind}'s {name}={window} is shorter than --context-length {context}: its attention is "
                    f"masked beyond causal there, and context parallelism splits causal attention alone (give "
                    f"--context-length {window} or less)")
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    mixers = cpm.token_mixers(model if decoder is None else decoder)
    if mixers:
        return (f"--cp: {kind} mixes tokens outside its attention ({', '.join(mixers)}): context parallelism "
                f"splits attention alone, and each rank's part of the sequence would miss the rest")
    return None


def tp_plan_problem(model) -> str | None:
    """Why --tp cannot train ``model`` by the plan it ships, or None: a plan that splits no
    module of its layers, where every rank would compute every layer whole (GraniteMoE's
    and PhiMoE's name only their experts, which --ep splits; Bamba's, Falcon-H1's and
    Hunyuan's only the embedding)."""
    split, whole = tp.model_plan(model)
    if any("*" in k for k in split):   # (a key of every layer's)
        return None
    only = f"only {', '.join(split)}; " if split else ""
    return (f"--tp: {model.config.model_type}'s tensor-parallel plan splits none of its layers' modules ({only}"
            f"{'; '.join(sorted(set(whole.values())))}): give --plan FILE (a JSON plan in 08's words) for --tp")


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
        self.loss = loss_of(args)
        P, D, F_, C, T = (sizes[a] for a in AXES)
        mesh, self.model = self.mesh, model
        if T > 1:
            tp.parallelize(model, plan or tp.model_plan(model)[0], mesh.group("tp"))
        if args.recompute:   # the model's own activation checkpointing, non-reentrant: each layer redone in backward
            recompute_layers(model)
        # each decoder layer through torch.compile (the model's _no_split_modules); under tp after
        # the first step, whose eager forward parallelize looks at (08's summed_whole)
        layers = [m for m in model.modules() if type(m).__name__ in (model._no_split_modules or ())]
        self.uncompiled = layers if args.compile and T > 1 else []
        for m in layers if args.compile and T == 1 else ():
            m.compile()
        self.autocast = lambda: common.autocast(device, args.dtype)   # noqa: E731
        self.experts = None
        if args.ep > 1:
            self.experts = experts_of(model)
            ep.split_experts(model, self.experts, mesh.group("dp"))
        ignore = ep.expert_parameters(model) if self.experts else None
        self.stage = pp.ModelStage(model, mesh.coord("pp"), P, args.chunks) if P > 1 else model
        units = self.stage.held_layers() if P > 1 else None
        tied = [n for n, p in self.stage.named_parameters() if any(p is t for t in self.stage.tied)] if P > 1 else []
        module = self.stage
        if F_ > 1:
            module = fsdp.FSDP(module, process_group=mesh.group("fsdp"), units=units, ignore=ignore or ())
        if D * C > 1:
            module = ddp.DDPBucketed(module, args.bucket_mb, process_group=mesh.joint(("dp", "cp")) if C > 1
                                     else mesh.group("dp"), ignore_parameters=ignore or ())
        self.module, self.pipe = module, None
        if P > 1:
            self.pipe = pp.Pipeline(module, args.microbatches, lambda out, y: self.loss(out["logits"], y),
                                    args.schedule, mesh.group("pp"), chunks=args.chunks)
        self.tied_group, self.tied = None, []
        if P > 1 and getattr(model.config, "tie_word_embeddings", False):
            held = dict(self.stage.named_parameters())   # (under fsdp its shards, by the names they had)
            self.tied_group, self.tied = pp.tied_group(mesh.slices("pp")), [held[n] for n in tied]
            pp.tie(self.tied, self.tied_group)
        self.replicas = D * F_
        self.replica = mesh.coord("dp") * F_ + mesh.coord("fsdp")

    def rows(self, batch: int) -> range:
        """This rank's rows of a global batch of ``batch`` (its data replica's): the reader
        reads these and no others."""
        n = batch // self.replicas
        return range(self.replica * n, (self.replica + 1) * n)

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
            loss = self.loss(logits, y)
            del logits   # (autograd keeps what backward needs: the logits themselves would be held through it)
            if scale is not None:
                (loss * scale).backward()
            return loss.detach()

    def train_step(self, x, y, accumulate: int, shared: bool = False) -> torch.Tensor:
        """Backward of this rank's share (in ``accumulate`` parts, synchronized once, or the
        pipeline's micro-batches), gradients synchronized; the share's loss (None off the
        pipeline's last stage). ``shared``: x and y are this rank's rows already."""
        x, y = (x, y) if shared else (self.share(x), self.share(y))
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
            pp.sum_tied_gradients(self.tied, self.tied_group)
        for m in self.uncompiled:
            m.compile()
        self.uncompiled = []
        return loss

    @torch.no_grad()
    def eval_loss(self, x, y, shared: bool = False):
        x, y = (x, y) if shared else (self.share(x), self.share(y))
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
        return self.loss_over_mesh(loss).item()

    def loss_over_mesh(self, loss) -> torch.Tensor:
        """mean_over_mesh's loss left on the device (a float64 scalar), read by no one yet:
        the step goes on to clip and the optimizer without waiting for the device."""
        counts = (self.pipe is None or self.pipe.last) and not (self.sizes["tp"] > 1 and self.mesh.coord("tp") > 0)
        t = torch.zeros(2, dtype=torch.float64, device=self.device)   # (every tp rank holds the same loss: one counts)
        if counts:
            t[1] = 1.0
            if loss is not None:
                t[0] = torch.as_tensor(loss).detach()
        dist.all_reduce(t)
        return t[0] / t[1]


lm_loss = pp.lm_loss   # cross-entropy over every token, in float32


def loss_of(args):
    """The loss the run's steps compute: lm_loss, under --compile through torch.compile (as
    torchtitan compiles its loss beside its layers): the float32 upcast, the log-softmax and
    their backward fused, so the (tokens x vocabulary) float32 copies are never made (at
    1 B, batch 4 x 2048, a vocabulary of 32000: 1 GB each, and passes over them)."""
    return torch.compile(lm_loss) if args.compile else lm_loss


def auto_class(config):
    """The transformers Auto class that builds a folder's model (``config``: a folder or its
    config) as the folder's config.json names it (``architectures``): AutoModelForCausalLM,
    or AutoModelForImageTextToText for a multimodal folder whose class that one maps to
    (Llama 4's, Mistral 3's, Qwen2.5-VL's whole folders: AutoModelForCausalLM would build
    Llama 4's language model alone, its weights' names not found), or AutoModelForMultimodalLM
    for one only that maps (an audio tower's: Voxtral, Granite Speech). A multimodal model's
    language model trains on the text; its vision or audio tower, which text never reaches,
    gets no gradient and is written back as it came."""
    import transformers
    from transformers.models.auto import modeling_auto as auto
    if not isinstance(config, transformers.PretrainedConfig):
        config = transformers.AutoConfig.from_pretrained(config)
    kinds = ((transformers.AutoModelForCausalLM, auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
             (transformers.AutoModelForImageTextToText, auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES),
             (getattr(transformers, "AutoModelForMultimodalLM", None),   # (transformers 5)
              getattr(auto, "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", {})))
    named = getattr(config, "architectures", None) or []
    return next((cls for cls, names in kinds if names.get(config.model_type) in named),
                next((cls for cls, names in kinds if config.model_type in names), transformers.AutoModelForCausalLM))


def build_on_meta(folder, device=None, attention="sdpa"):
    """The folder's model, its parameters on meta (placement.meta_parameters), its config
    as saved, ``attention`` its attention (attention_of); the buffers its constructor
    computed (rotary tables) moved to ``device`` (the data-parallel wrappers broadcast them
    as they wrap)."""
    import transformers
    config = transformers.AutoConfig.from_pretrained(folder)
    config._attn_implementation = attention
    with placement.meta_parameters():
        model = auto_class(config).from_config(config, dtype=torch.float32)
    for m in model.modules() if device is not None else ():
        for name, b in m._buffers.items():
            if b is not None and not b.is_meta:
                m._buffers[name] = b.to(device)
    return model


def recompute_layers(model):
    """The model's own activation checkpointing on each decoder layer, non-reentrant:
    activation_checkpointing_enable, or where transformers is older than that name (5.17),
    gradient_checkpointing_enable, which 5.24 still takes with a FutureWarning."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def attention_of(folder) -> tuple:
    """The attention the run gives the folder's model, and the model built on meta with it:
    "sdpa" (torch's fused attention, which context parallelism splits) where its family has
    it, else "eager", its own (a family without SDPA, as BLOOM, refuses it as it is built)."""
    try:
        return "sdpa", build_on_meta(folder)
    except ValueError:   # (a model that fails for another reason raises again here)
        return "eager", build_on_meta(folder, attention="eager")


# What a model draws at random while it trains, by its name in the config or on a module:
# dropout (dropout, attn_pdrop, hidden_dropout_prob, ...), layer drop, a router's jitter noise
RANDOM_NAMES = ("drop", "jitter")
DROPOUTS = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
            torch.nn.FeatureAlphaDropout)


def random_off(model) -> list:
    """Turn off everything ``model`` draws at random while it trains: every number named for
    dropout, layer drop or jitter (RANDOM_NAMES) in its config and sub-configs and on its
    modules (an attention module keeps its own copy of the rate), and every nn.Dropout's p.
    The check against one process needs this: no two runs draw the same masks (a rank's
    batch is a slice of the one process's), so with dropout on no method could match.
    Returns what was on, as ``name=value`` from the config (the modules' own where the
    config does not name them), sorted."""
    import transformers
    found, seen = set(), set()

    def off(owner, name, value, record):
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value \
                and any(w in name.lower() for w in RANDOM_NAMES):
            setattr(owner, name, type(value)(0))
            seen.add(name)
            if record or name not in seen_config:
                found.add(f"{name}={value}")
    configs = [model.config]
    configs += [v for c in configs for v in vars(c).values() if isinstance(v, transformers.PretrainedConfig)]
    for c in configs:
        for name, value in list(vars(c).items()):
            off(c, name, value, True)
    seen_config = set(seen)
    for m in model.modules():
        if isinstance(m, DROPOUTS):
            if m.p and not seen_config:
                found.add(f"{type(m).__name__}(p={m.p})")
            m.p = 0.0
        for name, value in list(vars(m).items()):
            if not name.startswith("_"):
                off(m, name, value, False)
    return sorted(found)


def attention_dropout(config: dict) -> list:
    """The attention dropout a model's config.json (and its text_config) sets, as
    ``name=value``: a number named for dropout and attention (attention_dropout, attn_pdrop,
    attention_probs_dropout_prob) that is not 0."""
    found = []
    for c in (config, config.get("text_config") or {}):
        found += [f"{k}={v}" for k, v in sorted(c.items()) if "drop" in k and ("attn" in k or "attention" in k)
                  and isinstance(v, (int, float)) and not isinstance(v, bool) and v]
    return found


def train_flops_per_token(model, context: int) -> float:
    """A training step's FLOPs a token (docs/13), for MFU: 6 for each parameter a matrix
    multiply uses (every one but the input embedding's, which is a lookup; a tied head
    counted as the head), and attention's 12 L T d (the scores and their values, forward
    and backward, the whole T x T square as nanoGPT and PaLM count it; T the context, d the
    heads' width, L d summed layer by layer where the layers' heads differ, as Gemma 4's).
    A mixture of experts counts every expert: an upper bound of its work. Only the decoder's
    and the head's count: a multimodal model's vision tower does no work on text."""
    config = model.config.get_text_config()
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    used = {id(p): p for p in [*model.get_decoder().parameters(), *(() if head is None else head.parameters())]}
    if head is None or head.weight is not emb:   # (the embedding a lookup; a tied one counted as the head)
        used.pop(id(emb))
    weights = sum(p.numel() for p in used.values())
    width = sum(h * (d or config.hidden_size // h) for h, d in   # (each layer's heads: Gemma 4's differ)
                zip(tp.layer_values(config, "num_attention_heads"), tp.layer_values(config, "head_dim")))
    return 6.0 * weights + 12.0 * context * width


def adamw(params, args):
    """The optimizer 13 trains with, and gives torch's side of every comparison: AdamW
    (betas 0.9, 0.95, --weight-decay), fused (one kernel a step for all of a device's
    parameters of one dtype, as torchtitan trains; the default, foreach, makes several
    passes over the state). Its steps are checked against one process stepping the same."""
    return torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=args.weight_decay,
                             fused=True)


def on_mesh(ctx, args, sizes, folder, plan=None) -> "OnMesh":
    """``folder``'s model built on meta, put on the mesh (OnMesh) and filled from the folder,
    each rank reading its slices."""
    model = build_on_meta(folder, ctx.device, args.attention)
    layout = hfc.model_layout(model, folder)   # (the source's own layout, as its files hold it)
    run = OnMesh(model, sizes, args, ctx.device, plan or read_plan(args.plan))
    hfc.load_hf_checkpoint(run.stage, folder, ctx.device, pieces=layout)
    run.layout = layout   # (the folder written back: the source's layout)
    return run


def read_plan(path):
    if not path:
        return None
    plan = json.loads(Path(path).read_text())
    return {k: tuple(v) if isinstance(v, list) else v for k, v in plan.items()}


# ---- the workers ----------------------------------------------------------------------
# Bytes a parameter of the check's one-process model takes on each rank: its weight, its
# gradient and AdamW's two states (float32), and the mesh's weights gathered whole beside it
CHECK_BYTES = 5 * 4


def check_room(ctx, args) -> str | None:
    """Why the check against one process does not fit here (None: it does). It builds the
    model whole on every rank: CHECK_BYTES a parameter, against the memory a rank has (its
    device's free memory over the ranks that share it; on the CPU, the host's available
    memory over this node's ranks), the tightest rank's; ``args.room``: bytes a rank has,
    given (the tests')."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))
    if args.room is not None:
        have = args.room
    elif ctx.device.type == "cuda":
        have = torch.cuda.mem_get_info(ctx.device)[0] / -(-local // torch.cuda.device_count())
    else:
        with open("/proc/meminfo") as f:
            have = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:")) / local
    least = torch.tensor([float(have)], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    need = CHECK_BYTES * args.n_params
    if need <= 0.8 * least.item():
        return None
    return (f"the model whole in one process with AdamW's state ({need / 2**30:.2f} GiB a rank, {args.n_params:,} "
            f"parameters) does not fit the {least.item() / 2**30:.2f} GiB a rank has here: the run goes on unchecked "
            f"(check a smaller model of the same family on this mesh)")


def verify(ctx, args, sizes):
    """The first --verify-steps steps of the run on the mesh against the same model trained
    in one process on the same global batches (each rank builds it whole: the check needs a
    model one process holds): the largest weight difference and whether every step's loss
    agreed; {"skipped": why} where that model does not fit (check_room)."""
    why = check_room(ctx, args)
    if why:
        return {"skipped": why}
    data = corpus.Reader(args.corpus, args.context_length, args.batch_size, args.seed)
    run = on_mesh(ctx, args, sizes, args.model)
    ref = auto_class(args.model).from_pretrained(args.model, attn_implementation=args.attention,
                                                            dtype=torch.float32).to(ctx.device)
    randomness = random_off(ref)   # (both sides: the check compares the math, not the masks)
    random_off(run.model)
    opts = [adamw(m.parameters(), args) for m in (run.module, ref)]
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
    return {"max_diff": diff, "loss_rel": worst, "ok": diff < tol[0] and worst < tol[1], "random_off": randomness}


def train(ctx, args, sizes):
    """The run: from the newest complete checkpoint in <run-dir>/checkpoints (or the
    folder's weights) to --steps; a line every --log-every steps, the eval loss every
    --eval-every, a checkpoint every --checkpoint-every; at the end the Hugging Face folder.
    On replicas (--join): one replica's ranks, each step a quorum of the live replicas
    (14's ReplicaManager): step i's batch is the corpus's batch i x --replicas + the
    replica's id, its gradients averaged over the quorum's members, the step taken only
    when every member's went well; a replica behind heals from a live peer rank by rank
    (its weights, AdamW's state, the step: the data position; the RNG is seeded from the
    step and the replica); its checkpoints in <run-dir>/replica-<id>/, the final folder
    written by the replica the coordinator names. Returns the summary on the first rank."""
    data = corpus.Reader(args.corpus, args.context_length, args.batch_size, args.seed)
    run = on_mesh(ctx, args, sizes, args.model)
    config = run.model.config
    opt = adamw(run.module.parameters(), args)
    run_dir = Path(args.run_dir)
    home = run_dir / f"replica-{args.replica_id}" if args.join else run_dir   # (this replica's own files)
    ckpts = home / "checkpoints"
    start, history = 0, []
    folder = sharded_checkpoint.latest_checkpoint(str(ckpts)) if ckpts.exists() else None
    if folder:
        extra = sharded_checkpoint.load_sharded(run.stage, opt, folder)
        start, history = extra["step"], extra.get("history", [])   # (main said so before the workers started)
    fault = args.fault_at or os.environ.get(common.FAULT_ENV)   # (the tests' kill -9: STEP:RANK, on the first
    kill_at, kill_rank = (int(v) for v in fault.split(":")) if fault else (None, None)   # attempt: torchrun's
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":                          # restarts count from 0)
        kill_at = None
    tokens_per_step = args.batch_size * args.context_length
    peak = nd.peak_flops(ctx.device, dtype=args.dtype)
    manager = replica_manager(ctx, args, sizes, run, opt, start) if args.join else None

    def evaluate():
        rows = run.rows(args.batch_size)   # (this rank's rows only: the reader reads no others)
        losses = [run.mean_over_mesh(run.eval_loss(*(t.to(ctx.device) for t in data.held_out(k, rows)), shared=True))
                  for k in range(args.eval_batches)]
        return sum(losses) / len(losses)
    if start == 0:   # where the eval loss starts from
        history.append({"step": 0, "eval": evaluate()})
    began, done, stepping = time.perf_counter(), 0, 0.0   # stepping: the training steps' seconds
    last_eval = next((r["eval"] for r in reversed(history) if "eval" in r), None)
    i = start
    try:
        while True:
            t0 = time.perf_counter()
            if manager is not None:   # (a replica's step counts its quorum, and a heal where it takes one)
                if not manager.start_step(args.steps):
                    break
                i = manager.step
                ft.act_out(manager.faults, ctx)
                torch.manual_seed(replica_seed(args, i))
            elif i >= args.steps:
                break
            if i == kill_at and ctx.rank == kill_rank:
                os.kill(os.getpid(), 9)
            lr = lr_at(i, args)
            for g in opt.param_groups:
                g["lr"] = lr
            opt.zero_grad(set_to_none=True)
            x, y = (t.to(ctx.device) for t in data.batch_of(batch_index(args, i), run.rows(args.batch_size)))
            loss = run.loss_over_mesh(run.train_step(x, y, args.accumulate, shared=True))
            if manager is not None:
                ft.act_out(manager.faults, ctx, "reduce")
                reduced = manager.all_reduce_gradients()
                ft.act_out(manager.faults, ctx, "vote")
                if not manager.should_commit(reduced):   # (a member lost: nobody steps; the next quorum redoes it)
                    continue
                ft.act_out(manager.faults, ctx, "commit")
            norm = placement.clip_grad_norm_(run.stage, args.clip)
            opt.step()
            loss, norm = torch.stack([loss, norm.to(loss)]).tolist()   # (read once the step is queued: the
            common.sync(ctx.device)                                      # device never waits on the host between)
            dt, done = time.perf_counter() - t0, done + 1
            stepping += dt
            i += manager is None
            step = manager.step if manager is not None else i
            row = {"step": step, "loss": loss, "lr": lr, "grad_norm": norm, "seconds": dt}
            if manager is not None:
                row["replicas"] = manager.members or [args.replica_id]
            if step % args.eval_every == 0 or step == args.steps:
                last_eval = row["eval"] = evaluate()
            history.append(row)
            speaks = manager is None or getattr(manager, "speaks", args.replica_id == min(row["replicas"]))
                                                                                    # (on replicas: the quorum's first)
            if ctx.rank == 0 and speaks and (step % args.log_every == 0 or step == args.steps or "eval" in row):
                elapsed = time.perf_counter() - began
                tok_s = tokens_per_step * done / stepping   # tokens/s: as the summary's (docs/13)
                mfu = f" | mfu {args.flops_per_token * tok_s / peak / ctx.world_size:.1%}" if peak else ""
                mem = torch.cuda.max_memory_allocated(ctx.device) / 2**20 if ctx.device.type == "cuda" else _status_mb("VmHWM")
                eta = elapsed / done * (args.steps - step)
                print(f"{f'replica {args.replica_id}: ' if manager else ''}step {step:>5}/{args.steps} | loss "
                      f"{loss:.4f} | eval {'-' if last_eval is None else f'{last_eval:.4f}'} | lr {lr:.2e} | "
                      f"{tok_s:,.0f} tok/s{mfu} | mem {mem:,.0f} MiB | {eta:,.0f} s left"
                      + (f" | {quorum_words(manager)}" if manager else ""), flush=True)
            if ctx.rank == 0 and (step % args.log_every == 0 or step == args.steps):
                _progress(home, history)
            if args.checkpoint_every and (step % args.checkpoint_every == 0 or step == args.steps):
                sharded_checkpoint.save_sharded(run.stage, opt, str(ckpts), step, async_save=args.checkpoint_async,
                                                extra={"step": step, "model": args.fingerprint, "history": list(history)})
            if manager is not None:
                time.sleep(max(0.0, args.pace_ms / 1000 - (time.perf_counter() - t0)))
    except ft.CoordinatorGone as e:   # (the replicas stop; the run resumes from each one's checkpoint)
        sharded_checkpoint.wait_for_saves()
        sharded_checkpoint.save_sharded(run.stage, opt, str(ckpts), manager.step,
                                        extra={"step": manager.step, "model": args.fingerprint, "history": list(history)})
        raise ft.CoordinatorGone(f"{e}: replica {args.replica_id} stops at its last committed step, {manager.step}, "
                                 f"saved in {ckpts}: start the coordinator and the replicas again to go on from there") \
            from None
    sharded_checkpoint.wait_for_saves()
    digest = common.weights_sha256(placement.full_state_dict(run.stage, all_ranks=True))
    final = run_dir / "final"
    writes = manager is None or manager.writer   # (on replicas: once for the run, by the one the coordinator names)
    if writes:
        hfc.save_hf_checkpoint(run.stage, str(final), config=config, layout=run.layout)
    if ctx.rank == 0:
        if writes:
            for name in tokenizer_files(args.model):   # the tokenizer's files beside the weights
                shutil.copy(Path(args.model) / name, final / name)
            if (Path(args.model) / "generation_config.json").exists():
                shutil.copy(Path(args.model) / "generation_config.json", final / "generation_config.json")
        _progress(home, history)
        out = {"history": history, "sha256": digest, "final": str(final) if writes else None, "start": start}
        if manager is not None:
            if writes:   # the run's loss beside its membership timeline
                _progress(run_dir, history)
                if manager.history:
                    draw_replica_timeline(args, manager.history, run_dir / "timeline.png")
            out.update(replica=args.replica_id, step=manager.step, heals=manager.heals, commits=manager.commits,
                       aborts=manager.aborts, writer=manager.writer)
            if args.result:   # (the launcher's record of this replica)
                common.save_file(args.result, lambda f: torch.save(out, f))
        return out
    return None


# ---- on replicas that survive a loss (14's ReplicaManager around the mesh) ----------------
def batch_index(args, step: int) -> int:
    """The corpus batch a step trains on: the step's own, or on replicas replica r's share
    of it: batch step x --replicas + r (each replica its own batches, the same wherever and
    whenever it runs)."""
    return step * args.replicas + args.replica_id if args.join else step


def replica_seed(args, step: int) -> int:
    """The RNG's seed at a replica's step (dropout's masks): from the run's seed, the step
    and the replica, so a replacement draws what the replica it replaces would have."""
    return (args.seed * 1_000_003 + step) * 1_009 + args.replica_id


def replica_settings(args, sizes) -> dict:
    """What every replica of a run shares (the coordinator refuses one whose differ)."""
    return {"model": args.fingerprint, "mesh": mesh_label(sizes, args.ep), "replicas": args.replicas,
            **{k: getattr(args, k) for k in ("batch_size", "context_length", "accumulate", "steps", "lr", "min_lr",
                                             "warmup_steps", "weight_decay", "clip", "seed", "dtype")}}


def replica_manager(ctx, args, sizes, run, opt, start):
    """This replica's manager: the coordinator at --join, its hello from step ``start``
    (its own checkpoint's), every rank of the mesh holding its part (rank k of every
    replica the same part: the same mesh)."""
    if args.torchft:   # torchft's Manager on each rank (the benchmark's side, or a torchrun job of the user's)
        home = Path(args.run_dir) / f"replica-{args.replica_id}"
        manager = ft.TorchftReplica(run.module, opt, args.join, args.replica_id, ctx.rank, ctx.world_size,
                                    log=home / f"torchft-{ctx.rank}.jsonl", stop=Path(args.run_dir) / "stop")
        if start:   # (its step, as our checkpoint has it)
            manager.manager.load_state_dict({"step": start, "batches_committed": start * args.replicas})
            manager.step = start
        return manager
    say = (lambda line: print(line, flush=True)) if ctx.rank == 0 else None
    manager = ft.ReplicaManager(run.module, opt, args.join, args.replica_id, timeout=args.timeout, step=start,
                                incarnation=args.incarnation, settings=replica_settings(args, sizes),
                                connect_wait=args.connect_wait, say=say)
    ft.arm_hooks(manager, ctx)
    return manager


def quorum_words(manager) -> str:
    got = sum(h["role"] == "joiner" for h in manager.heals)
    return (f"quorum {manager.members or [manager.replica_id]} | this start: {manager.commits} committed, "
            f"{manager.aborts} aborted, {got} heal(s) received, {len(manager.heals) - got} served")


def draw_replica_timeline(args, history, path):
    """The run's membership by committed step (14's timeline), from the coordinator's history."""
    tl = ft.timeline({"history": history}, args.replicas)
    ft.draw_timeline(tl, [], path, f"{args.replicas} replicas of {Path(args.model).name}: membership by committed "
                                   f"step")
    return tl


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


def torch_composition(ctx, folder, sizes, plan, recompute=False, compile_layers=False, attention="sdpa"):
    """The same model as transformers loads it (whole, on every rank), torch's TP over tp by
    ``plan`` (column -> ColwiseParallel, row -> RowwiseParallel), then FSDP2's fully_shard on
    each decoder layer and the root over the data ranks (``recompute``: the model's own
    gradient checkpointing first, as ours; ``compile_layers``: each decoder layer through
    torch.compile before its fully_shard, as torchtitan does, FSDP2's hooks around it)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    model = auto_class(folder).from_pretrained(folder, attn_implementation=attention,
                                                              dtype=torch.float32).to(ctx.device)
    model.train()   # (from_pretrained leaves it in eval mode, where transformers skips its checkpointing)
    if recompute:
        recompute_layers(model)
    data, T = sizes["dp"] * sizes["fsdp"], sizes["tp"]
    mesh = init_device_mesh(ctx.device.type, (data, T), mesh_dim_names=("data", "tp"))
    if T > 1:
        styles = {k: ColwiseParallel() if v == "column" else RowwiseParallel() for k, v in plan.items()}
        for name, m in model.named_modules():
            for key, style in styles.items():
                if placement.path_matches(name, key):
                    parallelize_module(m, mesh["tp"], style)
    # (the layers found first: fully_shard gives each a class of its own, FSDPLlamaDecoderLayer)
    for m in [m for m in model.modules() if type(m).__name__ in (model._no_split_modules or ())]:
        if compile_layers:
            m.compile()
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
        opt = adamw(run.module.parameters(), args)

        def step(x, y, phase=step_profile.no_phase):
            with phase("forward + backward"):
                opt.zero_grad(set_to_none=True)
                run.train_step(x, y, 1)
            with phase("clip"):
                placement.clip_grad_norm_(run.stage, args.clip)
            with phase("optimizer"):
                opt.step()
        return step, run.stage, opt
    model = torch_composition(ctx, folder, sizes, plan, recompute=args.recompute, compile_layers=args.compile,
                              attention=args.attention)
    opt, loss_fn = adamw(model.parameters(), args), loss_of(args)
    mesh = nd.Mesh(sizes)
    replicas, replica = sizes["dp"] * sizes["fsdp"], mesh.coord("dp") * sizes["fsdp"] + mesh.coord("fsdp")

    def step(x, y, phase=step_profile.no_phase):
        with phase("forward + backward"):
            opt.zero_grad(set_to_none=True)
            x, y = common.shard(x, replica, replicas), common.shard(y, replica, replicas)
            with common.autocast(ctx.device, args.dtype):   # (as ours: the loss in float32 from the logits)
                logits = model(input_ids=x, use_cache=False).logits
            loss = loss_fn(logits, y)
            del logits   # (as ours: autograd keeps what backward needs)
            loss.backward()
        with phase("clip"):
            torch_clip(model.parameters(), args.clip)
        with phase("optimizer"):
            opt.step()
    return step, model, opt


def bench_plan(args, sizes, folder) -> dict:
    return read_plan(args.plan) or (tp.model_plan(build_on_meta(folder, attention=args.attention))[0]
                                    if sizes["tp"] > 1 else {})


def bench_steps(ctx, args, sizes, folder, tag="given"):
    """Ours and torch's on ``folder``'s model: each rank's peak of live tensor bytes during a
    step (each method's third, under 07's StepPeak); their steps alternating on the same
    batches (--bench-steps after 2 warm-up, the slowest rank's time); with --profile, one
    more step each under torch.profiler (step_profile; rank 0's Chrome trace to --run-dir's
    profile/, named by ``tag``); each method's checkpoint save (ours: save_sharded; torch's:
    torch.distributed.checkpoint.save), three each, alternating. {"times": {method:
    [seconds]}, "saves": ..., "peaks": {method: [MiB a rank]}, "profiles": {method: [a
    rank's summary]}}."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    data = corpus.Reader(args.corpus, args.context_length, args.batch_size, args.seed)
    plan = bench_plan(args, sizes, folder)
    built, peaks, failed = {}, {}, None
    for m in ("ours", "torch"):   # each built and stepped three times under 07's StepPeak: the third's peak
        with fsdp.StepPeak(ctx.device) as mem:   # (live tensor bytes above what was alive before: the other's too)
            try:
                built[m] = bench_method(ctx, args, sizes, folder, m, plan)
                for i in range(3):
                    with mem.step() if i == 2 else contextlib.nullcontext():
                        built[m][0](*(t.to(ctx.device) for t in data.batch_of(i)))
            except Exception as e:   # torch's side that cannot take this model (Llama 4's shared expert under
                if m == "ours":      # torch's TP: an in-place add on RowwiseParallel's output): a SKIP, not a crash
                    raise
                failed = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        peaks[m] = mem.peak / 2**20 if mem.peak is not None else None
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, failed)
    if any(everyone):
        return {"skip": next(f for f in everyone if f)}
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
    profiles = {}
    if args.profile:   # (a batch of its own, after the timed ones)
        x, y = (t.to(ctx.device) for t in data.batch_of(2 + args.bench_steps))
        (Path(args.run_dir) / "profile").mkdir(parents=True, exist_ok=True)
        for name in ("ours", "torch"):
            dist.barrier()
            trace = Path(args.run_dir) / "profile" / f"{NAME}_profile_{tag}_{name}.json.gz" if ctx.rank == 0 else None
            try:   # (a summary or a trace that fails leaves the timed rows standing)
                profiles[name] = step_profile.profile_step(lambda phase: steps[name](x, y, phase), ctx.device, trace)
            except Exception as e:
                profiles[name] = {"error": f"{type(e).__name__}: {e}"}
    saves = {"ours": [], "torch": []}
    where = Path(args.run_dir) / "bench-checkpoints"
    for k in range(args.bench_saves):   # (each removed once timed: at 1 B parameters a save is 13 GB)
        for name in (("ours", "torch") if k % 2 == 0 else ("torch", "ours")):
            dist.barrier()
            t0 = time.perf_counter()
            if name == "ours":
                sharded_checkpoint.save_sharded(stage, opt, str(where / "ours"), k)
            else:
                msd, osd = get_state_dict(theirs, topt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(where / "torch"))
            dist.barrier()
            saves[name].append(time.perf_counter() - t0)
            if ctx.rank == 0:
                shutil.rmtree(where, ignore_errors=True)
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, (times, peaks, profiles))
    slowest = {n: [max(r[n][i] for r, _, _ in everyone) for i in range(args.bench_steps)] for n in times}
    if ctx.rank == 0:
        shutil.rmtree(where, ignore_errors=True)
    return {"times": slowest, "saves": saves, "peaks": {n: [p[n] for _, p, _ in everyone] for n in peaks},
            "profiles": {n: [f[n] for _, _, f in everyone] for n in profiles}}


def larger_model(args, run_dir: Path) -> Path:
    """The --bench larger setting: the model's config with twice the width and twice the
    layers (its patterns of one entry a layer, as Llama 4's no_rope_layers and the layer
    types, and a layer's own values, as Gemma 4's per_layer_config, repeated), its weights initialised (seeded), the tokenizer copied: a folder
    beside the run. ValueError, naming why, where the family's config does not take it
    (Bamba's Mamba heads are tied to its width): built on meta first, nothing written."""
    import transformers
    folder = run_dir / "bench-larger-model"
    if (folder / "config.json").exists():
        return folder
    config = transformers.AutoConfig.from_pretrained(args.model)
    text = config.get_text_config()   # (a multimodal model's language model: its vision tower as it is)
    n = text.num_hidden_layers
    own = {int(i): values for i, values in (text.to_dict().get("per_layer_config") or {}).items()} \
        if getattr(text, "is_heterogeneous", False) else {}   # (a layer's own values: Gemma 4's head_dim)
    if own:
        text.per_layer_config = None   # (set again below, for twice the layers)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers"):
        value = getattr(text, key)   # (Gemma 3n's intermediate size: a list, one a layer)
        setattr(text, key, [2 * v for v in value] * 2 if isinstance(value, list) else 2 * value)
    for key, value in list(vars(text).items()):   # a layer's type, flag or fraction, one a layer: the pattern twice
        if isinstance(value, list) and len(value) == n and all(
                isinstance(v, str) or v in (0, 1) or (isinstance(v, float) and 0 <= v <= 1) for v in value):
            setattr(text, key, value * 2)
    if own:   # each layer's own values again, the widths among them doubled, for both copies of the layers
        text.per_layer_config = {i + n * copy: {k: 2 * v if k in ("hidden_size", "intermediate_size") else v
                                                for k, v in values.items()}
                                 for copy in (0, 1) for i, values in own.items()}
    try:
        if hasattr(config, "validate"):   # (what save_pretrained checks: transformers 5.24's)
            config.validate()
        with torch.device("meta"):
            auto_class(config).from_config(config)
    except Exception as e:   # (whatever the family's config or its modules raise)
        why = e.__cause__ or e
        raise ValueError(f"{config.model_type}'s config does not take twice the width and depth "
                         f"({type(why).__name__}: {str(why).splitlines()[0] if str(why) else ''})") from None
    torch.manual_seed(args.seed)

    def fill(tmp):
        auto_class(config).from_config(config).save_pretrained(tmp)
        for name in tokenizer_files(args.model):
            shutil.copy(Path(args.model) / name, tmp / name)
    written_aside(folder, fill)
    return folder


BENCH_HEADERS = ["setting", "method", "step_ms", "tokens_per_s", "mfu", "vs_torch", "peak_MB", "save_ms"]


def report_bench(args, sizes):
    """--bench: ours beside torch's at the model as given and at a larger one, each a table
    row per method: step time (median of the slowest rank's), tokens/s, our step over
    theirs paired (median [min-max]), each rank's step peak, a checkpoint save."""
    plan = bench_plan(args, sizes, args.model)
    why = torch_skip(sizes, plan)
    if why:
        print(f"  SKIP  torch's composition on {mesh_label(sizes)}: {why}", flush=True)
        return
    rows, profiles = [], {}
    peak = nd.peak_flops(torch.device(args.device), dtype=args.dtype)   # (the device's: MFU where it is known)
    settings = [("as given", Path(args.model), "given")]
    if args.bench_settings == "both":
        try:
            settings.append(("2x wide, 2x deep", larger_model(args, Path(args.run_dir)), "larger"))
        except ValueError as e:
            print(f"  SKIP  the 2x wide, 2x deep setting: {e}", flush=True)
    extra = " + compile" * args.compile + " + recompute" * args.recompute
    labels = {"ours": "ours (13's mesh)" + extra, "torch": "torch FSDP2" + (" + TP" if sizes["tp"] > 1 else "") + extra}
    for setting, folder, tag in settings:
        r = common.launch(bench_steps, args, sizes, str(folder), tag)
        if "skip" in r:
            print(f"  SKIP  torch's side, {setting}: its first steps raised {r['skip']}", flush=True)
            continue
        profiles[setting] = r["profiles"]
        peaks = r["peaks"]
        tokens = args.batch_size * args.context_length
        flops = train_flops_per_token(build_on_meta(folder, attention=args.attention), args.context_length)
        ratios = [a / b for a, b in zip(r["times"]["ours"], r["times"]["torch"])]
        for method in ("ours", "torch"):
            t = statistics.median(r["times"][method])
            rows.append({"setting": setting, "method": labels[method],
                         "step_ms": t * 1e3, "tokens_per_s": round(tokens / t),
                         "mfu": f"{flops * tokens / t / peak / args.world_size:.1%}" if peak else "",
                         "vs_torch": f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
                         if method == "ours" else "",
                         "peak_MB": " / ".join(f"{p:.1f}" for p in peaks[method]) if peaks[method][0] is not None
                         else "", "save_ms": statistics.median(r["saves"][method]) * 1e3 if r["saves"][method]
                         else ""})
    title = f"13's training step beside torch's own on {mesh_label(sizes)}" + (f", {args.dtype} autocast"
                                                                                if args.dtype != "float32" else "")
    table = common.save_results(args.out, f"{NAME}_bench", rows, {"model": args.model, "mesh": mesh_label(sizes),
                                                                   "batch": args.batch_size,
                                                                   "context": args.context_length,
                                                                   "steps": args.bench_steps, "device": args.device,
                                                                   "dtype": args.dtype, "compile": args.compile,
                                                                   "recompute": args.recompute},
                                headers=BENCH_HEADERS, title=title,
                                note="mfu: tokens/s x the training FLOPs a token (6 a weight a matrix multiply "
                                     "uses, and attention's 12 L T d: docs/13) over the ranks' peak for --dtype "
                                     "(10's peak_flops; blank where the device's peak is not known); "
                                     "peak_MB: each rank's peak of live tensor bytes during a step (07's StepPeak); "
                                     "save_ms: one sharded checkpoint (ours: save_sharded; torch's: "
                                     "torch.distributed.checkpoint.save), median of three")
    print(f"\n{title} ({args.world_size} x {args.backend}/{args.device}, {args.batch_size} x {args.context_length} "
          f"tokens a step; median of {args.bench_steps} steps, alternating)\n{table}\n"
          f"{common.wrote(args.out, f'{NAME}_bench.json and .md')}", flush=True)
    if args.profile:
        report_profile(args, sizes, profiles, labels)


PROFILE_TABLES = (("gaps", "The device's longest idle stretches, and what the host ran then",
                   ["setting", "method", "at_ms", "gap_ms", "phase", "host_in"]),
                  ("categories", "The busy time by kind of work", ["setting", "method", "category", "ms", "share"]),
                  ("kernels", "The costliest kernels (a CPU's: operators)",
                   ["setting", "method", "name", "category", "calls", "ms"]))


def report_profile(args, sizes, profiles, labels):
    """--profile: rank 0's profiled step of each method (step_profile's summary) as tables:
    each phase's wall and device-busy time, the longest idle stretches, the busy time by
    kind, the costliest kernels; every rank's summary in the JSON."""
    def rows(key, n=None):   # (rank 0's, the first n of each)
        return [{"setting": setting, "method": labels[m], **r} for setting, by in profiles.items()
                for m in ("ours", "torch") for r in by[m][0].get(key, [])[:n]]
    failed = [f"  the profile of {labels[m]} ({setting}) failed on rank 0: {by[m][0]['error']}"
              for setting, by in profiles.items() for m in ("ours", "torch") if "error" in by[m][0]]
    busy = "the GPU running a kernel, a copy or a fill" if args.device == "cuda" else \
        "the step's thread inside an operator (a CPU's)"
    title = f"Where a step's time goes on {mesh_label(sizes)}: one profiled step a method, rank 0"
    table = common.save_results(
        args.out, f"{NAME}_profile", rows("phases"),
        {"model": args.model, "mesh": mesh_label(sizes), "batch": args.batch_size, "context": args.context_length,
         "device": args.device, "dtype": args.dtype, "compile": args.compile, "recompute": args.recompute},
        headers=["setting", "method", "phase", "wall_ms", "busy_ms", "idle_ms", "busy"], title=title,
        extra={"ranks": profiles}, sections=[(head, rows(key), cols) for key, head, cols in PROFILE_TABLES],
        note=f"busy: {busy} (step_profile.py); the phases are apart by a device sync, the step run under "
             f"torch.profiler (slower than the timed steps); rank 0's Chrome traces: {NAME}_profile_*.json.gz "
             f"(Perfetto opens them)")
    for trace in sorted((Path(args.run_dir) / "profile").glob(f"{NAME}_profile_*.json.gz")):
        common.save_file(Path(args.out) / trace.name, lambda f: f.write(trace.read_bytes()))
        trace.unlink()
    gaps = common.fit_width(rows("gaps", 4), PROFILE_TABLES[0][2][len(profiles) == 1:])   # (one setting: no column)
    print("\n".join(failed) + f"\n{title}\n{table}\n\n{PROFILE_TABLES[0][1]} (the 4 longest each)\n{gaps}\n"
          f"{common.wrote(args.out, f'{NAME}_profile.json and .md (and the kinds of work, the costliest kernels)')}",
          flush=True)


# ---- --setup-memory: each rank's peak host memory while it sets a model up ---------------
# (10's LM on 10's ParallelLM, whole or on meta, beside FSDP2's meta path; --hf-checkpoint
# below: the same from and to a Hugging Face folder, beside torch.distributed.checkpoint)
SETUP_MESHES = (nd.mesh_of(pp=2, fsdp=2, tp=2), nd.mesh_of(fsdp=8))
SETUP_METHODS = ("built whole on every rank", "built on meta, materialize (ours)", "built on meta, torch's (FSDP2)")


def _status_mb(field) -> float:
    """A field of /proc/self/status in MiB (VmRSS: resident now; VmHWM: its peak)."""
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) / 1024 for ln in f if ln.startswith(field + ":"))


def _reset_peak():
    """Start VmHWM again from the resident memory now (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def setup_memory(ctx, args, shape, method, size, steps):
    """One way of setting the LM of ``size`` up on ``shape``, in fresh processes: the peak
    resident memory of each rank from the start of the setup to its end (VmHWM, reset
    first), what the rank then holds, and with ``steps`` that many training steps after it
    (their peak too). Ours: 10's ParallelLM on the whole model, or on a meta-built one then
    ParallelLM.materialize with the LM's init; torch's: on meta, parallelize_module over tp
    (08's baseline), the stage's blocks and the stage fully_shard over fsdp, to_empty on
    the stage, every module's reset_parameters. A row, from the mesh's first rank."""
    dims, levers = common.MODEL_SIZES[size], nd.Levers()
    batch = 2 * levers.m(shape) * shape["dp"] * shape["fsdp"]
    gc.collect()
    start = _status_mb("VmRSS")
    if ctx.device.type == "cuda":   # on a GPU the device's peak too
        torch.cuda.reset_peak_memory_stats(ctx.device)
    _reset_peak()
    began = time.perf_counter()
    if method == SETUP_METHODS[0]:
        whole = nd.lm(dims, args.context_length, False, args.seed, ctx.device)
        model = nd.ParallelLM(nd.Mesh(shape), whole, batch, levers)
    elif method == SETUP_METHODS[1]:
        whole = nd.lm(dims, args.context_length, False, args.seed, "meta")
        blueprint = copy.deepcopy(whole)   # the model as built: its init's order and shapes
        model = nd.ParallelLM(nd.Mesh(shape), whole, batch, levers).materialize(
            ctx.device, placement.initialized(blueprint, seed=args.seed))
        del whole, blueprint
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        whole = nd.lm(dims, args.context_length, False, args.seed, "meta")
        tmesh = init_device_mesh(ctx.device.type, tuple(shape.values()), mesh_dim_names=nd.AXES)
        if shape["tp"] > 1:
            nd.tp_mod.torch_tensor_parallel_lm(whole, tmesh["tp"])
        model = nd.pp_mod.LMStage(whole, tmesh.get_local_rank("pp"), shape["pp"])
        for block in model.blocks.values():
            fully_shard(block, mesh=tmesh["dp", "fsdp"])
        fully_shard(model, mesh=tmesh["dp", "fsdp"])
        model.to_empty(device=ctx.device)
        # (on a CPU mesh each rank's reset_parameters warns that DTensor's random ops lack the
        # GPU's generator tracking: 16 lines a run; this row measures memory, not the values)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
            for mod in model.modules():
                if hasattr(mod, "reset_parameters"):
                    mod.reset_parameters()
        del whole
    gc.collect()
    seconds, peak, now = time.perf_counter() - began, _status_mb("VmHWM"), _status_mb("VmRSS")
    params = model.stage.parameters() if isinstance(model, nd.ParallelLM) else model.parameters()
    held = sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in params) / 2**20
    row = {"mesh": nd.label(shape), "setup": method, "model_size": size, "whole_mib": lm_param_count_mib(size, args),
           "held_mib": held, "start_mib": start, "setup_peak_mib": peak, "above_start_mib": peak - start,
           "after_mib": now, "setup_s": seconds}
    if ctx.device.type == "cuda":
        row["device_peak_mib"] = torch.cuda.max_memory_allocated(ctx.device) / 2**20
    if steps:   # plain SGD: no state beside the weights and their gradients (AdamW's would double them)
        opt = torch.optim.SGD(model.module.parameters(), lr=1e-3)
        _reset_peak()
        began = time.perf_counter()
        for i in range(steps):
            loss = nd.train_step(model, opt, model.part(common.lm_batch(batch, args.context_length, i, args.seed,
                                                                     ctx.device)), common.StepClock(ctx.device))
        row.update(step_s=(time.perf_counter() - began) / steps, step_peak_mib=_status_mb("VmHWM"),
                   loss=loss if loss is not None else float("nan"))
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    out = dict(rows[0])
    for k in ("held_mib", "start_mib", "setup_peak_mib", "above_start_mib", "after_mib", "setup_s", "step_s",
              "step_peak_mib", "device_peak_mib"):
        if k in out:
            out[k] = max(r[k] for r in rows)
    out["ranks_peak_gib"] = sum(r["setup_peak_mib"] for r in rows) / 1024
    if "loss" in out:
        out["loss"] = next((r["loss"] for r in rows if r["loss"] == r["loss"]), float("nan"))
    return out


def lm_param_count_mib(size, args) -> float:
    return common.lm_param_count(size, args.context_length) * 4 / 2**20


def report_setup_memory(args):
    """--setup-memory: the table of SETUP_MESHES x SETUP_METHODS at --model-size, then the
    --big-size model on meta at fsdp 8, set up and trained --big-steps steps."""
    headers = SETUP_HEADERS + (["device_peak_mib"] if args.device == "cuda" else [])
    rows, settings = [], {"backend": args.backend, "device": args.device, "context_length": args.context_length,
                          "model_size": args.model_size, "big_size": args.big_size, "seed": args.seed}

    def show(name, title, rows, headers, note, done=True):   # (saved as each row comes; printed when done)
        if common.is_reporter():
            table = common.save_results(args.out, name, rows, settings, headers=headers, title=title, note=note)
            if done:
                print(f"\n{title}\n{table}\n{common.wrote(args.out, f'{name}.json and .md')}", flush=True)
    runs = [(shape, method) for shape in SETUP_MESHES for method in SETUP_METHODS]
    for i, (shape, method) in enumerate(runs):
        try:
            rows.append(common.launch(setup_memory, args, shape, method, args.model_size, 0,
                                      world_size=math.prod(shape.values())))
        except common.LaunchError as e:
            print(f"setup-memory: SKIP {method} on {nd.label(shape)}: {str(e).splitlines()[0]}")
        done = i == len(runs) - 1
        show("13_setup_memory", f"Each rank's peak host memory while it sets up the {args.model_size} LM "
             f"({lm_param_count_mib(args.model_size, args):.0f} MiB of float32 weights), 8 ranks", rows, headers,
             SETUP_NOTE + common.partial_note(i + 1, len(runs), "setups"), done)
    if args.big_size != "none":
        big = common.launch(setup_memory, args, nd.mesh_of(fsdp=8), SETUP_METHODS[1], args.big_size, args.big_steps,
                            world_size=8)
        whole = lm_param_count_mib(args.big_size, args) / 1024
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        show("13_setup_big", f"The {args.big_size} LM ({whole:.1f} GiB of float32 weights; whole on each of 8 ranks: "
             f"{8 * whole:.0f} GiB, on a machine of {ram:.0f} GiB) built on meta at fsdp 8, then trained "
             f"{args.big_steps} step(s) (SGD)", [big], headers + ["step_s", "step_peak_mib", "loss"],
             SETUP_NOTE)


SETUP_HEADERS = ["mesh", "setup", "held_mib", "setup_peak_mib", "above_start_mib", "after_mib", "ranks_peak_gib",
                 "setup_s"]
SETUP_NOTE = ("held_mib: the parameters the rank holds after the setup; setup_peak_mib: the peak resident memory of "
              "the process from the start of its setup to its end (VmHWM, reset at the start; the largest rank); "
              "above_start_mib: that peak less the process's resident memory at the start (torch imported, the "
              "process group made); ranks_peak_gib: the ranks' peaks summed. Fresh processes for each row. Ours on "
              "meta holds the rank's part plus one module's tensors whole at a time (placement.initialized); torch's is "
              "FSDP2's meta path (to_empty, each module's reset_parameters on its shards), with 08's baseline of "
              "torch's tensor parallelism. On a GPU, device_peak_mib: the device's peak allocated memory during "
              "the setup (max_memory_allocated, reset at its start).")


# ---- --hf-checkpoint: a Hugging Face checkpoint folder in and out, each rank's peak memory --
HF_ROWS = ((nd.mesh_of(pp=2, fsdp=2, tp=2), "ours"), (nd.mesh_of(fsdp=8), "ours"),
           (nd.mesh_of(fsdp=8), "torch's DCP (FSDP2)"))


def write_hf_source(args, folder, files=8):
    """The LM of --model-size, whole in this process, as save_pretrained writes a sharded
    checkpoint: ``files`` safetensors files of about equal bytes and their index."""
    from safetensors.torch import save_file
    model = nd.lm(common.MODEL_SIZES[args.model_size], args.context_length, False, args.seed)
    state = model.state_dict()
    budget = sum(t.numel() * t.element_size() for t in state.values()) / files
    groups, size = [[]], 0
    for name, t in state.items():
        if size >= budget and len(groups) < files:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += t.numel() * t.element_size()
    os.makedirs(folder, exist_ok=True)
    index = {}
    for k, names in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: state[n] for n in names}, os.path.join(folder, file), metadata={"format": "pt"})
        index.update({n: file for n in names})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                   "weight_map": index}, f)
    return max(t.numel() * t.element_size() for t in state.values()) / 2**20


def hf_checkpoint_memory(ctx, args, shape, method, source, out):
    """Set the LM of --model-size up on ``shape`` from the checkpoint folder ``source`` and
    save it to ``out``, in fresh processes: each phase's peak resident memory (VmHWM, reset
    at its start) and time. Ours: built on meta, 10's ParallelLM, load_hf_checkpoint, then
    save_hf_checkpoint; torch's: built on meta, fully_shard per block and on the model,
    to_empty, torch.distributed.checkpoint's load with HuggingFaceStorageReader, then its save
    with HuggingFaceStorageWriter (each rank its shards, consolidated into whole tensors).
    ``method`` "initialized()": the setup from placement.initialized instead (no checkpoint).
    Rows from the mesh's first rank, the largest rank's peak and time."""
    import torch.distributed.checkpoint as dcp
    dims, levers = common.MODEL_SIZES[args.model_size], nd.Levers()
    batch = 2 * levers.m(shape) * shape["dp"] * shape["fsdp"]
    rows = []

    def phase(name, run):
        gc.collect()
        start = _status_mb("VmRSS")
        _reset_peak()
        began = time.perf_counter()
        result = run()
        gc.collect()
        rows.append({"mesh": nd.label(shape), "method": method, "phase": name, "start_mib": start,
                     "peak_mib": _status_mb("VmHWM"), "above_start_mib": _status_mb("VmHWM") - start,
                     "seconds": time.perf_counter() - began})
        return result
    whole = nd.lm(dims, args.context_length, False, args.seed, "meta")
    if method == "torch's DCP (FSDP2)":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        def setup():
            tmesh = init_device_mesh(ctx.device.type, (dist.get_world_size(),), mesh_dim_names=("fsdp",))
            for block in whole.blocks:
                fully_shard(block, mesh=tmesh)
            fully_shard(whole, mesh=tmesh)
            whole.to_empty(device=ctx.device)
            state = whole.state_dict()
            dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(source))
            return whole
        model = phase("load", setup)
        held = sum(p.to_local().numel() * p.element_size() for p in model.parameters()) / 2**20
        phase("save", lambda: dcp.save(model.state_dict(), storage_writer=dcp.HuggingFaceStorageWriter(
            out, save_distributed=True, enable_consolidation=True)))
    else:
        if method == "initialized()":
            blueprint = copy.deepcopy(whole)
            model = phase("set up from initialized()", lambda: nd.ParallelLM(nd.Mesh(shape), whole, batch, levers)
                          .materialize(ctx.device, placement.initialized(blueprint, seed=args.seed)))
        else:
            def load():
                made = nd.ParallelLM(nd.Mesh(shape), whole, batch, levers)
                hfc.load_hf_checkpoint(made.stage, source, ctx.device)
                return made
            model = phase("load", load)
            phase("save", lambda: hfc.save_hf_checkpoint(model.stage, out))
        held = sum(p.numel() * p.element_size() for p in model.stage.parameters()) / 2**20
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (rows, held))
    out_rows = []
    for i, row in enumerate(everyone[0][0]):
        row = dict(row, held_mib=max(h for _, h in everyone))
        for k in ("peak_mib", "above_start_mib", "seconds"):
            row[k] = max(r[i][k] for r, _ in everyone)
        out_rows.append(row)
    return out_rows


def report_hf_checkpoint(args):
    """--hf-checkpoint: the LM of --model-size written as a sharded safetensors folder, then
    set up from it and saved again by each of HF_ROWS (and set up from initialized() on
    the first mesh), 8 ranks; the saved folders checked equal to the source, tensor by
    tensor."""
    work = tempfile.mkdtemp(prefix="hf-checkpoint-")
    try:
        source = os.path.join(work, "source")
        largest = write_hf_source(args, source)
        whole = lm_param_count_mib(args.model_size, args)
        rows, settings = [], {"backend": args.backend, "device": args.device, "model_size": args.model_size,
                              "context_length": args.context_length, "seed": args.seed}
        cases = [*HF_ROWS, (HF_ROWS[0][0], "initialized()")]
        for k, (shape, method) in enumerate(cases):
            out = os.path.join(work, f"saved-{k}")
            got = common.launch(hf_checkpoint_memory, args, shape, method, source, out, world_size=8)
            if method != "initialized()":
                got[-1]["round trip"] = same_tensors(source, out)
            for row in got:
                row.update(whole_mib=whole, part_and_largest_mib=row["held_mib"] + largest)
            rows += got
        if common.is_reporter():
            title = (f"A Hugging Face checkpoint folder in and out: the {args.model_size} LM ({whole:.0f} MiB of "
                     f"float32 weights, 8 safetensors files), 8 ranks")
            headers = ["mesh", "method", "phase", "held_mib", "part_and_largest_mib", "whole_mib", "peak_mib",
                       "above_start_mib", "seconds", "round trip"]
            table = common.save_results(args.out, "13_hf_checkpoint", rows, settings, headers=headers, title=title,
                                        note=HF_NOTE)
            print(f"\n{title}\n{table}\n{common.wrote(args.out, '13_hf_checkpoint.json and .md')}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def same_tensors(a, b) -> str:
    """Whether two checkpoint folders hold the same tensors by name, bit for bit (read by
    the safetensors library, not by the kit's reader)."""
    from safetensors import safe_open
    maps = []
    for folder in (a, b):
        with open(os.path.join(folder, "model.safetensors.index.json")) as f:
            maps.append(json.load(f)["weight_map"])
    left, right = maps
    if set(left) != set(right):
        return f"names differ: {sorted(set(left) ^ set(right))[:3]}"
    for name in left:
        with safe_open(os.path.join(a, left[name]), "pt") as x, safe_open(os.path.join(b, right[name]), "pt") as y:
            if not torch.equal(x.get_tensor(name), y.get_tensor(name)):
                return f"{name} differs"
    return "exact"


HF_NOTE = ("held_mib: the parameters the rank holds; part_and_largest_mib: that plus the largest tensor of the model "
           "(the bound a rank that makes one tensor whole at a time stays under); whole_mib: the model's float32 "
           "weights; peak_mib: the peak resident memory of the process during the phase (VmHWM, reset at its start; "
           "the largest rank), above_start_mib: that less its resident memory at the phase's start (torch imported, "
           "the process group made); seconds: the slowest rank. load: built on meta, the axes applied, filled from "
           "the folder (ours: hf_checkpoint.load_hf_checkpoint, each rank reading its slices; torch's: FSDP2's "
           "to_empty, then torch.distributed.checkpoint.load with HuggingFaceStorageReader); save: written as a "
           "folder from_pretrained reads (ours: save_hf_checkpoint, each tensor gathered whole on its shard groups "
           "and written by the ranks in turn; torch's: HuggingFaceStorageWriter with save_distributed and "
           "enable_consolidation). round trip: the saved folder's tensors against the source's, bit for bit. "
           "Fresh processes for each method.")


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
    generate() continues ``prompt`` greedily: returns the sample's text. The folder must
    load; where transformers' own generate() fails on text alone (Qwen2.5-Omni's thinker
    asks its config for a vision token it does not hold), that is said in its place, and
    the run's row and files are still written (NoSample)."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = auto_class(folder).from_pretrained(folder)
    ids = tok(prompt, return_tensors="pt")
    try:
        out = model.generate(**ids, max_new_tokens=tokens, do_sample=False, pad_token_id=tok.eos_token_id)
    except Exception as e:   # noqa: BLE001 (transformers' generation, not the run's weights)
        raise NoSample(f"none: the folder loads, and transformers' {type(model).__name__}.generate() fails on "
                       f"text ({type(e).__name__}: {e})") from e
    return tok.decode(out[0], skip_special_tokens=True)


class NoSample(Exception):
    """generate() failed in transformers on a folder that loads (sample's)."""


# ---- flags, and what is refused before any worker starts -------------------------------
def parser():
    p = common.KitParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", default=None, help="a Hugging Face model folder (config, safetensors weights, tokenizer); "
                                                 "default: a tiny Llama-style model written in --run-dir's parent")
    p.add_argument("--data", action="append", default=None, metavar="PATH[:WEIGHT]",
                   help="the corpus, again for each source mixed in by weight: a text file or a folder of them, JSON "
                        "lines or Parquet (their --text-field), a folder datasets' save_to_disk wrote (its train "
                        "split); text and JSON lines also .gz, .bz2, .xz, .zst (default: Python's own help text, "
                        "written beside the model)")
    p.add_argument("--text-field", default="text", help="the field (column) holding the text in JSON lines, Parquet, "
                                                        "a datasets folder")
    p.add_argument("--data-cache", default=None, help="where the prepared token shards go (default: a 13_data folder "
                                                      "beside the first --data, or beside --run-dir where that is the "
                                                      "model's folder or cannot be written)")
    p.add_argument("--eval-batches", type=common.COUNT, default=8,
                   help="held-out batches each evaluation averages (the same ones every time)")
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
    p.add_argument("--checkpoint-every", type=common.COUNT, default=None,
                   help="a sharded checkpoint (default 100; on replicas with --faults 10: the replay goes from "
                        "checkpoint to checkpoint)")
    p.add_argument("--checkpoint-async", action="store_true",
                   help="each checkpoint copied to host memory, then written while training goes on")
    p.add_argument("--run-dir", default=str(common.ROOT / "runs" / "13_train"),
                   help="the run's folder: checkpoints, progress, the final model (and the tiny model beside it); "
                        "on several nodes, a folder every node shares (each rank writes its checkpoint pieces there)")
    p.add_argument("--prompt", default="The for statement", help="the sample's start")
    p.add_argument("--sample-tokens", type=common.COUNT, default=40, help="tokens generate() adds to the prompt")
    p.add_argument("--dtype", choices=common.AUTOCAST_DTYPES, default="float32",
                   help="bf16: forward and backward in bf16 autocast (weights, gradients' reduction and optimizer "
                        "state float32); checked against one process under the same autocast")
    p.add_argument("--recompute", action="store_true",
                   help="each decoder layer recomputed in backward (the model's own gradient checkpointing, "
                        "non-reentrant): activation memory for compute")
    p.add_argument("--compile", action="store_true", help="each decoder layer and the loss through torch.compile")
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
                        "alternating: step time, tokens/s, each rank's step peak, a checkpoint save; with --replicas "
                        "N: the replicas' step, a kill -9, its heal and rejoin, ours beside torchft's Manager and "
                        "beside the same mesh as one job")
    p.add_argument("--bench-steps", type=common.COUNT, default=8, help="--bench: measured steps a method")
    p.add_argument("--bench-saves", type=common.COUNT0, default=3,
                   help="--bench: checkpoint saves timed a method, each removed once timed (0: none)")
    p.add_argument("--bench-settings", choices=["both", "given"], default="both",
                   help="--bench: the model as given and one twice as wide and deep (both), or as given only")
    p.add_argument("--profile", action="store_true",
                   help="--bench: one more step of each method under torch.profiler: where its time goes (each "
                        "phase's wall and device-busy time, the device's longest idle stretches and what the host ran "
                        "then, the busy time by kind of work, the costliest kernels) in <out>/13_train_profile."
                        "{json,md}, rank 0's Chrome traces beside it")
    r = p.add_argument_group("replicas that survive a loss (14's ReplicaManager around the mesh; docs/13)")
    r.add_argument("--replicas", type=common.COUNT, default=1,
                   help="data-parallel replicas of the mesh, each its own job: a lost one is left out of the next "
                        "step and a replacement heals from a live peer (this command starts the coordinator and "
                        "every replica; under torchrun: --coordinator, then one torchrun job a replica with --join)")
    r.add_argument("--join", default=None, metavar="HOST:PORT",
                   help="run as the ranks of one replica (one torchrun job a replica), joining the coordinator there")
    r.add_argument("--replica-id", type=common.COUNT0, default=None, help="--join: this replica's number, below "
                                                                          "--replicas (its batches)")
    r.add_argument("--torchft", action="store_true",
                   help="--join: HOST:PORT is torchft's lighthouse, and this replica runs under torchft's Manager (a "
                        "Manager on each rank, as torchtitan runs it; --bench on replicas runs it beside ours)")
    r.add_argument("--coordinator", action="store_true",
                   help="run the coordinator alone (14's, with its flags: --host, --port, --run-dir, --min-replicas, "
                        "--detect, --join-timeout, --log-every)")
    ft.add_waits(r)
    r.add_argument("--replay", default=None, metavar="RUN_DIR",
                   help="with --model and --data (the rest from the run's record): replay the committed "
                        "steps of a run on replicas (torchrun's: its coordinator's record.jsonl and the replicas' "
                        "checkpoints in RUN_DIR) in one process, from checkpoint to checkpoint, against its final folder")
    r.add_argument("--faults", action="store_true",
                   help="--replicas 3 or more: the run goes through 14's failures (kill -9 of a replica, its heal's "
                        "source killed midway, a SIGSTOP, two replicas killed at once at five points of a step) and "
                        "stops 3 steps after them (--steps: at most), then every committed step is replayed in one "
                        "process")
    r.add_argument("--pace-ms", type=common.number(float, lo=0), default=None,
                   help="on replicas: a step takes at least this long (default 0; 200 with --faults, so that a "
                        "replacement, which starts in seconds, finds the run still going)")
    p.add_argument("--incarnation", type=common.COUNT0, default=0, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--parent", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--fault-at", default=None, help=argparse.SUPPRESS)   # STEP:RANK: that rank kill -9s itself there
    p.add_argument("--room", type=int, default=None, help=argparse.SUPPRESS)   # bytes a rank has for the check
    add_measure_flags(p)
    p.set_defaults(attention="sdpa")   # (main: attention_of the model)
    return p


def add_measure_flags(p, own=False):
    """--setup-memory and --hf-checkpoint: measurements of setting a model up on 8 ranks,
    each with flags of its own (``own``: those, for their parser; else named only)."""
    given = "" if own else " (its own flags: 13_train.py --setup-memory --help)"
    p.add_argument("--setup-memory", action="store_true",
                   help="instead of a run: each rank's peak host memory while it sets 10's LM of --model-size up on "
                        "pp 2 x fsdp 2 x tp 2 and on fsdp 8, built whole or on meta (ours, and torch's FSDP2), then "
                        "--big-size built on meta at fsdp 8 and trained --big-steps steps" + given)
    p.add_argument("--hf-checkpoint", action="store_true",
                   help="instead of a run: 10's LM of --model-size written as a sharded safetensors folder, set up from "
                        "it and saved again on pp 2 x fsdp 2 x tp 2 and fsdp 8 (ours) and with "
                        "torch.distributed.checkpoint's HuggingFaceStorageReader/Writer on FSDP2: each rank's peak "
                        "host memory and the time" + given)
    if own:
        p.add_argument("--big-size", choices=[*common.MODEL_SIZES, "none"], default="large",
                       help="--setup-memory: the model too large to build whole on every rank (none: skip it)")
        p.add_argument("--big-steps", type=common.COUNT, default=1, help="--setup-memory: --big-size's training steps")


def measure(argv):
    """--setup-memory or --hf-checkpoint, with their own flags (10's LM, 8 ranks)."""
    p = common.script_parser(__doc__, cpu_size="medium", gpu_size="medium", world="8, the measurements' meshes")
    add_measure_flags(p, own=True)
    p.set_defaults(context_length=32)
    args = common.parse(p, argv, world=lambda a: 8, batch_unit=lambda a: None)
    if args.setup_memory and args.hf_checkpoint:
        raise common.UsageError("--setup-memory and --hf-checkpoint are two measurements: give one")
    args.doing = "a Hugging Face folder in and out" if args.hf_checkpoint else "each rank's memory while it sets up"
    return report_hf_checkpoint(args) if args.hf_checkpoint else report_setup_memory(args)


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
    if args.profile and (not args.bench or args.replicas > 1):
        raise common.UsageError("--profile profiles --bench's steps on one job: add --bench" if not args.bench else
                                "--profile with --replicas: it profiles --bench's steps on one job (no --replicas)")
    check_replicas(args, world)
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
        args.data = args.data or [str(data)]
    model = Path(args.model)
    missing = missing_libraries()
    if missing:
        raise common.UsageError(missing)
    if not (model / "config.json").exists():
        raise common.UsageError(f"--model {model}: no config.json there (a folder save_pretrained wrote)")
    if not (model / "model.safetensors").exists() and not (model / "model.safetensors.index.json").exists():
        raise common.UsageError(f"--model {model}: no weights there (model.safetensors or its index)")
    if not any(n.startswith("tokenizer") for n in os.listdir(model)):
        raise common.UsageError(f"--model {model}: no tokenizer there (tokenizer.json and its config)")
    if args.data is None:
        raise common.UsageError("--data: the text to train on (with --model)")
    try:
        sources = corpus.parse_sources(args.data, args.text_field)
        corpus.check_sources(sources)
    except corpus.CorpusError as e:
        raise common.UsageError(str(e)) from None
    args.data_label = ", ".join(corpus.label(d, s) for d, s in zip(args.data, sources))
    config = json.loads((model / "config.json").read_text())
    check_mesh_fits(config.get("text_config") or config, sizes, args)   # (a multimodal model's: its text's)
    args.attention, meta = attention_of(model)   # (meta: no memory)
    if sizes["cp"] > 1 and (why := cp_problem(meta, config, args.attention, args.context_length)):
        raise common.UsageError(why)
    if sizes["pp"] > 1 and not pp.pipeline_plan(meta):
        raise common.UsageError(f"{config.get('model_type')} ships no pipeline plan, and none can be read from it "
                                f"(one list of its decoder layers, and its forward's source): --pp needs one")
    if sizes["tp"] > 1 and not args.plan and (why := tp_plan_problem(meta)):
        raise common.UsageError(why)
    args.n_params = sum(p.numel() for p in meta.parameters())
    args.flops_per_token = train_flops_per_token(meta, args.context_length)
    if sizes["pp"] > 1:   # (what every rank's stage would refuse, refused here: on meta, the model used up)
        try:
            pp.ModelStage(meta, 0, sizes["pp"], args.chunks)
        except ValueError as e:
            raise common.UsageError(f"--pp: {e}") from None
    del meta
    cache = Path(args.data_cache) if args.data_cache else data_cache(sources[0], model, run_dir)
    say = (lambda line: print(line, flush=True)) if common.is_reporter() else (lambda line: None)
    try:   # (every core, once; under torchrun every rank asks, one prepares, the others wait for it)
        args.corpus = corpus.prepare(sources, str(model), str(cache), say=say)
        reader = corpus.Reader(args.corpus, args.context_length, args.batch_size, args.seed)
    except (corpus.CorpusError, OSError) as e:
        raise common.UsageError(str(e)) from None
    try:
        reader.check()
    except corpus.CorpusError as e:   # a corpus too small to train on leaves nothing behind
        corpus.remove(args.corpus)
        raise common.UsageError(str(e)) from None
    args.fingerprint = hashlib.sha256(json.dumps({k: v for k, v in config.items() if k != "transformers_version"},
                                                 sort_keys=True).encode()).hexdigest()[:16]
    ckpts = (run_dir / f"replica-{args.replica_id}" if args.join else run_dir) / "checkpoints"
    latest = sharded_checkpoint.latest_checkpoint(str(ckpts)) if ckpts.exists() else None
    if args.replicas > 1 and not args.join:   # (each replica's own checkpoint: its job looks)
        latest = None
        record = run_dir / "record.jsonl"
        if record.is_file() and not args.replay and ft.read_record(record)[2] is not None:
            raise common.UsageError(f"the run on replicas recorded in {record} is over (its final folder in "
                                    f"{run_dir / 'final'}): give another --run-dir for another run")
    if latest:
        meta = json.loads((Path(latest) / "metadata.json").read_text())
        saved = (meta.get("extra") or {}).get("model")
        if saved != args.fingerprint:
            raise common.UsageError(f"{latest} is a checkpoint of another model (its config differs from "
                                    f"{model}'s): give another --run-dir, or remove it")
        args.resume_from = f"resumed from step {meta['step']} ({latest})"
        if meta["step"] >= args.steps:   # (the folder and the table are still made, from the checkpoint)
            args.resume_from += (f": --steps {args.steps} already reached, nothing left to train (give more --steps, "
                                 f"or another --run-dir to start again)")
    return sizes, reader


def check_replicas(args, world: int):
    """--replicas, --join and --faults against each other and the ranks (one line, exit 2)."""
    if args.replay is not None:
        if args.join:
            raise common.UsageError("--replay RUN_DIR and --join: a process replays a run or is a replica's rank")
        args.replicas = max(args.replicas, 2)   # (the record's, below)
        if not (Path(args.replay) / "record.jsonl").is_file():
            raise common.UsageError(f"--replay {args.replay}: no record.jsonl there (the coordinator writes it in its "
                                    f"--run-dir)")
        args.run_dir, args.no_verify = args.replay, True
        return
    if args.join is None:
        if args.replica_id is not None:
            raise common.UsageError("--replica-id applies to --join (a replica's ranks)")
        if args.replicas > 1 and common.under_torchrun():
            raise common.UsageError(f"--replicas {args.replicas} under torchrun: a replica is a torchrun job of its "
                                    f"own: start the coordinator (13_train.py --coordinator --run-dir R), then each "
                                    f"replica with --join HOST:PORT --replica-id N")
        if args.replicas > 1:   # (this command starts them all: their ranks share the machine)
            common.check_ranks(args.replicas * world, args.backend or "gloo", f"--replicas {args.replicas} x the mesh "
                                                                              f"{mesh_label({a: getattr(args, a) for a in AXES})}")
    else:
        ft.check_join(args)
        args.no_verify = True   # (a replica's job: the run's replay checks its steps, --replay for torchrun's)
        if args.replicas < 2:
            raise common.UsageError("--join needs --replicas N: the run's number of replicas (2 or more; each "
                                    "replica's batches are its share of the corpus's)")
        if args.replica_id >= args.replicas:
            raise common.UsageError(f"--replica-id {args.replica_id}: the run's replicas are 0 to {args.replicas - 1} "
                                    f"(--replicas {args.replicas})")
    if args.bench and (args.join or args.faults):
        raise common.UsageError(f"--bench {'--join' if args.join else '--faults'}: the benchmark starts its replicas "
                                f"itself, and kills one (--bench --replicas N)")
    if args.torchft and not args.join:
        raise common.UsageError("--torchft applies to --join (a replica's ranks, HOST:PORT torchft's lighthouse); "
                                "--bench --replicas N runs torchft beside ours")
    if args.faults and (args.join or args.replicas < 3):
        raise common.UsageError("--faults: the run loses two replicas at once and needs a third to go on: --replicas "
                                "3 or more, started by this command (not --join)")
    args.pace_ms = args.pace_ms if args.pace_ms is not None else 200.0 if args.faults else 0.0
    args.checkpoint_every = args.checkpoint_every or (10 if args.faults else 100)


def check_mesh_fits(config: dict, sizes: dict, args):
    """The mesh against the model's config: heads and key/value heads for tp, layers for
    pp (and its chunks), experts for ep; a family with no tp plan needs --plan."""
    T, P = sizes["tp"], sizes["pp"]
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads") or config.get("num_attention_heads")
    if T > 1:
        if not config.get("base_model_tp_plan") and not _class_has_plan(config, "base_model_tp_plan") and not args.plan:
            raise common.UsageError(f"{config.get('model_type')} ships no tensor-parallel plan: give --plan FILE "
                                    f"(a JSON plan in 08's words) for --tp")
        inner = config.get("intermediate_size")   # (Gemma 3n's: a list, a size a layer)
        inners = [(f"intermediate size (layer {i})", m) for i, m in enumerate(inner)] if isinstance(inner, list) \
            else [("intermediate size", inner)]
        own = [(f"{what} (layer {i})", n) for i, values in sorted((config.get("per_layer_config") or {}).items(),
                                                                   key=lambda kv: int(kv[0]))   # (Gemma 4's layers
               for key, what in (("num_attention_heads", "attention heads"),                 # of full attention)
                                 ("num_key_value_heads", "key/value heads"), ("intermediate_size", "intermediate size"))
               if isinstance(n := values.get(key), int)]
        for what, n in [("attention heads", heads), ("key/value heads", kv), *inners, *own]:
            if n and n % T:
                raise common.UsageError(f"--tp {T} does not divide the model's {n} {what}")
    layers = config.get("num_hidden_layers")
    if P > 1:
        if layers and P * args.chunks > layers:
            raise common.UsageError(f"--pp {P} x --chunks {args.chunks} stages for the model's {layers} layers: at "
                                    f"most one stage a layer")
    if args.ep > 1:
        experts = next((config[k] for k in EXPERT_COUNTS if config.get(k)), None)
        if not experts:
            raise common.UsageError("--ep: the model has no experts of its own")
        if experts % args.ep:
            raise common.UsageError(f"--ep {args.ep} does not divide the model's {experts} experts")


# the names families give their count of routed experts (Ernie 4.5's the last)
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _class_has_plan(config: dict, attr: str) -> bool:
    import transformers
    try:
        cfg = transformers.AutoConfig.for_model(config.get("model_type"))
    except (ValueError, KeyError):   # (a text config saved without its model_type)
        return False
    return bool(getattr(cfg, attr, None))


def mesh_label(sizes: dict, ep: int = 1) -> str:
    label = " x ".join(f"{a} {n}" for a, n in sizes.items() if n > 1) or "one rank"
    return f"{label} (its experts at ep {ep})" if ep > 1 else label


def main(argv=None):
    given = sys.argv[1:] if argv is None else list(argv)
    if "--setup-memory" in given or "--hf-checkpoint" in given:
        return measure(given)
    if "--coordinator" in given:   # the quorum service alone: 14's, its record in 13's run folder
        return ft.main(given + ([] if "--run-dir" in given else ["--run-dir", str(common.ROOT / "runs" / NAME)]))
    args = parser().parse_args(argv)
    sizes, reader = check(args)
    if args.join:
        return run_replica(args, sizes)
    if args.replay:
        return replay_run(args, sizes)
    if common.is_reporter():
        train_n, held_n = (sum(s[k] for s in reader.sources) for k in ("train", "held"))
        ranks = (f"{args.replicas} replicas of {args.world_size} rank(s), " if args.replicas > 1
                 else f"{args.world_size} x ")
        print(f"{args.model} on {mesh_label(sizes, args.ep)} ({ranks}{args.backend}/{args.device}): "
              f"{args.data_label}: {reader.tokens:,} tokens, {train_n:,} to train on, {held_n:,} held out "
              f"({args.eval_batches} evaluation batches of {args.batch_size} x {args.context_length})", flush=True)
    if common.is_reporter() and getattr(args, "resume_from", None):
        print(args.resume_from, flush=True)
    if args.bench and args.replicas > 1:
        return bench_replicas(args, sizes, given)
    if args.bench:
        report_bench(args, sizes)
        return
    if not args.no_verify:
        r = common.launch(verify, args, sizes)
        if "skipped" in r:
            print(f"  SKIP  the check against one process: {r['skipped']}", flush=True)
        else:
            off = f" ({', '.join(r['random_off'])} off in both: drawn at random)" if r["random_off"] else ""
            common.check_verification({f"first {args.verify_steps} steps against one process{off}": r},
                                      f"{NAME} on {mesh_label(sizes, args.ep)}")
    if args.replicas > 1:
        return run_replicas(args, sizes, given)
    result = common.launch(train, args, sizes)
    if not common.is_reporter():
        return
    summarize(args, sizes, result, NAME)


def summarize(args, sizes, result, name):
    """The sample from the saved folder, the run's row and its files in --out."""
    evals = [r for r in result["history"] if "eval" in r]
    hist = [r for r in result["history"] if "loss" in r]
    try:
        text = sample(Path(result["final"]), args.prompt, args.sample_tokens)
        said = repr(text)
    except NoSample as e:
        text = said = str(e)
    print(f"final weights sha256 {result['sha256']}\n{common.wrote(result['final'])} (from_pretrained loads it)\n"
          f"sample: {said}", flush=True)
    reached = max((r["step"] for r in result["history"]), default=0)   # (a resumed run's may be past --steps)
    row = {"mesh": mesh_label(sizes, args.ep), "steps": reached, "first loss": hist[0]["loss"] if hist else None,
           "last loss": hist[-1]["loss"] if hist else None, "first eval": evals[0]["eval"] if evals else None,
           "last eval": evals[-1]["eval"] if evals else None,
           "tokens/s": round(args.batch_size * args.context_length / (sum(r["seconds"] for r in hist) / len(hist)))
           if hist else None}
    for plot in ("loss", "timeline"):   # the loss plot (and on replicas their timeline) beside the summary
        path = Path(args.run_dir) / f"{plot}.png"
        if path.exists() and (plot == "loss" or args.replicas > 1):
            common.save_file(Path(args.out) / f"{name}_{plot}.png", lambda f: f.write(path.read_bytes()))
    if args.replicas > 1:
        row = {"replicas": args.replicas, **row}
    table = common.save_results(args.out, name, [row], {"model": args.model, "data": args.data,
                                                        "context": args.context_length, "batch": args.batch_size,
                                                        "device": args.device, "backend": args.backend,
                                                        "world_size": args.world_size, "replicas": args.replicas},
                                title=TITLE, extra={"sample": text, "sha256": result["sha256"]})
    print(f"\n{TITLE}\n{table}\n{common.wrote(args.out, f'{name}.json and .md')}", flush=True)


# ---- on replicas: this command's launcher, a replica's job, the replay ---------------------
def run_replica(args, sizes):
    """--join: this process is a rank of one replica (torchrun's, or the launcher's); its
    first rank prints where the replica ended, or the one line of why it stopped."""
    if args.parent:
        common._watch_parent(args.parent)   # the launcher gone: so is this replica
    if not common.under_torchrun() and not args.torchft:   # (its ranks spawned here: whether anything answers,
                                                            # asked once first)
        try:
            ft.connect(args.join, args.connect_wait).close()
        except ft.NotJoined as e:
            raise common.UsageError(f"replica {args.replica_id}: {e}") from None
    try:
        out = common.launch(train, args, sizes)
    except ft.ReplicaStopped as e:
        return ft.stopped(e, __file__, args.replica_id)
    if out is None:
        return
    print(f"{ft.done_line(args.replica_id, out)}; weights sha256 {out['sha256']}; the final folder "
          f"{'written to ' + out['final'] if out['final'] else 'written by another replica'}", flush=True)


def run_replicas(args, sizes, given):
    """--replicas N: the coordinator (here, its record in --run-dir) and N replicas of the
    mesh, each its own job started again when a rank of it dies or it hangs (14's Launcher),
    their lines printed as they come; with --faults, 14's failures on the way. Then (unless
    --no-verify) every committed step replayed in one process, the membership timeline, and
    the run's summary."""
    n, run_dir = args.replicas, Path(args.run_dir)
    record = run_dir / "record.jsonl"
    phases = ft.verification_phases(n) if args.faults else []   # (the last: the run stops 3 steps after them)
    argv = replica_argv(args, given)
    began = time.time()
    say = lambda line: print(f"coordinator [{time.time() - began:7.1f} s] {line}", flush=True)   # noqa: E731
    run = ft.run_scenario(args, n, args.world_size, phases, deadline=math.inf, work=run_dir / "replicas",
                          script=__file__, argv=argv, record=record, say=say, echo=True)
    tl = ft.timeline(run, n)
    ft.print_timeline(tl, run["acted"])
    if len(run["acted"]) < len(phases):   # (--steps ran out first)
        raise common.LaunchError(f"--faults: only {len(run['acted'])} of the scenario's {len(phases) - 1} failures "
                                 f"happened before --steps {args.steps} ran out (a replacement starts in seconds): "
                                 f"give more --steps or a longer --pace-ms")
    ft.draw_timeline(tl, run["acted"], run_dir / "timeline.png",
                     f"{n} replicas of {Path(args.model).name} on {mesh_label(sizes, args.ep)}: membership by "
                     f"committed step")
    result = next((r for r in run["records"].values() if r.get("final")), None)
    if result is None:
        raise common.LaunchError(f"no replica wrote the final folder (records: {sorted(run['records'])})")
    digests = {r: rec["sha256"] for r, rec in run["records"].items() if rec["step"] == result["step"]}
    if not args.no_verify:
        _, done, _ = ft.committed_steps(record)
        check = replay_replicas(args, done, Path(result["final"]))
        check["ok"] = check["ok"] and len(set(digests.values())) == 1
        common.check_verification({f"{len(done)} committed steps replayed in one process in {len(check['stretches'])} "
                                   f"stretches from checkpoint to checkpoint, the last against the final folder "
                                   f"({sum(tl['cells'][r].count('healed') for r in tl['cells'])} heals; the "
                                   f"{len(digests)} replicas at the last step alike: {len(set(digests.values())) == 1})"
                                   f"{replay_words(check)}":
                                   check}, f"{NAME} on {n} replicas of {mesh_label(sizes, args.ep)}")
    summarize(args, sizes, result, NAME + "_replicas")


def replica_argv(args, given, *extra):
    """What a replica's ranks run (the launcher's argv(r, incarnation, address, work)): this
    command's flags less the launcher's own, then the replica's (``extra``: more, last)."""
    own, skip, kept = {"--faults", "--bench"}, {"--bench-steps", "--bench-settings", "--bench-saves"}, []
    it = iter(given)
    for g in it:
        if g in skip:
            next(it, None)
        elif g not in own and g.split("=")[0] not in skip:
            kept.append(g)

    def argv(r, incarnation, address, work):
        return [*kept, "--join", address, "--replica-id", str(r), "--incarnation", str(incarnation), "--parent",
                str(os.getpid()), "--result", str(work / f"replica-{r}.pt"), "--pace-ms", str(args.pace_ms),
                "--checkpoint-every", str(args.checkpoint_every), "--no-verify", *extra]
    return argv


# ---- --bench on replicas: ours beside torchft's Manager and beside the mesh as one job -----
def plain_steps(ctx, args, sizes):
    """The replicas' mesh as one job (its dp times --replicas, the replicas' batches at once):
    train()'s step without a quorum, the slowest rank's seconds a step."""
    data = corpus.Reader(args.corpus, args.context_length, args.batch_size, args.seed)
    run = on_mesh(ctx, args, sizes, args.model)
    opt = adamw(run.module.parameters(), args)
    times = []
    for i in range(ft.BENCH_WARM + args.bench_steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        x, y = (t.to(ctx.device) for t in data.batch_of(i, run.rows(args.batch_size)))
        run.mean_over_mesh(run.train_step(x, y, args.accumulate, shared=True))
        placement.clip_grad_norm_(run.stage, args.clip)
        opt.step()
        common.sync(ctx.device)
        times.append(time.perf_counter() - t0)
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, times)
    return [max(t[i] for t in everyone) for i in range(len(times))][ft.BENCH_WARM:]


def all_in_times(record: dict, n: int) -> list:
    """A replica's step seconds where every replica was in, from its record's history."""
    return [row["seconds"] for row in record["history"] if "seconds" in row and len(row.get("replicas", ())) == n]


def torchft_replicas(args, sizes, given, base: Path) -> dict:
    """torchft's side: its lighthouse here (on loopback; --detect its heartbeat timeout,
    --join-timeout its join timeout), --replicas jobs of the mesh, each rank under its own
    Manager (--join LIGHTHOUSE --torchft); once replica 0 has BENCH_WARM + --bench-steps
    steps with every replica in, replica n-1's last rank killed (kill -9), its job ended and
    started again at once, as our launcher does; then a stop two steps on."""
    from torchft.coordination import LighthouseServer
    n, run_dir, work = args.replicas, base / "torchft", base / "torchft" / "replicas"
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=int(args.join_timeout * 1000),
                                  heartbeat_timeout_ms=int(args.detect * 1000))
    address = "127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]
    work.mkdir(parents=True, exist_ok=True)
    job = ft.Launcher(args, work, n, args.world_size, script=__file__, address=address,
                      argv=replica_argv(args, given, "--run-dir", str(run_dir), "--steps", str(args.steps), "--torchft"))
    logs = lambda r, k=0: ft._torchft_log(run_dir / f"replica-{r}" / f"torchft-{k}.jsonl")   # noqa: E731
    commits = lambda r, after=0.0, k=0: [e for e in logs(r, k) if e.get("commit") and e["t"] > after]   # noqa: E731

    def wait_for(cond, what):
        deadline = time.time() + REPLICAS_BENCH_DEADLINE
        while not cond():
            for r, procs in job.procs.items():
                if any(p.exitcode not in (None, 0) for p in procs) and not (r == n - 1 and not restarted):
                    raise common.LaunchError(f"torchft's replica {r} ended (exit codes {[p.exitcode for p in procs]}) "
                                             f"waiting for {what}:\n{job.tail(12)}")
            if time.time() > deadline:
                raise common.LaunchError(f"torchft's replicas: no {what} in {REPLICAS_BENCH_DEADLINE:.0f} s:\n{job.tail(12)}")
            time.sleep(0.05)
    restarted = True
    try:
        for r in range(n):
            job.start(r)
        wait_for(lambda: sum(e["n"] == n for e in commits(0)) >= ft.BENCH_WARM + args.bench_steps,
                 "steps with every replica")
        restarted, victim = False, job.procs[n - 1][-1]
        killed = time.time()
        os.kill(victim.pid, signal.SIGKILL)
        victim.join()
        job.end(n - 1, "killed")   # (the rest of its job, as our launcher ends a replica whose rank died)
        for k in range(args.world_size):
            (run_dir / f"replica-{n - 1}" / f"torchft-{k}.jsonl").unlink(missing_ok=True)
        job.start(n - 1)
        restarted = True
        wait_for(lambda: commits(0, killed) and commits(n - 1), "a commit of the replica started again")
        joiner = [logs(n - 1, k) for k in range(args.world_size)]
        heals = [e["heal"] for log in joiner for e in log if "heal" in e]
        (run_dir / "stop").write_text(str(max(e["step"] for e in logs(0) if "step" in e) + 3))
        for r in range(n):
            for p in job.procs[r]:
                p.join(max(1.0, REPLICAS_BENCH_DEADLINE - (time.time() - killed)))
        if any(p.exitcode != 0 for procs in job.procs.values() for p in procs):
            raise common.LaunchError(f"torchft's replicas did not end at the stop:\n{job.tail(12)}")
        times = all_in_times(torch.load(work / "replica-0.pt", weights_only=False), n)
        rank0 = next((e["heal"] for e in joiner[0] if "heal" in e), None)
        return {"torchft_step_ms": round(statistics.median(times[ft.BENCH_WARM:ft.BENCH_WARM + args.bench_steps])
                                         * 1000, 2),
                "torchft_kill_to_commit_s": round(commits(0, killed)[0]["t"] - killed, 3),
                "torchft_heal_s": round(max(h["s"] for h in heals), 4) if heals else None,
                "torchft_heal_MB": round(rank0["bytes"] / 1e6, 2) if rank0 else None,
                "torchft_rejoin_to_commit_s": round(commits(n - 1)[0]["t"] - joiner[0][0]["hello"], 3)}
    finally:
        job.close()
        lighthouse.shutdown()


def bench_replicas(args, sizes, given):
    """--bench --replicas N: on the model and mesh given, N replicas of it three ways, each
    its own run on the same batches: the mesh as one job (its dp x N: no fault tolerance),
    ours (the coordinator, 14's ReplicaManager) and torchft's Manager (where torchft is
    installed: make torchft-bench); for each, the step with every replica in (after
    BENCH_WARM), and for the two that survive a loss: kill -9 of replica N-1's last rank to
    the next committed step, the replacement's heal (seconds, a rank's MB) and its hello to
    its first committed step. A row each, <out>/13_train_replicas_bench.{json,md}."""
    n, base = args.replicas, Path(args.run_dir) / "bench-replicas"
    shutil.rmtree(base, ignore_errors=True)
    args.pace_ms, args.checkpoint_every, args.steps = 0.0, 10**6, 10**6   # (the scenario stops the run)
    missing = ft.torchft_missing()
    if missing:
        print(f"benchmark: SKIP torchft's Manager: {missing}; ours and the mesh as one job only", flush=True)
    one = argparse.Namespace(**{**vars(args), "batch_size": args.batch_size * n, "world_size": args.world_size * n})
    plain = statistics.median(common.launch(plain_steps, one, {**sizes, "dp": sizes["dp"] * n})) * 1000
    print(f"benchmark: the mesh as one job ({mesh_label({**sizes, 'dp': sizes['dp'] * n}, args.ep)}): "
          f"{plain:.1f} ms a step", flush=True)
    run = ft.run_scenario(args, n, args.world_size, ft.bench_phases(n, args.bench_steps), deadline=REPLICAS_BENCH_DEADLINE,
                          work=base / "ours" / "replicas", script=__file__, record=base / "ours" / "record.jsonl",
                          argv=replica_argv(args, given, "--run-dir", str(base / "ours"), "--steps", str(args.steps)))
    got = ft.bench_row(args, n, {**run, "records": {0: {"times": all_in_times(run["records"][0], n)}}}, plain)
    mesh = mesh_label(sizes, args.ep)
    one_job = mesh_label({**sizes, "dp": sizes["dp"] * n}, args.ep)
    rows = [{"method": "one job", "step_ms": round(plain, 2),
             "vs_one_job": 1.0, **dict.fromkeys(("kill_to_commit_s", "heal_s", "heal_MB", "rejoin_to_commit_s"), "")},
            {"method": "ours", "step_ms": got["ours_step_ms"], "vs_one_job": got["vs_ddp"],
             **{k: got[k] for k in ("kill_to_commit_s", "heal_s", "heal_MB", "rejoin_to_commit_s")}}]
    print(f"benchmark: ours: {got['ours_step_ms']} ms a step, kill -9 to a commit {got['kill_to_commit_s']} s, "
          f"heal {got['heal_s']} s", flush=True)
    if not missing:
        theirs = torchft_replicas(args, sizes, given, base)
        rows.append({"method": "torchft", "step_ms": theirs["torchft_step_ms"],
                     "vs_one_job": round(theirs["torchft_step_ms"] / plain, 3),
                     **{k: theirs["torchft_" + k] for k in ("kill_to_commit_s", "heal_s", "heal_MB",
                                                             "rejoin_to_commit_s")}})
    settings = {"model": args.model, "mesh": mesh, "replicas": n, "one_job": one_job, "batch": args.batch_size,
                "context": args.context_length, "bench_steps": args.bench_steps, "detect_s": args.detect,
                "device": args.device, "backend": args.backend}
    title = (f"13's run on {n} replicas of {mesh} that survive a loss: ours beside "
             f"{'' if missing else 'torchft' + chr(39) + 's Manager and beside '}one job ({one_job})")
    table = common.save_results(args.out, f"{NAME}_replicas_bench", rows, settings, title=title,
                                note=REPLICAS_BENCH_NOTE)
    print(f"\n{title}\n{table}\n{common.wrote(args.out, f'{NAME}_replicas_bench.json and .md')}", flush=True)
    if common.is_reporter():
        shutil.rmtree(base, ignore_errors=True)


REPLICAS_BENCH_DEADLINE = 600.0   # seconds each of the benchmark's waits may take before it ends the run
REPLICAS_BENCH_NOTE = (
    "Three runs of the same model and mesh, each replica on its own batches (batch i x N + r at step i, as the run on "
    "replicas trains). step_ms: one job: the replicas' mesh as one job, its dp times N (no fault tolerance: a step's "
    "floor), the slowest rank's; ours: replica 0's step with every replica in (the quorum, forward and backward on "
    "its mesh, each rank's all-reduce with the same rank of the others, the vote, clip, AdamW); torchft: the same "
    "under torchft's Manager on each rank (its quorum beside the forward, manager.allreduce of the rank's gradients, "
    "should_commit); the median of --bench-steps after 5 warm-up; vs_one_job: over the one job's. "
    "kill_to_commit_s: from the kill -9 of replica N-1's last rank (ours: from the quorum that handed it out) to the "
    "next committed step; heal_s: the replacement's slowest rank's transfer from its peer (its slices of the weights "
    "and AdamW's state; heal_MB: rank 0's); rejoin_to_commit_s: from the replacement's hello (before its quorum "
    "manager starts) to its first committed step (torchft's replacement sits out the step it heals in). torchft: its "
    "lighthouse here on loopback, --detect its heartbeat timeout, --join-timeout its join timeout, its timeouts those "
    "of 14's benchmark (gloo 5 s, heal 10 s, Manager 30 s).")


def replay_run(args, sizes):
    """--replay RUN_DIR: a run on replicas (torchrun's) replayed in one process from its
    record and checkpoints, against its final folder."""
    run_dir = Path(args.run_dir)
    settings, done, final = ft.committed_steps(run_dir / "record.jsonl")
    if settings and settings.get("model") != args.fingerprint:
        raise common.UsageError(f"--replay {run_dir}: its run trained another model (its config differs from "
                                f"{args.model}'s)")
    for k, v in (settings or {}).items():   # (the run's hyperparameters, batches and seed: the record's)
        if k not in ("model", "mesh"):
            setattr(args, k, v)
    if final is None or not (run_dir / "final" / "config.json").is_file():
        raise common.UsageError(f"--replay {run_dir}: the run there has not ended (no final folder): replay it once its "
                                f"replicas are done")
    check = replay_replicas(args, done, run_dir / "final")
    common.check_verification({f"{len(done)} committed steps replayed in one process in {len(check['stretches'])} "
                               f"stretches from checkpoint to checkpoint, the last against the final folder (written "
                               f"by replica {final['replica']} at step {final['step']}){replay_words(check)}": check},
                              f"{NAME} replay of {run_dir}")


REPLAY_NUDGE, REPLAY_FLOORS = 1e-7, 8   # the floor's twin: weights x (1 + about 1e-7); a stretch passes within 8


def replay_words(check) -> str:
    """The replay's stretches past float32's horizon, in words (empty where none)."""
    if not check["beyond"]:
        return ""
    spans = ", ".join(f"steps {a}-{b} (floor {f:.1e})" for a, b, f in check["beyond"])
    return (f"; past float32's horizon, judged within {REPLAY_FLOORS} floors of a twin nudged by {REPLAY_NUDGE:g}: "
            f"{spans} (a checkpoint more often, --checkpoint-every, checks such a stretch within 1e-4)")


def replay_replicas(args, schedule, final: Path) -> dict:
    """The run's committed steps in one process: at each, the gradients of every member's
    batch (batch step x --replicas + r, the replica's RNG seed), averaged, clipped by the
    global norm, AdamW at the step's learning rate. From checkpoint to checkpoint (any
    replica's: at a committed step every live replica holds the same state): each stretch
    starts from the run's state at its first step (the folder's weights at step 0) and
    ends compared with the run's state at its last (the next checkpoint; the final folder).
    float32's reordering (the mesh's sums against one process's) grows chaotically over
    many steps, fastest where one replica trains alone: 4e-5 after 150 steps of three
    replicas here, 3e-2 after 150 with the failures, where stretches of 10 steps stay
    within 2e-6; a wrong step moves weights by about the learning rate. A stretch 1e-4
    apart or more is replayed again from weights nudged by float32's rounding
    (REPLAY_NUDGE): how far the nudged twin ends from the replay is the stretch's floor. A
    stretch whose floor is below 1e-4 had a wrong step; one past float32's horizon (its
    floor above) passes within REPLAY_FLOORS floors, and the result names it ("beyond":
    checked only that far)."""
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    data = corpus.Reader(args.corpus, args.context_length, args.batch_size, args.seed)
    run_dir, one = Path(args.run_dir), argparse.Namespace(**vars(args))
    saved = {}   # step: a checkpoint of it (the newest: a step redone after a rewind is saved again elsewhere)
    for folder in run_dir.glob("replica-*/checkpoints/step-*"):
        meta, step = folder / "metadata.json", int(folder.name.split("-")[1])
        if meta.exists() and (step not in saved or meta.stat().st_mtime > (saved[step] / "metadata.json").stat().st_mtime):
            saved[step] = folder
    last = len(schedule)
    anchors = [0] + sorted(k for k in saved if 0 < k < last) + [last]

    def fresh():
        model = auto_class(args.model).from_pretrained(args.model, attn_implementation=args.attention,
                                                                  dtype=torch.float32).to(device)
        return model, adamw(model.parameters(), args)

    def stretch(a, b, nudge=0.0):   # the run's steps a to b in one process, from its state at a
        model, opt = fresh()
        if a:
            sharded_checkpoint.load_sharded(model, opt, str(saved[a]))
        params = [p for p in model.parameters() if p.requires_grad]
        if nudge:   # each weight moved by about float32's rounding (the twin that measures the stretch's floor)
            g = torch.Generator().manual_seed(a)
            with torch.no_grad():
                for p in params:
                    p.add_(torch.randn(p.shape, generator=g).to(p.device) * nudge * p.abs().mean())
        for step, members in schedule[a:b]:
            total = {}
            for r in members:
                one.replica_id = r
                model.zero_grad(set_to_none=True)
                torch.manual_seed(replica_seed(one, step))
                x, y = (t.to(device) for t in data.batch_of(step * args.replicas + r))
                with common.autocast(device, args.dtype):
                    logits = model(input_ids=x, use_cache=False).logits
                lm_loss(logits, y).backward()
                for p in params:
                    if p.grad is not None:
                        total[p] = total[p] + p.grad if p in total else p.grad
            for p in params:
                p.grad = total[p] / len(members) if p in total else None
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args)
            torch.nn.utils.clip_grad_norm_(params, args.clip)
            opt.step()
        return {k: v.detach().cpu().float() for k, v in model.state_dict().items()}

    def apart(got, want):
        return max((got[k].float().cpu() - want[k]).abs().max().item() for k in want if k in got)
    tol = 1e-4 if args.dtype == "float32" else common.TOLERANCE["autocast"]["atol"] * 10
    worst, stretches, ok, beyond = 0.0, [], True, []
    for a, b in zip(anchors, anchors[1:]):
        want = stretch(a, b)
        if b < last:
            got, _ = fresh()
            sharded_checkpoint.load_sharded(got, None, str(saved[b]))
        else:
            got = auto_class(final).from_pretrained(final, dtype=torch.float32)
        diff = apart(got.state_dict(), want)
        floor = None
        if diff >= tol:   # past float32's horizon, or a wrong step: the stretch's own floor tells which
            floor = apart(stretch(a, b, nudge=REPLAY_NUDGE), want)
            ok = ok and floor >= tol and diff <= REPLAY_FLOORS * floor
            beyond.append((a, b, floor))
        stretches.append((a, b, diff, floor))
        worst = max(worst, diff)
    return {"max_diff": worst, "ok": ok, "stretches": stretches, "beyond": beyond}


if __name__ == "__main__":
    common.run_main(main)

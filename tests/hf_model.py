"""Workers for the models people have: transformers' LlamaForCausalLM and
Qwen3MoeForCausalLM (tiny configs: 2 or 4 layers, d 64, 8 query and 2 key/value heads,
sdpa; Qwen3-MoE with 4 experts of its own, 3D tensors, top 2), built from their own config
classes and never changed, put on every axis with documented calls only and compared with
the same model trained in one process (clipped AdamW steps). Their forward returns a
ModelOutput (a dict and a dataclass), which the loss reads by name."""
import argparse
import contextlib
import copy
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers

import common
import hf_checkpoint as hfc
import placement
from own_model import (MAX_NORM, batches, compare, cpm, with_floor, ddp, everyone, ep, fsdp, nd, norms_close, pp,
                       tp)

overlap = common.load_script(os.path.join(common.ROOT, "04_overlap_ddp.py"))
MODELS = ("llama", "qwen3-moe")
AUX = 0.01          # Qwen3-MoE's router_aux_loss_coef: the model's own balancing loss, times this
ATTENTION = {"model.layers.*.self_attn.q_proj": "column", "model.layers.*.self_attn.k_proj": "column",
             "model.layers.*.self_attn.v_proj": "column", "model.layers.*.self_attn.o_proj": "row"}
MLP = {"model.layers.*.mlp.gate_proj": "column", "model.layers.*.mlp.up_proj": "column",
       "model.layers.*.mlp.down_proj": "row"}
HEAD_NORMS = {"model.layers.*.self_attn.q_norm": "sum", "model.layers.*.self_attn.k_norm": "sum"}   # per head
PLANS = {"llama": {**ATTENTION, **MLP}, "qwen3-moe": {**ATTENTION, **HEAD_NORMS},   # HF views heads with -1
         # GPT-OSS's own plan (transformers 5.24's) splits its embedding alone: its attention by a
         # plan in 08's words, its sinks (one logit a head) split with the heads
         "gpt-oss": {**ATTENTION, "model.layers.*.self_attn.sinks": "heads"}}
EXPERTS = "model.layers.*.mlp.experts"
# More families, tiny, by their own plans (08's model_plan): what each splits, and what it keeps
# whole (an all-sparse MoE's plan names a dense MLP it does not build); where HF gathers (Phi-3's
# fused qkv_proj and gate_up_proj, GLM-4's gate_up_proj, OLMo-2's projections normed over every
# head) the kit splits by heads; GPT-NeoX's embedding is split by vocabulary
VISION = dict(vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14),
              mm_tokens_per_image=4, image_token_id=255, boi_token_index=254, eoi_token_index=253)
FAMILIES = {
    "qwen2-moe, all sparse": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1)),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", dict(intermediate_size=128)),
    "gpt-neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(intermediate_size=128)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(intermediate_size=128, pad_token_id=0)),
    "glm4": ("Glm4ForCausalLM", "Glm4Config", dict(intermediate_size=128, pad_token_id=0)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(intermediate_size=128)),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(intermediate_size=128, tie_word_embeddings=False)),
    "apertus": ("ApertusForCausalLM", "ApertusConfig", dict(   # xIELU: two learned scalars between up and down
        intermediate_size=128, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(intermediate_size=64, num_local_experts=4,
                                                            num_experts_per_tok=2)),
    "deepseek-v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(   # MLA attention; layer 0 dense
        intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, num_key_value_heads=8, head_dim=4,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)),
    "llama4": ("Llama4ForCausalLM", "Llama4TextConfig", dict(   # its decoder under "model", not its prefix's name;
        intermediate_size=32, intermediate_size_mlp=128, num_local_experts=4,   # layer 1 a MoE whose experts take
        interleave_moe_layer_step=2)),                                          # every expert's rows (dense)
    # Gemma 4's MoE shape (26B-A4B's: a dense MLP beside experts in every layer, keys that are
    # also its values on full attention): a heterogeneous config, the full-attention layers'
    # head_dim and key/value heads their own (per_layer_config), which reading config.head_dim
    # refuses
    "gemma4": ("Gemma4ForCausalLM", "Gemma4TextConfig", dict(
        intermediate_size=128, hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4,
        top_k_experts=2, moe_intermediate_size=32, attention_k_eq_v=True, sliding_window=16, global_head_dim=16,
        num_global_key_value_heads=4, tie_word_embeddings=False)),   # (ties: Gemma 3's cases)
    # a multimodal folder (Gemma 3 from 4B up): its language model trains, under
    # model.language_model; its vision tower, which text never reaches, gets no gradient
    "gemma3, multimodal": ("Gemma3ForConditionalGeneration", "Gemma3Config", dict(
        text_config=dict(model_type="gemma3_text", intermediate_size=128), tie_word_embeddings=False, **VISION))}
# Gemma 3n on tp alone (its altup streams, per-layer inputs and shared key/value layers
# have no pipeline plan): layer 0's MLP with activation sparsity, whose gate's cutoff is
# the mean and spread of every intermediate feature, which model_plan keeps whole
TP_FAMILIES = {"gemma3n": ("Gemma3nForCausalLM", "Gemma3nTextConfig", dict(
    intermediate_size=128, hidden_size_per_layer_input=8, vocab_size_per_layer_input=256, laurel_rank=8,
    num_kv_shared_layers=0, activation_sparsity_pattern=[0.95, 0.0], sliding_window=64,
    layer_types=["sliding_attention", "full_attention"])),
    "gpt-oss": ("GptOssForCausalLM", "GptOssConfig", dict(   # no SDPA: eager attention with its sinks
        intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=64,
        layer_types=["sliding_attention", "full_attention"], attn_implementation="eager")),
    # its plan names the sinks (one a head) "colwise": split with the heads
    "granite-swa": ("GraniteSWAForCausalLM", "GraniteSWAConfig", dict(intermediate_size=128, sliding_window=8,
                                                                       attn_implementation="eager")),
    # DeepSeek-V3.2's MLA with its indexer (DSA): scores of whole tensors whose top 8 keys a
    # query mask every split head's attention; the indices carry no gradient back
    "deepseek-v32": ("DeepseekV32ForCausalLM", "DeepseekV32Config", dict(
        intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, num_key_value_heads=8, head_dim=4,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, index_n_heads=2, index_head_dim=8, index_topk=8))}
MOE_FAMILIES = ("qwen2-moe, all sparse", "mixtral", "deepseek-v3", "llama4", "gemma4")   # experts of their own: ep splits them
EXPERTS_OF = {"llama4": "model.layers.*.feed_forward.experts", "gemma4": "model.layers.*.experts"}   # (others': EXPERTS)
FIRST, LAST = ["model.embed_tokens", "model.rotary_emb"], ["model.norm", "lm_head"]
# AdamW's rate: HF's init (std 0.02) gives gradients small enough that at 1e-2 one process
# differs from itself by 2e-5 when only its batch is summed in two halves (AdamW's division
# by sqrt(v) magnifies the last bits of a near-zero gradient); at 1e-3 that floor is 5e-7 to
# 1e-5 by family (OLMo-2's norms over whole projections the highest), while a wrong gradient
# still moves a weight by ~1e-3. Each comparison's bound is its own floor's (own_model.compare).
LR = 1e-3


def tiny(kind, layers=2, router_loss=True, experts=4, tied=False):
    """The model as its user builds it, seeded. ``router_loss``: Qwen3-MoE returns its
    balancing loss (output_router_logits); off where its tokens are not a rank's whole
    share (pipeline stages call the layers themselves, context parallel splits sequences)."""
    torch.manual_seed(0)
    common_cfg = dict(vocab_size=256, hidden_size=64, num_hidden_layers=layers, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64, attn_implementation="sdpa",
                      bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=128, **common_cfg))
    if kind == "gpt2":   # Conv1D layers, no tensor-parallel or pipeline plan
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=256, n_embd=64, n_layer=layers, n_head=8, n_positions=64, attn_implementation="sdpa",
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2))
    if kind in FAMILIES or kind in TP_FAMILIES:   # the other families, each as transformers builds it
        cls, cfg_cls, own = FAMILIES.get(kind) or TP_FAMILIES[kind]
        own = {**own, "tie_word_embeddings": True} if tied else own   # (Gemma 3's own default)
        return getattr(transformers, cls)(getattr(transformers, cfg_cls)(**with_text(common_cfg, own)))
    cfg = transformers.Qwen3MoeConfig(moe_intermediate_size=32, num_experts=experts, num_experts_per_tok=2,
                                      output_router_logits=router_loss, router_aux_loss_coef=AUX, **common_cfg)
    return transformers.Qwen3MoeForCausalLM(cfg)


def lm_loss(logits, y):
    """Cross-entropy in float32 (bf16 logits cast up), or float64 where the model is (the
    rounding floor's twin)."""
    wide = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return F.cross_entropy(logits.flatten(0, 1).to(wide), y.flatten())


def output_loss(out, y):
    """The last pipeline stage's loss: the model's own output (a ModelOutput), its logits."""
    return lm_loss(out["logits"], y)


def loss_of(model, x, y, positions=None, seen=None):
    """The LM's cross-entropy on the ModelOutput's logits, plus the model's own balancing
    loss where it returns one. ``seen``: a list the output's type name is appended to. With
    ``positions`` (a context-parallel rank's, which skip), a mask of ones, as 13 gives: without
    one, a model that makes no cache (Gemma 3's multimodal class) takes the skip for packed
    sequences and masks, which context_parallel refuses."""
    out = model(input_ids=x, position_ids=None if positions is None else positions[None],
                attention_mask=None if positions is None else torch.ones_like(x))
    if seen is not None:
        seen.append(type(out).__name__)
    loss = lm_loss(out["logits"], y)
    return loss + AUX * out.aux_loss if getattr(out, "aux_loss", None) is not None else loss


def train_reference(ref, data, parts=1):
    """One process: each batch's loss the mean of its ``parts`` (the data ranks' shares:
    Qwen3-MoE's balancing loss is a share's), torch's clip, AdamW. The norms."""
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=1e-6)
    norms = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        (sum(loss_of(ref, a, b) for a, b in zip(x.chunk(parts), y.chunk(parts))) / parts).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item())
        opt.step()
    return norms


def against_one_process(kind, data, put, parts=1, layers=2, router_loss=True, tied=False):
    """``put(model)`` puts a copy of the seeded model on its axes and returns (the module the
    optimizer steps, step(x, y) for one batch's backward with its gradients synchronized,
    clip(max_norm) -> the norm, the whole state dict on every rank). Trains it beside one
    process; the comparison of the weights and whether every step's norm agreed, made on
    rank 0, whose result the job returns (``whole()`` is every rank's, the norm the mesh's;
    the other ranks return {} without training the reference: on 8 ranks, 7 copies of it
    were a sixth of the job's CPU)."""
    model = tiny(kind, layers, router_loss, tied=tied)
    first = dist.get_rank() == 0
    ref, want = reference(kind, data, parts, layers, router_loss, tied) if first else (None, None)
    module, step, clip, whole = put(model)
    opt = torch.optim.AdamW(module.parameters(), lr=LR, eps=1e-6)
    norms = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        step(x, y)
        norms.append(clip(MAX_NORM).item())
        opt.step()
    full = whole()
    if not first:
        return {}
    r = compare(full, ref)
    r.update(norms=norms_close(norms, want), norm_diffs=[abs(a - b) / b for a, b in zip(norms, want)],
             norm_floors=want.floor)
    return r


_references = {}


def reference(kind, data, parts=1, layers=2, router_loss=True, tied=False):
    """One process trained on ``data`` (train_reference), with its rounding floor (own_model's
    with_floor), once per model and batches in a job: (the trained model, its norms)."""
    key = (kind, parts, layers, router_loss, tied, tuple(hash(t.numpy().tobytes()) for b in data for t in b))
    if key not in _references:
        ref = tiny(kind, layers, router_loss, tied=tied)
        _references[key] = (ref, with_floor(ref, data, train_reference, parts))
    return _references[key]


def _mine(t, rank, n):
    return t.chunk(n)[rank]


def data_parallel(ctx, kind, data, wrap, seen=None):
    """dp = world: DDPBucketed, 04's DDPIndividualParameters ("dp 04"), or FSDP with its
    default units (each decoder layer: the model's own _no_split_modules); each rank its share.
    ``seen``: what the wrapped model returned, by type name."""
    def put(model):
        if wrap == "fsdp":
            module = fsdp.FSDP(model)
        elif wrap == "dp 04":
            module = overlap.DDPIndividualParameters(model)
        else:
            module = ddp.DDPBucketed(model, 1)

        def step(x, y):
            loss_of(module, _mine(x, ctx.rank, ctx.world_size), _mine(y, ctx.rank, ctx.world_size), seen=seen).backward()
            module.finish_gradient_synchronization()
        return module, step, lambda n: placement.clip_grad_norm_(model, n), \
            lambda: placement.full_state_dict(model, all_ranks=True)
    return against_one_process(kind, data, put, parts=ctx.world_size)


_replica_groups = {}


def replicas(ctx, kind, data, tied=False, inner=None, join=2):
    """14's ReplicaManager around the model as built, two replicas of half the ranks each
    (``inner``: "fsdp", 07's FSDP over a replica's ranks; None: one rank a replica, the
    model alone): replica 0 trains alone for ``join`` steps; then replica 1, built apart (its
    weights moved), joins and heals from it, rank k from rank k (the weights or FSDP's
    shards, the buffers the model registered, persistent or not, AdamW's state and the step)
    before both go on. Each step the quorum's ranks share the batch's 4 parts, so every step
    is one process's; the clip is torch's on a whole model, placement's on shards."""
    ft = common.load_script(os.path.join(common.ROOT, "14_fault_tolerant_dp.py"))
    size = ctx.world_size // 2
    me, k = divmod(ctx.rank, size)   # this rank's replica, its rank in it
    model = tiny(kind, tied=tied)
    ref, want = reference(kind, data, 4, tied=tied)
    if ctx.world_size not in _replica_groups:   # (made once, by every rank)
        made = [dist.new_group(list(range(r * size, (r + 1) * size))) for r in range(2)]
        _replica_groups[ctx.world_size] = made
    group = _replica_groups[ctx.world_size][me]
    coordinator = ft.Coordinator(min_replicas=1) if ctx.rank == 0 else None
    address = everyone(coordinator and coordinator.address)[0]
    if me == 1:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
    module = fsdp.FSDP(model, process_group=group) if inner == "fsdp" else model
    opt = torch.optim.AdamW(module.parameters(), lr=LR, eps=1e-6)

    def manager(**kw):
        return ft.ReplicaManager(module, opt, address, replica_id=me, process_group=group, **kw)
    try:   # the all-reduce during backward, where a replica's gradients are final only after FSDP's reduction
        manager(bucket_mb=1) if inner else None
        refused = "not refused"
    except ValueError as e:
        refused = str(e)
    if me == 0:
        m = manager()
    else:
        dist.barrier()   # replica 0 is at its step ``join``: say hello (a live replica that has
        m = manager()    # not asked holds the quorum up to the coordinator's join_timeout)
        dist.barrier()
    norms, waited = {}, False
    while True:
        if me == 0 and m.step == join and not waited:
            dist.barrier()
            dist.barrier()   # replica 1 said hello: this quorum waits for it
            waited = True
        if not m.start_step(len(data)):
            break
        x, y = data[m.step]
        mine = range(m.members.index(me) * size + k, 4, len(m.members) * size)   # this rank's parts
        for n, i in enumerate(mine):   # (accumulated: FSDP communicates at the last)
            with module.no_sync() if inner and n < len(mine) - 1 else contextlib.nullcontext():
                (loss_of(module, x.chunk(4)[i], y.chunk(4)[i]) / len(mine)).backward()
        if inner:
            module.finish_gradient_synchronization()
        at = m.step
        if m.should_commit(m.all_reduce_gradients()):
            norms[at] = (placement.clip_grad_norm_(model, MAX_NORM, process_group=group) if inner else
                         torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)).item()
            opt.step()
        opt.zero_grad(set_to_none=True)
    heals = everyone([{k: h[k] for k in ("role", "step", "bytes", "exact")} for h in m.heals])
    stepped = everyone(sorted(norms))
    full = placement.full_state_dict(model, process_group=group, all_ranks=True) if inner else \
        {n: v.detach() for n, v in model.state_dict().items()}
    dist.barrier()
    if coordinator:
        coordinator.close()
    r = compare(full, ref)
    r["norms"] = norms_close(norms, want, stepped[ctx.rank])
    weights = sum(p.numel() * p.element_size() for p in module.parameters())   # (this rank's: a shard under FSDP)
    trained = sum(p.numel() * p.element_size() for p in module.parameters() if opt.state.get(p))   # (AdamW's moments:
    r.update(stepped=stepped, heals=heals, weights=weights, trained=trained, refused=refused)   # not a vision tower's)
    return r


def tensor_parallel(ctx, kind, data, plan=None, own=None, keep=None):
    """tp = world: the whole-model plan on the model's own names (``plan``: another; ``own``:
    a dict that gets the model's own plan, 08's model_plan, which is then the one applied,
    and the model; ``keep``: a dict that gets the model)."""
    def put(model):
        if own is not None:
            own["plan"], own["whole"] = tp.model_plan(model)
        for d in (own, keep):
            if d is not None:
                d["model"] = model
        tp.parallelize(model, own["plan"] if own is not None else plan or PLANS[kind])
        return model, lambda x, y: loss_of(model, x, y).backward(), lambda n: tp.clip_grad_norm_(model, n), \
            lambda: tp.full_state_dict(model, all_ranks=True)
    return against_one_process(kind, data, put)


def embed(m, tokens):
    """docs/10's first recipe, hand-written: the model's own embedding and rotary module
    (HF's positions 0..t-1); with head and call, the control of stage_against_forward."""
    h = m.model.embed_tokens(tokens)
    return (h, *m.model.rotary_emb(h, torch.arange(tokens.shape[1], device=tokens.device)[None]))


def head(m, h):
    return m.lm_head(m.model.norm(h))


def call(layer, h, cos, sin):
    """A decoder layer takes the rotary tables by keyword."""
    return layer(h, position_embeddings=(cos, sin))


def stage_of(model, rank, n_stages, chunks=1):
    """09's ModelStage: the model's own pipeline plan and forward, nothing written for it."""
    return pp.ModelStage(model, rank, n_stages, chunks)


def hand_written_stage(model, rank, n_stages, chunks=1):
    return pp.PipelineStage(model, "model.layers", rank, n_stages, embed, head, first=FIRST, last=LAST,
                            chunks=chunks, call=call)


# Every family, eager attention, 4 layers, sequences of 16 tokens past an 8-token sliding
# window where the family has one: what a stage computes against the model's own forward
STAGE_FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(moe_intermediate_size=32, num_experts=4,
                                                                 num_experts_per_tok=2)),
    "qwen2-moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(moe_intermediate_size=32, num_experts=4,
                                                                 shared_expert_intermediate_size=32,
                                                                 num_experts_per_tok=2)),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(sliding_window=8, final_logit_softcapping=3.0,
                                                         attn_logit_softcapping=5.0)),
    "gemma3, tied": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(sliding_window=8, tie_word_embeddings=True)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(pad_token_id=0)),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", {}),
    "glm4": ("Glm4ForCausalLM", "Glm4Config", dict(pad_token_id=0)),
    "apertus": ("ApertusForCausalLM", "ApertusConfig", dict(   # xIELU: two learned scalars between up and down
        intermediate_size=128, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2,
                                                            sliding_window=8)),
    "gpt-neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", {}),
    "deepseek-v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, num_key_value_heads=8, head_dim=4,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)),
    # families that ship no pipeline plan: ModelStage reads one from the model (09's
    # pipeline_plan): GPT-2's position embedding and OPT's (nested in its decoder) added, and
    # BLOOM's embedding norm, on every stage; BLOOM's and Falcon's layers return tuples, and
    # Bamba's forward unpacks its layers' (hidden_states, attn_weights): Mamba-2 layers
    # between its attention layers; BioGPT names no no-split modules
    "gpt2, tied": ("GPT2LMHeadModel", "GPT2Config", dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                                       tie_word_embeddings=True)),
    "opt": ("OPTForCausalLM", "OPTConfig", dict(ffn_dim=128, dropout=0.0, attention_dropout=0.0)),
    "bloom": ("BloomForCausalLM", "BloomConfig", {}),
    "falcon": ("FalconForCausalLM", "FalconConfig", dict(new_decoder_architecture=True, num_kv_heads=2,
                                                         head_dim=None)),
    "bamba": ("BambaForCausalLM", "BambaConfig", dict(attn_layer_indices=[1, 3], mamba_n_heads=4, mamba_d_head=32,
                                                      mamba_d_state=8, mamba_n_groups=1, head_dim=None)),
    "biogpt": ("BioGptForCausalLM", "BioGptConfig", dict(   # (no _no_split_modules; dropout and layer drop off)
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, activation_dropout=0.0, layerdrop=0.0,
        head_dim=None, num_key_value_heads=None)),
    # Llama 4's decoder sits under "model", not under its base_model_prefix ("language_model"), and
    # its MoE layers alternate with dense ones; NemotronH's forward reads each layer's block_type
    # (Mamba-2, MoE, attention, MLP): a layer's stand-in reads it through
    "llama4": ("Llama4ForCausalLM", "Llama4TextConfig", dict(intermediate_size_mlp=128, num_local_experts=4,
                                                             interleave_moe_layer_step=2, attention_chunk_size=8)),
    "gemma3, multimodal": ("Gemma3ForConditionalGeneration", "Gemma3Config", dict(   # its head under the top,
        text_config=dict(model_type="gemma3_text", sliding_window=8), **VISION)),       # its decoder two down
    "nemotron-h": ("NemotronHForCausalLM", "NemotronHConfig", dict(
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=8, n_groups=1, n_routed_experts=4,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=32)),
    # what a stage cannot hold, refused: layers the forward runs twice (a recurrent depth), and
    # layers that take every earlier layer's hidden state (Inkling2's block states)
    "dory": ("DoryForCausalLM", "DoryConfig", dict(n_input_layers=1, n_recurrent_layers=2, n_output_layers=1,
                                                   n_recurrent_loops=2)),
    "inkling2-loop": ("Inkling2LoopForCausalLM", "Inkling2LoopTextConfig", dict(
        n_layers_per_attn_res_block=1, loop_layer_index_start=1, loop_layer_index_end=3, loop_num_passes=2)),
    "inkling2": ("Inkling2ForCausalLM", "Inkling2TextConfig", {})}


def stage_family(kind):
    torch.manual_seed(0)
    cls, cfg_cls, own = STAGE_FAMILIES[kind]
    cfg = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
               head_dim=8, intermediate_size=128, max_position_embeddings=64, attn_implementation="eager",
               tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    return getattr(transformers, cls)(getattr(transformers, cfg_cls)(
        **{k: v for k, v in with_text(cfg, own).items() if v is not None}))   # (None: a key the family does not take)


def with_text(sizes, own):
    """A family's config keywords: ``sizes`` and its ``own``; a multimodal family's sizes
    (and attention) go to its language model's config (its text_config)."""
    if "text_config" not in own:
        return {**sizes, **own}
    text = {k: v for k, v in sizes.items() if k not in ("attn_implementation", "tie_word_embeddings")}
    return {**own, "text_config": {**text, **own["text_config"]}, "attn_implementation": sizes["attn_implementation"],
            "tie_word_embeddings": own.get("tie_word_embeddings", sizes.get("tie_word_embeddings"))}


def stage_against_forward(kind, n_stages, chunks=1, build=stage_of, positions=False):
    """Every stage of ``kind`` in this process, chained by hand (each stage its own copy of
    the model, as on its own rank; the activations detached between them, their gradients
    passed back), against the model's own forward and backward on the same batch: the
    largest differences of the logits and of any parameter's gradient (a weight tied over
    the first and last stage: its two copies' gradients summed), and the names no stage
    holds. ``positions``: the model given position ids (B, T), 5.. onwards, which ride along."""
    ref = stage_family(kind)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    pos = (5 + torch.arange(16)).expand(2, 16) if positions else None
    want = ref(input_ids=x, position_ids=pos, use_cache=False).logits
    want.float().square().mean().backward()
    stages = [build(copy.deepcopy(ref), s, n_stages, chunks) for s in range(n_stages)]
    embedding = next(n for n, p in ref.named_parameters() if p is ref.get_input_embeddings().weight)
    xs, handed = (x, pos) if positions else (x,), []
    for v in range(n_stages * chunks):
        out = stages[v % n_stages](*xs, chunk=v // n_stages)
        if v < n_stages * chunks - 1:
            outs = (out,) if torch.is_tensor(out) else tuple(out)
            xs = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in outs)
            handed.append((outs[0], xs[0]))
    got = out.logits if hasattr(out, "logits") else out
    got.float().square().mean().backward()
    for sent, received in reversed(handed):
        sent.backward(received.grad)
    grads = {}
    for s in stages:
        tied = {id(p) for p in getattr(s, "tied", [])}
        for n, p in s.named_parameters(remove_duplicate=False):
            if p.grad is not None:
                n = embedding if id(p) in tied else n   # the one tensor of one process
                grads[n] = grads.get(n, 0) + p.grad
    want_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    return {"logits": (got - want).abs().max().item(),
            "grads": max((grads[n] - g).abs().max().item() for n, g in want_grads.items() if n in grads),
            "missing": sorted(set(want_grads) - set(grads)), "tied": [len(getattr(s, "tied", [])) for s in stages]}


def pipeline(ctx, kind, data, schedule, m=2, tied=False):
    """stages = world, 4 layers cut evenly (interleaved: 2 chunks a stage); what crosses the
    stages (the hidden state) found by the first step. Also whether the merged checkpoint
    loads into the model of one process as it is. ``tied``: the model's head tied to its
    embedding (``tie_word_embeddings``), the stage's two copies kept equal by 09's tie and
    sum_tied_gradients over the first and last stage."""
    loaded = {}

    def put(model):
        chunks = 2 if schedule == "interleaved" else 1
        stage = stage_of(model, ctx.rank, ctx.world_size, chunks)
        pipe = pp.Pipeline(stage, m, output_loss, schedule, chunks=chunks)
        group = pp.tied_group([list(range(ctx.world_size))]) if tied else None
        pp.tie(stage.tied, group)

        def step(x, y):
            pipe.step(x if pipe.first else None, y if pipe.last else None)
            if tied:
                pp.sum_tied_gradients(stage.tied, group)

        def whole():
            full = everyone(pp.full_state_dict(stage))[0]   # merged on the first rank
            plain = tiny(kind, 4, router_loss=False, tied=tied)
            loaded["missing"] = plain.load_state_dict(full, strict=False)
            return full
        return stage, step, lambda n: pp.clip_grad_norm_(stage, n), whole
    r = against_one_process(kind, data, put, layers=4, router_loss=False, tied=tied)
    r["loads"] = not any(loaded["missing"])
    return r


class _PackedStage(torch.nn.Module):
    """Half of a two-piece model that packs what it returns as transformers does: the first
    half a BaseModelOutput of two tensors, the second a CausalLMOutput."""

    def __init__(self, first):
        super().__init__()
        self.first = first
        self.piece = torch.nn.Embedding(256, 32) if first else torch.nn.Linear(32, 256)

    def forward(self, *xs):
        if self.first:
            h = self.piece(xs[0])
            return transformers.modeling_outputs.BaseModelOutput(last_hidden_state=h, hidden_states=(2 * h,))
        return transformers.modeling_outputs.CausalLMOutput(logits=self.piece(xs[0] + xs[1]))


def refused_in_a_pipeline(ctx, kind, data):
    """A family ModelStage refuses at its first forward (Dory's layers run twice, Inkling2's
    block states handed on: both seen by the last stage), trained in a Pipeline on every
    rank of the group as a user's loop does: what each rank raised (none may be left
    waiting for the one that refused)."""
    pipe = pp.Pipeline(stage_of(stage_family(kind), ctx.rank, ctx.world_size), 2, output_loss, "1f1b")
    x, y = data[0][:2]
    try:
        pipe.step(x if pipe.first else None, y if pipe.last else None)
        said = "not refused"
    except Exception as e:
        said = f"{type(e).__name__}: {e}"
    return everyone(said)


def packed_pipeline(ctx, data):
    """Two stages returning ModelOutputs (09's Pipeline, 1F1B): the gradients against one
    process's on the same batch."""
    stages = [_PackedStage(True), _PackedStage(False)]
    x, y = data[0]
    first = stages[0](x)
    out = stages[1](first.last_hidden_state, first.hidden_states[0])
    lm_loss(out.logits, y).backward()
    want = [p.grad.clone() for s in stages for p in s.parameters()]
    mine = copy.deepcopy(stages[ctx.rank])
    mine.zero_grad(set_to_none=True)
    pipe = pp.Pipeline(mine, 2, lambda o, t: lm_loss(o.logits, t), "1f1b")
    pipe.step(x if pipe.first else None, y if pipe.last else None)
    got = [g for grads in everyone([p.grad for p in mine.parameters()]) for g in grads]
    return all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(got, want)) and len(got) == len(want)


def context_parallel(ctx, kind, data, method):
    """cp = world: each step inside 11's context_parallel with the model's own position_ids,
    DDPBucketed averaging the gradients over the group."""
    def put(model):
        module = ddp.DDPBucketed(model, 1)

        def step(x, y):
            x, y, pos = x.clone(), y.clone(), torch.arange(x.shape[1])
            with cpm.context_parallel(None, buffers=[x, y, pos], seq_dims=[1, 1, 0], method=method):
                loss_of(module, x, y, pos).backward()
            module.finish_gradient_synchronization()
        return module, step, lambda n: placement.clip_grad_norm_(model, n), model.state_dict
    return against_one_process(kind, data, put, router_loss=False)


def expert_parallel(ctx, kind, data, rest):
    """Qwen3-MoE's own experts split over ranks (12's split_experts), its router and code
    unchanged; the rest of the model: "dp" (DDPBucketed over every rank; ep = world, or at 4
    ranks ep 2 with two copies of each expert), "fsdp" (FSDP by layers, the experts left to
    the split) or "tp" (at 4 ranks: dp 2 x tp 2, the attention plan over tp, the experts
    split over dp)."""
    W, rank, experts_at = ctx.world_size, ctx.rank, EXPERTS_OF.get(kind, EXPERTS)
    groups = {}
    if W == 4:   # every rank makes every group, in one order
        pairs = {"ep": [[0, 1], [2, 3]], "copies": [[0, 2], [1, 3]]} if rest == "dp" else \
            {"tp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]]}
        for axis, ranks in pairs.items():
            made = [dist.new_group(r) for r in ranks]
            groups[axis] = next(g for g, r in zip(made, ranks) if rank in r)
    data_ranks, r = 2 if rest == "tp" else W, {}

    def put(model):
        if rest == "tp":
            tp.parallelize(model, PLANS[kind], groups["tp"])
            ep.split_experts(model, experts_at, groups["dp"])
        else:
            ep.split_experts(model, experts_at, groups.get("ep"), copies=groups.get("copies"))
        experts = ep.expert_parameters(model)
        split = next(m for n, m in model.named_modules() if placement.path_matches(n, experts_at))
        r["held"] = {"gate_up_proj": list(split.gate_up_proj.shape), "down_proj": list(split.down_proj.shape),
                     "num_experts": split.num_experts}
        r["exchange"] = split.expert_exchange
        if rest == "fsdp":
            module = fsdp.FSDP(model, units=list(model.model.layers), ignore=experts)
        else:
            module = ddp.DDPBucketed(model, 1, process_group=groups.get("dp"), ignore_parameters=experts)
        share = rank // 2 if rest == "tp" else rank

        def step(x, y):
            loss_of(module, _mine(x, share, data_ranks), _mine(y, share, data_ranks)).backward()
            module.finish_gradient_synchronization()
            ep.reduce_expert_gradients(model, data_ranks=data_ranks)
        def whole():
            full = placement.full_state_dict(model, all_ranks=True)
            first = next(n for n in full if placement.path_matches(n, f"{experts_at}.gate_up_proj"))[:-len("gate_up_proj")]
            r["whole"] = {n: list(full[first + n].shape) for n in ("gate_up_proj", "down_proj")}
            return full
        return module, step, lambda n: placement.clip_grad_norm_(model, n), whole
    r.update(against_one_process(kind, data, put, parts=data_ranks))
    r["rows sent"] = r.pop("exchange").rows_out
    return r


def axes(ctx, args):
    """Every axis at 2 ranks, both models: dp (DDPBucketed), fsdp, tp, pp with each
    schedule, cp with each method, 14's replicas (ft) with a late joiner that heals;
    Qwen3-MoE's own experts split, with dp and with fsdp."""
    data, out, seen = batches(), {"outputs": {}, "own plans": {}, "units": {}, "summed whole": {}}, {}
    for kind in MODELS:
        for wrap in ("dp", "dp 04", "fsdp"):
            out[f"{kind}, {wrap}"] = data_parallel(ctx, kind, data, wrap, seen.setdefault(wrap, []))
            out["outputs"][wrap] = seen[wrap][-1]
        out[f"{kind}, tp"] = tensor_parallel(ctx, kind, data)
        out["own plans"][kind] = tp.model_plan(tiny(kind))
        out["units"][kind] = sorted({type(u.module).__name__ for u in fsdp.FSDP(tiny(kind))._units if u.module})
        for schedule in pp.SCHEDULES:
            out[f"{kind}, pp {schedule}"] = pipeline(ctx, kind, data, schedule)
        for method in cpm.METHODS:
            out[f"{kind}, cp {method}"] = context_parallel(ctx, kind, data, method)
        out[f"{kind}, ft"] = replicas(ctx, kind, data)
    for kind in [*FAMILIES, "gpt2"]:   # each by its own plans, nothing written for it
        if kind != "gpt2":
            own = {}
            out[f"{kind}, tp"] = tensor_parallel(ctx, kind, data, own=own)
            out["own plans"][kind] = (own["plan"], own["whole"])
            out["summed whole"][kind] = tp.summed_whole(own["model"])
            out[f"{kind}, pp 1f1b"] = pipeline(ctx, kind, data, "1f1b")
        for wrap in ("dp", "fsdp"):
            out[f"{kind}, {wrap}"] = data_parallel(ctx, kind, data, wrap)
        out[f"{kind}, cp ring"] = context_parallel(ctx, kind, data, "ring")
        out[f"{kind}, ft"] = replicas(ctx, kind, data)
    out["gemma3, tied, ft"] = replicas(ctx, "gemma3", data, tied=True)
    for kind in TP_FAMILIES:   # by its own plan, or (GPT-OSS) by PLANS
        own = {} if kind not in PLANS else None
        out[f"{kind}, tp"] = tensor_parallel(ctx, kind, data, own=own)
        if own is not None:
            out["own plans"][kind] = (own["plan"], own["whole"])
    spread, _ = tp.model_plan(tiny("gemma3n"))   # its sparse MLP split too, as transformers' plan has it
    spread = {**{k: v for k, v in spread.items() if ".mlp." not in k}, "model.layers.*.mlp.gate_proj": "column",
              "model.layers.*.mlp.up_proj": "column", "model.layers.*.mlp.down_proj": "row"}
    try:   # its gate's cutoff over each rank's half of the features: refused at the first forward
        loss_of(tp.parallelize(tiny("gemma3n"), spread), *data[0])
        out["gemma3n, tp with its sparse MLP split"] = "not refused"
    except ValueError as e:
        out["gemma3n, tp with its sparse MLP split"] = str(e)
    try:   # control: GPT-OSS's sinks left whole meet its split heads at the first forward, refused
        tensor_parallel(ctx, "gpt-oss", data, ATTENTION)
        out["gpt-oss, tp with its sinks whole"] = "not refused"
    except ValueError as e:
        out["gpt-oss, tp with its sinks whole"] = str(e)
    odd = torch.nn.Module()
    odd.sinks = torch.nn.Parameter(torch.zeros(3))
    try:   # (refused before anything changes or any collective)
        tp.parallelize(odd, {"sinks": "heads"})
        out["heads that do not divide"] = "not refused"
    except ValueError as e:
        out["heads that do not divide"] = str(e)
    for kind in MOE_FAMILIES:
        out[f"{kind}, ep with dp"] = expert_parallel(ctx, kind, batches(), "dp")
    out["gemma3, tied, pp 1f1b"] = pipeline(ctx, "gemma3", data, "1f1b", tied=True)   # its own default
    mla, _ = tp.model_plan(tiny("deepseek-v3"))   # MLA by heads, from its config and MLA's own plan
    out["own plans"]["deepseek-v3, attention"] = {k: v for k, v in mla.items() if ".self_attn." in k}
    try:   # without "shared", the rotary key's projection meets split heads and goes on whole: refused
        tensor_parallel(ctx, "deepseek-v3", data, {k: v for k, v in mla.items() if not k.endswith("kv_a_proj_with_mqa")})
        out["deepseek-v3, tp with MLA, the rotary key not shared"] = "not refused"
    except ValueError as e:
        out["deepseek-v3, tp with MLA, the rotary key not shared"] = str(e)
    for rest in ("dp", "fsdp"):
        out[f"qwen3-moe, ep with {rest}"] = expert_parallel(ctx, "qwen3-moe", batches(), rest)
    own = {}   # its per-head norms left out: found between the split layers and summed
    out["qwen3-moe, tp without the head norms"] = tensor_parallel(ctx, "qwen3-moe", data, ATTENTION, keep=own)
    out["qwen3-moe, tp without the head norms"]["summed"] = tp.summed_whole(own["model"])
    packed, _ = tp.model_plan(tiny("phi3"))   # control: Phi-3's packed projections split as if one matrix each
    out["phi3, packed split as one matrix"] = tensor_parallel(
        ctx, "phi3", data, {k: "column" if isinstance(v, tuple) else v for k, v in packed.items()})
    out["refusals"] = split_refusals()
    out["packed pipeline"] = packed_pipeline(ctx, data)
    for kind in ("dory", "inkling2"):
        out[f"{kind}, refused in a pipeline"] = refused_in_a_pipeline(ctx, kind, data)
    sweep = common.load_script(os.path.join(common.ROOT, "tools", "tp_families.py")).sweep   # (make tp-families)
    out["tp families"] = sweep(ctx, argparse.Namespace(quiet=True), [("granite_swa", "GraniteSWAForCausalLM"),
                                                                   ("doge", "DogeForCausalLM")])
    return out


def split_refusals():
    """What split_experts refuses, each before it changes the model: a pattern that matches
    nothing, a module with no experts, experts the group's ranks do not divide."""
    out = {}
    for label, pattern, experts in (("no match", "model.layers.*.mlp.expert", 4),
                                    ("no experts", "model.layers.*.self_attn", 4), ("divide", EXPERTS, 3)):
        model = tiny("qwen3-moe", experts=experts)
        before = {n: p.shape for n, p in model.named_parameters()}
        try:
            ep.split_experts(model, pattern)
            out[label] = "not refused"
        except ValueError as e:
            out[label] = str(e) if before == {n: p.shape for n, p in model.named_parameters()} else f"changed: {e}"
    return out


def four_ranks(ctx, args):
    """Qwen3-MoE at 4 ranks: ep 2 with two copies of each expert, DDPBucketed on the rest;
    and dp 2 x tp 2 with the experts split over dp. Both models in 14's replicas of 2 ranks,
    FSDP inside each."""
    out = {f"qwen3-moe, ep with {rest}": expert_parallel(ctx, "qwen3-moe", batches(), rest) for rest in ("dp", "tp")}
    for kind in MODELS:
        out[f"{kind}, ft with fsdp inside"] = replicas(ctx, kind, batches(), inner="fsdp")
    return out


def compose(kind, model, mesh, m=2):
    """The model on ``mesh`` by calls, innermost first, as docs/10 shows: tp (the plan) ->
    stages -> fsdp (each layer a unit) -> dp and cp's data ranks -> the schedule."""
    P, D, F_, C, T = (mesh.size(a) for a in ("pp", "dp", "fsdp", "cp", "tp"))
    if T > 1:   # the model's own plan (Llama's and Qwen3-MoE's: PLANS, as the test above shows)
        tp.parallelize(model, tp.model_plan(model)[0], mesh.group("tp"))
    stage = stage_of(model, mesh.coord("pp"), P) if P > 1 else model
    units = stage.held_layers() if P > 1 else None   # (None: the model's own _no_split_modules)
    module = fsdp.FSDP(stage, process_group=mesh.group("fsdp"), units=units) if F_ > 1 else stage
    if D * C > 1:
        module = ddp.DDPBucketed(module, 1, process_group=mesh.joint(("dp", "cp")) if C > 1 else mesh.group("dp"))
    pipe = pp.Pipeline(module, m, output_loss, "1f1b", mesh.group("pp")) if P > 1 else None
    return stage, module, pipe


COMPOSED = (*MODELS, *FAMILIES)


def composed(ctx, args):
    """Every family (GPT-2 aside: no tp or pp plan) on pp 2 x fsdp 2 x tp 2 and on dp 2 x
    cp 2 x tp 2 (8 ranks), by the same calls, against one process, one clip over the mesh."""
    meshes = {"pp 2 x fsdp 2 x tp 2": {"pp": 2, "dp": 1, "fsdp": 2, "cp": 1, "tp": 2},
              "dp 2 x cp 2 x tp 2": {"pp": 1, "dp": 2, "fsdp": 1, "cp": 2, "tp": 2}}
    out, data = {}, batches()
    for label, sizes in meshes.items():
        mesh = nd.Mesh(sizes)
        replicas = mesh.size("dp") * mesh.size("fsdp")
        replica = mesh.coord("dp") * mesh.size("fsdp") + mesh.coord("fsdp")
        for kind in COMPOSED:
            def put(model):
                stage, module, pipe = compose(kind, model, mesh)

                def step(x, y):
                    x, y = (common.shard(t, replica, replicas).clone() for t in (x, y))
                    if pipe is not None:
                        pipe.step(x if pipe.first else None, y if pipe.last else None)
                    else:
                        pos = torch.arange(x.shape[1])
                        with cpm.context_parallel(mesh.group("cp"), buffers=[x, y, pos], seq_dims=[1, 1, 0]):
                            loss_of(module, x, y, pos).backward()
                    if hasattr(module, "finish_gradient_synchronization"):
                        module.finish_gradient_synchronization()
                return module, step, lambda n: placement.clip_grad_norm_(stage, n), \
                    lambda: placement.full_state_dict(stage, all_ranks=True)
            out[f"{kind}, {label}"] = against_one_process(kind, data, put, layers=4, router_loss=False)
    return out


# ---- Hugging Face checkpoints in and out (hf_checkpoint.py) ----------------------------
CHECKPOINT_MESHES = {   # 8 ranks each
    "fsdp 8": {"pp": 1, "dp": 1, "fsdp": 8, "cp": 1, "tp": 1},
    "dp 4 x tp 2": {"pp": 1, "dp": 4, "fsdp": 1, "cp": 1, "tp": 2},
    "pp 2 x fsdp 2 x tp 2": {"pp": 2, "dp": 1, "fsdp": 2, "cp": 1, "tp": 2},
}


def _from_meta(kind, layers):
    """The model as its user builds it with placement.meta_parameters: its parameters on
    meta, its rotary tables computed by its own code."""
    with placement.meta_parameters():
        return tiny(kind, layers, router_loss=False)


def _checkpoint_round(ctx, kind, label, put, data, src, out, ref):
    """A model built on meta, put on its axes, filled from ``src`` (save_pretrained's
    sharded folder), trained beside ``ref`` (one process, same steps), saved by
    save_hf_checkpoint to ``out`` and loaded back by from_pretrained. ``put(model)`` returns
    (the module whose names are the model's, the module stepped, step(x, y))."""
    model = _from_meta(kind, ref.config.get_text_config().num_hidden_layers)
    r = {"buffers": all(torch.equal(b, dict(ref.named_buffers())[n]) for n, b in model.named_buffers()),
         "meta": all(p.is_meta for p in model.parameters())}
    layout = hfc.model_layout(model)   # the model's own file names (GPT-NeoX's embed_out, Mixtral's experts)
    named, module, step = put(model)
    r.update(hfc.load_hf_checkpoint(named, src, pieces=layout))
    r["loaded"] = compare(placement.full_state_dict(named, all_ranks=True), ref)["ok"]   # before training
    opt = torch.optim.AdamW(module.parameters(), lr=LR, eps=1e-6)
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        step(x, y)
        placement.clip_grad_norm_(named, MAX_NORM)
        opt.step()
    hfc.save_hf_checkpoint(named, os.path.join(out, label), config=ref.config, layout=layout)
    full = placement.full_state_dict(named)   # (the test's own check: whole on the first rank)
    if ctx.rank == 0:
        a, b = _source_shapes.get(src) or _source_shapes.setdefault(src, _tensor_shapes(src)), \
            _tensor_shapes(os.path.join(out, label))
        r["layout"] = a == b   # the source's names and shapes
        r["layout diff"] = sorted(set(a) ^ set(b))[:6] + [(k, a[k], b[k]) for k in a if k in b and a[k] != b[k]][:6]
        back = type(ref).from_pretrained(os.path.join(out, label))
        plain = tiny(kind, ref.config.get_text_config().num_hidden_layers, router_loss=False)
        plain.load_state_dict(full)
        x = data[0][0]
        r["logits"] = torch.equal(back(input_ids=x).logits, plain(input_ids=x).logits)
        files = [f for f in os.listdir(os.path.join(out, label)) if f.endswith(".safetensors")]
        sizes = [os.path.getsize(os.path.join(out, label, f)) for f in files]
        r["files"], r["largest share"] = sorted(files), max(sizes) / sum(sizes)
    if label == "fsdp 8":   # a save that fails on one rank: refused everywhere, the folder as it was
        r["failed save"] = _failed_save(ctx, named, os.path.join(out, label), ref.config)
    return r


_source_shapes = {}   # save_pretrained's folder, read once a job


def _tensor_shapes(folder) -> dict:
    """{name: shape} of every tensor a checkpoint folder's files hold."""
    from safetensors import safe_open
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), "pt") as st:
                out.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
    return out


def _failed_save(ctx, named, folder, config):
    before = sorted(os.listdir(folder)), os.path.getmtime(os.path.join(folder, hfc.INDEX))
    write = hfc._bytes

    def disk_full(*a, **k):   # rank 3's disk fills up half-way through its file
        raise OSError(28, "No space left on device")
    if ctx.rank == 3:
        hfc._bytes = disk_full
    try:
        hfc.save_hf_checkpoint(named, folder, config=config)
        said = "not refused"
    except OSError as e:
        said = str(e)
    finally:
        hfc._bytes = write
    dist.barrier()
    left = [f for f in os.listdir(os.path.dirname(folder)) if ".partial-" in f]
    return {"said": said, "unchanged": before == (sorted(os.listdir(folder)),
                                                  os.path.getmtime(os.path.join(folder, hfc.INDEX))), "left": left}


def checkpoints(ctx, args):
    """Both models, built on meta, on fsdp 8, dp 4 x tp 2 and pp 2 x fsdp 2 x tp 2 (Qwen3-MoE
    also with its experts split at ep 4, two copies each), each filled from a sharded
    checkpoint save_pretrained wrote, trained like one process, saved as a Hugging Face
    folder and loaded back by from_pretrained (two steps: the round trip, not the training,
    is what this checks); and a checkpoint that lacks a tensor, or has other shapes."""
    data, out = batches(steps=2), {}   # (training like one process over 4 steps: test_hf_models)
    root = os.path.join(args.out, "hf")
    for kind in COMPOSED:   # the other families on the 8-rank mesh with every split (by heads too)
        ref = tiny(kind, 4, router_loss=False)
        src = os.path.join(root, f"{kind} from save_pretrained")
        if ctx.rank == 0:
            ref.save_pretrained(src, max_shard_size="40KB")   # several files and their index
        dist.barrier()
        if ctx.rank == 0:   # (the one that compares; a copy of a transformers model is 0.1 s of CPU a rank)
            trained = copy.deepcopy(ref)
            train_reference(trained, data)
        cases = dict(CHECKPOINT_MESHES) if kind in MODELS else {k: v for k, v in CHECKPOINT_MESHES.items()
                                                                if k.startswith("pp")}
        if kind == "qwen3-moe":
            cases["ep 4 x 2 copies"] = None
        for label, sizes in cases.items():
            def put(model, sizes=sizes):
                if sizes is None:   # experts split over 4 consecutive ranks, the rest replicated
                    made = {a: [dist.new_group(r) for r in ranks] for a, ranks in
                            (("ep", [[0, 1, 2, 3], [4, 5, 6, 7]]), ("copies", [[i, i + 4] for i in range(4)]))}
                    ep_group, copies = made["ep"][ctx.rank // 4], made["copies"][ctx.rank % 4]
                    ep.split_experts(model, EXPERTS, ep_group, copies=copies)
                    module = ddp.DDPBucketed(model, 1, ignore_parameters=ep.expert_parameters(model))

                    def step(x, y):
                        loss_of(module, _mine(x, ctx.rank, 8), _mine(y, ctx.rank, 8)).backward()
                        module.finish_gradient_synchronization()
                        ep.reduce_expert_gradients(model, data_ranks=8)
                    return model, module, step
                mesh = nd.Mesh(sizes)
                stage, module, pipe = compose(kind, model, mesh)
                replicas = mesh.size("dp") * mesh.size("fsdp")
                replica = mesh.coord("dp") * mesh.size("fsdp") + mesh.coord("fsdp")

                def step(x, y):
                    x, y = (common.shard(t, replica, replicas) for t in (x, y))
                    if pipe is not None:
                        pipe.step(x if pipe.first else None, y if pipe.last else None)
                    else:
                        loss_of(module, x, y).backward()
                    if hasattr(module, "finish_gradient_synchronization"):
                        module.finish_gradient_synchronization()
                return stage, module, step
            with common.groups_freed():   # (each case's mesh: 28 groups a case, each a gloo thread)
                r = _checkpoint_round(ctx, kind, label, put, data, src, root, ref)
            if ctx.rank == 0:
                back = type(ref).from_pretrained(os.path.join(root, label))
                r["trained"] = compare(back.state_dict(), trained)["ok"]
            out[f"{kind}, {label}"] = everyone(r)
        if kind in MODELS:
            out[f"{kind}, missing"] = everyone(_missing(ctx, kind, src, root))
            out[f"{kind}, bf16 from float32"] = everyone(_cast(ctx, kind, src, ref))
    out["kit LM, fused qkv at tp 2"] = everyone(_fused_qkv(ctx, root))
    return out


def _fused_qkv(ctx, root):
    """The kit's LM under 08's tensor_parallel_lm at tp 2 (its fused qkv's rows reordered so
    each rank holds whole heads: three runs of rows a rank) from one model.safetensors:
    equal to the file, every rank reading exactly what it holds."""
    from safetensors.torch import save_file
    torch.manual_seed(0)
    whole = common.TransformerLM(64, 128, 2, 8, context_length=16)
    folder = os.path.join(root, "kit LM")
    if ctx.rank == 0:
        os.makedirs(folder, exist_ok=True)
        save_file(whole.state_dict(), os.path.join(folder, hfc.SINGLE))
    dist.barrier()
    pairs = [dist.new_group([i, i + 1]) for i in range(0, 8, 2)]
    with torch.device("meta"):
        model = common.TransformerLM(64, 128, 2, 8, context_length=16)
    tp.tensor_parallel_lm(model, pairs[ctx.rank // 2])
    r = hfc.load_hf_checkpoint(model, folder)
    full = placement.full_state_dict(model, all_ranks=True)
    r["equal"] = all(torch.equal(full[k], v) for k, v in whole.state_dict().items())
    return r


def _cast(ctx, kind, src, ref):
    """The model built in bfloat16 (on meta, then FSDP over every rank) filled from the
    float32 checkpoint: each tensor the checkpoint's, cast, bit for bit."""
    model = _from_meta(kind, 4).to(torch.bfloat16)
    fsdp.FSDP(model, units=list(model.model.layers))
    hfc.load_hf_checkpoint(model, src, pieces=hfc.per_expert_layout())
    full = placement.full_state_dict(model, all_ranks=True)
    return {"dtypes": sorted({str(v.dtype) for v in full.values()}),
            "equal": all(torch.equal(full[k], v.to(torch.bfloat16)) for k, v in ref.state_dict().items())}


def _missing(ctx, kind, src, root):
    """A copy of the checkpoint's index without one tensor: refused on every rank, naming
    it, the model still on meta (nothing read); the same model at another width: its
    shapes refused the same way; and the model built under torch.device("meta"), whose
    rotary tables would hold no values: refused, naming them."""
    lacking = os.path.join(root, f"{kind} lacking a tensor")
    if ctx.rank == 0:
        import shutil
        shutil.copytree(src, lacking, dirs_exist_ok=True)
        with open(os.path.join(lacking, hfc.INDEX)) as f:
            index = json.load(f)
        del index["weight_map"]["model.layers.1.self_attn.o_proj.weight"]
        with open(os.path.join(lacking, hfc.INDEX), "w") as f:
            json.dump(index, f)
    dist.barrier()
    model = _from_meta(kind, 4)
    fsdp.FSDP(model, units=list(model.model.layers))
    r = {}
    try:
        hfc.load_hf_checkpoint(model, lacking, pieces=hfc.per_expert_layout())
        r["refused"] = "not refused"
    except KeyError as e:
        r.update(refused=str(e), untouched=all(p.is_meta for p in model.parameters()))
    with torch.device("meta"):   # every tensor on meta: the rotary tables would hold no values
        bare = tiny(kind, 4, router_loss=False)
    try:
        hfc.load_hf_checkpoint(bare, src, pieces=hfc.per_expert_layout())
        r["bare meta"] = "not refused"
    except ValueError as e:
        r["bare meta"] = str(e) if all(p.is_meta for p in bare.parameters()) else f"changed: {e}"
    with placement.meta_parameters():   # the same names, another width: its shapes refused
        other = type(model)(type(model.config)(**{**model.config.to_dict(), "hidden_size": 32, "head_dim": 4}))
    try:
        hfc.load_hf_checkpoint(other, src, pieces=hfc.per_expert_layout())
        r["shapes"] = "not refused"
    except ValueError as e:
        r["shapes"] = str(e) if all(p.is_meta for p in other.parameters()) else f"changed: {e}"
    return r

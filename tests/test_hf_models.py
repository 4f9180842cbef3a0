"""The models people have, from transformers (a test dependency: requirements-test.txt):
LlamaForCausalLM and Qwen3MoeForCausalLM, their source and config classes as shipped, on
every axis and on two 8-rank meshes, each trained like one process with documented calls
only (tests/hf_model.py). One spawned job a world size serves every case."""
import re

import pytest

import common
from conftest import verify_args

_cache = {}


def run(worker, world_size):
    import hf_model
    if worker not in _cache:
        _cache[worker] = common.launch(getattr(hf_model, worker), verify_args(world_size, timeout=300.0),
                                       world_size=world_size)
    return _cache[worker]


AXES = [f"{kind}, {axis}" for kind in ("llama", "qwen3-moe")
        for axis in ("dp", "dp 04", "fsdp", "tp", "pp gpipe", "pp 1f1b", "pp interleaved", "pp zb1",
                     "cp ring", "cp allgather", "cp ulysses", "ft")] + ["qwen3-moe, ep with dp", "qwen3-moe, ep with fsdp"]


@pytest.mark.parametrize("case", AXES)
def test_each_axis_trains_a_transformers_model_like_one_process(case):
    r = run("axes", 2)[case]
    assert r["ok"], f"{case}: max diff {r['max_diff']}"
    assert r["norms"], f"{case}: a step's global norm differs from one process's"
    if " pp " in case:
        assert r["loads"], "the merged stages' checkpoint does not load into the model as built"


def test_the_model_returns_a_model_output_that_each_wrapper_passes_through():
    r = run("axes", 2)["outputs"]
    assert r == {w: "MoeCausalLMOutputWithPast" for w in ("dp", "dp 04", "fsdp")}   # a ModelOutput


def test_pipeline_stages_that_return_model_outputs_pass_their_tensors_on():
    assert run("axes", 2)["packed pipeline"] is True


def test_qwen3_moe_experts_are_split_along_their_first_dim_and_whole_in_a_checkpoint():
    r = run("axes", 2)["qwen3-moe, ep with dp"]
    assert r["held"] == {"gate_up_proj": [2, 64, 64], "down_proj": [2, 64, 32], "num_experts": 2}
    assert r["whole"] == {"gate_up_proj": [4, 64, 64], "down_proj": [4, 64, 32]}
    assert r["rows sent"] > 0   # tokens crossed to the other rank's experts


def test_a_per_head_norm_left_out_of_the_tp_plan_is_found_and_summed_and_trains_like_one_process():
    """Qwen3-MoE's q_norm and k_norm (one weight every head uses) left out of the plan: each
    rank's gradient of them is its own heads' part; parallelize's look at the first forward
    finds them between the split layers and sums them (before, this was the control that
    drifted 4.6e-3 away)."""
    r = run("axes", 2)["qwen3-moe, tp without the head norms"]
    assert r["summed"] == [f"model.layers.{i}.self_attn.{n}.weight" for i in (0, 1) for n in ("k_norm", "q_norm")]
    assert r["ok"] and r["norms"], r


@pytest.mark.parametrize("case", ["qwen3-moe, ep with dp", "qwen3-moe, ep with tp"])
def test_qwen3_moe_experts_split_beside_copies_or_tp_train_like_one_process(case):
    r = run("four_ranks", 4)[case]
    assert r["ok"], f"{case}: max diff {r['max_diff']}"
    assert r["norms"]


FAMILIES = ["qwen2-moe, all sparse", "olmo2", "apertus", "gpt-neox", "phi3", "glm4", "qwen3", "gemma3", "mixtral", "deepseek-v3",
            "llama4", "gemma4", "gemma3, multimodal"]
FAMILY_AXES = [f"{kind}, {axis}" for kind in FAMILIES for axis in ("tp", "pp 1f1b", "dp", "fsdp", "cp ring", "ft")] + \
    [f"gpt2, {axis}" for axis in ("dp", "fsdp", "cp ring", "ft")] + ["gemma3, tied, ft"] + \
    [f"{kind}, ep with dp" for kind in ("qwen2-moe, all sparse", "mixtral", "deepseek-v3", "llama4", "gemma4")] + \
    ["gemma3, tied, pp 1f1b"]
TP_ONLY = ["gemma3n, tp", "gpt-oss, tp", "granite-swa, tp", "deepseek-v32, tp"]   # (hf_model.TP_FAMILIES: tp alone)


@pytest.mark.parametrize("case", FAMILY_AXES)
def test_every_family_trains_on_every_axis_it_takes_like_one_process(case):
    """The same calls for every family, nothing written for one: tp by its own plan (split
    by heads where HF gathers), pipeline stages by its own pipeline plan and forward
    (09's ModelStage), DDPBucketed, FSDP by its _no_split_modules, context parallelism
    (ring; Gemma 3's attention scale passed through), its own experts split (12's
    split_experts); Gemma 3's head tied to its embedding across the stages. GPT-2 (Conv1D,
    no tp or pp plan) takes the axes that need no plan; tp and pp refuse it, named.
    DeepSeek-V3's plan names no attention: model_plan splits its MLA by heads from its config
    (test_mla_is_split_by_heads_from_the_config_with_no_entry_written). Llama 4's experts
    take every expert's rows at once (dense): split_experts sends each expert's rows to its
    rank and back (before 2026-11-30, a TypeError at the first forward). Gemma 3's multimodal
    class (its language model two modules down, beside a vision tower that text never
    reaches) by its language model's plans; its vision tower gets no gradient and stays."""
    r = run("axes", 2)[case]
    assert r["ok"], f"{case}: max diff {r['max_diff']}"
    assert r["norms"], f"{case}: a step's global norm differs from one process's"
    if " pp " in case:
        assert r["loads"], "the merged stages' checkpoint does not load into the model as built"


def _healed_late(case, c, ranks=1):
    """Replica 1 (its ranks after replica 0's) stepped from step 2 on, after a heal from
    replica 0, rank k from rank k, exact (sha256), of the weights and AdamW's two moments."""
    assert c["stepped"] == [[0, 1, 2, 3]] * ranks + [[2, 3]] * ranks, (case, c["stepped"])
    sources, joiners = c["heals"][:ranks], c["heals"][ranks:]
    for (source,), (joiner,) in zip(sources, joiners):
        assert source["role"] == "source" and joiner["role"] == "joiner", case
        assert joiner["step"] == 2 and joiner["exact"] and joiner["bytes"] == source["bytes"], (case, joiner)
        assert joiner["bytes"] >= c["weights"] + 2 * c["trained"], (case, joiner["bytes"], c["weights"])   # + AdamW's
        assert c["trained"] > (0.5 if "multimodal" in case else 0.99) * c["weights"], case   # exp_avg, exp_avg_sq


def test_a_replica_that_joins_late_heals_every_familys_model_and_its_optimizer_state():
    """14's replicas ("ft" above, one rank each): replica 1, its weights moved, joins at
    step 2 and heals from replica 0: every tensor the model registered (nested names,
    non-persistent rotary buffers, 3D experts, a tied head once) and AdamW's state, checked
    by sha256; then both step, each on its parts of the batch. (Without the heal its weights
    would stay 0.5 away; they are one process's.)"""
    r = run("axes", 2)
    cases = [k for k in r if k.endswith(", ft")]
    assert len(cases) == 2 + len(FAMILIES) + 2
    for case in cases:
        _healed_late(case, r[case])


@pytest.mark.parametrize("kind", ["llama", "qwen3-moe"])
def test_replicas_of_two_ranks_with_fsdp_inside_heal_shard_by_shard_and_train_like_one_process(kind):
    """14's replicas of 2 ranks each, 07's FSDP over a replica's ranks (its units the model's
    own decoder layers): replica 1 joins at step 2 and each of its ranks heals its shards
    from the same rank of replica 0; the global norm is placement's, over the replica."""
    c = run("four_ranks", 4)[f"{kind}, ft with fsdp inside"]
    assert c["ok"], f"max diff {c['max_diff']}"
    assert "only where a replica is one rank (this one has 2" in c["refused"]   # bucket_mb, before its hello
    assert c["norms"]
    _healed_late(kind, c, ranks=2)


@pytest.mark.parametrize("case", [f"{kind}, {mesh}" for kind in ("llama", "qwen3-moe", *FAMILIES)
                                  for mesh in ("pp 2 x fsdp 2 x tp 2", "dp 2 x cp 2 x tp 2")])
def test_transformers_models_composed_on_eight_ranks_train_like_one_process(case):
    r = run("composed", 8)[case]
    assert r["ok"], f"{case}: max diff {r['max_diff']}"
    assert r["norms"], f"{case}: each step's norm {r['norm_diffs']} from one process's, its floors {r['norm_floors']}"


@pytest.mark.parametrize("case, words", [
    ("no match", "'model.layers.*.mlp.expert' matches no module"),
    ("no experts", "model.layers.0.self_attn has no num_experts"),
    ("divide", "2 ranks do not divide model.layers.0.mlp.experts's 3 experts")])
def test_split_experts_refuses_what_it_cannot_split_before_changing_the_model(case, words):
    assert words in run("axes", 2)["refusals"][case]


@pytest.mark.parametrize("kind", ["qwen2-moe, all sparse", "olmo2", "gpt-neox", "phi3", "glm4"])
def test_a_family_trains_by_its_own_tp_plan_like_one_process(kind):
    """08's model_plan reads the plan the model ships (config.base_model_tp_plan), nothing
    written per family, and splits by heads where HF gathers: Phi-3's fused qkv_proj (each
    rank its own q, k and v heads, the attention's head counts divided in a config of its
    own) and gate_up_proj, GLM-4's gate_up_proj, OLMo-2's q and k normed over every head (the
    norm's statistic summed over the ranks), GPT-NeoX's embedding split by vocabulary. Each
    trains like one process; an all-sparse MoE's entries for a dense MLP it never builds are
    left out (parallelize refused the whole plan for them)."""
    r = run("axes", 2)
    assert r[f"{kind}, tp"]["ok"], f"max diff {r[f'{kind}, tp']['max_diff']}"
    assert r[f"{kind}, tp"]["norms"]
    plan, whole = r["own plans"][kind]
    kinds = {k.rsplit(".", 1)[1] if not k.endswith("_heads") else k.split("self_attn.")[1]:
             tuple(v) if isinstance(v, list) else v for k, v in plan.items()}
    want = {"qwen2-moe, all sparse": {"q_proj": "column", "k_proj": "column", "v_proj": "column", "o_proj": "row"},
            "olmo2": {"q_proj": "column", "k_proj": "column", "v_proj": "column", "o_proj": "row", "q_norm": "norm",
                      "k_norm": "norm", "gate_proj": "column", "up_proj": "column", "down_proj": "row"},
            "gpt-neox": {"embed_in": "vocab", "query_key_value": "column", "dense": "row", "dense_h_to_4h": "column",
                         "dense_4h_to_h": "row"},
            "phi3": {"qkv_proj": ("column", (64, 16, 16)), "o_proj": "row", "gate_up_proj": ("column", (128, 128)),
                     "down_proj": "row", "num_key_value_heads": "divide", "config.num_attention_heads": "divide",
                     "config.num_key_value_heads": "divide"},
            "glm4": {"q_proj": "column", "k_proj": "column", "v_proj": "column", "o_proj": "row",
                     "gate_up_proj": ("column", (128, 128)), "down_proj": "row"}}[kind]
    assert kinds == want
    assert not [k for k in plan if ".mlp.gate_proj" in k] or kind == "olmo2"   # the dense MLP it does not build
    assert " ".join(whole.values()) == ("" if kind != "qwen2-moe, all sparse" else " ".join(whole.values()))
    if kind == "qwen2-moe, all sparse":
        assert "expert parallelism" in " ".join(whole.values())


def test_an_mlp_whose_gate_is_cut_by_statistics_of_all_its_features_stays_whole_under_tp():
    """Gemma 3n's MLPs with activation sparsity (its first ten layers) cut their gate's
    output at its mean plus a multiple of its spread over every intermediate feature; split
    by columns, each rank took its own half's, and 13 on Gemma 3n at tp 2 failed its check
    against one process (max diff 9e-4). model_plan keeps such an MLP whole on every rank
    and splits the others' (here layer 1's); Gemma 3n then trains like one process. Split
    as transformers' plan has it, parallelize's look at the first forward refuses the
    mean taken over the split features, naming the MLP."""
    r = run("axes", 2)
    assert r["gemma3n, tp"]["ok"], f"max diff {r['gemma3n, tp']['max_diff']}"
    assert r["gemma3n, tp"]["norms"]
    plan, whole = r["own plans"]["gemma3n"]
    assert {k: v for k, v in plan.items() if ".mlp." in k} == {
        "model.layers.1.mlp.gate_proj": "column", "model.layers.1.mlp.up_proj": "column",
        "model.layers.1.mlp.down_proj": "row"}
    assert whole["model.layers.0.mlp"].startswith("activation sparsity 0.95: its gate's cutoff")
    assert plan["model.layers.*.self_attn.q_proj"] == "column"   # its attention split in every layer
    msg = r["gemma3n, tp with its sparse MLP split"]   # split as transformers' plan has it: refused
    assert msg.startswith("model.layers.0.mlp: mean over the 128 features its column layers split over the group's "
                          "2 ranks would be taken over each rank's 64 alone"), msg


def test_a_parameter_with_one_entry_a_head_is_split_with_the_heads():
    """GPT-OSS's attention adds a learned logit a head (its sinks, shaped [heads]) to each
    head's softmax; its plan (transformers 5.24's) splits only the embedding, and 08's words
    had none for such a parameter, so no plan could split its attention. "heads" gives each
    rank its heads' rows, beside its column-split projections: GPT-OSS trains like one
    process at tp 2. Left whole, the sinks meet the split heads at the first forward,
    refused naming them and the word."""
    r = run("axes", 2)
    assert r["gpt-oss, tp"]["ok"], f"max diff {r['gpt-oss, tp']['max_diff']}"
    assert r["gpt-oss, tp"]["norms"]
    assert r["gpt-oss, tp with its sinks whole"].startswith("model.layers.0.self_attn.sinks (8,): a parameter the plan "
                                                           "leaves whole meets features split")
    assert '"heads" for one entry a head' in r["gpt-oss, tp with its sinks whole"]
    assert r["heads that do not divide"] == "sinks: its 3 heads do not divide over the group's 2 ranks"


def test_a_parameter_the_models_plan_splits_colwise_is_split_with_the_heads():
    """Granite-SWA's plan (transformers 5.24's, as MiMo-V2-Flash's, GraniteMoE-SWA's and
    HY-V4's) names its attention sinks, one a head, "colwise": a parameter, not a module,
    which model_plan kept whole, and the sinks then met the split heads at the first
    forward, refused. model_plan now splits a 1-D parameter its plan names colwise by
    "heads", beside its attention's split heads: Granite-SWA trains like one process at
    tp 2 with nothing written."""
    r = run("axes", 2)
    assert r["granite-swa, tp"]["ok"], f"max diff {r['granite-swa, tp']['max_diff']}"
    assert r["granite-swa, tp"]["norms"]
    plan, whole = r["own plans"]["granite-swa"]
    assert plan["model.layers.*.self_attn.sinks"] == "heads" and plan["model.layers.*.self_attn.q_proj"] == "column"


def test_the_tp_families_sweep_tells_a_family_that_trains_from_one_refused():
    """tools/tp_families.py (make tp-families), in the shared job: Granite-SWA by its own
    plan passes (its logits and every gradient within 1e-4 of one process's); Doge, whose
    plan leaves a parameter a key/value head whole, is refused in one line naming it."""
    rows = {r["family"]: r for r in run("axes", 2)["tp families"]}
    assert rows["granite_swa"]["outcome"] == "PASS" and rows["granite_swa"]["grads"] < 1e-4, rows["granite_swa"]
    assert rows["doge"]["outcome"] == "refused", rows["doge"]
    assert rows["doge"]["why"].startswith("ValueError: model.layers.0.self_attn.A (2,): a parameter the plan leaves "
                                          "whole meets features split"), rows["doge"]


def test_whole_scores_whose_top_keys_mask_the_split_heads_train_like_one_process():
    """DeepSeek-V3.2's indexer (DSA) scores keys from the whole low-rank query (after
    q_a_layernorm, which also goes on whole into q_b_proj) and masks every split head's
    attention to each query's top keys. Its indices carry no gradient back, but
    parallelize's look at the first forward followed them as computed from q_a_layernorm's
    weight, found it both meeting split features and going on whole, and refused (so were
    GLM-MoE-DSA, HY-V4 and AXK-2). Integer outputs (indices, masks) now carry nothing:
    DeepSeek-V3.2 trains like one process at tp 2 by its own plan, its indexer whole."""
    r = run("axes", 2)
    assert r["deepseek-v32, tp"]["ok"], f"max diff {r['deepseek-v32, tp']['max_diff']}"
    assert r["deepseek-v32, tp"]["norms"]
    plan, whole = r["own plans"]["deepseek-v32"]
    assert plan["model.layers.*.self_attn.q_b_proj"] == "column" and "model.layers.*.self_attn.indexer" in whole


def test_mla_is_split_by_heads_from_the_config_with_no_entry_written():
    """DeepSeek-V3's plan names no attention; its config describes MLA (kv_lora_rank,
    qk_rope_head_dim), so model_plan takes MLA's own plan (transformers' DeepSeek-V2 one):
    the up-projections q_b_proj and kv_b_proj column, o_proj row, and the rotary key of
    kv_a_proj_with_mqa "shared" (the low-rank down-projections and their norms stay whole);
    "deepseek-v3, tp" above trains by it like one process."""
    attention = run("axes", 2)["own plans"]["deepseek-v3, attention"]
    a = "model.layers.*.self_attn."
    assert attention == {f"{a}q_b_proj": "column", f"{a}kv_a_proj_with_mqa": ("shared", (16, 20)),
                         f"{a}kv_b_proj": "column", f"{a}o_proj": "row"}


def test_mla_by_heads_without_its_shared_rotary_key_is_refused_at_the_first_forward_naming_it():
    """Every head uses the one rotary key kv_a_proj_with_mqa makes, and the rest of its
    output goes on whole into kv_b_proj: left out of the plan, its gradient would be partly
    this rank's heads' part and partly whole, neither summed nor replicated (it trained
    2.4e-3 to 6e-3 away before): refused, naming it."""
    msg = run("axes", 2)["deepseek-v3, tp with MLA, the rotary key not shared"]
    assert msg.startswith("model.layers.0.self_attn.kv_a_proj_with_mqa.weight (20, 64): a parameter the plan leaves "
                          "whole of which part meets features split over the group's 2 ranks and part goes on whole"), msg


def test_packed_projections_split_as_one_matrix_do_not_train_like_one_process():
    """The control: Phi-3's qkv_proj and gate_up_proj cut as if each were one matrix (rank 0
    gets all of q and part of k, say): it runs, and it is a different model."""
    r = run("axes", 2)["phi3, packed split as one matrix"]
    assert not r["ok"] and not r["norms"]


CONTROLS = ("phi3, packed split as one matrix",)


def test_each_bound_follows_its_cases_rounding_floor_and_every_control_lies_far_beyond_it():
    """docs/testing: each comparison's bound is FLOOR_TIMES its floor, how far float32's
    rounding alone moves those weights (the same steps in float64 beside them), measured on
    the machine that runs it; a floor is measured for every case, and each broken variant the
    suite keeps misses its bound a hundredfold or more."""
    from own_model import FLOOR_TIMES
    r = run("axes", 2)
    floors = {k: v["floor"] for k, v in r.items() if isinstance(v, dict) and "max_diff" in v}
    assert len(floors) == len(AXES) + len(FAMILY_AXES) + 1 + len(TP_ONLY) + len(CONTROLS)   # (+ the head norms left out)
    # (Gemma 4's four-layer pipeline: 2e-4, its q_proj's and embedding's near-zero gradients
    # through AdamW's division by sqrt(v); every other case under 1e-4)
    assert all(0 < f < (3e-4 if k.startswith("gemma4, pp") else 1e-4) for k, f in floors.items()), floors
    for case in CONTROLS:
        assert r[case]["max_diff"] > 100 * FLOOR_TIMES * r[case]["floor"], (case, r[case])


def test_parameters_a_familys_plan_leaves_whole_between_its_split_layers_are_found_and_summed():
    """Apertus's xIELU activation holds two learned scalars between the column-split up_proj
    and the row-split down_proj, named nowhere in its plan: parallelize's look at the first
    forward finds them (and nothing in any other family) and sums their gradients, so
    "apertus, tp" above trains like one process (it drifted 1.5e-3 away in 4 steps before)."""
    summed = run("axes", 2)["summed whole"]
    assert summed.pop("apertus") == [f"model.layers.{i}.mlp.act_fn.{a}" for i in (0, 1) for a in ("alpha_n", "alpha_p")]
    assert not any(summed.values()), summed


def test_the_models_own_plan_is_the_hand_written_one_and_fsdp_units_are_its_decoder_layers():
    r = run("axes", 2)
    llama, qwen = r["own plans"]["llama"], r["own plans"]["qwen3-moe"]
    import hf_model
    assert llama[0] == hf_model.PLANS["llama"] and not llama[1]
    assert {k: v for k, v in qwen[0].items() if ".mlp." not in k} == hf_model.PLANS["qwen3-moe"]
    assert set(qwen[1]) == {f"{hf_model.EXPERTS}{s}" for s in ("", ".gate_up_proj", ".down_proj")}
    assert r["units"] == {"llama": ["LlamaDecoderLayer"], "qwen3-moe": ["Qwen3MoeDecoderLayer"]}


def test_a_model_with_no_plan_or_an_unknown_style_is_refused_naming_it(one_rank):
    import torch
    import transformers
    tp = common.load_script(common.ROOT / "08_tensor_parallel.py")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64))
    with pytest.raises(ValueError, match=re.escape("GPT2LMHeadModel ships no tensor-parallel plan")):
        tp.model_plan(gpt2)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4))
    llama.config.base_model_tp_plan = {**llama.config.base_model_tp_plan, "layers.*.mlp.up_proj": "colwise_sideways"}
    with pytest.raises(ValueError, match=re.escape("'model.layers.*.mlp.up_proj': style 'colwise_sideways' is not one")):
        tp.model_plan(llama)
    assert isinstance(llama.model.layers[0].mlp.up_proj, torch.nn.Linear)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3-moe", "qwen2-moe", "gemma2", "gemma3, tied", "phi3", "olmo2",
                                  "glm4", "mixtral", "gpt-neox", "deepseek-v3", "gpt2, tied", "opt", "bloom", "falcon",
                                  "bamba", "biogpt", "llama4", "nemotron-h"])
def test_a_stage_by_the_models_own_plan_computes_the_models_own_forward(kind):
    """09's ModelStage, nothing written for the family: eager attention, sequences past the
    sliding window, Gemma 2's soft-caps, Gemma 3's rotary table per layer type and its tied
    head, MLA attention; and for the families that ship no pipeline plan (GPT-2, OPT,
    BLOOM, Falcon, Bamba, whose forward unpacks each layer's output into two, BioGPT, which
    names no no-split modules, Llama 4, whose decoder is not under its base_model_prefix,
    NemotronH, whose forward reads its layers' block_type), the plan read from the model:
    the stages chained are the model's forward and backward, bit for
    bit, at 2 and 4 stages and at 2 chunks a stage."""
    import hf_model
    for n_stages, chunks in ((2, 1), (4, 1), (2, 2)):
        r = hf_model.stage_against_forward(kind, n_stages, chunks)
        assert r["logits"] == 0 and r["grads"] == 0, f"{n_stages} stages x {chunks}: {r}"
        assert not r["missing"]
        assert r["tied"] == ([[1, 1], [1, 0, 0, 1], [1, 1]][[(2, 1), (4, 1), (2, 2)].index((n_stages, chunks))]
                             if kind.endswith(", tied") else [0] * n_stages)


def test_a_stage_may_hold_the_head_alone_or_uneven_runs_of_layers():
    """cuts as PipelineStage takes them: a last stage holding only the final norm and head
    (the activation enters at the norm), and runs of 1 and 3 layers."""
    import hf_model
    alone = hf_model.stage_against_forward(
        "gemma2", 3, build=lambda m, s, n, c: hf_model.pp.ModelStage(m, s, n, c, cuts=[0, 2, 4, 5]))
    uneven = hf_model.stage_against_forward(
        "llama", 2, build=lambda m, s, n, c: hf_model.pp.ModelStage(m, s, n, c, cuts=[0, 1, 4]))
    assert alone["logits"] == alone["grads"] == uneven["logits"] == uneven["grads"] == 0


def test_position_ids_ride_along_every_stage():
    import hf_model
    r = hf_model.stage_against_forward("gemma2", 2, positions=True)
    assert r["logits"] == 0 and r["grads"] == 0


@pytest.mark.parametrize("kind", ["gemma2", "llama"])
def test_the_hand_written_stage_is_not_the_models_forward_under_eager_attention(kind):
    """The control: docs/10's former recipe (the layers called with the rotary tables and no
    mask) attends to the future under eager attention, and Gemma 2's head has no soft-cap."""
    import hf_model
    r = hf_model.stage_against_forward(kind, 2, build=hf_model.hand_written_stage)
    assert r["logits"] > 0.1 and r["grads"] > 1e-3


def test_a_stage_refuses_what_the_models_plan_cannot_place():
    import torch
    import transformers
    pp = common.load_script(common.ROOT / "09_pipeline_parallel.py")
    import hf_model
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64))
    assert pp.pipeline_plan(gpt2) == ["wte", "wpe", "drop", "h", "ln_f"]   # (read: it ships none)
    gpt2._no_split_modules = []   # no decoder layers named (as BioGPT): the outermost list of one kind of module
    assert pp.pipeline_plan(gpt2) == ["wte", "wpe", "drop", "h", "ln_f"]
    gpt2.transformer.extra = torch.nn.ModuleList([torch.nn.Linear(2, 2)])   # and a second such list: none can be read
    with pytest.raises(ValueError, match=re.escape("GPT2LMHeadModel ships no pipeline plan (config.base_model_pp_plan) "
                                                   "and none can be read from it")):
        pp.ModelStage(gpt2, 0, 2)
    moe = hf_model.stage_family("qwen3-moe")
    moe.config.output_router_logits = True
    with pytest.raises(ValueError, match="output_router_logits=True: its balancing loss is over every layer"):
        pp.ModelStage(moe, 0, 2)
    llama = hf_model.stage_family("llama")
    llama.model.extra = torch.nn.Linear(4, 4)   # a module of the model's own that its plan does not name
    with pytest.raises(ValueError, match=re.escape("LlamaForCausalLM's model.extra has parameters its pipeline plan")):
        pp.ModelStage(llama, 0, 2)
    with pytest.raises(ValueError, match=re.escape("5 stages x 1 chunks for 4 layers")):
        pp.ModelStage(hf_model.stage_family("llama"), 0, 5)
    assert len(llama.model.layers) == 4 and all(type(b).__name__ == "LlamaDecoderLayer" for b in llama.model.layers)


@pytest.mark.parametrize("kind, words", [
    ("dory", "DoryForCausalLM's forward runs its layers [1, 2] more than once each (a recurrent depth"),
    ("inkling2-loop", "Inkling2LoopForCausalLM's forward runs its layers [1, 2] more than once each"),
    ("inkling2", "Inkling2ForCausalLM's layers hand each other argument 1 beside the hidden state (Inkling2's block "
                 "states), here from a layer another stage holds")])
def test_a_stage_refuses_layers_run_twice_or_handed_more_than_the_hidden_state(kind, words):
    """Dory and Inkling2-Loop run their middle layers twice a forward (a recurrent depth);
    Inkling2's layers each take every earlier layer's hidden state (its block states). On
    Dory a stage holding part of the layers computed another model, silently (13's check on
    it a FAIL); both Inkling2s ended in an AttributeError (their forward reads a class
    attribute of their layers, which the stand-ins did not carry), and with that mended
    Inkling2's stages computed another model too (logits 0.83 away). A stage's first forward
    notes the order its layers run in and what they are given: refused, naming why."""
    import hf_model
    with pytest.raises(ValueError, match=re.escape(words)):
        hf_model.stage_against_forward(kind, 2)


@pytest.mark.parametrize("kind", ["dory", "inkling2"])
def test_a_stage_that_refuses_in_a_pipeline_raises_on_every_rank_none_left_in_a_receive(kind):
    """The same refusals in a Pipeline on 2 ranks, as a user's own loop (torchrun's, say)
    runs it, not in the kit's launcher, which ends the other ranks itself: the stage that
    refused raises its ValueError, and the other rank the same kind naming that stage, not
    a wait for its gradients until the group's timeout. Both are refused by the last stage
    (the first hands on before Dory's layers run again, and before Inkling2's block states
    cross), whose first forward had run in the schedule, after the first stage's: the first
    step now runs it before the schedule, as the other stages' (09's infer)."""
    said, stage = run("axes", 2)[f"{kind}, refused in a pipeline"], 1
    assert len(said) == 2 and all(s.startswith("ValueError: ") for s in said), said
    words = "more than once each" if kind == "dory" else "hand each other argument 1 beside the hidden state"
    assert words in said[stage] and f"stage {stage}'s first forward" not in said[stage], said
    assert f"stage {stage}'s first forward: " in said[1 - stage] and words in said[1 - stage], said


def test_the_new_plan_words_refuse_what_they_cannot_split_before_changing_anything(one_rank):
    """("column", parts) whose parts do not add up, "norm" on a norm that is not an RMS norm
    (a LayerNorm subtracts the mean: a split would need a second statistic), "vocab" on a
    module that is no embedding: each a ValueError naming the module, the model unchanged.
    At one rank the words themselves compute the whole layer (a split of one)."""
    import torch
    tp = common.load_script(common.ROOT / "08_tensor_parallel.py")
    import hf_model
    model = hf_model.stage_family("phi3")
    before = {n: p.shape for n, p in model.named_parameters()}
    for plan, words in (({"model.layers.*.self_attn.qkv_proj": ("column", (64, 16, 15))}, "parts [64, 16, 15] must add"),
                        ({"model.layers.*.self_attn.qkv_proj": ("row", (64, 16, 16))}, "unknown kind"),
                        ({"model.layers.*.mlp.down_proj": "vocab"}, "must be an nn.Embedding"),
                        ({"model.layers.*.self_attn.nope.num_heads": "divide"}, "matches no integer attribute"),
                        ({"model.layers.*.self_attn.qkv_proj.bias": "heads"}, "matches no parameter")):
        with pytest.raises(ValueError, match=re.escape(words)):
            tp.parallelize(model, plan)
    ln = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    with pytest.raises(ValueError, match=re.escape("LayerNorm is not weight * x * rsqrt(mean(x^2) + eps)")):
        tp.parallelize(ln, {"0": "column", "1": "norm"})
    assert {n: p.shape for n, p in model.named_parameters()} == before and isinstance(ln[0], torch.nn.Linear)
    x = torch.randint(0, 256, (2, 16))
    want = model(input_ids=x).logits
    plan, whole = tp.model_plan(model)
    tp.parallelize(model, plan)
    assert type(model.model.layers[0].self_attn.qkv_proj).__name__ == "ColumnParallelLinear" and not whole
    assert model.model.layers[0].self_attn.config is not model.config   # the attention's own counts
    assert torch.allclose(model(input_ids=x).logits, want, atol=1e-6)
    olmo = hf_model.stage_family("olmo2")
    want = olmo(input_ids=x).logits
    tp.parallelize(olmo, tp.model_plan(olmo)[0])
    assert type(olmo.model.layers[0].self_attn.q_norm).__name__ == "SplitRMSNorm"
    assert torch.allclose(olmo(input_ids=x).logits, want, atol=1e-6)


def test_every_style_transformers_registers_is_split_or_kept_whole_by_name():
    """model_plan knows every tensor-parallel style transformers registers (its
    ALL_PARALLEL_STYLES), so a plan that ships with any family is split or kept whole,
    named, never refused for a word; mla_kv_a_proj becomes "shared" on MLA's rotary key."""
    tp = common.load_script(common.ROOT / "08_tensor_parallel.py")
    from transformers.distributed import tensor_parallel as hf_tp
    import transformers.distributed.expert_parallel   # noqa: F401 (registers the experts' styles in the same registry)
    styles = set(hf_tp.ALL_PARALLEL_STYLES)
    known = set(tp.HF_STYLES) | set(tp.HF_KEPT_WHOLE)
    assert styles and styles <= known, styles - known
    import hf_model
    model = hf_model.tiny("deepseek-v3")
    model.config.base_model_tp_plan = {**model.config.base_model_tp_plan,
                                       "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj"}
    plan, _ = tp.model_plan(model)
    assert plan["model.layers.*.self_attn.kv_a_proj_with_mqa"] == ("shared", (16, 20))


def test_a_gathered_projection_with_no_row_partner_is_kept_whole_though_its_width_is_the_heads():
    """Qwen3-Next's linear attention: its plan gathers in_proj_qkvz, in_proj_ba and out_proj,
    and names no row partner. out_proj's width is the attention heads' by chance (4 x 16),
    and model_plan split it by heads, ungathered: --tp 2 failed at the residual add (64
    against 32). Kept whole now; its full attention and shared expert are still split."""
    import transformers
    tp = common.load_script(common.ROOT / "08_tensor_parallel.py")
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, layer_types=["linear_attention", "full_attention"]))
    plan, whole = tp.model_plan(model)
    for name in ("out_proj", "in_proj_qkvz", "in_proj_ba"):
        assert f"model.layers.*.linear_attn.{name}" not in plan and "no row partner" in \
            whole[f"model.layers.*.linear_attn.{name}"]
    assert plan["model.layers.*.self_attn.q_proj"] == "column" and plan["model.layers.*.mlp.shared_expert.down_proj"] == "row"

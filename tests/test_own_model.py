"""Your own model on the kit's axes: the tests' Llama-style decoder (tests/llama.py: rotary
positions from position indices, RMSNorm, grouped-query attention with 8 query and 2
key/value heads through F.scaled_dot_product_attention, SwiGLU, untied head, Meta's module
names), written for one process and never changed, trained with documented calls only and
compared with one process over several clipped AdamW steps."""
import pytest

import common
from conftest import verify_args

_cache = {}


def run(worker, world_size):
    import own_model
    key = (worker, world_size)
    if key not in _cache:
        _cache[key] = common.launch(getattr(own_model, worker), verify_args(world_size), world_size=world_size)
    return _cache[key]


@pytest.mark.parametrize("world_size, layout", [(2, "dp 1 x tp 2"), (4, "dp 2 x tp 2")])
def test_llama_under_a_whole_model_tp_plan_trains_like_one_process(world_size, layout):
    r = run("tensor_parallel", world_size)[layout]
    assert r["ok"], f"{layout}: max diff {r['max_diff']}"
    assert r["norms"]   # 08's clip_grad_norm_ saw the one process's global norm each step


def test_parameters_left_whole_between_split_layers_are_summed_and_train_like_one_process():
    """A block the kit has never seen (ScaledBlock): a learned activation's two scalars and
    a scale per head dimension sit between the column and the row layers, whole on every
    rank, each rank's gradient of them its own features' part; parallelize's look at the
    first forward sums them over the group (and not the norm before the split layers)."""
    r = run("tensor_parallel", 2)["between split layers"]
    assert r["summed"] == ["act.alpha_n", "act.alpha_p", "scale"]
    assert r["ok"] and r["norms"], r


def test_a_whole_parameter_that_does_not_fit_the_split_features_is_refused_naming_it():
    msg = run("tensor_parallel", 2)["a gain per split feature"]
    assert msg.startswith("gain (64,): a parameter the plan leaves whole meets features split over the group's 2 "
                          "ranks and does not fit their part"), msg


def test_a_statistic_taken_over_the_split_features_is_refused_at_the_first_forward_naming_it():
    """Split by columns, the MLP's hidden features centered on their mean would be centered
    on each rank's half's mean: no parameter tells (its shapes all fit), and it trains as a
    different model. parallelize's look at the first forward follows where the features are
    split and refuses the op that takes a statistic over them, naming it and its module."""
    msg = run("tensor_parallel", 2)["a mean over split features"]
    assert msg.startswith("ScaledBlock: mean over the 64 features its column layers split over the group's 2 ranks "
                          "would be taken over each rank's 32 alone, a different model"), msg


@pytest.mark.parametrize("case, words", [
    ("no match", "plan key 'layers.*.attention.wqkv' matches no module"),
    ("heads", "layers.0.attention.n_kv_heads = 1 does not divide over the group's 2 ranks"),
    ("kind", "unknown kind 'colum'"),
])
def test_a_plan_it_cannot_apply_is_refused_before_anything_changes(case, words):
    msg = run("plan_refusals", 2)[case]
    assert words in msg and not msg.startswith("changed the model"), msg


@pytest.mark.parametrize("world_size", [2, 4])
def test_llama_with_swiglu_experts_and_a_shared_expert_under_ep_trains_like_one_process(world_size):
    r = run("expert_parallel", world_size)
    assert r["ok"], f"ep {world_size}: max diff {r['max_diff']}"
    assert r["norms"] and r["shared_replicated"]
    assert len(r["local_experts"]) == 4 // world_size   # this rank's share of the user's experts
    assert r["grouped"] == ("grouped_swiglu" if world_size == 2 else "loop")


@pytest.mark.parametrize("world_size", [2, 4])
def test_any_models_attention_runs_under_context_parallel_like_one_process(world_size):
    res = run("context_parallel", world_size)
    cases = {k: r for k, r in res.items() if k.startswith("attention")}
    assert len(cases) == 3 * 2 * 2 * 2
    for name, r in cases.items():
        assert r["ok"], f"cp {world_size}, {name}: max diff {r['max_diff']}"
    for layout in ("contiguous", "zigzag"):   # the ring sends only the key/value heads there are: 2 of 8
        for causal in ("causal", "full"):
            gqa, rep = (res[f"attention, ring, {layout}, {causal}, {w}"] for w in ("enable_gqa", "repeated"))
            assert gqa["sent"] > 0 and rep["sent"] == pytest.approx(4 * gqa["sent"])
            assert gqa["sent"] == pytest.approx(gqa["formula"]) and rep["sent"] == pytest.approx(rep["formula"])


@pytest.mark.parametrize("method", ["ring", "allgather", "ulysses"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_llama_under_context_parallel_trains_like_one_process(world_size, method):
    r = run("context_parallel", world_size)[f"llama, {method}"]
    assert r["ok"], f"cp {world_size}, {method}: max diff {r['max_diff']}"
    assert r["norms"]


def test_without_its_true_positions_the_llama_does_not_train_like_one_process():
    assert not run("context_parallel", 2)["llama, control"]["ok"]


@pytest.mark.parametrize("case, words", [("attn_mask", "with an attn_mask"), ("dropout", "dropout_p 0.1"),
                                         ("gqa without enable_gqa", "without enable_gqa=True")])
def test_context_parallel_refuses_what_it_cannot_split_and_the_group_still_works(case, words):
    res = run("context_parallel", 2)
    assert words in res[f"refuses {case}"]
    assert res["works after a refusal"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb1"])
def test_llama_cut_into_pipeline_stages_trains_like_one_process(schedule):
    r = run("pipeline", 2)[schedule]
    assert r["ok"], f"{schedule}: max diff {r['max_diff']}"
    assert r["norms"] and r["loads"]


def test_llama_with_its_head_tied_to_its_embedding_across_two_stages_trains_like_one_process():
    r = run("pipeline", 2)["tied"]
    assert r["ok"], f"max diff {r['max_diff']}"
    assert r["norms"]


@pytest.fixture(scope="module")
def composed(tmp_path_factory):
    import own_model
    return common.launch(own_model.composed, verify_args(8, out=str(tmp_path_factory.mktemp("composed"))),
                         world_size=8)


@pytest.mark.parametrize("case", ["pp 2 x fsdp 2 x tp 2, then dp 2 x cp 2 x tp 2",
                                  "dp 2 x cp 2 x tp 2, then pp 2 x fsdp 2 x tp 2"])
def test_llama_composed_by_calls_trains_clips_and_resumes_on_another_mesh(composed, case):
    """08's plan, 09's stages, 07's FSDP, 05's DDP and 11's context manager on the user's
    Llama, one clip_grad_norm_ and one checkpoint (common's placement record) over all of
    them: the checkpoint of the first mesh, half-way, resumes on the second."""
    for rank, r in enumerate(composed[case]):
        assert r["ok"], f"rank {rank}: max diff {r['max_diff']}"
        assert r["inf and 1-norm"], rank
        assert r["one process"], rank   # the sharded checkpoint loads into the model of one process too
        assert r["scalars once"] == [1], rank   # AdamW's step of each parameter written by one rank, not 8
        if case.startswith("pp"):   # the norm over tp alone: a stage's part, refused (not silently partial)
            assert "outside the process group" in r["refused"], r["refused"]
        else:                       # the tp group holds the whole model: each data rank's copy clips alike
            assert r["refused"] == "not refused"
        first, then = case.split(", then ")
        assert r[first] == {"count": True, "norms": True}, (rank, first)
        assert r[then] == {"count": True, "norms": True, "sharded": True}, (rank, then)   # sharded = full, bit for bit


def test_the_composition_takes_a_llama_built_on_meta_each_rank_holding_its_part(composed):
    """pp 2 x fsdp 2 x tp 2 on a Llama built under torch.device("meta"): materialize makes
    each rank's part real (an eighth of the model and the replicated norms' and FSDP's
    padding: under a fifth), the Llama's own init fills it, and it trains like one process."""
    for rank, r in enumerate(composed["pp 2 x fsdp 2 x tp 2, built on meta"]):
        assert r["ok"] and r["norms"], f"rank {rank}: max diff {r['max_diff']}"
        assert r["held"] < 0.2, r["held"]


def test_without_the_placement_record_the_count_is_wrong(composed):
    assert composed["control count"] > 1.2   # tp's whole weights (embedding, norms, head) counted twice


def test_each_class_dropped_after_training_frees_the_model():
    """A loop that builds one model after another in a process (a sweep, a notebook) gets
    each one's memory back, and its process groups' threads: no class keeps its model alive
    through a gradient hook torch holds where Python's collector cannot see (DDPBucketed,
    DDPIndividualParameters and ShardedGradientOptimizer did) or a thread of its own (14's
    ReplicaManager's beats did); the control, a hook that holds its wrapper, keeps it."""
    r = run("dropped", 2)
    control = "a hook holding its wrapper (the control)"
    assert not r.pop(control)
    assert r == dict.fromkeys(["DDPIndividualParameters", "DDPBucketed", "ShardedOptimizer", "ShardedGradientOptimizer",
                               "FSDP", "parallelize", "PipelineStage", "context_parallel", "MoE", "ReplicaManager"],
                              True), r


def test_llama_in_replicas_that_survive_a_loss_trains_like_one_process():
    """14's ReplicaManager around the Llama as written (one rank a replica): the quorum's
    all-reduce and vote give one process's weights."""
    r = run("fault_tolerant_replicas", 2)
    assert r["ok"], r

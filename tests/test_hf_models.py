"""The models people have, from transformers (a test dependency: requirements-test.txt):
LlamaForCausalLM and Qwen3MoeForCausalLM, their source and config classes as shipped, on
every axis and on two 8-rank meshes, each trained like one process with documented calls
only (tests/hf_model.py). One spawned job a world size serves every case."""
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
                     "cp ring", "cp allgather", "cp ulysses")] + ["qwen3-moe, ep with dp", "qwen3-moe, ep with fsdp"]


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


def test_a_per_head_norm_left_out_of_the_tp_plan_does_not_train_like_one_process():
    r = run("axes", 2)["qwen3-moe, tp without the head norms"]
    assert not r["ok"] and not r["norms"]


@pytest.mark.parametrize("case", ["qwen3-moe, ep with dp", "qwen3-moe, ep with tp"])
def test_qwen3_moe_experts_split_beside_copies_or_tp_train_like_one_process(case):
    r = run("experts_on_four", 4)[case]
    assert r["ok"], f"{case}: max diff {r['max_diff']}"
    assert r["norms"]


@pytest.mark.parametrize("case", [f"{kind}, {mesh}" for kind in ("llama", "qwen3-moe")
                                  for mesh in ("pp 2 x fsdp 2 x tp 2", "dp 2 x cp 2 x tp 2")])
def test_transformers_models_composed_on_eight_ranks_train_like_one_process(case):
    r = run("composed", 8)[case]
    assert r["ok"], f"{case}: max diff {r['max_diff']}"
    assert r["norms"]


@pytest.mark.parametrize("case, words", [
    ("no match", "'model.layers.*.mlp.expert' matches no module"),
    ("no experts", "model.layers.0.self_attn has no num_experts"),
    ("divide", "2 ranks do not divide model.layers.0.mlp.experts's 3 experts")])
def test_split_experts_refuses_what_it_cannot_split_before_changing_the_model(case, words):
    assert words in run("axes", 2)["refusals"][case]

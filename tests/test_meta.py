"""A model larger than one rank: built on the meta device, each axis applied, then each rank
given real storage for its part only (placement.materialize), filled by the model's own init
module by module (placement.initialized) or from a checkpoint; trained against one process."""
import copy
import sys

import pytest
import torch
import torch.nn as nn

import common
import placement
from conftest import ROOT, verify_args

sys.path.insert(0, str(ROOT / "tests"))
import llama  # noqa: E402

_cache = {}


def run(worker, world_size):
    import tempfile

    import meta_model
    key = (worker, world_size)
    if key not in _cache:
        with tempfile.TemporaryDirectory() as out:
            _cache[key] = common.launch(getattr(meta_model, worker), verify_args(world_size, out=out),
                                        world_size=world_size)
    return _cache[key]


def _llama_init(m):
    if isinstance(m, llama.RMSNorm):
        nn.init.ones_(m.weight)
    elif hasattr(m, "reset_parameters"):
        m.reset_parameters()


def test_the_init_module_by_module_gives_one_processs_constructor_values_bit_for_bit():
    torch.manual_seed(4)
    want = llama.Transformer(llama.ModelArgs())
    with torch.device("meta"):
        model = llama.Transformer(llama.ModelArgs())
    blueprint = copy.deepcopy(model)
    before = torch.get_rng_state()
    placement.materialize(model, "cpu", placement.initialized(blueprint, _llama_init, seed=4))
    assert torch.equal(torch.get_rng_state(), before)   # the caller's generator untouched
    for name, t in want.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    lm = common.build_lm("nano", 16, "cpu", seed=2)      # the kit's LM: every module's reset_parameters
    with torch.device("meta"):
        meta = common.TransformerLM(*common.MODEL_SIZES["nano"], context_length=16)
    placement.materialize(meta, "cpu", placement.initialized(copy.deepcopy(meta), seed=2))
    assert all(torch.equal(a, b) for a, b in zip(lm.state_dict().values(), meta.state_dict().values()))


def test_a_tied_weight_keeps_its_first_modules_values_and_the_later_init_still_draws():
    def build():
        m = llama.Transformer(llama.ModelArgs())
        m.output.weight = m.tok_embeddings.weight
        return m
    torch.manual_seed(1)
    want = build()
    with torch.device("meta"):
        model = build()
    placement.materialize(model, "cpu", placement.initialized(copy.deepcopy(model), _llama_init, seed=1))
    assert model.output.weight is model.tok_embeddings.weight
    for name, t in want.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name


def test_materialize_without_a_source_leaves_storage_for_a_checkpoint_and_a_missing_tensor_is_named():
    with torch.device("meta"):
        model = llama.Transformer(llama.ModelArgs())
    placement.materialize(model, "cpu")
    assert not any(t.is_meta for t in model.state_dict().values())
    with torch.device("meta"):
        model = llama.Transformer(llama.ModelArgs())
    state = llama.Transformer(llama.ModelArgs()).state_dict()
    del state["norm.weight"]
    with pytest.raises(KeyError, match="norm.weight"):
        placement.materialize(model, "cpu", state)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("axis", ["ddp", "fsdp", "tp", "pipeline", "experts"])
def test_each_axis_takes_a_meta_built_llama_and_trains_like_one_process(world_size, axis):
    res = run("axes", world_size)
    assert res["collectives seen"] > 0   # and none was given a meta tensor (the observer raises)
    key = {"tp": "dp 1 x tp 2" if world_size == 2 else "dp 2 x tp 2"}.get(axis, axis)
    r = res[key]
    assert r["ok"], f"{axis} at {world_size}: max diff {r['max_diff']}"
    assert r["norms"]
    if axis == "ddp":
        assert len(set(res["same init on every rank"])) == 1
    if axis == "fsdp":   # this rank's shards: a W-th of every tensor's rows, padded
        whole = sum(p.numel() for p in llama.Transformer(llama.ModelArgs()).parameters())
        assert whole / world_size <= res["fsdp held"] < whole / world_size * 1.1
    if axis == "pipeline":   # each rank made only its stage's tensors real
        assert r["meta left"] > 0 and sum(r["held"]) == r["whole"] and max(r["held"]) < r["whole"]
    if axis == "experts":
        assert len(r["local"]) == 4 // world_size


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("how", ["load_full_state_dict", "load_sharded"])
def test_a_meta_built_model_loads_a_checkpoint_into_its_storage(world_size, how):
    r = run("axes", world_size)[how]
    assert r["ok"] and r["max_diff"] == 0.0, r


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_state_merged_over_ranks_arrives_bit_for_bit_whatever_its_tensors(world_size):
    """full_state_dict's and full_optim_state_dict's transport (placement._collect) on the
    world and on a group of the last ranks, to the first rank and to all (meta_model.collected)."""
    for r in run("axes", world_size)["collect"]:
        assert r and all(r.values()), r


@pytest.mark.parametrize("case, words", [
    ("shape", "activation_shape says [[4, 16, 32] float32] crosses into stage 1 (chunk 0), but the model sends "
              "[[4, 16, 64] float32, [16, 4] float32, [16, 4] float32]"),
    ("other module", "the init of layers.0.attention (Attention) writes fill_ into a tensor that is not its own"),
    ("no reset", "layers.0.attention_norm (RMSNorm) has parameters or buffers of its own and no reset_parameters"),
])
def test_what_a_meta_setup_refuses_is_named_on_every_rank(case, words):
    res = run("refusals", 2)
    assert words in res[case], res[case]
    if case == "shape":
        assert res["grads after"] == 0   # refused before the schedule ran

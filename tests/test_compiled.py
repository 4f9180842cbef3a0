"""torch.compile with the kit's classes: the tests' Llama with each layer compiled
(``layer.compile()``, torch.compile per block as torchtitan does; inductor on the CPU), on
DDPBucketed, FSDP (prefetching), parallelize, PipelineStage, context_parallel and the MoE
with split experts, each against the same compiled model in one process (tests/compiled.py).
One spawned group of 2 ranks serves every case."""
import pytest

import common
from conftest import verify_args

CLASSES = ["DDPBucketed", "FSDP", "parallelize", "PipelineStage", "context_parallel", "MoE"]
_cache = {}


def run():
    import compiled
    if "classes" not in _cache:
        _cache["classes"] = common.launch(compiled.classes, verify_args(2, timeout=600.0), world_size=2)
    return _cache["classes"]


@pytest.mark.parametrize("name", CLASSES)
def test_each_class_trains_a_compiled_llama_like_the_same_compiled_model_in_one_process(name):
    r = run()[name]
    assert r["ok"] and r["norms"], f"{name}: max diff {r['max_diff']}"
    assert r["graphs"] > 0   # dynamo compiled the layers: not an eager fallback
    if name == "FSDP":   # its hooks run eager, outside the compiled layers: no more graphs than DDPBucketed's
        ddp_graphs = run()["DDPBucketed"]["graphs"]   # (traced, they had made 8: a graph per layer's place)
        assert r["graphs"] - ddp_graphs <= ddp_graphs
    if name == "PipelineStage":   # the first step's shape probe (Pipeline.infer, without autograd) runs
        assert r["probe_graphs"] == 0   # eager: no second graph of each layer, compiled for no_grad

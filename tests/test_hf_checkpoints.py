"""Hugging Face checkpoints in and out (hf_checkpoint.py) on transformers' LlamaForCausalLM
and Qwen3MoeForCausalLM built on meta (placement.meta_parameters): filled from the sharded
folder save_pretrained wrote, each rank reading only its slices, on fsdp 8, dp 4 x tp 2,
pp 2 x fsdp 2 x tp 2 and (Qwen3-MoE) its own experts split at ep 4, and every other family
of tests/hf_model.py on pp 2 x fsdp 2 x tp 2 by its own plans (the packed projections split by
heads, the norms over all heads, GPT-NeoX's embedding by vocabulary); trained like one
process, saved as a folder from_pretrained loads with the same logits, bit for bit. One
spawned job of 8 ranks serves every case (tests/hf_model.py's checkpoints)."""
from pathlib import Path

import pytest

import common
from conftest import verify_args

@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import hf_model
    return common.launch(hf_model.checkpoints, verify_args(8, timeout=300.0, out=str(tmp_path_factory.mktemp("hf"))),
                         world_size=8)


FAMILIES = ["qwen2-moe, all sparse", "olmo2", "gpt-neox", "phi3", "glm4", "qwen3", "gemma3", "mixtral", "deepseek-v3",
            "gemma3, multimodal"]   # (its vision tower on the first stage, written back as it came)
CASES = [f"{kind}, {mesh}" for kind in ("llama", "qwen3-moe")
         for mesh in ("fsdp 8", "dp 4 x tp 2", "pp 2 x fsdp 2 x tp 2")] + ["qwen3-moe, ep 4 x 2 copies"] + \
    [f"{kind}, pp 2 x fsdp 2 x tp 2" for kind in FAMILIES]   # Phi-3's packed rows, OLMo-2's split norms, a vocabulary


@pytest.mark.parametrize("case", CASES)
def test_a_model_built_on_meta_is_filled_from_its_checkpoint_reading_only_its_slices(results, case):
    ranks = results[case]
    assert all(r["meta"] and r["buffers"] for r in ranks)   # parameters on meta, rotary tables the model's own
    assert all(r["loaded"] for r in ranks), "the loaded weights differ from the checkpoint's"
    assert all(r["read"] == r["held"] for r in ranks), [(r["read"], r["held"]) for r in ranks]


@pytest.mark.parametrize("case", CASES)
def test_trained_and_saved_it_loads_in_transformers_with_the_same_logits(results, case):
    first = results[case][0]
    assert first["logits"], "from_pretrained's logits differ from the saved weights'"
    assert first["trained"], "the saved weights differ from one process trained on the same batches"
    assert len(first["files"]) > 1 and all(f.startswith("model-") for f in first["files"])
    assert first["largest share"] <= 0.6   # written by ranks in turn: no rank held the whole model


@pytest.mark.parametrize("case", CASES)
def test_the_folder_written_back_has_the_sources_tensor_names_and_shapes(results, case):
    """save_hf_checkpoint(layout=model_layout(model)): the tensors, by name and shape, that
    save_pretrained wrote for the same model (Mixtral's and Qwen3-MoE's experts one tensor
    each under their files' names, GPT-NeoX's embed_out), not the model's fused tensors."""
    assert results[case][0]["layout"], results[case][0]["layout diff"]


def test_a_save_that_fails_on_one_rank_is_refused_on_every_rank_and_the_folder_stays_as_it_was(results):
    for r in results["llama, fsdp 8"]:
        assert "rank 3: [Errno 28] No space left on device" in r["failed save"]["said"]
        assert r["failed save"]["unchanged"] and not r["failed save"]["left"]


@pytest.mark.parametrize("kind", ["llama", "qwen3-moe"])
def test_a_checkpoint_lacking_a_tensor_or_of_other_shapes_is_refused_on_every_rank_before_anything_is_read(results, kind):
    for r in results[f"{kind}, missing"]:
        assert "lacks ['model.layers.1.self_attn.o_proj.weight']" in r["refused"]
        assert r["untouched"]
        assert "model.embed_tokens.weight: [256, 64] in the folder, [256, 32] here" in r["shapes"], r["shapes"]
        assert "['model.rotary_emb.inv_freq', 'model.rotary_emb.original_inv_freq'] are buffers" in r["bare meta"]
        assert "placement.meta_parameters()" in r["bare meta"]


def test_a_fused_qkv_split_by_heads_reads_each_ranks_rows_and_nothing_more(results):
    for r in results["kit LM, fused qkv at tp 2"]:
        assert r["equal"] and r["read"] == r["held"], r


@pytest.mark.parametrize("kind", ["llama", "qwen3-moe"])
def test_a_model_built_in_bf16_takes_the_float32_checkpoint_cast(results, kind):
    for r in results[f"{kind}, bf16 from float32"]:
        assert r == {"dtypes": ["torch.bfloat16"], "equal": True}


def test_experts_the_files_hold_transposed_are_read_and_written_back_as_the_source_held_them(tmp_path):
    """Qwen3-VL-MoE's experts are [E, in, out] in the Hub's files and [E, out, in] in the
    model: transformers transposes a shape that differs from the model's (check_dims).
    model_layout refused that conversion, so 13 could not load the family at all (before
    2026-11-30). One process, both layouts: the Hub's and the model's own (what save_pretrained
    writes) are read into a model built on meta, equal to from_pretrained's; written back, each
    folder has its source's names and shapes, and from_pretrained reads it back the same."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    import hf_checkpoint as hfc
    import placement
    from test_13_train import qwen3_vl_moe, tensors_in
    auto = transformers.AutoModelForImageTextToText
    torch.manual_seed(0)
    qwen3_vl_moe(vocab=64, layers=1).save_pretrained(tmp_path / "own")
    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "config.json").write_text((tmp_path / "own" / "config.json").read_text())
    stored = load_file(tmp_path / "own" / "model.safetensors")
    save_file({k: v.transpose(1, 2).contiguous() if ".experts." in k else v for k, v in stored.items()},
              hub / "model.safetensors", metadata={"format": "pt"})
    experts = "model.language_model.layers.0.mlp.experts."
    for folder in (tmp_path / "own", hub):
        want = auto.from_pretrained(folder).state_dict()
        with placement.meta_parameters():
            model = auto.from_config(transformers.AutoConfig.from_pretrained(folder))
        layout = hfc.model_layout(model, str(folder))
        hfc.load_hf_checkpoint(model, str(folder), pieces=layout)
        assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items()), folder.name
        out = hfc.save_hf_checkpoint(model, str(tmp_path / f"{folder.name}-out"), config=model.config, layout=layout)
        assert tensors_in(Path(out)) == tensors_in(folder), folder.name
        back = auto.from_pretrained(out).state_dict()
        assert all(torch.equal(v, want[k]) for k, v in back.items()), folder.name
    assert tensors_in(hub)[experts + "down_proj"] == (4, 8, 32)        # [E, in, out] on the Hub,
    assert tensors_in(tmp_path / "own")[experts + "down_proj"] == (4, 32, 8)   # the model's [E, out, in]

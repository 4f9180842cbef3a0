"""08's and 09's classes in the loops users write: a GPT the kit did not write, split with
08's parallelize, and a pipeline of nn.TransformerEncoderLayer stages, against one process,
with clipping by the global norm (torch's clip on a rank's part as the control that must
fail), accumulation, dropout, evaluation, and checkpoints resumed at another degree."""
import atexit
import os
import shutil
import tempfile
import time

import pytest

import common
from conftest import seconds, verify_args

_cache = {}


def run(world_size):
    """Every case at this world size, one job (the 2-rank job saves the checkpoints the
    4-rank job resumes: it runs first)."""
    import loops
    if world_size not in _cache:
        if "folder" not in _cache:
            _cache["folder"] = tempfile.mkdtemp(prefix="loops_")
            atexit.register(shutil.rmtree, _cache["folder"], True)   # the checkpoints go with the session
        folder = _cache["folder"]
        if world_size == 4:
            run(2)
        _cache[world_size] = common.launch(loops.real_loops, verify_args(world_size), os.path.join(folder, "ckpt.pt"),
                                           world_size=world_size)
    return _cache[world_size]


def norms_agree(ranks, rel=1e-4):
    return all(abs(a - b) <= rel * b for r in ranks for a, b in r["norms"])


def test_a_gpt_split_by_parallelize_trains_like_one_process_under_its_clip():
    ranks = run(2)["tp clip ours"]
    assert all(r["ok"] for r in ranks), [r["max_diff"] for r in ranks]
    assert all(r["clipped"] for r in ranks) and norms_agree(ranks)
    for r in ranks:   # evaluation under no_grad, on every rank of the group: the process's loss
        assert r["eval"][0] == pytest.approx(r["eval"][1], rel=1e-5)


def test_torch_clip_on_a_tensor_parallel_rank_is_silently_wrong():
    ranks = run(2)["tp clip torch"]
    assert not norms_agree(ranks) and ranks[0]["norms"][0][0] != ranks[1]["norms"][0][0]   # two factors
    assert not all(r["ok"] for r in ranks)


def test_dropout_keeps_the_replicated_weights_equal_over_the_group():
    cases = run(2)
    assert all(r["same"] for r in cases["tp dropout"])
    assert not all(r["same"] for r in cases["tp dropout, seeded apart, not synced"])   # the control
    split = cases["tp dropout in the split region"]
    assert all(r["same"] and r["own_masks"] for r in split)   # each rank its own mask, the rest in step


def test_a_tensor_parallel_checkpoint_resumes_at_another_degree():
    ranks = run(4)["tp resumed"]   # saved at tp 2 after 3 steps, resumed at tp 4
    assert all(r["ok"] for r in ranks), [r["max_diff"] for r in ranks]


def test_evaluation_on_one_rank_of_a_tp_group_fails_saying_why(tmp_path):
    import loops
    began = tmp_path / "began"
    with pytest.raises(common.LaunchError, match="rank 0 failed") as e:
        common.launch(loops.tp_eval_on_one_rank, verify_args(2, began=str(began)))
    assert time.time() - float(began.read_text()) < seconds(15)   # its 2 s eval timeout, not rank 1's 20 s
    assert "every rank of a tensor-parallel group must run the same forwards, evaluation too" in str(e.value)


@pytest.mark.parametrize("world_size, case", [(2, "pp 2 stages x 1, clip ours"), (4, "pp 2 stages x 2, clip ours")])
def test_a_pipeline_of_encoder_layers_trains_like_one_process_under_its_clip(world_size, case):
    import loops
    ranks = run(world_size)[case]
    assert all(r["ok"] for r in ranks), [r["max_diff"] for r in ranks]
    assert all(r["clipped"] for r in ranks) and norms_agree(ranks)
    names = sorted(n for r in ranks for n in r["names"])
    assert names == sorted(sorted(loops.Encoder().state_dict()) * (world_size // 2))   # each on one stage


def test_torch_clip_on_a_pipeline_stage_is_silently_wrong():
    ranks = run(2)["pp 2 stages x 1, clip torch"]
    assert not norms_agree(ranks) and not all(r["ok"] for r in ranks)


def test_a_pipeline_checkpoint_resumes_at_another_number_of_stages():
    ranks = run(4)["pp resumed"]   # saved at 2 stages after 3 steps, resumed at 4
    assert all(r["ok"] for r in ranks), [r["max_diff"] for r in ranks]


def test_a_gpt_on_three_axes_by_documented_calls_trains_clips_and_resumes_on_another_mesh(tmp_path):
    """tp (parallelize) x fsdp (FSDP) x dp (DDPBucketed) on the GPT, with its own parameter
    groups and accumulation: every step's norm is the process's; the checkpoint saved on
    dp 2 x fsdp 2 x tp 2 resumes on fsdp 4 x tp 2 and ends at the process's weights."""
    import loops
    res = common.launch(loops.gpt_three_axes, verify_args(8), str(tmp_path / "gpt.pt"), world_size=8)
    for ranks in res.values():
        assert norms_agree(ranks)
    assert all(r["ok"] for r in res["fsdp 4 x tp 2"]), [r["max_diff"] for r in res["fsdp 4 x tp 2"]]
    assert all(r["sharded"] for r in res["fsdp 4 x tp 2"])   # the sharded checkpoint loads as the full one

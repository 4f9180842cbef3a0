import json

import pytest

import common
from conftest import check_equivalence, run_inline

CASES = list(common.VERIFY_CASES)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("case", CASES)
def test_flat_ddp_matches_single_process(world_size, case):
    check_equivalence("03_flat_ddp", world_size, case)


def test_benchmark_compares_naive_and_flat_in_one_run(tmp_path):
    p = run_inline("03_flat_ddp.py", "--world-size", "2", "--model-size", "nano", "--steps", "2",
                   "--warmup", "1", "--no-verify", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    rows = {r["method"]: r for r in json.loads((tmp_path / "03_flat_ddp.json").read_text())["rows"]}
    naive, flat = rows["naive (per-parameter)"], rows["flat (one all-reduce)"]
    assert flat["collectives"] == 1                      # the LM has one dtype: one call
    assert naive["collectives"] == len(list(common.build_lm("nano", 128, "cpu").parameters())) + 1
    for r in (naive, flat):
        assert 0 < r["comm_ms"] < r["step_ms"]

"""The shape every numbered script shares: each class is one copyable region that needs
only torch and the standard library, takes a process group, and the scripts refuse a
results folder they cannot write before any worker starts."""
import ast
import builtins
import symtable
import sys

import pytest

import common
from conftest import ROOT, refused, verify_args

CLASSES = {"02_naive_ddp": "NaiveDDP", "03_flat_ddp": "FlatDDP", "04_overlap_ddp": "DDPIndividualParameters",
           "05_bucketed_ddp": "DDPBucketed", "06_sharded_optimizer": "sharded optimizers", "07_fsdp": "FSDP",
           "08_tensor_parallel": "tensor-parallel layers", "09_pipeline_parallel": "pipeline parallelism",
           "10_nd_parallel": "Mesh", "11_context_parallel": "context-parallel attention",
           "12_expert_parallel": "mixture of experts", "14_fault_tolerant_dp": "fault-tolerant replicas"}
MAIN_CLASS = {"sharded optimizers": "ShardedGradientOptimizer", "tensor-parallel layers": "ColumnParallelLinear", "pipeline parallelism": "Pipeline",   # several classes
              "context-parallel attention": "_RingAttention", "mixture of experts": "MoE",
              "fault-tolerant replicas": "ReplicaManager"}
# (script or library file, region name; None: the whole file is the copy)
REGIONS = {**CLASSES, "01_allreduce_bench": "point-to-point", "placement": None, "sharded_checkpoint": None,
           "hf_checkpoint": None, "step_profile": None}
LIBRARY_MAIN = {"placement": "Placement", "sharded_checkpoint": "save_sharded", "hf_checkpoint": "save_hf_checkpoint",
                "step_profile": "profile_step"}
ALSO = {"hf_checkpoint": ("transformers",)}   # a library file's packages beyond torch, named in its docstring


def undefined_names(src: str) -> set:
    """Global names the code reads but neither defines, imports, nor gets from builtins."""
    top = symtable.symtable(src, "<region>", "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    missing = set()

    def walk(table):
        for s in table.get_symbols():
            if (table is top or s.is_global()) and s.is_referenced() and s.get_name() not in defined \
                    and not hasattr(builtins, s.get_name()):
                missing.add(s.get_name())
        for child in table.get_children():
            walk(child)
    walk(top)
    return missing


def imported_modules(src: str) -> set:
    imported = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    return imported


@pytest.mark.parametrize("script, name", REGIONS.items())
def test_the_copy_region_needs_only_torch_the_standard_library_and_the_files_it_names(script, name):
    """A copy is the region and the kit's files its first line names (placement.py), each
    of which needs only torch, the standard library and files named there too."""
    import workers
    src = workers.copied_region(script, name)
    main = LIBRARY_MAIN.get(script) or MAIN_CLASS.get(name, name)
    assert f"class {main}(" in src or f"class {main}:" in src or f"def {main}(" in src or "def ring_all_reduce(" in src
    named = workers.kit_files(src)
    header = workers.region_header(script, name)
    for f in named:
        assert f"{f}.py" in header, f"{script}'s region imports {f}.py but its first line does not name it: {header}"
    assert "common.py" not in header and "common" not in named
    kit = set(named)
    for f in named:   # what a named file needs is named too
        assert set(workers.kit_files(workers.copied_region(f, None))) <= kit
    imported = imported_modules(src) - kit
    assert all(m in header for m in ALSO.get(script, ()))
    assert imported and all(m == "torch" or m in sys.stdlib_module_names or m in ALSO.get(script, ())
                            for m in imported), imported
    assert undefined_names(src) == set()   # nothing from the rest of the script (common, helpers)


def test_the_undefined_name_check_can_fail():
    assert undefined_names("import torch\nclass A:\n    def f(self):\n        return common.x + torch.y\n") == {"common"}


def used_before_imported(src: str) -> list:
    """(function, name, line) where a function reads a name above its own import of it: an
    import inside a function makes the name local to all of it (`import torch._dynamo`
    binds `torch`), so the read above is an UnboundLocalError, reached perhaps only on a GPU."""
    found = []
    for fn in ast.walk(ast.parse(src)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = {}
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    for a in node.names:
                        name = a.asname or a.name.split(".")[0]
                        first[name] = min(first.get(name, node.lineno), node.lineno)
            found += [(fn.name, n.id, n.lineno) for n in ast.walk(fn) if isinstance(n, ast.Name)
                      and isinstance(n.ctx, ast.Load) and n.lineno < first.get(n.id, 0)]
    return found


def test_no_function_reads_a_name_above_its_own_import_of_it():
    files = sorted([*ROOT.glob("*.py"), *ROOT.glob("tools/*.py"), *ROOT.glob("tests/*.py")])
    assert len(files) > 40
    assert {str(f.relative_to(ROOT)): found for f in files if (found := used_before_imported(f.read_text()))} == {}
    assert used_before_imported("import torch\ndef launch():\n    torch.cuda.set_device(0)\n    import torch._dynamo\n"
                                ) == [("launch", "torch", 3)]   # common.launch's, found on a GPU


_cache = {}


def once(key, fn):
    """One job's result shared by several parametrized tests."""
    if key not in _cache:
        _cache[key] = fn()
    return _cache[key]


@pytest.mark.parametrize("script, name", CLASSES.items())
def test_the_copied_region_alone_trains_like_one_process(script, name):
    import workers
    r = once("copies", lambda: common.launch(workers.train_with_copied_regions, verify_args(2), CLASSES))[name]
    assert r["ok"], f"{name} copied alone: max diff {r['max_diff']}"


# Each group trains on its own data and must match its own single-process reference: a
# class that communicated over every rank would mix the two groups' gradients.
SUBGROUP_CASES = {"02_naive_ddp": ["uneven", "everything"], "03_flat_ddp": ["uneven", "everything"],
                  "04_overlap_ddp": ["uneven", "everything"], "05_bucketed_ddp": ["uneven", "everything"],
                  "06_sharded_optimizer": ["adamw", "state_dict_round_trip"], "07_fsdp": ["toy fp32 tied", "LM fp32 (AdamW, clipped at 1.0)"]}
LAYOUTS = {"{0,1},{2,3}": [[0, 1], [2, 3]], "{0,2},{1,3}": [[0, 2], [1, 3]]}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("script", SUBGROUP_CASES)
def test_each_class_trains_on_a_subgroup(script, layout):
    import workers
    by_layout = once(script, lambda: common.launch(workers.verify_on_subgroups, verify_args(4), script,
                                                   list(LAYOUTS.values()), SUBGROUP_CASES[script]))
    everyone = by_layout[list(LAYOUTS).index(layout)]
    for rank, r in enumerate(everyone):
        assert rank in LAYOUTS[layout][r["group"]]
        assert r["results"] and all(res["ok"] for res in r["results"].values()), (rank, r["results"])


def test_a_class_that_ignores_its_group_fails_the_subgroup_check():
    import workers
    r = common.launch(workers.world_ddp_on_subgroups, verify_args(4), LAYOUTS["{0,2},{1,3}"])
    assert not r["ok"] and r["max_diff"] > 1e-4


@pytest.mark.parametrize("script", ["02_naive_ddp.py", "05_bucketed_ddp.py", "01_allreduce_bench.py"])
def test_an_out_folder_that_cannot_be_written_is_refused_before_any_worker_starts(tmp_path, script):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    line = refused(script, "--out", str(blocker / "results"))   # nothing verified, nothing measured
    assert "--out" in line and "cannot be made" in line and "is a file, not a folder" in line

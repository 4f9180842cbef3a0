"""The device audit: a GPU's device rules on a CPU run (diagnostics.DeviceAudit). A GPU run
found two classes of bug no CPU run could: a collective given a host tensor (NCCL refuses
it) and the one-process reference compared with the method's weights across devices. The
audit labels each tensor host or device as a GPU run would place it, so the tests catch both
here; `make gpu-check`'s CPU dry run runs every smoke job under it."""
import argparse
import copy

import pytest
import torch
import torch.distributed as dist

import common
import placement
import diagnostics
import workers


def test_audit_refuses_a_host_tensor_in_a_collective_and_names_where_it_was_made(one_rank):
    with diagnostics.device_audit():
        fine = torch.zeros(3, device=torch.device("cpu"))      # made on the job's device
        dist.all_reduce(fine)
        moved = torch.ones(2).to(torch.device("cpu"))          # moved there: a copy, as on a GPU
        dist.all_reduce(moved)
        host = torch.tensor(0.5, dtype=torch.float64)          # no device: the host, on a GPU too
        with pytest.raises(RuntimeError, match=r"dist.all_reduce was given a host tensor \(made at "
                                               r"test_device_audit.py:\d+\).*NCCL refuses"):
            dist.all_reduce(host)
        with pytest.raises(RuntimeError, match="host tensor"):
            dist.all_gather_into_tensor(torch.zeros(2, device=torch.device("cpu")), torch.ones(2))
    dist.all_reduce(torch.tensor(0.5))   # outside the block: no audit


def test_audit_refuses_mixing_host_and_device_as_cuda_does_and_allows_what_cuda_allows(one_rank):
    with diagnostics.device_audit() as audit:
        model = torch.nn.Linear(4, 4).to(torch.device("cpu"))
        assert audit.of(model.weight)[0] == diagnostics.DEVICE
        assert audit.of(torch.nn.Linear(2, 2).weight)[0] == diagnostics.HOST   # built, never moved
        gathered = model.weight.detach().cpu()                            # a copy on the host
        assert gathered is not model.weight and audit.of(gathered)[0] == diagnostics.HOST
        with pytest.raises(RuntimeError, match="sub mixes a host tensor"):
            gathered - model.weight.detach()
        with pytest.raises(RuntimeError) as e:   # (assert_close wraps what its comparison raised)
            torch.testing.assert_close(gathered, model.weight.detach())
        assert "mixes a host tensor" in f"{e.value} {e.value.__cause__}"
        torch.testing.assert_close(gathered, model.weight.detach().cpu())   # both on the host
        scale = torch.tensor(0.5)                                            # a host scalar: CUDA takes it
        assert audit.of(model.weight * scale)[0] == diagnostics.DEVICE
        model(torch.randn(3, 4).to(torch.device("cpu"))).sum().backward()
        torch.optim.AdamW(model.parameters()).step()                         # its step counter stays on the host
        with pytest.raises(RuntimeError, match="assigning .grad"):
            model.bias.grad = torch.zeros(4)


def test_audit_keeps_where_a_tensor_was_through_an_object_collective(one_rank):
    with diagnostics.device_audit() as audit:
        device = torch.ones(3, device=torch.device("cpu"))
        got = [None]
        dist.all_gather_object(got, {"host": torch.ones(3), "device": device, "n": 1})
        assert audit.of(got[0]["host"])[0] == diagnostics.HOST and audit.of(got[0]["device"])[0] == diagnostics.DEVICE
        box = [torch.zeros(2)]
        dist.broadcast_object_list(box, src=0)
        assert torch.is_tensor(box[0]) and audit.of(box[0])[0] == diagnostics.HOST


def test_the_gpu_runs_failures_fail_under_the_audit_on_the_cpu(monkeypatch):
    """08's comparison across devices, 12's and 11's host tensors on NCCL groups: each of
    them failed on the H200 at 8b1762b; under the audit each fails here on the old code,
    and none does now."""
    monkeypatch.setenv(diagnostics.AUDIT_ENV, "1")
    args = argparse.Namespace(world_size=2, backend="gloo", device="cpu", timeout=60.0, seed=0, model_size="nano",
                              context_length=16, batch_size=4, experts=4, top_k=2, aux_coef=0.01, moe_every=1,
                              warmup=0, steps=1)
    got = common.launch(workers.device_audit_regressions, args)
    assert got == {k: None for k in got} and len(got) == 4, got


def test_a_meta_built_model_is_made_real_under_the_audit_where_its_sources_are(one_rank):
    """materialize swaps each meta tensor for real storage (torch.utils.swap_tensors, which
    refuses a tensor something holds a weak reference to: the audit's table did, and 10's
    smoke jobs failed under it); the source's host tensors, cut by an order moved to their
    own device (``order.to(whole.device)``), stay on the host as on a GPU."""
    with diagnostics.device_audit() as audit:
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
        blueprint = copy.deepcopy(model)
        weight = model[0].weight
        placement.materialize(model, torch.device("cpu"), placement.initialized(blueprint, seed=0))
        assert model[0].weight is weight and not weight.is_meta
        assert audit.of(weight)[0] == diagnostics.DEVICE
        torch.manual_seed(0)
        plain = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
        assert all(torch.equal(a.cpu(), b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))
        host, device = torch.arange(6.0), torch.arange(3, device=torch.device("cpu"))
        moved = device.to(host.device)                 # where ``host`` is: the host
        assert audit.of(moved)[0] == diagnostics.HOST and audit.of(host.index_select(0, moved))[0] == diagnostics.HOST
        assert audit.of(host.to(device.device))[0] == diagnostics.DEVICE


def test_the_audit_finds_the_tensors_of_a_call_as_pytree_does():
    """Its own walk of tuples, lists and dicts (pytree for anything else): the same tensors,
    the same objects, in the same order, as torch's pytree finds."""
    import collections
    from torch.utils._pytree import tree_leaves
    pair = collections.namedtuple("pair", "a b")
    t, u, w = torch.ones(2), torch.zeros(3), torch.nn.Parameter(torch.ones(1))
    calls = [((t, 1.0, None), {"out": u}), ([t, [u, (w,)]], {}), (pair(t, u),), ({"x": t, "y": [u]},),
             (torch.Size([2]), t), (torch.topk(torch.arange(5.0), 2),), (collections.OrderedDict(a=t, b=(u, 2)),),
             (slice(1, 2), ..., torch.float32, torch.device("cpu"), t, "s", 3 + 0j), ()]
    for call in calls:
        got, want = diagnostics._tensors(call), [x for x in tree_leaves(call) if torch.is_tensor(x)]
        assert len(got) == len(want) and all(a is b for a, b in zip(got, want)), call


def test_torchs_frames_are_known_when_torch_was_imported_through_a_link(tmp_path):
    """Where a collective was called, or a tensor made, is the first frame outside torch:
    with the virtual environment reached through a symbolic link, torch's files carry the
    link's path (a run in a folder whose .venv is a link blamed torch's eval_frame.py), and a
    neighbour whose name starts like torch's (torchvision) is not torch."""
    from pathlib import Path
    site = Path(torch.__file__).resolve().parent.parent
    (tmp_path / "site").symlink_to(site)
    inside = str(tmp_path / "site" / "torch" / "_dynamo" / "a_wrapper.py")
    assert diagnostics._in_torch(inside) and diagnostics._in_torch(torch.__file__)
    assert not diagnostics._in_torch(str(site / "torchvision" / "ops.py"))
    assert not diagnostics._in_torch(diagnostics.__file__)
    wrapper = {}
    exec(compile("def call(fn):\n    return fn()\n", inside, "exec"), wrapper)   # a frame of "torch's" through the link
    where = wrapper["call"](lambda: diagnostics._caller(1, False))   # (1: from the frame that called the lambda)
    assert where.startswith("test_device_audit.py:"), where

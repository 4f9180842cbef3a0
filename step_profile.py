"""Where one training step's time goes: the step run once under torch.profiler, in phases
the step names, and summed up as the questions a slow step raises. torch and the standard
library only: copy the file.

    def step(phase):                          # phase(name): a context for each part of the step
        with phase("forward + backward"):
            loss_fn(model(x), y).backward()
        with phase("optimizer"):
            opt.step(); opt.zero_grad()
    summary = profile_step(step, device, trace="step.json.gz")   # the trace opens in Perfetto

``summary`` (a dict of rows, plain numbers and strings):
- "phases": each phase's wall time and how much of it the device was busy (a GPU: any
  kernel, copy or fill running; a CPU: the step's thread inside an operator), whole step
  first. The phases are apart by a device sync, so each one's device work lies inside it.
- "gaps": the device's longest idle stretches, where each lies and what the host was
  running then (the innermost operator, a CUDA call such as a synchronize, or Python
  between operators): a host-bound step shows as many gaps under Python or launches.
- "categories": the busy time by kind of work (matmul, attention, communication, the
  optimizer, copies, compiled kernels, the rest); "kernels": the costliest by total time.
"""
from __future__ import annotations

import contextlib
import re

import torch

# kinds of device work, by the first words that match a kernel's or an operator's name
CATEGORIES = (
    ("communication", ("nccl", "gloo", "c10d::", "allreduce", "all_reduce", "allgather", "all_gather",
                       "reduce_scatter", "reducescatter", "broadcast", "alltoall")),
    ("attention", ("flash", "fmha", "attention", "scaled_dot_product", "sdpa")),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "splitk", "gemv", "aten::mm", "aten::addmm",
                "aten::bmm", "aten::linear", "aten::matmul", "triton_tem", "_mm_", "addmm", "mmbackward")),
    ("optimizer", ("multi_tensor_apply", "foreach", "adam", "optimizer")),
    ("copy", ("memcpy", "memset", "copy", "aten::to", "aten::cat", "catarray")),
    ("compiled kernels", ("triton", "compiled", "inductor", "cpp_fused")),
)
MAX_GAPS, MAX_KERNELS = 8, 12


def category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, words in CATEGORIES if any(w in low for w in words)), "other")


def short_name(name: str, width: int = 70) -> str:
    """A CUDA kernel's name as a table shows it: without "void", its argument list (which
    repeats its template's) and namespaces, cut in the middle where still too long
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>,
    ...>(int, ...)" -> "vectorized_elementwise_kernel<4, CUDAFunctor_add<float>, ...>")."""
    s = name[5:] if name.startswith("void ") else name
    if s.endswith(")") and (s != name or "<" in s):   # a C++ argument list (not "Memcpy HtoD (Pageable -> Device)")
        depth = 0
        for i in range(len(s) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(s[i], 0)
            if depth == 0:
                s = s[:i] if i > 0 else s
                break
    s = re.sub(r"\(anonymous namespace\)::|\b[A-Za-z_]\w*::", "", s).strip()
    return s if len(s) <= width else s[:width // 2 - 2] + "..." + s[-(width - width // 2 - 1):]


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def no_phase(name):
    """The ``phase`` a step gets when it is not profiled."""
    return contextlib.nullcontext()


def profile_step(step, device, trace=None) -> dict:
    """Run ``step(phase)`` once under torch.profiler (a GPU's kernels too where ``device``
    is one) and return its summary (the module's docstring); ``trace``: a path for the
    Chrome trace (.json, or .json.gz to compress it)."""
    from torch.profiler import ProfilerActivity, profile
    device = torch.device(device)
    gpu = device.type == "cuda"
    names = []

    @contextlib.contextmanager
    def phase(name):
        names.append(name)
        _sync(device)
        with torch.profiler.record_function(name):
            yield
            _sync(device)

    _sync(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])) as prof:
        step(phase)
    if trace:
        prof.export_chrome_trace(str(trace))
    return summarize(prof.events(), names, gpu)


def _union(spans):
    """Sorted, merged (start, end) spans."""
    out = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _covered(merged, s, e) -> float:
    return sum(max(0.0, min(e, b) - max(s, a)) for a, b in merged)


def _is_annotation(ev) -> bool:
    return bool(getattr(ev, "is_user_annotation", False)) or "user_annotation" in str(getattr(ev, "activity_type", ""))


def summarize(events, phase_names, gpu: bool) -> dict:
    """The summary of a profiled step from torch.profiler's events (``prof.events()``) and
    the names of the phases the step ran, in order."""
    from torch.autograd import DeviceType
    cpu = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    spans = [e for e in cpu if _is_annotation(e) and e.name in phase_names]
    if not spans:
        raise ValueError("the step ran no phase: wrap its parts in phase(name)")
    thread = spans[0].thread
    spans = sorted((e for e in spans if e.thread == thread), key=lambda e: e.time_range.start)
    t0, t1 = spans[0].time_range.start, max(e.time_range.end for e in spans)

    def outermost(ev):   # an operator with no operator around it (a phase's annotation aside)
        return ev.cpu_parent is None or _is_annotation(ev.cpu_parent)
    if gpu:   # the device's work: every kernel, copy and fill (aside: its mirror of each span the host named)
        spans_named = {e.name for e in cpu if _is_annotation(e)}
        work = [e for e in events if e.device_type == DeviceType.CUDA and not _is_annotation(e)
                and e.name not in spans_named]
    else:     # the host's: the step's thread inside an operator
        work = [e for e in cpu if e.thread == thread and not _is_annotation(e) and outermost(e)
                and not getattr(e, "is_python_function", False)]
    work = [e for e in work if e.time_range.end > t0 and e.time_range.start < t1]
    busy = _union((max(e.time_range.start, t0), min(e.time_range.end, t1)) for e in work)

    def row(name, start, end):
        b = _covered(busy, start, end)
        return {"phase": name, "wall_ms": round((end - start) / 1e3, 3), "busy_ms": round(b / 1e3, 3),
                "idle_ms": round((end - start - b) / 1e3, 3), "busy": f"{b / (end - start):.0%}" if end > start else ""}
    phases = [row("whole step", t0, t1)] + [row(e.name, e.time_range.start, e.time_range.end) for e in spans]

    def host_at(t):   # what the host ran at time t: the step's thread's innermost operator or span, or else
        inside = [e for e in cpu if e.time_range.start <= t <= e.time_range.end and e.name not in phase_names
                  and not e.name.startswith("PyTorch Profiler")]   # (another thread's, such as gloo's collective)
        own = [e for e in inside if e.thread == thread]
        if not (own or inside):
            return "Python between operators"
        best = min(own or inside, key=lambda ev: ev.time_range.end - ev.time_range.start)
        return (best.name if not _is_annotation(best) else f"Python in {best.name}") if own \
            else f"{best.name} (another thread)"

    edges = [t0] + [x for ab in busy for x in ab] + [t1]
    idle = sorted(((b - a, a, b) for a, b in zip(edges[::2], edges[1::2]) if b > a), reverse=True)
    gaps = []
    for length, a, b in idle[:MAX_GAPS]:
        mid = (a + b) / 2
        where = next((e.name for e in spans if e.time_range.start <= mid <= e.time_range.end), "between phases")
        gaps.append({"at_ms": round((a - t0) / 1e3, 3), "gap_ms": round(length / 1e3, 3), "phase": where,
                     "host_in": host_at(mid)})

    def kind(ev):   # by its name, else by what it runs inside (a CPU's "Optimizer.step#AdamW.step")
        while ev is not None:
            if category(ev.name) != "other" or ev.cpu_parent is None:
                return category(ev.name)
            ev = ev.cpu_parent
        return "other"
    per_name, per_cat = {}, {}
    for e in work:
        d = (min(e.time_range.end, t1) - max(e.time_range.start, t0)) / 1e3
        calls, ms, cat = per_name.get(e.name, (0, 0.0, kind(e)))
        per_name[e.name] = (calls + 1, ms + d, cat)
        per_cat[kind(e)] = per_cat.get(kind(e), 0.0) + d
    total = sum(per_cat.values()) or 1.0
    categories = [{"category": c, "ms": round(ms, 3), "share": f"{ms / total:.0%}"}
                  for c, ms in sorted(per_cat.items(), key=lambda kv: -kv[1])]
    kernels = [{"name": short_name(n) if gpu else n, "category": cat, "calls": c, "ms": round(ms, 3)}
               for n, (c, ms, cat) in sorted(per_name.items(), key=lambda kv: -kv[1][1])[:MAX_KERNELS]]
    return {"device": "gpu" if gpu else "cpu", "phases": phases, "gaps": gaps,
            "idle_over_100us": sum(1 for g in idle if g[0] >= 100), "categories": categories, "kernels": kernels}

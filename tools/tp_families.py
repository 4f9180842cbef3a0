"""Tensor parallelism on every text family transformers ships a plan for: each causal LM
built tiny from its own config class (random weights, nothing downloaded), split over 2
ranks by 08's model_plan and parallelize with nothing written for it, then one forward
and one backward beside the same model in one process. Prints a table and writes
results/tp_families.json and .md.

    python tools/tp_families.py                          # every family (a few minutes)
    python tools/tp_families.py --families llama qwen3   # some, by model_type

Each family ends in one of:
    PASS      the logits and every parameter's gradient match one process (float32)
    FAIL      they differ: the split changed the model (a bug)
    refused   08 refused the split in one line (ValueError), naming what it cannot split
    error     anything else after the model ran whole (a bug: it should be a refusal)
    skipped   this tiny configuration does not build or run in one process (the sweep's
              limit, not the kit's), or a multimodal family (13's tests cover Gemma 3's)
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import result_files  # noqa: E402

# a tiny model in every config's own names (only those its config has); MLA's head_dim
# is its rotary part's, and a partial rotary's dim (GPT-J's) fits the tiny heads
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_layers=2, num_attention_heads=8,
            num_key_value_heads=2, head_dim=8, vocab_size=256, max_position_embeddings=128, moe_intermediate_size=32,
            num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16,
            q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, first_k_dense_replace=1, n_group=1,
            topk_group=1, shared_expert_intermediate_size=64, n_shared_experts=1, sliding_window=64,
            num_kv_shared_layers=0, vocab_size_per_layer_input=256, hidden_size_per_layer_input=8, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)
MLA = dict(head_dim=4, num_key_value_heads=8)
BOUND = 1e-4   # relative to the logits' and each gradient's size (at least 1e-4 of the largest gradient's):
#                float32's rounding is ~1e-6 here


def families(only=()) -> list:
    """(model_type, causal-LM class name) of every family whose config ships a tp plan."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LM
    out = []
    for kind in sorted(CAUSAL_LM):
        if only and kind not in only:
            continue
        try:
            config = CONFIG_MAPPING[kind]()
            text = config.get_text_config() if hasattr(config, "get_text_config") else config
        except Exception:   # (a config that needs arguments: reported when built)
            out.append((kind, CAUSAL_LM[kind]))
            continue
        if getattr(text, "base_model_tp_plan", None):
            out.append((kind, CAUSAL_LM[kind]))
    return out


def build(kind: str, cls_name: str):
    """The family's tiny causal LM in float32, eval mode (no dropout or router noise), seeded."""
    import transformers
    from transformers import CONFIG_MAPPING
    config_cls = CONFIG_MAPPING[kind]
    defaults = config_cls()
    if getattr(defaults, "sub_configs", None):
        raise LookupError("a multimodal family: not in this sweep")
    names = {*vars(defaults), *getattr(config_cls, "attribute_map", {})}   # (not hasattr: a per-layer one raises)
    own = {k: v for k, v in TINY.items() if k in names}
    own.update({k: v for k, v in MLA.items() if "kv_lora_rank" in names})
    if "rotary_dim" in names:
        own["rotary_dim"] = 4
    try:
        config = config_cls(**own)
    except Exception:   # (a list a layer its config does not derive from the count: its first two layers')
        layers = getattr(defaults, "num_hidden_layers", None)
        config = config_cls(**own, **{k: v[:2] for k, v in vars(defaults).items() if isinstance(v, list) and layers
                                      and len(v) == layers and k not in own and not k.startswith("_")})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return getattr(transformers, cls_name)(config).float().eval()


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:240]}"


def sweep(ctx, args, kinds):
    """Every rank: each family built, split by its own plan, one forward and backward beside
    one process, each parameter's gradient made whole (rank 0's rows returned)."""
    tp = importlib.import_module("08_tensor_parallel")
    rows = []
    for kind, cls_name in kinds:
        t0, row = time.perf_counter(), {"family": kind, "class": cls_name}
        try:
            model = build(kind, cls_name)
            ref = copy.deepcopy(model)
            x = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(1))
            want = ref(input_ids=x, use_cache=False).logits
        except Exception as e:   # (the tiny configuration's limit, or a multimodal family)
            rows.append({**row, "outcome": "skipped", "why": _first_line(e)})
            continue
        try:
            plan, whole = tp.model_plan(model)
            tp.parallelize(model, plan)
            got = model(input_ids=x, use_cache=False).logits
            for m, y in ((model, got), (ref, want)):   # each parameter then holds its gradient (zeros: none)
                y.float().square().mean().backward()
                with torch.no_grad():
                    for p in m.parameters():
                        p.data = p.grad if p.grad is not None else torch.zeros_like(p)
            mine, theirs = tp.full_state_dict(model, all_ranks=True), dict(ref.named_parameters())
            lost = sorted(set(theirs) - set(mine))
            logits = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
            scale = 1e-4 * max(t.abs().max().item() for t in theirs.values())   # (a gradient near none: a router's)
            rel = {n: ((mine[n].float() - theirs[n].float()).abs().max() /
                       theirs[n].float().abs().max().clamp_min(scale)).item() for n in theirs if n in mine}
            worst = max(rel, key=rel.get)
            grads = rel[worst]
            row["worst"] = f"{worst} (its largest gradient {theirs[worst].abs().max().item():.1e})"
            ok = logits < BOUND and grads < BOUND and not lost
            row.update(outcome="PASS" if ok else "FAIL", split=len(plan), whole=len(whole), logits=logits,
                       grads=grads, why="" if ok else f"missing {lost[:3]}" if lost else f"differs most: {row['worst']}")
        except ValueError as e:
            row.update(outcome="refused", why=_first_line(e))
        except Exception as e:
            row.update(outcome="error", why=_first_line(e))
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        del model, ref
        gc.collect()
        if ctx.rank == 0 and not args.quiet:
            print(f"  {kind:24s} {row['outcome']:8s} {row.get('why', '')[:100]}", flush=True)
    return rows


def table(rows: list, versions: str) -> str:
    """The markdown table of the rows, the tallies first."""
    tally = {o: sum(r["outcome"] == o for r in rows) for o in ("PASS", "FAIL", "refused", "error", "skipped")}
    lines = [f"{len(rows)} families ({versions}), tp 2 on 2 CPU ranks (gloo): "
             + ", ".join(f"{n} {o}" for o, n in tally.items() if n), "",
             "| family | outcome | split keys | kept whole | logits rel. diff | gradients rel. diff | why |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        nums = [f"{r[k]:.1e}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in ("logits", "grads")]
        lines.append(f"| {r['family']} | {r['outcome']} | {r.get('split', '')} | {r.get('whole', '')} | {nums[0]} | "
                     f"{nums[1]} | {r.get('why', '').replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", nargs="*", default=[], help="model_types to run (default: every one with a tp plan)")
    p.add_argument("--out", default=str(ROOT / "results"), help="where tp_families.json and .md go")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may wait")
    p.add_argument("--quiet", action="store_true", help="no line a family as it finishes")
    args = p.parse_args()
    args.world_size, args.backend, args.device, args.no_bench, args.doing = 2, "gloo", "cpu", True, "tp_families"
    import transformers
    kinds = families(set(args.families))
    unknown = set(args.families) - {k for k, _ in kinds}
    if unknown:
        raise common.UsageError(f"--families: {', '.join(sorted(unknown))}: not a causal-LM family with a tp plan here")
    rows = common.launch(sweep, args, kinds)
    versions = f"transformers {transformers.__version__}, torch {torch.__version__}"
    text = table(rows, versions)
    print(text)
    out = Path(args.out)
    doc = json.dumps({"versions": versions, "rows": rows}, indent=1) + "\n"
    result_files.save_file(out / "tp_families.json", lambda f: f.write(doc.encode()))
    result_files.save_file(out / "tp_families.md", lambda f: f.write(text.encode()))
    bad = [r["family"] for r in rows if r["outcome"] in ("FAIL", "error")]
    if bad:
        raise SystemExit(f"tp_families: {', '.join(bad)} did not match one process or failed without a refusal")


if __name__ == "__main__":
    common.run_main(main)

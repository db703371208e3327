"""Float8 autocast on CPU: product accuracy per recipe, and what float8 costs in compile time.

    python benchmarks/bench_fp8.py [--repeats 5] [--json results/bench_fp8.json]

Two tables:

* **accuracy**: the relative error (Frobenius norm of the error over the norm
  of the float32 result) of one product ``x @ w`` (256 x 512 x 256) and of its
  two backward products, under ``autocast(..., "float32", fp8=recipe)`` for
  tensorwise and rowwise scaling with exact (the default) or power-of-two
  scales, and under plain bfloat16 autocast for reference. Operand distributions: standard
  normal; scaled to 1e-4 and to 1e4 (outside float8_e4m3fn's range unscaled);
  one outlier row of order 1e4 among rows of order 1 (the error is measured
  on the other rows); heavy-tailed (log-normal magnitudes, sigma 2).
  Deterministic (fixed seeds): the same figures on every CPU.
* **compile**: trace + lower + compile time (best and median of
  ``--repeats`` fresh compiles, round-robin so that machine load hits every
  version alike), StableHLO ops and optimized HLO instructions of a
  transformer LM train step (2 blocks, AdamW) under ``autocast(...,
  "mixed_bfloat16")`` and under the same with ``fp8="tensorwise"`` and
  ``fp8="rowwise"``; ratios to the bfloat16 step. (Step times on a CPU, which
  emulates float8, say nothing about a GPU: see ``gpu_fp8.py``.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_policy

RECIPES: dict[str, Optional[jmp_policy.Float8Recipe]] = {
    "bfloat16 (no fp8)": None,
    "tensorwise": jmp_policy.Float8Recipe("tensorwise"),
    "tensorwise, 2^k scales": jmp_policy.Float8Recipe("tensorwise", power_of_two_scales=True),
    "rowwise": jmp_policy.Float8Recipe("rowwise"),
    "rowwise, 2^k scales": jmp_policy.Float8Recipe("rowwise", power_of_two_scales=True),
}


# --- accuracy --------------------------------------------------------------------------

def operands(kind: str, m: int = 256, k: int = 512, n: int = 256):
    """``(x, w, cotangent, rows)``: a product's operands, the gradient reaching it and the
    output rows the error is measured on."""
    keys = jax.random.split(jax.random.key(0), 3)
    x, w, ct = (jax.random.normal(key, shape) for key, shape in zip(keys, [(m, k), (k, n), (m, n)]))
    rows = slice(None)
    if kind in ("1e-4", "1e4"):
        s = float(kind)
        x, w, ct = x * s, w * s, ct * s
    elif kind == "outlier row":
        x = x.at[0].multiply(1e4)
        rows = slice(1, None)
    elif kind == "heavy-tailed":
        tails = [jnp.exp(2 * jax.random.normal(key, a.shape))
                 for key, a in zip(jax.random.split(jax.random.key(1), 3), (x, w, ct))]
        x, w, ct = (a * t for a, t in zip((x, w, ct), tails))
    return x, w, ct, rows


def rel_error(got: Any, want: Any) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def accuracy(kinds=("normal", "1e-4", "1e4", "outlier row", "heavy-tailed")) -> list[dict]:
    rows = []
    for kind in kinds:
        x, w, ct, sel = operands(kind)
        want, vjp = jax.vjp(jnp.matmul, x, w)
        want_dx, want_dw = vjp(ct)
        for name, recipe in RECIPES.items():
            policy = "mixed_bfloat16" if recipe is None else "float32"
            f = jmp_policy.autocast(jnp.matmul, policy, fp8=recipe)
            got, vjp = jax.jit(lambda x, w: jax.vjp(f, x, w))(x, w)
            dx, dw = jax.jit(vjp)(ct.astype(got.dtype))
            rows.append(dict(operands=kind, recipe=name,
                             forward=rel_error(got[sel], want[sel]),
                             grad_x=rel_error(dx[sel], want_dx[sel]),
                             grad_w=rel_error(dw, want_dw)))
    return rows


# --- compile time --------------------------------------------------------------------------

def layer_norm(x, g):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * g


def lm_loss(p, tokens, heads=4):
    """A 2-block transformer LM in plain JAX, named scopes as Flax would give them."""
    b, t = tokens.shape
    x = p["emb"][tokens[:, :-1]]
    t -= 1
    for i, blk in enumerate(p["blocks"]):
        with jax.named_scope(f"block_{i}"):
            d = x.shape[-1]
            q, k, v = jnp.split(layer_norm(x, blk["g1"]) @ blk["qkv"], 3, axis=-1)
            q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // heads)
            s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
            a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v).reshape(b, t, d)
            x = x + a @ blk["proj"]
            x = x + jax.nn.gelu(layer_norm(x, blk["g2"]) @ blk["w1"]) @ blk["w2"]
    with jax.named_scope("logits"):
        logits = layer_norm(x, p["g"]) @ p["head"]
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), tokens[:, 1:]).mean()


def lm_params(d=128, vocab=256, layers=2):
    keys = iter(jax.random.split(jax.random.key(0), 4 * layers + 2))
    n = lambda shape: jax.random.normal(next(keys), shape) * shape[0] ** -0.5
    blocks = [dict(qkv=n((d, 3 * d)), proj=n((d, d)), w1=n((d, 4 * d)), w2=n((4 * d, d)),
                   g1=jnp.ones(d), g2=jnp.ones(d)) for _ in range(layers)]
    return dict(emb=n((vocab, d)), blocks=blocks, g=jnp.ones(d), head=n((d, vocab)))


def make_step(fp8: Optional[str]) -> Callable[..., Any]:
    """A fresh jitted train step (new function objects: no trace or compile cache hits)."""
    loss_fn = jmp_policy.autocast(lambda p, t: lm_loss(p, t), "mixed_bfloat16", fp8=fp8)
    tx = optax.adamw(1e-3)

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step)


def count_stablehlo_ops(text: str) -> int:
    return (len(re.findall(r"=\s*\"?stablehlo\.", text))
            + len(re.findall(r"^\s*stablehlo\.", text, re.M)))


def count_hlo_instructions(text: str) -> int:
    return sum(1 for line in text.splitlines() if re.match(r"\s*(ROOT\s+)?%?[\w.\-]+ = ", line))


def count_float8_dots(stablehlo: str) -> int:
    """``dot_general`` ops of the lowered module whose operands are float8."""
    return sum(1 for line in stablehlo.splitlines()
               if "stablehlo.dot_general" in line and re.search(r":\s*\(tensor<[^>]*xf8", line))


def compile_once(fp8, args):
    step = make_step(fp8)
    t0 = time.perf_counter()
    lowered = step.trace(*args).lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    return t1 - t0, time.perf_counter() - t0, lowered, compiled


def compile_costs(repeats: int) -> list[dict]:
    params = lm_params()
    tokens = jax.random.randint(jax.random.key(1), (16, 65), 0, 256)
    args = (params, optax.adamw(1e-3).init(params), tokens)
    kinds = (None, "tensorwise", "rowwise")
    for fp8 in kinds:
        compile_once(fp8, args)  # warm-up: JAX's own caches, imports
    times: dict[Any, list] = {k: [] for k in kinds}
    last = {}
    for _ in range(repeats):
        for fp8 in kinds:
            trace, total, lowered, compiled = compile_once(fp8, args)
            times[fp8].append((trace, total))
            last[fp8] = (lowered, compiled)
    rows = []
    for fp8 in kinds:
        lowered, compiled = last[fp8]
        hlo = compiled.as_text()
        traces, totals = zip(*times[fp8])
        rows.append(dict(
            step="bfloat16" if fp8 is None else f"fp8 {fp8}",
            trace_lower_s=min(traces), compile_s=min(totals),
            compile_median_s=statistics.median(totals),
            stablehlo_ops=count_stablehlo_ops(lowered.as_text()),
            hlo_instructions=count_hlo_instructions(hlo),
            float8_dots=count_float8_dots(lowered.as_text()),
            loss=float(compiled(*args)[2])))
    base = rows[0]
    for r in rows:
        for key in ("compile_s", "compile_median_s", "stablehlo_ops", "hlo_instructions"):
            r[key.replace("_s", "") + "_ratio"] = r[key] / base[key]
    return rows


# --- output ------------------------------------------------------------------------------

def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """``columns``: (title, key, format)."""
    cells = [[t for t, _, _ in columns]] + [[format(r[k], f) for _, k, f in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the results to this path as JSON")
    parser.add_argument("--skip-compile", action="store_true", help="accuracy table only")
    args = parser.parse_args(argv)

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}\n")
    acc = accuracy()
    print("Relative error against float32 (one 256x512x256 product and its two backward "
          "products; outlier row: error on the other rows)\n")
    print(table(acc, [("operands", "operands", ""), ("recipe", "recipe", ""),
                      ("forward", "forward", ".4f"), ("grad x", "grad_x", ".4f"),
                      ("grad w", "grad_w", ".4f")]))
    costs = []
    if not args.skip_compile:
        costs = compile_costs(args.repeats)
        print(f"\nTrain step (2-block transformer LM, d_model 128, AdamW) under autocast "
              f"mixed_bfloat16: best of {args.repeats} fresh compiles (median)\n")
        for r in costs:
            r["compile"] = f"{r['compile_s']:.2f} ({r['compile_median_s']:.2f})"
        print(table(costs, [("step", "step", ""), ("trace+lower s", "trace_lower_s", ".2f"),
                            ("+compile s", "compile", ""), ("x bf16", "compile_ratio", ".2f"),
                            ("x bf16 median", "compile_median_ratio", ".2f"),
                            ("StableHLO ops", "stablehlo_ops", "d"),
                            ("x bf16 ", "stablehlo_ops_ratio", ".2f"),
                            ("HLO instrs", "hlo_instructions", "d"),
                            ("x bf16  ", "hlo_instructions_ratio", ".2f"),
                            ("float8 dots", "float8_dots", "d")]))
        for r in costs:
            r.pop("compile")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "device": str(jax.devices()[0]),
                       "accuracy": acc, "compile": costs}, f, indent=1)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()

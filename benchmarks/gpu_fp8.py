"""Float8 autocast on a GPU (H100 or newer): cuBLASLt float8 GEMMs, step time, where it pays off.

    python benchmarks/gpu_fp8.py --json results/gpu_fp8.json     # on an H100 (a few minutes)
    python benchmarks/gpu_fp8.py --smoke                          # tiny sizes, any device

Three measurements, all against the same function under
``jmp_policy.autocast(..., "mixed_bfloat16")`` without float8:

1. **HLO check**: the optimized HLO of the float8 train step of the MLP block
   below calls cuBLASLt float8 GEMMs: custom calls whose target or operand
   types name ``f8`` (XLA's ``__cublas$lt$matmul$f8``). Every one of its six
   products (two forward, four backward) should be one. On a CPU this is
   skipped (XLA:CPU converts float8 operands to float32); the lowered
   StableHLO's float8 ``dot_general`` count is reported instead.
2. **MLP block step time**: a transformer MLP block (LayerNorm, d_model ->
   4 d_model, GELU, -> d_model, residual; d_model 4096, 8192 tokens per step:
   batch 8 x sequence 1024) trained with AdamW, and its forward + backward
   alone; median over interleaved rounds (bfloat16, fp8 tensorwise, fp8
   rowwise one after another in every round, so drifting clocks and load hit
   all alike). Target: fp8 at least 1.3x faster per step.
3. **Size sweep**: forward + backward of one product ``x @ w`` with x of
   8192 x s and w of s x s, and of a square s x s x s product, for growing s:
   where float8, its quantization included, stops paying off. The smallest s
   from which both scalings are faster than bfloat16 is the suggested
   ``Float8Recipe.min_size``.
"""

from __future__ import annotations

import argparse
import datetime
import json
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

KINDS: tuple[Optional[str], ...] = (None, "tensorwise", "rowwise")
SIZES = {
    "gpu": dict(d_model=4096, batch=8, seq=1024, sweep=(256, 512, 1024, 2048, 4096, 8192),
                sweep_tokens=8192, rounds=10, steps=10),
    "smoke": dict(d_model=64, batch=2, seq=32, sweep=(16, 32, 64), sweep_tokens=64, rounds=2,
                  steps=2),
}


def name(kind: Optional[str]) -> str:
    return "bfloat16" if kind is None else f"fp8 {kind}"


# --- the MLP block ----------------------------------------------------------------------------

def mlp_block(p, x):
    mu = x.mean(-1, keepdims=True)
    h = (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * p["scale"]
    return x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]


def mlp_params(d: int):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"scale": jnp.ones(d), "w1": jax.random.normal(k1, (d, 4 * d)) * d ** -0.5,
            "w2": jax.random.normal(k2, (4 * d, d)) * (4 * d) ** -0.5}


def block_loss(kind: Optional[str]) -> Callable[..., Any]:
    f = jmp_policy.autocast(mlp_block, "mixed_bfloat16", fp8=kind)
    return lambda p, x, y: jnp.mean((f(p, x).astype(jnp.float32) - y) ** 2)


def train_step(kind: Optional[str]) -> Callable[..., Any]:
    loss_fn, tx = block_loss(kind), optax.adamw(1e-4)

    @jax.jit
    def step(p, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss

    return step


def grad_step(kind: Optional[str]) -> Callable[..., Any]:
    return jax.jit(jax.grad(block_loss(kind)))


# --- 1. the HLO ------------------------------------------------------------------------------

def gemm_custom_calls(hlo: str) -> list[str]:
    """The GEMM custom-call lines of an optimized HLO module (cuBLAS / cuBLASLt)."""
    return [line for line in hlo.splitlines()
            if "custom-call(" in line and re.search(r"custom_call_target=\"[^\"]*(cublas|gemm)",
                                                    line, re.I)]


def hlo_check(size: dict) -> dict:
    p = mlp_params(size["d_model"])
    x = jnp.ones((size["batch"], size["seq"], size["d_model"]), jnp.bfloat16)
    args = (p, optax.adamw(1e-4).init(p), x, x.astype(jnp.float32))
    lowered = train_step("tensorwise").lower(*args)
    stablehlo = lowered.as_text()
    float8_dots = sum(1 for line in stablehlo.splitlines()
                      if "stablehlo.dot_general" in line and "xf8" in line)
    out = {"platform": jax.devices()[0].platform, "float8_dot_generals_lowered": float8_dots}
    if out["platform"] != "gpu":
        out["cublaslt_f8_gemms"] = None
        out["note"] = "not a GPU: the cuBLASLt check needs one"
        return out
    gemms = gemm_custom_calls(lowered.compile().as_text())
    f8 = [g for g in gemms if re.search(r"f8", g)]
    out.update(gemm_custom_calls=len(gemms), cublaslt_f8_gemms=len(f8),
               f8_targets=sorted({re.search(r'custom_call_target="([^"]*)"', g).group(1)
                                  for g in f8}),
               passed=len(f8) >= 6)
    return out


# --- timing --------------------------------------------------------------------------------

def per_step(fn: Callable[..., Any], args: tuple, steps: int, carry: bool) -> float:
    """Seconds per call over ``steps`` calls (a train step feeds its state back)."""
    out = fn(*args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = fn(*args)
        if carry:
            args = (out[0], out[1], *args[2:])
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / steps


def interleaved(fns: dict[str, Callable[..., Any]], args: dict[str, tuple], rounds: int,
                steps: int, carry: bool) -> dict[str, float]:
    """Median seconds per step of each function, the functions taking turns in every round."""
    for k, fn in fns.items():
        per_step(fn, args[k], 1, carry)  # compile, warm up
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            times[k].append(per_step(fn, args[k], steps, carry))
    return {k: statistics.median(v) for k, v in times.items()}


def mlp_timing(size: dict) -> list[dict]:
    d, b, t = size["d_model"], size["batch"], size["seq"]
    p = mlp_params(d)
    x = jax.random.normal(jax.random.key(1), (b, t, d)).astype(jnp.bfloat16)
    y = jnp.zeros((b, t, d), jnp.float32)
    rows = []
    for what, make, carry in (("train step (AdamW)", train_step, True),
                              ("forward + backward", grad_step, False)):
        fns = {name(k): make(k) for k in KINDS}
        if carry:
            args = {n: (p, optax.adamw(1e-4).init(p), x, y) for n in fns}
        else:
            args = {n: (p, x, y) for n in fns}
        times = interleaved(fns, args, size["rounds"], size["steps"], carry)
        base = times["bfloat16"]
        rows += [dict(measure=what, step=n, ms=1e3 * s, speedup=base / s) for n, s in times.items()]
    return rows


def sweep(size: dict) -> list[dict]:
    rows = []
    for shape in ("tokens", "square"):
        for s in size["sweep"]:
            m = size["sweep_tokens"] if shape == "tokens" else s
            x = jax.random.normal(jax.random.key(0), (m, s)).astype(jnp.bfloat16)
            w = jax.random.normal(jax.random.key(1), (s, s)) * s ** -0.5
            fns, args = {}, {}
            for k in KINDS:
                f = jmp_policy.autocast(jnp.matmul, "mixed_bfloat16", fp8=jmp_policy.Float8Recipe(
                    k, min_size=0) if k else None)
                fns[name(k)] = jax.jit(jax.grad(
                    lambda x, w, f=f: jnp.sum(f(x, w).astype(jnp.float32)), (0, 1)))
                args[name(k)] = (x, w)
            times = interleaved(fns, args, size["rounds"], size["steps"], False)
            base = times["bfloat16"]
            rows += [dict(shape=shape, m=m, k=s, n=s, step=n, us=1e6 * t, speedup=base / t)
                     for n, t in times.items()]
    return rows


def suggested_min_size(rows: list[dict]) -> Optional[int]:
    """The smallest swept size from which every float8 row, in both shapes, beats bfloat16."""
    sizes = sorted({r["k"] for r in rows})
    for s in sizes:
        if all(r["speedup"] > 1.0 for r in rows if r["k"] >= s and r["step"] != "bfloat16"):
            return s
    return None


# --- output ------------------------------------------------------------------------------------

def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    cells = [[t for t, _, _ in columns]] + [[format(r[k], f) for _, k, f in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script runs")
    parser.add_argument("--json", help="write the results to this path as JSON")
    parser.add_argument("--rounds", type=int, help="interleaved timing rounds")
    parser.add_argument("--skip-sweep", action="store_true")
    args = parser.parse_args(argv)
    size = dict(SIZES["smoke" if args.smoke else "gpu"])
    if args.rounds:
        size["rounds"] = args.rounds
    device = jax.devices()[0]
    print(f"jax {jax.__version__} on {device.device_kind} ({device.platform}); "
          f"{'smoke sizes' if args.smoke else 'full sizes'}\n")

    check = hlo_check(size)
    print("1. HLO of the fp8 train step:", json.dumps(check))

    mlp = mlp_timing(size)
    tokens = size["batch"] * size["seq"]
    print(f"\n2. MLP block, d_model {size['d_model']}, {tokens} tokens per step: median of "
          f"{size['rounds']} interleaved rounds of {size['steps']} steps\n")
    print(table(mlp, [("measure", "measure", ""), ("step", "step", ""), ("ms", "ms", ".3f"),
                      ("speedup vs bf16", "speedup", ".2f")]))

    swept, suggestion = [], None
    if not args.skip_sweep:
        swept = sweep(size)
        suggestion = suggested_min_size(swept)
        print(f"\n3. One product x @ w, forward + backward: x is {size['sweep_tokens']} x s "
              "(tokens) or s x s (square), w is s x s\n")
        print(table(swept, [("shape", "shape", ""), ("m", "m", "d"), ("k = n", "k", "d"),
                            ("step", "step", ""), ("us", "us", ".1f"),
                            ("speedup vs bf16", "speedup", ".2f")]))
        print(f"\nsuggested Float8Recipe.min_size: {suggestion} "
              "(smallest swept size from which float8 wins at every larger size, both shapes)")

    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"),
                       "jax": jax.__version__, "device": device.device_kind, "size": size,
                       "hlo": check, "mlp": mlp, "sweep": swept,
                       "suggested_min_size": suggestion}, f, indent=1)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()

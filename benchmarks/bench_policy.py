"""Policy casting benchmark (issue 2).

1. Eager `cast_to_compute` of a 1,000-leaf float32 pytree: jmp_policy vs DeepMind
   jmp on the same tree, interleaved rounds, median; results checked identical.
2. Under jit, `policy.wrap(f)` vs a hand-written cast of the same function: the
   optimized HLO must have the same instruction count and the same number of
   `convert` ops, and XLA's cost analysis the same bytes accessed.

Run:  python benchmarks/bench_policy.py [--leaves 1000] [--rounds 20]
Needs the `bench` extra (jmp).
"""

from __future__ import annotations

import argparse
import gc
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

import jmp_policy


def eager_cast(n_leaves: int, rounds: int, block: int = 5) -> dict:
    import jmp  # benchmark-only dependency

    rng = np.random.default_rng(0)
    shapes = [(16, 16), (64,), (8, 32), (128,)]
    tree = {
        f"layer_{i}": {"w": jnp.asarray(rng.standard_normal(shapes[i % len(shapes)]), jnp.float32)}
        for i in range(n_leaves)
    }
    ours = jmp_policy.Policy("params=float32,compute=float16,output=float32")
    theirs = jmp.get_policy("params=float32,compute=float16,output=float32")

    t0 = time.perf_counter()
    first = jax.block_until_ready(ours.cast_to_compute(tree))
    first_call = time.perf_counter() - t0
    reference = jax.block_until_ready(theirs.cast_to_compute(tree))
    same = jax.tree_util.tree_all(jax.tree_util.tree_map(
        lambda a, b: a.dtype == b.dtype and bool(jnp.array_equal(a, b)), first, reference))

    # Interleaved in blocks: each round runs a block of calls of one library,
    # then of the other, so both see the same machine load; the first call of a
    # block only re-warms caches the other library evicted and is not counted.
    times = {"jmp_policy": [], "jmp": []}
    for _ in range(rounds):
        for name, pol in (("jmp_policy", ours), ("jmp", theirs)):
            for i in range(block + 1):
                gc.collect()  # as timeit does: no collection of the other's garbage inside a timing
                gc.disable()
                t = time.perf_counter()
                out = jax.block_until_ready(pol.cast_to_compute(tree))
                elapsed = time.perf_counter() - t
                gc.enable()
                del out
                if i:
                    times[name].append(elapsed)
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {"leaves": n_leaves, "identical": same, "first_call_s": first_call,
            "jmp_policy_ms": med["jmp_policy"] * 1e3, "jmp_ms": med["jmp"] * 1e3,
            "speedup": med["jmp"] / med["jmp_policy"]}


def _hlo_stats(fn, *args) -> dict:
    compiled = jax.jit(fn).lower(*args).compile()
    text = compiled.as_text()
    instrs = [line for line in text.splitlines()
              if re.match(r"\s*(ROOT\s+)?[%\w.\-]+\s*=", line)]
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return {"instructions": len(instrs),
            "converts": sum(" convert(" in line for line in instrs),
            "bytes": float(cost.get("bytes accessed", float("nan")))}


def jit_overhead() -> dict:
    policy = jmp_policy.Policy("params=float32,compute=bfloat16,output=float32")
    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.standard_normal((256, 512)), jnp.float32),
              "b1": jnp.zeros((512,), jnp.float32),
              "w2": jnp.asarray(rng.standard_normal((512, 10)), jnp.float32)}
    x = jnp.asarray(rng.standard_normal((64, 256)), jnp.float32)

    def mlp(p, x):
        return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"]

    def hand(p, x):
        bf = jnp.bfloat16
        h = jax.nn.relu(x.astype(bf) @ p["w1"].astype(bf) + p["b1"].astype(bf))
        return (h @ p["w2"].astype(bf)).astype(jnp.float32)

    wrapped = _hlo_stats(policy.wrap(mlp), params, x)
    handcast = _hlo_stats(hand, params, x)
    grad_w = _hlo_stats(jax.grad(lambda p, x: policy.wrap(mlp)(p, x).sum()), params, x)
    grad_h = _hlo_stats(jax.grad(lambda p, x: hand(p, x).sum()), params, x)
    return {"forward": (wrapped, handcast), "grad": (grad_w, grad_h)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}")
    r = eager_cast(args.leaves, args.rounds)
    print(f"\nEager cast_to_compute, {r['leaves']} float32 leaves -> float16 "
          f"(median of {args.rounds} interleaved rounds of 5 calls each):")
    print(f"  jmp_policy {r['jmp_policy_ms']:.2f} ms | jmp {r['jmp_ms']:.2f} ms | "
          f"speedup {r['speedup']:.1f}x | identical results: {r['identical']} | "
          f"jmp_policy first call (compiles) {r['first_call_s'] * 1e3:.0f} ms")

    o = jit_overhead()
    print("\nUnder jit, policy.wrap(mlp) vs hand-cast mlp (optimized HLO):")
    print(f"  {'':8} {'wrap instrs':>12} {'hand instrs':>12} {'wrap converts':>14} "
          f"{'hand converts':>14} {'wrap bytes':>12} {'hand bytes':>12}")
    for name, (w, h) in o.items():
        print(f"  {name:8} {w['instructions']:>12} {h['instructions']:>12} {w['converts']:>14} "
              f"{h['converts']:>14} {w['bytes']:>12.0f} {h['bytes']:>12.0f}")


if __name__ == "__main__":
    main()

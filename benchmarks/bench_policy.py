"""Policy casting: eager casts against DeepMind jmp, and what a policy adds under jit.

1. Eager ``cast_to_compute`` of a 1,000-leaf float32 pytree (four small
   shapes) to float16: jmp_policy against DeepMind jmp on the same tree
   (results checked identical: dtype and bits). Timing: interleaved rounds,
   each a block of ``--iters`` calls of one library after one untimed call
   that re-warms the caches the other library evicted; median of the
   per-call means. jmp_policy's first call (it compiles the convert
   program) is recorded beside it.
2. Under jit, ``policy.wrap(mlp)`` against a hand-written cast of the same MLP
   (bfloat16 compute), forward and gradient: optimized-HLO instructions,
   ``convert`` instructions and bytes accessed must be the same.

Commands (from the repository root; JSON to ``benchmarks/results/bench_policy.json``;
needs the ``bench`` extra for jmp)::

    python -m benchmarks.bench_policy                  # ~30 s on 2 CPU cores
    python -m benchmarks.bench_policy --quick          # smoke run, ~10 s
    python -m benchmarks.bench_policy --leaves 1000 --rounds 20
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, List, Optional

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
import jmp_policy

POLICY = "params=float32,compute=float16,output=float32"
EAGER_COLUMNS = [harness.Column("wall_s", "time per cast of the tree", "s"),
                 harness.Column("first_call_s", "first call", "s"),
                 harness.Column("identical", "same result as jmp", "bool")]
JIT_COLUMNS = [harness.Column("hlo_instructions", "HLO instructions", "count"),
               harness.Column("converts", "converts", "count"),
               harness.Column("bytes_accessed", "bytes accessed", "bytes")]


def leafy_tree(n_leaves: int) -> Any:
    rng = np.random.default_rng(0)
    shapes = [(16, 16), (64,), (8, 32), (128,)]
    return {f"layer_{i}": {"w": jnp.asarray(rng.standard_normal(shapes[i % len(shapes)]),
                                            jnp.float32)} for i in range(n_leaves)}


def eager_cast(report: harness.Report, n_leaves: int, rounds: int, iters: int) -> None:
    import jmp  # benchmark-only dependency

    tree = leafy_tree(n_leaves)
    ours, theirs = jmp_policy.Policy(POLICY), jmp.get_policy(POLICY)
    t0 = time.perf_counter()
    first = jax.block_until_ready(ours.cast_to_compute(tree))
    first_call = time.perf_counter() - t0
    reference = jax.block_until_ready(theirs.cast_to_compute(tree))
    same = all(a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()
               for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(reference)))
    samples = harness.time_interleaved(
        {"jmp": lambda: theirs.cast_to_compute(tree),
         "jmp_policy": lambda: ours.cast_to_compute(tree)}, rounds, iters, warmup=1)
    table = report.table("eager-cast", "Eager cast_to_compute", baseline="jmp",
                         columns=EAGER_COLUMNS,
                         description=f"{n_leaves} float32 leaves to float16")
    table.add_row("jmp", {"wall_s": np.median(samples["jmp"]["wall_s"])},
                  samples={"wall_s": samples["jmp"]["wall_s"]})
    table.add_row("jmp_policy", {"wall_s": np.median(samples["jmp_policy"]["wall_s"]),
                                 "first_call_s": first_call, "identical": same},
                  samples={"wall_s": samples["jmp_policy"]["wall_s"]})


def mlp_functions():
    policy = jmp_policy.Policy("params=float32,compute=bfloat16,output=float32")

    def mlp(p, x):
        return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"]

    def hand(p, x):
        bf = jnp.bfloat16
        h = jax.nn.relu(x.astype(bf) @ p["w1"].astype(bf) + p["b1"].astype(bf))
        return (h @ p["w2"].astype(bf)).astype(jnp.float32)

    wrapped = policy.wrap(mlp)
    return {"forward": (wrapped, hand),
            "grad": (jax.grad(lambda p, x: wrapped(p, x).sum()),
                     jax.grad(lambda p, x: hand(p, x).sum()))}


def converts(build: harness.Build) -> dict:
    ops = harness.parse_hlo(build.compiled.as_text())
    return {"converts": sum(i.opcode == "convert" for i in ops)}


def jit_overhead(report: harness.Report) -> None:
    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.standard_normal((256, 512)), jnp.float32),
              "b1": jnp.zeros((512,), jnp.float32),
              "w2": jnp.asarray(rng.standard_normal((512, 10)), jnp.float32)}
    x = jnp.asarray(rng.standard_normal((64, 256)), jnp.float32)
    for what, (wrapped, hand) in mlp_functions().items():
        cases = [harness.Case("hand-cast", hand, (params, x), extra=converts),
                 harness.Case("policy.wrap", wrapped, (params, x), extra=converts)]
        rows, failed = harness.measure(cases, wall=False, progress=lambda s: None)
        table = report.table(f"jit-{what}", f"Under jit, {what}: policy.wrap(mlp) against a "
                             "hand-cast mlp", baseline="hand-cast", columns=JIT_COLUMNS,
                             description="MLP 256-512-10, batch 64, bfloat16 compute")
        table.add_rows(rows)
        report.failed(failed, what)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, default=1000)
    harness.add_common_arguments(parser, rounds=20, iters=5, compile_rounds=1)
    args = parser.parse_args(argv)
    if args.quick:
        args.leaves, args.rounds, args.iters = 100, 3, 2
    report = harness.Report("bench_policy", __doc__.splitlines()[0], vars(args), argv)
    print(f"jax {jax.__version__} on {jax.default_backend()}", flush=True)
    try:
        eager_cast(report, args.leaves, args.rounds, args.iters)
    except ImportError as e:
        report.failed([{"name": "eager cast against jmp", "error": str(e)}])
    jit_overhead(report)
    print(report.markdown())
    path = args.json or harness.default_json_path("bench_policy", args.quick)
    report.write(path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

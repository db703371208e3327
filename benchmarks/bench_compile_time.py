"""Compile time of the quantized optimizer steps against plain Adam, on XLA:CPU and an H100.

The step is ``update`` + ``optax.apply_updates`` of Adam on transformer-shaped
leaves (those of ``bench_low_precision.transformer_shapes`` for a given width
and depth: per layer ``qkv``, ``proj``, ``up``, ``down``, a bias and a norm
scale), wrapped in each recipe:
``cast_state`` (bfloat16 moments), ``quantize_state`` (8- and 4-bit moments)
and ``low_precision_params`` (``kahan``, ``stochastic``, ``split``, bfloat16
weights). Each is compiled ``--reps`` times afresh (rounds interleave the
recipes, so that a shared machine's load hits them alike); the figure is the
fastest (the least disturbed). Beside it, from the optimized HLO: kernels
(fusions) and distinct kernels (fused computations that differ other than in
their names), which XLA compiles once each; the distinct kernels of the
same step with a quarter of the layers: the same count when nothing is
specific to one leaf; and HLO instructions (fusion bodies included), in all
and per leaf (what the step of all the layers has more than that of a
quarter of them, per leaf more), to which XLA's compile time is about
proportional (XLA:GPU's priority fusion, its longest pass, visits each).
The summary gives the per-leaf count's ratio to Adam's too: unlike the
times, a count no machine's load disturbs.

Targets, each in a process of its own (XLA reads its flags once):

* ``cpu``: XLA:CPU with XLA's default flags;
* ``cpu-fast``: XLA:CPU with the test suite's flags (``tests/conftest.py``:
  no LLVM optimization, the older kernel emitters);
* ``h100``: XLA:GPU for an H100 (deviceless, ``harness.gpu_target``), run by
  ``--gpu-python``, a Python with the CUDA plugin (no GPU needed).

``--before PATH`` also measures the library at ``PATH`` (a checkout of an
older commit, e.g. ``git worktree add /tmp/before <commit>``), with this
script, in the same run: the table then has a before and an after column per
target, each with its ratio to that library's Adam. ``--rounds N`` runs every
(target, version) worker N times in turn and pools their compiles, so that
before and after meet alike a load that drifts over minutes. Commands (from the
repository root; ~25 min per round on 2 busy CPU cores)::

    git worktree add /tmp/before <commit>
    python -m benchmarks.bench_compile_time --before /tmp/before \
        --gpu-python /tmp/gpuvenv/bin/python
    python -m benchmarks.bench_compile_time --quick          # 24 leaves, CPU only, 1 rep

``--train-step`` compiles what a user compiles instead: the gradient of a
transformer's loss over those leaves (pre-RMSNorm attention and GELU MLP blocks,
unrolled, ``--tokens`` tokens) followed by the optimizer step, so the ratio is that of
the whole train step, the model's own compile included.

JSON to ``benchmarks/results/bench_compile_time.json``.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

RECIPES = ["adam", "adam, bf16 moments", "adam, 8-bit moments", "adam, 4-bit moments",
           "kahan", "stochastic", "split"]
TARGETS = ("cpu", "cpu-fast", "h100")
FAST_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def optimizer(recipe: str) -> Any:
    """(the weights' dtype, the optimizer) of ``recipe``."""
    import jax.numpy as jnp
    import optax

    import jmp_policy
    adam = optax.adam(1e-4)
    if recipe == "adam":
        return jnp.float32, adam
    if recipe == "adam, bf16 moments":
        return jnp.float32, jmp_policy.cast_state(adam)
    if recipe.startswith("adam, ") and recipe.endswith("-bit moments"):
        return jnp.float32, jmp_policy.quantize_state(adam, bits=int(recipe[6]))
    return jnp.bfloat16, jmp_policy.low_precision_params(adam, recipe)


def shapes(layers: int, d: int) -> Dict[str, tuple]:
    """The leaves of ``layers`` transformer layers of width ``d``."""
    out: Dict[str, tuple] = {}
    for i in range(layers):
        out.update({f"l{i}.qkv": (d, 3 * d), f"l{i}.proj": (d, d), f"l{i}.up": (d, 4 * d),
                    f"l{i}.down": (4 * d, d), f"l{i}.up_bias": (4 * d,), f"l{i}.ln": (d,)})
    return out


def transformer_loss(params: Dict[str, Any], x: Any) -> Any:
    """A loss of the transformer whose leaves `shapes` lists (8 heads per layer)."""
    import jax
    import jax.numpy as jnp

    h, layers = x, len(params) // 6
    t, d = x.shape
    for i in range(layers):
        p = {k.split(".", 1)[1]: v.astype(x.dtype) for k, v in params.items()
             if k.startswith(f"l{i}.")}
        y = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * p["ln"]
        q, k, v = (a.reshape(t, 8, d // 8) for a in jnp.split(y @ p["qkv"], 3, -1))
        weights = jax.nn.softmax(jnp.einsum("thd,shd->hts", q, k) * (d // 8) ** -0.5)
        h = h + jnp.einsum("hts,shd->thd", weights, v).reshape(t, d) @ p["proj"]
        h = h + jax.nn.gelu(h @ p["up"] + p["up_bias"]) @ p["down"]
    return jnp.mean(h * h)


def worker(target: str, layers: int, d: int, reps: int, tokens: int = 0) -> Dict[str, Any]:
    """Measures every recipe on ``target`` in this process (its library, its XLA flags);
    with ``tokens``, the train step of a transformer on that many tokens."""
    if target == "h100":
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    import contextlib

    import jax
    import jax.numpy as jnp
    import optax

    from benchmarks import harness
    import jmp_policy

    sharding, kind = (harness.gpu_target() if target == "h100"
                      else (None, jax.devices()[0].device_kind))
    n = sum(math.prod(s) for s in shapes(layers, d).values())
    steps: Dict[str, Dict[int, Any]] = {recipe: {} for recipe in RECIPES}
    for recipe in RECIPES:
        for count in (layers, max(1, layers // 4)):
            dtype, tx = optimizer(recipe)
            leaves = shapes(count, d)
            params = {k: jax.ShapeDtypeStruct(s, dtype, sharding=sharding)
                      for k, s in leaves.items()}
            state = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                jax.eval_shape(tx.init, params))

            def step(params: Any, state: Any, grads: Any, tx: Any = tx) -> Any:
                if tokens:  # ``grads`` is the batch
                    grads = jax.grad(transformer_loss)(params, grads)
                updates, state = tx.update(grads, state, params)
                return optax.apply_updates(params, updates), state

            batch = (jax.ShapeDtypeStruct((tokens, d), jnp.float32, sharding=sharding)
                     if tokens else params)
            steps[recipe][count] = (step, (params, state, batch), len(leaves))
    # A deviceless compile cannot lower the host callback of low_precision_params' misuse
    # check: there, it is zeros computed on the device (harness.callbacks_on_device).
    on_device = harness.callbacks_on_device if target == "h100" else contextlib.nullcontext
    if target != "h100":
        harness.warm_up_compiler()
    out: Dict[str, Any] = {"kind": kind,
                           "library": os.path.dirname(os.path.realpath(inspect.getfile(jmp_policy))),
                           "rows": {r: {"compile_s": [], "compile_cpu_s": [], "lower_s": []}
                                    for r in RECIPES}}
    for rep in range(reps):
        for recipe in RECIPES:
            step, args, leaves = steps[recipe][layers]
            jax.clear_caches()
            t0 = time.perf_counter()
            with on_device():
                lowered = jax.jit(step, donate_argnums=(0, 1)).lower(*args)
            t1, c1 = time.perf_counter(), time.process_time()
            compiled = lowered.compile()
            t2, c2 = time.perf_counter(), time.process_time()
            row = out["rows"][recipe]
            row["lower_s"].append(t1 - t0)
            row["compile_s"].append(t2 - t1)
            row["compile_cpu_s"].append(c2 - c1)
            if rep == 0:
                text = compiled.as_text()
                row.update(leaves=leaves, kernels=harness.hlo_figures(text)["fusions"],
                           distinct=harness.distinct_kernels(text),
                           instructions=len(harness.parse_hlo(text)))
                small_step, small_args, small_leaves = steps[recipe][max(1, layers // 4)]
                with on_device():
                    small = jax.jit(small_step, donate_argnums=(0, 1)).lower(*small_args).compile()
                small_text = small.as_text()
                # What one more leaf adds (the model's leaves, a few shapes, each layer
                # alike): XLA's passes take a time about proportional to it.
                per_leaf = ((row["instructions"] - len(harness.parse_hlo(small_text)))
                            / max(1, leaves - small_leaves))
                row.update(small_leaves=small_leaves, per_leaf=per_leaf,
                           small_distinct=harness.distinct_kernels(small_text))
            print(f"  [{target}] {recipe}: {t2 - t1:.2f} s", file=sys.stderr, flush=True)
    out["parameters"] = n
    return out


def run_worker(python: str, library: Optional[str], target: str, args: Any) -> Dict[str, Any]:
    """`worker` in a process of its own: its XLA flags, and ``library`` 's jmp_policy
    (None: this checkout's)."""
    from benchmarks import harness

    env: Dict[str, Optional[str]] = {"XLA_FLAGS": FAST_FLAGS if target == "cpu-fast" else None}
    if target != "h100":
        env["JAX_PLATFORMS"] = "cpu"
    return harness.run_child(
        "bench_compile_time", ["--worker", target, "--layers", str(args.layers), "--d",
                               str(args.d), "--reps", str(args.reps),
                               "--tokens", str(args.tokens if args.train_step else 0)],
        python=python, library=library, env=env)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16, help="transformer layers (6 leaves each)")
    parser.add_argument("--d", type=int, default=512, help="model width (16 layers of 512: "
                        "50.4M parameters)")
    parser.add_argument("--reps", type=int, default=3, help="fresh compiles per recipe")
    parser.add_argument("--rounds", type=int, default=1,
                        help="times to run every (target, version) worker in turn, their "
                        "compiles pooled: before and after then meet alike a shared "
                        "machine's load, which drifts over minutes")
    parser.add_argument("--targets", default="cpu,cpu-fast,h100")
    parser.add_argument("--before", help="a checkout of the library to measure as 'before'")
    parser.add_argument("--gpu-python", default=sys.executable,
                        help="a Python with JAX's CUDA plugin, for the h100 target")
    parser.add_argument("--quick", action="store_true", help="4 layers, CPU, 1 rep")
    parser.add_argument("--train-step", action="store_true",
                        help="compile a transformer's train step (its gradient, then the "
                        "optimizer step), not the optimizer step alone")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of --train-step")
    parser.add_argument("--json")
    parser.add_argument("--worker", choices=TARGETS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        result = worker(args.worker, args.layers, args.d, args.reps, args.tokens)
        from benchmarks import harness
        harness.child_result(result)
        return 0
    if args.quick:
        args.layers, args.reps, args.targets = 4, 1, "cpu"
    from benchmarks import harness

    versions: List[Tuple[str, Optional[str]]] = [("before", os.path.abspath(args.before))] \
        if args.before else []
    versions.append(("after", None))
    targets = args.targets.split(",")
    results: Dict[str, Dict[str, Any]] = {}
    for round_ in range(args.rounds):
        for target in targets:
            for version, library in versions:
                python = args.gpu_python if target == "h100" else sys.executable
                print(f"{target}, {version} ({library or 'this checkout'}), round {round_ + 1}",
                      file=sys.stderr, flush=True)
                result = run_worker(python, library, target, args)
                pooled = results.setdefault(f"{target} {version}", result)
                if pooled is not result:
                    for recipe, row in result["rows"].items():
                        for key in ("compile_s", "compile_cpu_s", "lower_s"):
                            pooled["rows"][recipe][key] += row[key]
    report = harness.Report("bench_compile_time", __doc__.split("\n")[0], vars(args), argv)
    first = next(iter(results.values()))
    columns = []
    for target in targets:
        for version, _ in versions:
            columns += [
                harness.Column(f"{target} {version}", f"{target}, {version}", "s", ratio=False),
                harness.Column(f"{target} {version} x", "x Adam", "x", ratio=False),
                harness.Column(f"{target} {version} leaf x", "per leaf, x Adam's HLO", "x",
                               ratio=False)]
    summary = report.table(
        "summary", f"Compile time of the {'train' if args.train_step else 'optimizer'} step "
        "(fastest of the reps) and its ratio to Adam's, before and after", baseline=None,
        columns=columns,
        description=f"{first['parameters'] / 1e6:.1f}M parameters in "
                    f"{first['rows']['adam']['leaves']} leaves")
    for recipe in RECIPES:
        figures = {}
        for key, result in results.items():
            best = min(result["rows"][recipe]["compile_s"])
            figures[key] = best
            figures[key + " x"] = best / min(result["rows"]["adam"]["compile_s"])
            figures[key + " leaf x"] = (result["rows"][recipe]["per_leaf"]
                                        / result["rows"]["adam"]["per_leaf"])
        summary.add_row(recipe, figures)
    detail_columns = [
        harness.Column("compile_s", "compile (fastest)", "s"),
        harness.Column("compile_cpu_s", "compile, CPU time (least)", "s"),
        harness.Column("lower_s", "trace + lower (fastest)", "s"),
        harness.Column("kernels", "kernels", "count", ratio=False),
        harness.Column("distinct", "distinct kernels", "count", ratio=False),
        harness.Column("small_distinct", "distinct, a quarter of the layers", "count", ratio=False),
        harness.Column("instructions", "HLO instructions", "count"),
        harness.Column("per_leaf", "HLO instructions per leaf", "count"),
    ]
    for key, result in results.items():
        table = report.table(key.replace(" ", "_"), f"{key}: {result['kind']}", baseline="adam",
                             columns=detail_columns, description=f"library: {result['library']}")
        for recipe, row in result["rows"].items():
            figures = {k: min(v) if isinstance(v, list) else v for k, v in row.items()}
            table.add_row(recipe, figures, samples={k: v for k, v in row.items()
                                                    if isinstance(v, list)})
    report.note(f"cpu-fast: XLA_FLAGS={FAST_FLAGS!r}; cpu: no XLA_FLAGS.")
    print(report.markdown())
    path = args.json or harness.default_json_path("bench_compile_time", args.quick)
    report.write(path)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""XLA:GPU's memory account of the optimizer step, compiled for an H100 without one.

XLA decides per backend which intermediate values it stores: XLA:CPU, where
the other benchmarks run, rarely fuses one computation into several kernels' outputs, while
XLA:GPU's multi-output fusion does, and its cost model may instead store a
value that several kernels read. The temporaries and copies of an optimizer
step on a GPU are therefore XLA:GPU's figures, not XLA:CPU's. This script
gets them on any machine: with a GPU it compiles for that GPU; without one
it compiles for an H100 through JAX's deviceless ahead-of-time path (a GPU
"topology" built from a target description; nothing runs).

The workload is ``bench_low_precision``'s optimizer step (``update`` +
``optax.apply_updates`` on transformer-shaped leaves) for each of its recipes,
and 4-bit SGD with momentum and Lion, each compiled with the weights and
optimizer state donated (as a train loop does) and without. Figures:
temporaries (``memory_analysis``) in units of one float32 copy of the largest
leaf, copies in the optimized HLO, kernels (fusions), and the bytes those
kernels read and write, summed from the optimized HLO (a deviceless compile
gives no cost analysis). A deviceless compile also cannot lower host
callbacks, which ``low_precision_params``' misuse check makes: without a GPU,
its recipes are compiled with ``jax.pure_callback`` returning zeros on the
device instead (rows noted "callback as zeros"), a program that differs from
the real one in that conditional branch only.

Without a GPU, in a virtual environment of its own (the CUDA wheels are
about 4 GB; no driver needed), from the repository root::

    python -m venv /tmp/gpuvenv && /tmp/gpuvenv/bin/pip install "jax[cuda12]==$(python -c 'import jax; print(jax.__version__)')" optax
    /tmp/gpuvenv/bin/python -m benchmarks.bench_xla_gpu_memory
    # bench_low_precision's GPU size (100.7M parameters in 48 leaves), ~10 min:
    /tmp/gpuvenv/bin/python -m benchmarks.bench_xla_gpu_memory --params 1e8 \
        --json benchmarks/results/bench_xla_gpu_memory_100m.json

JSON to ``benchmarks/results/bench_xla_gpu_memory.json``.
"""

from __future__ import annotations

import os

# Without a GPU the CUDA plugin's version check fails (no driver); the
# deviceless compile needs only the plugin's compiler.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import argparse  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
from typing import Any, Dict, List, Optional, Tuple  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from benchmarks import harness  # noqa: E402
import jmp_policy  # noqa: E402
from benchmarks.bench_low_precision import RECIPES, transformer_shapes  # noqa: E402

COLUMNS = [
    harness.Column("temp_per_leaf", "temporaries (largest f32 leaves)", "x", ratio=False),
    harness.Column("temp_bytes", "temporaries", "bytes", ratio=False),
    harness.Column("copies", "copies", "count", ratio=False),
    harness.Column("fusions", "kernels (fusions)", "count"),
    harness.Column("kernel_bytes", "bytes read + written (kernels)", "bytes"),
]


def optimizers() -> List[Tuple[str, Any, optax.GradientTransformation]]:
    """(name, weights' dtype, optimizer) of every case."""
    cases = [(r.name, r.weights, r.optimizer(optax.adam(1e-4))) for r in RECIPES]
    for name, inner in (("sgd momentum", optax.sgd(1e-3, momentum=0.9)),
                        ("lion", optax.lion(1e-4))):
        cases.append((name, jnp.float32, inner))
        for bits in (8, 4):
            cases.append((f"{name}, {bits}-bit", jnp.float32,
                          jmp_policy.quantize_state(inner, bits=bits)))
    return cases


def figures(tx: optax.GradientTransformation, params: Any, sharding: Any,
            donate: Tuple[int, ...]) -> Dict[str, Any]:
    state = harness.on_target(jax.eval_shape(tx.init, params), sharding)

    def step(params: Any, state: Any, grads: Any) -> Any:
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    compiled = jax.jit(step, donate_argnums=donate).lower(params, state, params).compile()
    text = compiled.as_text()
    hlo = harness.hlo_figures(text)
    out: Dict[str, Any] = dict(harness.memory_figures(compiled))
    out.update(copies=hlo["copies"], fusions=hlo["fusions"], kernel_bytes=harness.kernel_bytes(text))
    largest = max(math.prod(x.shape) for x in jax.tree.leaves(params)) * 4
    out["temp_per_leaf"] = out["temp_bytes"] / largest
    return out


def row(tx: optax.GradientTransformation, params: Any, sharding: Any,
        donate: Tuple[int, ...]) -> Tuple[Dict[str, Any], str]:
    """``figures`` and a note: without a GPU, a step with a host callback compiles
    with the callback as zeros on the device."""
    try:
        return figures(tx, params, sharding, donate), ""
    except Exception as e:
        if jax.default_backend() == "gpu" or "backend" not in str(e):
            raise
    with harness.callbacks_on_device():
        return figures(tx, params, sharding, donate), "callback as zeros"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=4e6,
                        help="parameters of the optimizer step (default 4e6, as "
                             "bench_low_precision's cpu size)")
    parser.add_argument("--json", help="write the report here (default: "
                        "benchmarks/results/bench_xla_gpu_memory.json)")
    args = parser.parse_args(argv)
    sharding, kind = harness.gpu_target()
    shapes = transformer_shapes(args.params)
    env = harness.environment()
    env["target"] = kind
    report = harness.Report("bench_xla_gpu_memory", __doc__.split("\n")[0], vars(args), argv,
                            env=env)
    n = sum(math.prod(s) for s in shapes.values())
    largest = max(math.prod(s) for s in shapes.values())
    print(f"{kind}: optimizer step on {n:,} parameters in {len(shapes)} leaves "
          f"(largest {largest:,})", flush=True)
    for donate, title in (((0, 1), "donated"), ((), "not donated")):
        table = report.table(f"step_{title.replace(' ', '_')}",
                             f"Optimizer step (update + apply_updates), {title}",
                             baseline="adam", columns=COLUMNS,
                             description=f"{n:,} parameters in {len(shapes)} leaves, "
                                         f"largest {largest:,}; {kind}")
        failed = []
        for name, dtype, tx in optimizers():
            params = {k: jax.ShapeDtypeStruct(s, dtype, sharding=sharding)
                      for k, s in shapes.items()}
            try:
                table.add_row(name, *row(tx, params, sharding, donate))
            except Exception as e:  # a case that does not compile is reported, not fatal
                failed.append({"name": name, "error": f"{type(e).__name__}: {e}"[:500]})
        report.failed(failed, title)
        print(harness.render_table(table.to_json()), flush=True)
    path = args.json or harness.default_json_path("bench_xla_gpu_memory")
    report.write(path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

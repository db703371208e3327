"""Transformer LM train step: float32 against mixed_bfloat16 and mixed_float16 + loss scaling.

The train step is the one of ``examples/transformer_lm.py`` (per-module policy:
LayerNorm, softmax and logits float32; ``jmp_policy.loss_scaling`` around
AdamW). ``--runs`` adds its float8 runs (``bench_residuals.LM_RUNS``: float8
products, float8 residuals, both). Each run is in a fresh subprocess, so that
the device's peak memory (``memory_stats()["peak_bytes_in_use"]``, GPU/TPU
only) is that run's own. Per run: the median step time over ``--steps`` timed
steps after ``--warmup`` steps, as a ratio to float32 (to mixed_bfloat16
without float32); XLA's memory account of one
compiled step (arguments + outputs + temporaries) and bytes accessed; the
device's peak memory; the loss after the steps and the skipped steps.

Commands (from the repository root; JSON to ``benchmarks/results/gpu_train_step.json``)::

    python -m benchmarks.gpu_train_step                 # GPU-sized model on a GPU, else --size cpu
    python -m benchmarks.gpu_train_step --size cpu      # small sizes, runs anywhere (~1 min on CPU)
    python -m benchmarks.gpu_train_step --quick         # smoke run: --size cpu, 3 steps
    python -m benchmarks.gpu_train_step --runs mixed_bfloat16 "float8 residuals" \
        tensorwise "tensorwise, float8 residuals" --json benchmarks/results/gpu_residuals.json

On a GPU machine whose Python lacks this checkout's packages::

    PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m benchmarks.gpu_train_step
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List, Optional

from benchmarks import harness
from benchmarks.bench_residuals import LM_RUNS

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
RUNS: Dict[str, Dict[str, Any]] = {
    **{policy: {"policy": policy} for policy in POLICIES}, **LM_RUNS}
"""``make_train_step``'s keyword arguments (and its policy, mixed_bfloat16 if none) by name."""
SIZES = {
    "cpu": dict(d_model=64, heads=4, layers=2, seq_len=64, batch_size=16),
    "gpu": dict(d_model=1024, heads=16, layers=8, seq_len=512, batch_size=32),
}
COLUMNS = [
    harness.Column("wall_s", "step time", "s"),
    harness.Column("bytes_accessed", "bytes accessed", "bytes"),
    harness.Column("step_memory_bytes", "step memory (XLA)", "bytes"),
    harness.Column("peak_device_bytes", "peak device memory", "bytes"),
    harness.Column("final_loss", "loss after the steps", ""),
    harness.Column("skipped_steps", "skipped steps", "count", ratio=False),
]


def run_one(name: str, size: Dict[str, int], steps: int, warmup: int) -> Dict[str, Any]:
    """One run's figures (in a child process)."""
    import time

    import jax
    import numpy as np
    import optax

    lm = harness.load_file("examples/transformer_lm.py")
    config = lm.Config(**size)
    options = dict(RUNS[name])
    init, train_step, _ = lm.make_train_step(options.pop("policy", "mixed_bfloat16"), config,
                                             **options)
    params, opt_state = init(0)
    batch = jax.device_put(next(lm.batches(lm.load_text(), config, seed=0)))
    compiled = train_step.lower(params, opt_state, batch).compile()
    figures = harness.xla_figures(compiled)
    for _ in range(warmup):
        params, opt_state, loss = train_step(params, opt_state, batch)
    jax.block_until_ready(params)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        params, opt_state, loss = train_step(params, opt_state, batch)
        jax.block_until_ready((params, loss))
        times.append(time.perf_counter() - start)
    stats = jax.local_devices()[0].memory_stats() or {}
    memory = [figures[k] for k in ("argument_bytes", "output_bytes", "temp_bytes")]
    return {
        "run": name,
        "params": int(sum(x.size for x in jax.tree.leaves(params))),
        "figures": {
            "wall_s": float(np.median(times)),
            "bytes_accessed": figures["bytes_accessed"],
            "step_memory_bytes": None if None in memory else sum(memory),
            "peak_device_bytes": stats.get("peak_bytes_in_use"),
            "final_loss": float(loss),
            "skipped_steps": int(optax.tree_utils.tree_get(opt_state, "skipped_steps")),
        },
        "samples": {"wall_s": times},
    }


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="model size preset (default: gpu on a GPU, else cpu)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--runs", nargs="+", default=list(POLICIES), choices=list(RUNS),
                        metavar="RUN", help=f"of {list(RUNS)}")
    parser.add_argument("--json", help="write the report here (default: "
                        "benchmarks/results/gpu_train_step.json; .quick.json with --quick)")
    parser.add_argument("--quick", action="store_true", help="smoke run: --size cpu, 3 steps")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.one is not None:  # child process: one policy
        harness.child_result(run_one(args.one, SIZES[args.size], args.steps, args.warmup))
        return 0

    if args.quick:
        args.size, args.steps, args.warmup = "cpu", 3, 1
    if args.size is None:
        import jax
        args.size = "gpu" if jax.default_backend() == "gpu" else "cpu"
    report = harness.Report("gpu_train_step", __doc__.split("\n")[0], vars(args), argv)
    results = []
    for name in args.runs:
        results.append(harness.run_child(
            "gpu_train_step", ["--one", name, "--size", args.size, "--steps", str(args.steps),
                               "--warmup", str(args.warmup)]))
        print(f"{name}: {results[-1]['figures']['wall_s'] * 1e3:.2f} ms/step "
              f"{results[-1]['figures']}", flush=True)
    desc = (f"size {args.size} {SIZES[args.size]}, {results[0]['params']:,} params, "
            f"median of {args.steps} steps after {args.warmup}")
    table = report.table("policies", "Transformer LM train step by policy",
                         baseline="float32" if "float32" in args.runs else "mixed_bfloat16"
                         if "mixed_bfloat16" in args.runs else None,
                         columns=COLUMNS, description=desc)
    for r in results:
        table.add_row(r["run"], r["figures"], samples=r["samples"])
    print(harness.render_table(table.to_json()))
    path = args.json or harness.default_json_path("gpu_train_step", args.quick)
    report.write(path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Transformer LM train step: float32 vs mixed_bfloat16 vs mixed_float16 + loss scaling.

    python benchmarks/gpu_train_step.py                 # GPU-sized model if a GPU is present
    python benchmarks/gpu_train_step.py --size cpu      # small sizes (runs anywhere)

The train step is the one of ``examples/transformer_lm.py`` (per-module policy:
LayerNorm, softmax and logits float32; ``jmp_policy.loss_scaling`` around
AdamW). Each policy runs in a fresh subprocess, so the device's peak memory
(``memory_stats()["peak_bytes_in_use"]``, GPU/TPU only) is that policy's own.
Reported per policy: median step time over ``--steps`` timed steps after
``--warmup`` steps, the ratio to float32, XLA's memory account of one compiled
step (arguments + outputs + temporaries), and the device peak.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "examples"))

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
SIZES = {
    "cpu": dict(d_model=64, heads=4, layers=2, seq_len=64, batch_size=16),
    "gpu": dict(d_model=1024, heads=16, layers=8, seq_len=512, batch_size=32),
}


def run_one(policy: str, size: dict, steps: int, warmup: int) -> dict:
    import jax
    import numpy as np

    import transformer_lm as lm

    config = lm.Config(**size)
    init, train_step, _ = lm.make_train_step(policy, config)
    params, opt_state = init(0)
    data = lm.batches(lm.load_text(), config, seed=0)
    batch = jax.device_put(next(data))
    compiled = train_step.lower(params, opt_state, batch).compile()
    memory = compiled.memory_analysis()
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
    n_params = sum(x.size for x in jax.tree.leaves(params))
    return {
        "policy": policy,
        "device": jax.devices()[0].device_kind,
        "params": int(n_params),
        "step_ms": 1e3 * float(np.median(times)),
        "step_memory_bytes": None if memory is None else int(
            memory.argument_size_in_bytes + memory.output_size_in_bytes
            + memory.temp_size_in_bytes),
        "peak_device_bytes": stats.get("peak_bytes_in_use"),
        "final_loss": float(loss),
        "skipped_steps": int(__import__("optax").tree_utils.tree_get(opt_state, "skipped_steps")),
    }


def _mib(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.0f} MiB"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="model size preset (default: gpu on a GPU, else cpu)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--out", default=None, help="write results as JSON here")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.one is not None:  # child process: one policy, JSON on the last line
        print(json.dumps(run_one(args.one, SIZES[args.size], args.steps, args.warmup)))
        return

    size = args.size
    if size is None:
        import jax
        size = "gpu" if jax.default_backend() == "gpu" else "cpu"
    results = []
    for policy in args.policies:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", policy, "--size", size,
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(f"{policy}: {results[-1]['step_ms']:.2f} ms/step", flush=True)

    base = next((r["step_ms"] for r in results if r["policy"] == "float32"), None)
    device = results[0]["device"]
    date = datetime.date.today().isoformat()
    print(f"\n{device}, {date}, size={size} {SIZES[size]}, {results[0]['params']:,} params, "
          f"median of {args.steps} steps")
    print("| policy | step time | speed-up vs float32 | step memory (XLA) | peak device memory "
          "| skipped |")
    print("|---|---|---|---|---|---|")
    for r in results:
        ratio = "n/a" if base is None else f"{base / r['step_ms']:.2f}x"
        print(f"| {r['policy']} | {r['step_ms']:.2f} ms | {ratio} | {_mib(r['step_memory_bytes'])} "
              f"| {_mib(r['peak_device_bytes'])} | {r['skipped_steps']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": date, "size": size, "config": SIZES[size], "results": results},
                      f, indent=1)


if __name__ == "__main__":
    main()

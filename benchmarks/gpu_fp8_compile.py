"""Compile time of the float8 train step of `gpu_fp8.py`'s MLP block, per XLA flag set.

On an H100 (2026-11-25, 2026-11-27) the ``"rowwise"`` train step took minutes to
compile and the ``"tensorwise"`` one 4.7 s; compiled for an H100 without one
(``bench_compile_time``'s deviceless path, which autotunes nothing) rowwise was
1.4x tensorwise. This script separates the candidate causes on a GPU: each
(recipe, flag set) is compiled in a fresh process under its own time limit, with
XLA's default flags, with GEMM autotuning off (``--xla_gpu_autotune_level=0``)
and with Triton GEMMs off (``--xla_gpu_enable_triton_gemm=false``). A flag set
that brings rowwise back near tensorwise names the pass that costs the time.

Commands (from the repository root)::

    python benchmarks/gpu_fp8_compile.py --limit 90          # on a GPU
    python benchmarks/gpu_fp8_compile.py --smoke             # anywhere (tiny sizes)
    python benchmarks/gpu_fp8_compile.py --kinds rowwise \
        --flags no-fusion-autotuner,no-cublas-fallback,default --autotune-logs /tmp/at

The two further flag sets and the autotuning logs separate the autotuning that costs
rowwise its minutes (benchmarks/results/rowwise_compile_2026-11-27.md).

JSON lines to stdout, and ``--json PATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
FLAG_SETS = {
    "default": "",
    "autotune-0": "--xla_gpu_autotune_level=0",
    "no-triton-gemm": "--xla_gpu_enable_triton_gemm=false",
    # Added after rowwise_compile_2026-11-27.md: the autotuner of the fusions that are not
    # GEMMs (native against Triton block-level emitter, on reductions and transposes), and
    # the cuBLAS(Lt) candidates of each Triton GEMM fusion, each off on its own.
    "no-fusion-autotuner": "--xla_gpu_experimental_enable_fusion_autotuner=false",
    "no-cublas-fallback": "--xla_gpu_cublas_fallback=false",
}


def worker(kind: str, smoke: bool) -> Dict[str, Any]:
    """Compiles the train step of ``kind`` here (the flags are this process's)."""
    import jax
    import jax.numpy as jnp

    import gpu_fp8
    size = gpu_fp8.SIZES["smoke" if smoke else "full"]
    d, b, t = size["d_model"], size["batch"], size["seq"]
    p = gpu_fp8.mlp_params(d)
    x = jnp.zeros((b, t, d), jnp.bfloat16)
    y = jnp.zeros((b, t, d), jnp.float32)
    recipe = None if kind == "bfloat16" else kind
    step = jax.jit(gpu_fp8.train_step(recipe), donate_argnums=(0, 1))
    lowered = step.lower(p, gpu_fp8.init_state(recipe, p, x), x, y)
    t0 = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - t0
    text = compiled.as_text()
    gemms = [line for line in text.splitlines() if "custom-call(" in line
             and ("cublas" in line or "gemm" in line.lower())]
    return {"compile_s": seconds, "gemms": len(gemms), "f8_gemms": sum("f8" in g for g in gemms),
            "triton_fusions": text.count('"kind":"__triton'),
            "device": jax.devices()[0].device_kind}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="tensorwise,rowwise")
    parser.add_argument("--flags", default="autotune-0,no-triton-gemm,default",
                        help=f"flag sets, in this order: {', '.join(FLAG_SETS)}")
    parser.add_argument("--limit", type=float, default=120.0, help="seconds per compile")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--autotune-logs", metavar="DIR",
                        help="XLA's autotuning log of each compile to DIR/<kind>-<flags>.txt "
                             "(--xla_gpu_dump_autotune_logs_to): what it tried, per fusion")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a.worker, a.smoke)))
        return 0
    rows = []
    for flags in a.flags.split(","):
        for kind in a.kinds.split(","):
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                [os.path.dirname(BENCHMARKS), BENCHMARKS]))
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + FLAG_SETS[flags]).strip()
            if a.autotune_logs:
                os.makedirs(a.autotune_logs, exist_ok=True)
                log = os.path.join(os.path.abspath(a.autotune_logs), f"{kind}-{flags}.txt")
                env["XLA_FLAGS"] += f" --xla_gpu_dump_autotune_logs_to={log}"
            command = [sys.executable, os.path.abspath(__file__), "--worker", kind]
            command += ["--smoke"] if a.smoke else []
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(command, env=env, capture_output=True, text=True,
                                      timeout=a.limit)
                row = (json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0
                       else {"error": proc.stderr[-800:]})
            except subprocess.TimeoutExpired:
                row = {"error": f"not compiled within {a.limit:.0f} s"}
            row.update(kind=kind, flags=flags, process_s=time.perf_counter() - t0)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

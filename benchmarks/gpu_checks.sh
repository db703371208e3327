#!/usr/bin/env bash
# The GPU checks of ../shared/GPU.md as one command, most important first, each under
# its own time limit, each writing its log under $OUT as it ends (a lease is short: a
# slow step must not eat the others). From the repository root, on a GPU machine:
#
#     OUT=/tmp/out bash benchmarks/gpu_checks.sh [steps]
#
# steps: a comma-separated subset of suite,fp8compile,optcompile,fp8 (default: the
# first three). Runs the image's own python3 (JAX with the CUDA plugin, Flax, optax,
# chex, pytest-xdist); the library from this checkout.
set -u
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
STEPS=${1:-suite,fp8compile,optcompile}
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
want() { [[ ",$STEPS," == *",$1,"* ]]; }
step() { echo "=== $1 ($(date +%T))"; }

step versions
{ nvidia-smi -L; git rev-parse HEAD; git status --short | head -5
  python3 -c "import jax, jaxlib, optax, flax; print('jax', jax.__version__, 'jaxlib', \
jaxlib.__version__, 'optax', optax.__version__, 'flax', flax.__version__, jax.devices())"
} 2>&1 | tee "$OUT/versions.txt"

if want suite; then
  step "suite (-n 16)"
  timeout 230 python3 -m pytest -n 16 -q -p no:cacheprovider --ignore=tests/test_typing.py \
    --durations=15 --junitxml="$OUT/suite.xml" 2>&1 | tail -n 80 > "$OUT/suite.log"
  echo "rc ${PIPESTATUS[0]}" >> "$OUT/suite.log"
  grep -E "^(FAILED|ERROR)|passed|failed|^rc " "$OUT/suite.log" | tail -n 40
fi

if want fp8compile; then
  step "float8 train step compile, per flag set"
  python3 benchmarks/gpu_fp8_compile.py --flags autotune-0 --limit 60 --json "$OUT/fp8_compile_a.json"
  python3 benchmarks/gpu_fp8_compile.py --flags no-triton-gemm,default --kinds rowwise \
    --limit 60 --json "$OUT/fp8_compile_b.json"
fi

if want optcompile; then
  step "quantized optimizer steps compile (16 layers of 512, 96 leaves)"
  # The worker itself: it prints each recipe's compile time as it ends (the report would
  # come only after all of them).
  timeout 120 python3 benchmarks/bench_compile_time.py --worker h100 --layers 16 --d 512 \
    --reps 1 > "$OUT/opt_compile.json" 2> >(tee "$OUT/opt_compile.log" >&2)
fi

if want fp8; then
  step "float8 speed (gpu_fp8.py, MLP block only)"
  timeout 240 python3 benchmarks/gpu_fp8.py --skip-sweep --json "$OUT/gpu_fp8.json" 2>&1 | tail -n 40
fi
step done

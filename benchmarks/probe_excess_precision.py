"""Which float roundings XLA:GPU keeps: the observations behind tests/support/excess_precision.py.

Compiles small programs for an H100 (deviceless where there is no GPU) and reads
the optimized HLO: a narrow round trip through a layout operation, in the
contexts where XLA moves conversions, and each narrow elementwise operation,
and prints whether the narrow rounding survives and what each operation is
computed in. Run with the CUDA plugin installed (no GPU needed)::

    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python benchmarks/probe_excess_precision.py
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, Callable, Dict, Tuple

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import harness  # noqa: E402

F32 = jnp.float32
NARROW = {"f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2", "f4e2m1fn": "float4_e2m1fn",
          "bf16": "bfloat16", "f16": "float16"}
MOVEMENT = {"convert", "parameter", "constant", "broadcast", "bitcast", "tuple", "fusion",
            "reshape", "transpose", "copy", "slice", "get-tuple-element"}

LAYOUTS: Dict[str, Tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    # name: (the layout operation, one that undoes it)
    "reshape": (lambda a: a.reshape(8, 2, 8), lambda a: a.reshape(8, 16)),
    "expand_dims": (lambda a: a[:, None, :], lambda a: a[:, 0, :]),
    "transpose": (lambda a: a.T, lambda a: a.T),
    "broadcast": (lambda a: jnp.broadcast_to(a, (3, 8, 16)), lambda a: a[0]),
    "slice": (lambda a: a[:, 2:10], lambda a: jnp.pad(a, ((0, 0), (2, 6)))),
    "pad": (lambda a: jnp.pad(a, ((0, 0), (2, 6))), lambda a: a[:, 2:18]),
    "concatenate": (lambda a: jnp.concatenate([a, a]), lambda a: a[:8]),
    "rev": (lambda a: lax.rev(a, (0,)), lambda a: lax.rev(a, (0,))),
    "gather": (lambda a: a[jnp.array([3, 1, 2, 0, 4, 5, 6, 7])], lambda a: a),
    "dynamic_slice": (lambda a: lax.dynamic_slice_in_dim(a, 2, 4, 0), lambda a: a),
}
ARITHMETIC: Dict[str, Callable[..., Any]] = {
    "neg": lax.neg, "abs": lax.abs, "sign": lax.sign, "floor": lax.floor, "exp": lax.exp,
    "log": lax.log, "log1p": lax.log1p, "tanh": lax.tanh, "sin": lax.sin, "sqrt": lax.sqrt,
    "rsqrt": lax.rsqrt, "add": lax.add, "mul": lax.mul, "div": lax.div, "max": lax.max,
    "pow": lax.pow, "clamp": lambda a, b: lax.clamp(b, a, b + b),
    "select_n": lambda a, b: lax.select(a > b, a, b),
    "reduce_sum": lambda a: jnp.sum(a, axis=1, dtype=a.dtype),
    "reduce_max": lambda a: jnp.max(a, axis=1),
}
BINARY = {"add", "mul", "div", "max", "pow", "clamp", "select_n"}


def optimized_hlo(fn: Callable[..., Any], sharding: Any, *shapes: Tuple[int, ...]) -> str:
    args = [jax.ShapeDtypeStruct(s, F32, sharding=sharding) for s in shapes]
    return jax.jit(fn).trace(*args).lower().compile().as_text()


def narrow_instructions(text: str, dtype: Any) -> int:
    short = [k for k, v in NARROW.items() if v == jnp.dtype(dtype).name][0]
    return len(re.findall(rf"= {short}\[[^\]]*\]\S* [\w-]+\(", text))


def computed_in(text: str) -> str:
    """The float types of the optimized program's arithmetic instructions."""
    types = {NARROW.get(t, "float32" if t == "f32" else t) for t, op in re.findall(r"= (\w+)\[[^\]]*\]\S* ([\w-]+)\(", text)
             if op not in MOVEMENT and t not in ("pred", "s32", "u32", "s8", "u8", "s4")}
    return ", ".join(sorted(types)) or "-"


def main() -> int:
    sharding, kind = harness.gpu_target()
    print(f"# {kind}, jax {jax.__version__}")
    print("\n## A round trip f32 -> narrow -> f32 through a layout operation: rounding kept?")
    contexts = {
        "alone": lambda op, undo, d: lambda x: op(x.astype(d)).astype(F32),
        "then * 3": lambda op, undo, d: lambda x: op(x.astype(d)).astype(F32) * 3.0,
        "then undone": lambda op, undo, d: lambda x: undo(op(x.astype(d)).astype(F32)),
    }
    print("| operation | dtype | " + " | ".join(contexts) + " |\n|---|---|" + "---|" * len(contexts))
    for name, (op, undo) in LAYOUTS.items():
        for dtype in (jnp.float8_e4m3fn, jnp.bfloat16):
            kept = [narrow_instructions(optimized_hlo(make(op, undo, dtype), sharding, (8, 16)),
                                        dtype) > 0 for make in contexts.values()]
            print(f"| {name} | {jnp.dtype(dtype).name} | "
                  + " | ".join("kept" if k else "removed" for k in kept) + " |")
    print("\n## op(x.astype(narrow)).astype(f32): rounding kept? computed in?")
    print("| operation | dtype | narrow rounding | computed in |\n|---|---|---|---|")
    for name, op in ARITHMETIC.items():
        for dtype in (jnp.float8_e4m3fn, jnp.float4_e2m1fn, jnp.bfloat16, jnp.float16):
            n = 2 if name in BINARY else 1
            fn = lambda *xs: op(*[x.astype(dtype) for x in xs]).astype(F32)  # noqa: E731
            text = optimized_hlo(fn, sharding, *[(8, 16)] * n)
            kept = "kept" if narrow_instructions(text, dtype) else "removed"
            print(f"| {name} | {jnp.dtype(dtype).name} | {kept} | {computed_in(text)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

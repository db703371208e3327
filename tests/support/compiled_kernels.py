"""The distinct kernels of a compiled optimizer step (``harness.distinct_kernels``).

A step that does the same work on many arrays of one shape (an optimizer on a
model's layers) should compile to the same kernels for each, whatever their
number: a constant specific to one array inside a kernel (an index into an
array of per-array seeds) makes every kernel distinct, and the compile time
grow with the arrays.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from typing import Any, Callable

import jax
import optax

_HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                        "benchmarks", "harness.py")


def _harness() -> Any:
    """``benchmarks/harness.py``, which reads HLO for the benchmarks too (one place)."""
    if "harness" not in sys.modules:
        spec = importlib.util.spec_from_file_location("harness", _HARNESS)
        module = importlib.util.module_from_spec(spec)
        sys.modules["harness"] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules["harness"]


def _cpu_text(step: Callable[..., Any], *args: Any) -> str:
    return jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile().as_text()


def instructions_per_leaf(make: Callable[[], optax.GradientTransformation], dtype: Any,
                          compile: Callable[..., str] = _cpu_text) -> int:
    """The HLO instructions (fusion bodies included) that one more parameter adds to the
    optimized step (``update`` + ``optax.apply_updates``) of the optimizer ``make()``
    makes: the step of two leaves less that of one (of two shapes, so that nothing is
    shared between them). What each leaf costs XLA's passes, whose time grows with the
    instructions of every kernel. ``compile(step, params, state, grads)``: the optimized
    HLO text of ``step`` (by default XLA:CPU's, parameters and state donated)."""
    shapes = [(128, 512), (512, 128)]

    def step(params: Any, state: Any, grads: Any, tx: Any) -> Any:
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def count(n: int) -> int:
        tx = make()
        params = {f"p{i}": jax.ShapeDtypeStruct(s, dtype) for i, s in enumerate(shapes[:n])}
        state = jax.eval_shape(tx.init, params)
        text = compile(functools.partial(step, tx=tx), params, state, params)
        return len(_harness().parse_hlo(text))

    return count(2) - count(1)


def step_kernels(tx: optax.GradientTransformation, params: Any) -> int:
    """Distinct kernels of ``tx``'s compiled step (``update`` + ``optax.apply_updates``)."""
    def step(params: Any, state: Any, grads: Any) -> Any:
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = jax.eval_shape(tx.init, params)
    text = jax.jit(step).lower(params, state, params).compile().as_text()
    return _harness().distinct_kernels(text)

"""The distinct kernels of a compiled optimizer step (``harness.distinct_kernels``).

A step that does the same work on many arrays of one shape (an optimizer on a
model's layers) should compile to the same kernels for each, whatever their
number: a constant specific to one array inside a kernel (an index into an
array of per-array seeds) makes every kernel distinct, and the compile time
grow with the arrays.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import optax

from benchmarks import harness  # reads HLO for the benchmarks too (one place)


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
        return len(harness.parse_hlo(text))

    return count(2) - count(1)


def step_kernels(tx: optax.GradientTransformation, params: Any) -> int:
    """Distinct kernels of ``tx``'s compiled step (``update`` + ``optax.apply_updates``)."""
    def step(params: Any, state: Any, grads: Any) -> Any:
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = jax.eval_shape(tx.init, params)
    text = jax.jit(step).lower(params, state, params).compile().as_text()
    return harness.distinct_kernels(text)

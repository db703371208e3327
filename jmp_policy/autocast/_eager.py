"""Eager calls compiled whole: one program per traced function and input signature.

Called outside ``jit``, an evaluation binds every primitive it produces one by
one, and JAX compiles a program for each: a float8 product's quantization alone
is dozens. `Programs.run` instead runs an evaluation as one ``jax.jit`` program,
kept while the function traces to the same jaxpr. Under ``jit``, ``make_jaxpr``
or a loop body the evaluation is traced into the caller's program, and under
eager ``grad``, ``jvp`` or ``vmap`` it runs primitive by primitive, as before.

>>> import jax.numpy as jnp, jmp_policy
>>> f = jmp_policy.autocast(lambda x, w: jnp.tanh(x @ w), "mixed_bfloat16", fp8="tensorwise")
>>> f(jnp.ones((16, 32)), jnp.ones((32, 16))).dtype   # one compiled program, not one per op
dtype(bfloat16)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax.extend.core import ClosedJaxpr

from jmp_policy.jaxprs import Kept

Evaluate = Callable[[ClosedJaxpr, Sequence[Any]], list[Any]]

# Programs kept per function: the traced jaxpr differs when shapes, dtypes or the
# function's Python choices differ; a bound keeps a function called on ever new
# shapes from holding every program it ever compiled.
_KEPT = 16


def compilable(values: Sequence[Any]) -> bool:
    """Whether an evaluation on ``values`` may run as one compiled program: when every
    value is concrete, so that the call is an eager one.

    Values being traced into a jaxpr (``jit``, ``make_jaxpr``, a loop body) are
    evaluated into the caller's program. Under eager ``grad``, ``jvp`` or ``vmap``
    the evaluation runs primitive by primitive as before: their results then stay
    those of the same transformation of the same function elsewhere, bit for bit
    (a compiled program of a batched or transposed function rounds in kernels of
    its own), and a float8 product under ``jvp`` can name itself in the error it raises.
    """
    return not any(isinstance(x, jax.core.Tracer) for x in values)


class Programs:
    """Compiled evaluations, by the jaxpr they evaluate (`jaxprs.Kept`)."""

    def __init__(self) -> None:
        self._kept = Kept[Any](_KEPT)

    def run(self, evaluate: Evaluate, closed: ClosedJaxpr, values: Sequence[Any]) -> list[Any]:
        """``evaluate(closed, values)``, compiled once for this jaxpr and input signature.

        The jaxpr's constants are arguments of the program, so a function closing
        over new values of the same types reuses it.
        """
        jaxpr = closed.jaxpr

        def whole(consts: list[Any], values: list[Any]) -> list[Any]:
            return evaluate(ClosedJaxpr(jaxpr, consts), values)

        program = self._kept.get(jaxpr, None, lambda: jax.jit(whole))
        out: list[Any] = program(list(closed.consts), list(values))
        return out

"""Autocast's float8 rule: the products a `Float8Recipe` selects run as quantized products.

`float8_matmul` makes a ``Context.matmul`` rule from a recipe. A product that
the recipe leaves alone (see `jmp_policy.float8.eligible`) goes to the default
`matmul` rule; an eligible ``dot_general`` or mixture-of-experts
``ragged_dot_general`` becomes `jmp_policy.float8.quantized_product`, in the formats
`jmp_policy.float8.operand_dtypes` gives it, and under delayed scaling with the amax
history the interpreter's slots hand it (``Context.float8_slots``).

>>> import jax.numpy as jnp, jmp_policy
>>> recipe = jmp_policy.Float8Recipe("rowwise", power_of_two_scales=True)
>>> f = jmp_policy.autocast(lambda x, w: x @ w, "float32", fp8=recipe)
>>> f(jnp.ones((16, 32)), jnp.ones((32, 16)))[0, 0]   # ones and their scales: exact in float8
Array(32., dtype=float32)
"""

from __future__ import annotations

import functools
from typing import Any

from jax.extend.core import JaxprEqn

from jmp_policy.autocast.interpreter import Context, MatmulRule, matmul
from jmp_policy.float8 import (
    AmaxHistory, Float8Recipe, eligible, operand_dtypes, quantized_product)


FLOAT8_PRODUCTS = "float8 products"
"""What `float8_matmul` tallies in the `Context`: one per product it runs in float8."""


@functools.lru_cache(maxsize=None)  # one rule per recipe: rewrites are reused by rule
def float8_matmul(recipe: Float8Recipe) -> MatmulRule:
    """The ``Context.matmul`` rule running the products ``recipe`` selects in float8.

    Other matrix work (excluded scopes, small or integer products,
    convolutions) goes to the default `matmul` rule.
    """
    def rule(ctx: Context, eqn: JaxprEqn, invals: list[Any]) -> Any:
        if not eligible(recipe, eqn, ctx.scope):
            return matmul(ctx, eqn, invals)
        ctx.tally(FLOAT8_PRODUCTS)
        history = _history(ctx) if recipe.delayed else None
        return quantized_product(eqn, recipe, operand_dtypes(recipe, ctx.scope), ctx.compute,
                                 *invals, history=history)

    return rule


def _history(ctx: Context) -> AmaxHistory:
    """The amax history of the delayed-scaling product ``ctx`` is at."""
    if ctx.float8_slots is None:
        raise TypeError(
            f"The product under {ctx.scope!r} has a delayed-scaling Float8Recipe, whose "
            "scales come from amax histories that only jmp_policy.autocast passes in (as its "
            "function's first argument, a jmp_policy.Float8State). Use autocast, or a current "
            "scaling (fp8='tensorwise').")
    history: AmaxHistory = ctx.float8_slots.take(ctx.scope)
    return history

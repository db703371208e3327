"""Autocast's float8 rule: the products a `Float8Recipe` selects run as quantized products.

`float8_matmul` makes a ``Context.matmul`` rule from a recipe. A product that
the recipe leaves alone (see `jmp_policy.float8.eligible`) goes to the default
`matmul` rule; an eligible ``dot_general`` or mixture-of-experts
``ragged_dot_general`` becomes `jmp_policy.float8.quantized_product` with the
recipe's scheme.
"""

from __future__ import annotations

import functools
from typing import Any

from jax.extend.core import JaxprEqn

from jmp_policy.autocast.interpreter import Context, MatmulRule, matmul
from jmp_policy.float8 import Blocks
from jmp_policy.float8 import AmaxHistory
from jmp_policy.float8 import quantized_product
from jmp_policy.float8 import RAGGED, Float8Recipe, eligible, native_block_products, operand_dtypes
from jmp_policy.float8 import Float8


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
        # Block products: native or emulated, decided when tracing, from the backend;
        # ragged ones have no native product in JAX.
        scheme = (Blocks(recipe, native_block_products(recipe) and eqn.primitive.name != RAGGED)
                  if recipe.blocks else Float8(recipe))
        history = _history(ctx) if recipe.delayed else None
        return quantized_product(eqn, recipe, scheme, operand_dtypes(recipe, ctx.scope),
                                 ctx.compute, *invals, history=history)

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

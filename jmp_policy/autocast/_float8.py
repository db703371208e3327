"""Autocast's float8 rule: the products a `Float8Recipe` selects run as quantized products.

`float8_matmul` makes a ``Context.matmul`` rule from a recipe. A product that
the recipe leaves alone (see `jmp_policy.float8.eligible`) goes to the default
`matmul` rule; an eligible ``dot_general`` or mixture-of-experts
``ragged_dot_general`` becomes `jmp_policy.float8.quantized_product`, in the formats
`jmp_policy.float8.operand_dtypes` gives it, and under delayed scaling with the amax
history the interpreter's slots hand it (``Context.float8_slots``).
`kept_layers` reads the function's products before it is evaluated: the
layers ``Float8Recipe.high_precision_layers`` keeps in the compute dtype need
the size of each stack, and the recipe's rules that match nothing are reported.

>>> import jax.numpy as jnp, jmp_policy
>>> recipe = jmp_policy.Float8Recipe("rowwise", power_of_two_scales=True)
>>> f = jmp_policy.autocast(lambda x, w: x @ w, "float32", fp8=recipe)
>>> f(jnp.ones((16, 32)), jnp.ones((32, 16)))[0, 0]   # ones and their scales: exact in float8
Array(32., dtype=float32)
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

from jax.extend.core import ClosedJaxpr, JaxprEqn

from jmp_policy.autocast.interpreter import Context, MatmulRule, matmul
from jmp_policy.autocast.rules import Rules
from jmp_policy.float8 import (
    NO_LAYERS, AmaxHistory, Float8Recipe, KeptLayers, eligible, operand_dtypes,
    products, quantized_product)
from jmp_policy.paths import display_scope, unmatched_patterns
from jmp_policy.policy import UnmatchedRuleWarning


FLOAT8_PRODUCTS = "float8 products"
"""What `float8_matmul` tallies in the `Context`: one per product it runs in float8."""


@functools.lru_cache(maxsize=None)  # one rule per recipe and layers: rewrites are reused by rule
def float8_matmul(recipe: Float8Recipe, layers: KeptLayers = NO_LAYERS) -> MatmulRule:
    """The ``Context.matmul`` rule running the products ``recipe`` selects in float8.

    Other matrix work (excluded scopes, the kept ``layers``, small or integer
    products, convolutions) goes to the default `matmul` rule.
    """
    def rule(ctx: Context, eqn: JaxprEqn, invals: list[Any]) -> Any:
        if not eligible(recipe, eqn, ctx.scope, layers):
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


# Scopes a warning lists, at most: enough to see the model's naming.
_SHOWN = 8


def kept_layers(recipe: Float8Recipe, closed: ClosedJaxpr, rules: Rules,
                name: str) -> KeptLayers:
    """The layers of ``closed`` (the function ``name``) that ``recipe.high_precision_layers``
    keeps in the compute dtype, found among the products that reach the float8 rule
    (those in a float32 scope of ``rules`` do not).

    A ``high_precision_layers`` that finds no stack, and each ``exclude`` entry of the
    user's (not in `Float8Recipe.DEFAULT_EXCLUDE`) that matches no product's scope,
    warn with an `UnmatchedRuleWarning`, once per trace. With neither, the function's
    products are not read at all.
    """
    user = [p for p in recipe.exclude if p not in Float8Recipe.DEFAULT_EXCLUDE]
    if not any(recipe.high_precision_layers) and not user:
        return NO_LAYERS
    found = list(products(closed))
    for pattern in unmatched_patterns(user, [p.scope for p in found]):
        warnings.warn(
            f"Float8Recipe exclude entry {pattern!r} matched no matrix product of {name} "
            f"(their scopes: {_listed(p.scope for p in found)}).",
            UnmatchedRuleWarning, stacklevel=5)
    if not any(recipe.high_precision_layers):
        return NO_LAYERS
    selected = [p for p in found
                if not rules.scopes_in(p.scope) and eligible(recipe, p.eqn, p.scope)]
    layers = KeptLayers.of(recipe.high_precision_layers, [p.unrolled for p in selected])
    if not layers.stacks:
        warnings.warn(
            f"Float8Recipe high_precision_layers={recipe.high_precision_layers} matched no "
            f"stack of numbered layers in {name} (the scopes of its float8 products: "
            f"{_listed(p.scope for p in selected)}). A stack is two or more sibling scopes "
            "numbered at the end (linen's Block_0, Block_1; NNX's layers/0, layers/1; "
            "jax.named_scope(f'layer_{i}')), not a single block's own numbered parts. A "
            "scanned stack (nn.scan, nnx.scan, lax.scan over layers) has one body and no "
            "layer numbers: split the scan, or unroll the layers to keep.",
            UnmatchedRuleWarning, stacklevel=5)
    return layers


def _listed(scopes: Any) -> str:
    shown = sorted({display_scope(s) for s in scopes})
    if not shown:
        return "none"
    more = f" and {len(shown) - _SHOWN} more" if len(shown) > _SHOWN else ""
    return ", ".join(map(repr, shown[:_SHOWN])) + more

"""Residuals: what a backward pass keeps of its forward pass, and keeping it in float8.

Between the forward and the backward pass of a gradient, the values the
backward pass needs (the inputs of norms and activation functions, the
operands of products) stay in memory; at long sequences and large batches they
are most of a train step's memory. ``autocast(fn, ..., residuals="float8")``
stores them in float8 (`Float8Residuals`); ``jmp_policy.saved_residuals``
lists them.

* ``_origins``: the residuals of ``jax.vjp`` traced to a jaxpr, and the
  equation, argument or constant each comes from (`vjp_jaxpr`, `origins`);
* ``_rule``: which residuals stay in their dtype (`Rule`);
* ``_format``: the float8 format they are stored in (`store`, `load`);
* ``_transform``: the option (`Float8Residuals`, `as_residuals`) and the
  transformation that applies it (`in_float8`).
"""

from jmp_policy.residuals._format import BLOCK, Stored, load, store
from jmp_policy.residuals._origins import Kind, Origin, origins, vjp_jaxpr
from jmp_policy.residuals._rule import Rule
from jmp_policy.residuals._transform import (
    Float8Residuals, ResidualsLike, as_residuals, in_float8)

__all__ = [
    "BLOCK",
    "Float8Residuals",
    "Kind",
    "Origin",
    "ResidualsLike",
    "Rule",
    "Stored",
    "as_residuals",
    "in_float8",
    "load",
    "origins",
    "store",
    "vjp_jaxpr",
]

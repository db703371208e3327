"""A quantized product's three contractions: which operands each takes, which axes it
sums over, how its result is laid out.

A product of ``lhs`` and ``rhs`` (a ``dot_general``, or a ``ragged_dot_general`` in
``lax.ragged_dot``'s layout) is three contractions: the forward one, and in the
backward pass the incoming gradient ``g`` with ``rhs`` (lhs's gradient) and with
``lhs`` (rhs's gradient). A `Layout` holds the three `Contraction` s of a product;
dense and ragged products differ only there, so the product itself
(``_product.quantized_product``) and its schemes are the same for both.

Every operand of every contraction is quantized along the axes that contraction
sums over (`Contraction.axes`): a scale per row keeps the rows of the result
apart, a block lies within one sum.

Sharded products: under explicit mesh axes, each contraction's result takes the
sharding the plain product gives it (the forward one) or that of the operand it is
the gradient of, as JAX's own transposition of a ``dot_general`` does
(`Contraction.result_sharding`).

>>> import jax, jax.numpy as jnp
>>> eqn = jax.make_jaxpr(jnp.matmul)(jnp.ones((8, 16)), jnp.ones((16, 4))).eqns[0]
>>> layout = layout_of(eqn, 2, 2)
>>> [(c.operands, c.axes) for c in (layout.forward, layout.lhs_gradient, layout.rhs_gradient)]
[(('lhs', 'rhs'), ((1,), (0,))), (('g', 'rhs'), ((1,), (1,))), (('g', 'lhs'), ((0,), (0,)))]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional, Sequence

import jax
from jax import lax
from jax.extend.core import JaxprEqn
from jax.sharding import NamedSharding

from jmp_policy import sharding as _sharding
from jmp_policy.float8._axes import DenseAxes
from jmp_policy.float8._quantize import WEIGHT_GRADIENT, in_groups, ragged_dims
from jmp_policy.float8._recipe import RAGGED
from jmp_policy.jaxprs import bind

Name = Literal["lhs", "rhs", "g"]


@dataclasses.dataclass(frozen=True)
class Contraction:
    """One contraction of a product.

    Attributes:
      operands: the names of its (left, right) operands.
      axes: the axes of (left, right) that it sums over: each operand is quantized
        along them (rowwise: one scale per row of the others; blocks: blocks along them).
      dims: its dimension numbers (``dot_general``'s, or a ``RaggedDotDimensionNumbers``).
      ragged: whether it is a ``ragged_dot_general``, whose third operand is the group sizes.
      grouped: whether it sums over each group's rows (a ragged product's weight
        gradient): its operands take one scale per group (and column).
      perm: the transpose taking its result to the layout of the operand it is the
        gradient of, if any.
      eqn: the equation it rewrites (the forward contraction), whose parameters it keeps.
    """

    operands: tuple[Name, Name]
    axes: tuple[tuple[int, ...], tuple[int, ...]]
    dims: Any
    ragged: bool = False
    grouped: bool = False
    perm: Optional[tuple[int, ...]] = None
    eqn: Optional[JaxprEqn] = None

    def dot(self, left: Any, right: Any, rest: Sequence[Any],
            out_sharding: Optional[NamedSharding] = None, **params: Any) -> jax.Array:
        """The contraction of ``left`` and ``right`` as JAX computes it, with ``params``
        (``preferred_element_type``, ``precision``), its result sharded as
        ``out_sharding`` if given (see `result_sharding`)."""
        if self.eqn is not None:  # bound as traced: the parameters hold canonical values
            precision = params.pop("precision", None)
            if precision is not None:
                precision = (precision, precision)
            out: jax.Array = bind(self.eqn, (left, right, *rest),
                                  {**self.eqn.params, "precision": precision, **params})
            return out
        if self.ragged:
            return lax.ragged_dot_general(left, right, rest[0], self.dims, **params)
        return lax.dot_general(left, right, self.dims, out_sharding=out_sharding, **params)

    def result_sharding(self, operand: Any) -> Optional[NamedSharding]:
        """Under explicit mesh axes, the sharding this contraction's result takes: the
        forward one's that of the traced product's result, a gradient's that of
        ``operand`` (the operand it is the gradient of, or a value of its type) before
        `arranged`'s transpose. ``None`` elsewhere, and for ragged products, which keep
        JAX's rule."""
        if self.ragged:
            return None
        if self.eqn is not None:
            return _sharding.explicit(self.eqn.outvars[0].aval)
        return _sharding.permuted(_sharding.explicit_or_replicated(operand), self.perm)

    def arranged(self, out: jax.Array) -> jax.Array:
        """The contraction's result in the layout of the operand it is the gradient of."""
        return out if self.perm is None else lax.transpose(out, self.perm)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A product's three contractions, and what its operands must be before them."""

    forward: Contraction
    lhs_gradient: Contraction
    rhs_gradient: Contraction
    ragged: bool = False

    def masked(self, x: Any, rest: Sequence[Any]) -> Any:
        """``x`` as the contractions take it: a ragged product's rows past the groups zeroed
        (they take no part in it, so they must not count in its scales either)."""
        return in_groups(x, rest[0]) if self.ragged else x


def layout_of(eqn: JaxprEqn, lhs_ndim: int, rhs_ndim: int) -> Layout:
    """The `Layout` of ``eqn``, a ``dot_general`` or a plain ``ragged_dot_general``."""
    if eqn.primitive.name == RAGGED:
        return _ragged_layout(eqn)
    dims = eqn.params["dimension_numbers"]
    lhs, rhs = axes = DenseAxes.of(dims, lhs_ndim, rhs_ndim)
    lhs_dims, lhs_perm = axes.gradient(0)
    rhs_dims, rhs_perm = axes.gradient(1)
    return Layout(
        Contraction(("lhs", "rhs"), (lhs.contract, rhs.contract), dims, eqn=eqn),
        Contraction(("g", "rhs"), (rhs.out_free, rhs.free), lhs_dims, perm=lhs_perm),
        Contraction(("g", "lhs"), (lhs.out_free, lhs.free), rhs_dims, perm=rhs_perm))


def _ragged_layout(eqn: JaxprEqn) -> Layout:
    """``[m, k] x [groups, k, n] -> [m, n]`` (or rhs ``[groups, n, k]``): lhs's gradient is
    ragged like the forward product; rhs's sums each group's rows, ``[m, k] x [m, n] ->
    [groups, k, n]``."""
    rhs_k = eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers[0][1][0]
    rhs_n = 3 - rhs_k
    return Layout(
        Contraction(("lhs", "rhs"), ((1,), (rhs_k,)), eqn.params["ragged_dot_dimension_numbers"],
                    ragged=True, eqn=eqn),
        Contraction(("g", "rhs"), ((1,), (rhs_n,)), ragged_dims((1, rhs_n), True, True),
                    ragged=True),
        Contraction(("lhs", "g"), ((0,), (0,)), WEIGHT_GRADIENT, ragged=True, grouped=True,
                    perm=(0, 2, 1) if rhs_k == 2 else None),
        ragged=True)

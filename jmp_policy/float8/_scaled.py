"""The current- and delayed-scaled float8 scheme of quantized products: `Float8`.

With ``"tensorwise"``, ``"rowwise"`` and ``"delayed"`` recipes,
``_product.quantized_product`` quantizes each operand of each contraction to
float8 with one scale per tensor, or per row along the axes the contraction keeps
(``_quantize``: from the operand's current maximum, or from its amax history), and
multiplies the float8 values in one ``dot_general`` that accumulates in float32 and
gives bfloat16 under a bfloat16 policy (half the bytes; ``_product._gemm_dtype``).
The result is rescaled in float32, by the two operands' scales laid out against it.

>>> import jax, jax.numpy as jnp, jmp_policy
>>> f = jmp_policy.autocast(lambda x, w: x @ w, "mixed_bfloat16", fp8="tensorwise")
>>> module = jax.jit(f).lower(jnp.ones((32, 64)), jnp.ones((64, 16))).as_text()
>>> [line.split(" : ")[-1] for line in module.splitlines() if "stablehlo.dot_general" in line]
['(tensor<32x64xf8E4M3FN>, tensor<64x16xf8E4M3FN>) -> tensor<32x16xbf16>']
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import layout as xla_layout
from jax.sharding import NamedSharding

from jmp_policy import sharding as _sharding
from jmp_policy.dtypes import F32, DType
from jmp_policy.float8._axes import DenseAxes, OperandAxes
from jmp_policy.float8._layout import Contraction
from jmp_policy.float8._quantize import (
    group_ids,
    quantize,
    quantize_delayed,
    quantize_groups,
)
from jmp_policy.float8._recipe import Float8Recipe

Quantized = tuple[jax.Array, jax.Array]
"""A float8 operand and its float32 scale, as `quantize` returns them."""

FORWARD_SCALE = "autocast_float8_forward_scale"
"""The ``checkpoint_name`` of a forward contraction's operand scales."""


def saving_scales(policy: Optional[Callable[..., Any]]) -> Optional[Callable[..., Any]]:
    """``policy`` (a ``jax.checkpoint`` policy), also saving the forward scales of float8
    products (`FORWARD_SCALE`) if it saves products.

    A float8 product's output is its GEMM's times the operands' scales. A policy that
    saves the GEMM's output (``dots_saveable`` and the like) would otherwise recompute
    the scales in the backward pass, and with them everything the operands are made
    from: a whole attention layer to rescale its output projection. A scale is one
    value per tensor (or row) of its operand. A policy that recomputes products
    recomputes their operands anyway, and is returned as it is.

    >>> import jax
    >>> from jax._src.ad_checkpoint import name_p
    >>> save = saving_scales(jax.checkpoint_policies.dots_saveable)
    >>> save(name_p, name=FORWARD_SCALE), save(name_p, name="other")
    (True, False)
    >>> saving_scales(jax.checkpoint_policies.nothing_saveable)
    <function nothing_saveable at ...>
    """
    args, params = _product_equation()
    if policy is None or not policy(*args, **params):
        return policy

    def save(prim: Any, *args: Any, **params: Any) -> Any:
        if prim.name == "name" and params.get("name") == FORWARD_SCALE:
            return True
        return policy(prim, *args, **params)

    return save


@functools.lru_cache(maxsize=None)
def _product_equation() -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A policy's arguments for a plain product ``x @ w``, as JAX traces it."""
    operand = jax.ShapeDtypeStruct((2, 2), jnp.float32)  # type: ignore[no-untyped-call]
    eqn = jax.make_jaxpr(lambda x, w: x @ w)(operand, operand).eqns[0]
    return (eqn.primitive, *(v.aval for v in eqn.invars)), dict(eqn.params)


@dataclasses.dataclass(frozen=True)
class Float8:
    """Float8 operands: one scale per tensor, or per row along the axes a contraction keeps
    (per group and column where it sums each group's rows), from the operand's current
    maximum; or one scale per tensor from its amax history (delayed scaling: prepared
    operands are ``(q, scale, amax)``, the third the maximum observed)."""

    recipe: Float8Recipe

    def prepare(self, x: Any, dtype: DType, c: Contraction, position: int,
                seed: Optional[jax.Array], rest: Sequence[Any],
                history: Optional[jax.Array] = None) -> Any:
        if isinstance(x, tuple):  # quantized already
            return x
        power_of_two = self.recipe.power_of_two_scales
        q: tuple[jax.Array, ...]
        if history is not None:
            q = quantize_delayed(x, dtype, history, self.recipe.amax_reduction,
                                 power_of_two=power_of_two, seed=seed)
        elif c.grouped and self.recipe.scaling == "rowwise":
            sizes = rest[0]
            q = quantize_groups(x, dtype, group_ids(sizes, jnp.shape(x)[0]),
                                jnp.shape(sizes)[0], power_of_two=power_of_two, seed=seed)
        else:
            q = quantize(x, dtype, self.recipe.scaling, c.axes[position],
                         power_of_two=power_of_two, seed=seed)
        if c.eqn is None:  # a backward contraction's
            return q
        # Named, a forward scale is kept by a checkpoint policy that saves products
        # (`saving_scales`): recomputed, it would recompute all its operand is made from.
        scale = checkpoint_name(q[1], FORWARD_SCALE)  # type: ignore[no-untyped-call]
        values = _in_own_layout(q[0]) if position == 1 else q[0]  # the weight of ``x @ w``
        return (values, scale, *q[2:])

    def keep(self, x: Any, prepared: Any, dtype: DType, c: Contraction, position: int,
             rest: Sequence[Any]) -> Any:
        # Saved in float8: a tensorwise operand as the forward quantized it, a rowwise one
        # quantized again along the axes its backward contraction sums over.
        if self.reuses(prepared, c):
            return prepared
        return self.prepare(x, dtype, c, position, None, rest)

    def reuses(self, prepared: Any, c: Contraction) -> bool:
        return self.recipe.scaling in ("tensorwise", "delayed")

    def contract(self, c: Contraction, left: Any, right: Any, rest: Sequence[Any],
                 out_sharding: Optional[NamedSharding], gemm_dtype: DType) -> jax.Array:
        if not c.ragged:
            out = c.dot(left[0], right[0], rest, out_sharding, preferred_element_type=gemm_dtype)
            return _scaled_product(left, right, DenseAxes.of(c.dims, left[0].ndim, right[0].ndim),
                                   lax.convert_element_type(out, F32), out_sharding)
        out = c.dot(left[0], right[0], rest, out_sharding, preferred_element_type=F32)
        if c.grouped:  # [groups, k, n]: lhs scaled per (group, k), g per (group, n)
            return _rescaled_groups(out, left[1], right[1])
        return _rescaled_rows(out, left[1], lax.squeeze(right[1], c.axes[1]), rest[0])


# --- A weight's layout ------------------------------------------------------------------------

def _in_own_layout(values: jax.Array) -> jax.Array:
    """Float8 ``values`` laid out as the array they quantize (row-major), on GPUs.

    XLA:GPU's float8 GEMMs take both operands contraction-major, so the forward and the
    backward product want a weight's float8 values in transposed layouts. Left to
    itself, XLA writes the cast in the forward GEMM's layout, reading the float32
    weight transposed, and transposes the float8 copy back for the backward GEMM: two
    transposing kernels. Pinned row-major, the cast is a plain elementwise kernel and
    only the float8 copy is transposed, or both layouts come from one kernel.
    """
    if values.ndim < 2:
        return values
    row_major = xla_layout.Layout(tuple(range(values.ndim)))

    def pin(v: jax.Array) -> jax.Array:
        out: jax.Array = xla_layout.with_layout_constraint(  # type: ignore[no-untyped-call]
            v, row_major)
        return out

    # Only on GPUs: XLA:CPU lays arrays out row-major anyway, and a TPU's are tiled.
    pinned: jax.Array = lax.platform_dependent(values, cuda=pin, rocm=pin,
                                               default=lambda v: v)
    return pinned


# --- Rescaling ---------------------------------------------------------------------------------

def _scaled_product(a: Quantized, b: Quantized, axes: DenseAxes, out: jax.Array,
                    out_sharding: Optional[NamedSharding]) -> jax.Array:
    """``out``, the float32 product of float8 ``a`` and ``b``, times both operands' scales."""
    out_sharding = _sharding.explicit(out) if out_sharding is None else out_sharding
    sa = _to_output(a[1], axes.lhs, out.shape, out_sharding)
    sb = _to_output(b[1], axes.rhs, out.shape, out_sharding)
    return lax.mul(lax.mul(out, sa), sb)


def _to_output(scale: jax.Array, axes: OperandAxes, out_shape: Sequence[int],
               out_sharding: Optional[NamedSharding]) -> Any:
    """An operand's scale (size 1 along its contracting axes) laid out against the output
    (and, under explicit mesh axes, sharded as it: ``out_sharding``)."""
    if math.prod(scale.shape) == 1:
        return lax.reshape(scale, ())
    kept = [a for a in range(scale.ndim) if a not in axes.contract]
    order = tuple(kept.index(a) for a in (*axes.batch, *axes.free))
    squeezed = lax.squeeze(scale, axes.contract)
    if order != tuple(range(len(order))):  # batch axes after free ones, as in attention
        squeezed = lax.transpose(squeezed, order)
    return lax.broadcast_in_dim(squeezed, tuple(out_shape),
                                tuple(range(len(axes.batch))) + axes.out_free,
                                out_sharding=out_sharding)


def _rescaled_rows(out: jax.Array, row_scale: jax.Array, group_scale: jax.Array,
                   sizes: jax.Array) -> jax.Array:
    """``out`` ``[m, n]``, a float32 ragged product of float8 operands, rescaled.

    ``row_scale`` is lhs's, one per row (``[m, 1]``) or one in all (``[1, 1]``);
    ``group_scale`` rhs's, one per group and output column (``[g, n]``) or one
    in all. Row ``i`` takes the scales of its group's columns; rows in no group
    take 0 (their product is zero, and must stay so next to an inf scale).
    """
    if group_scale.shape[0] == sizes.shape[0]:  # per group (or a single group)
        ids = group_ids(sizes, out.shape[0])
        group_scale = jnp.take(group_scale, ids, axis=0, mode="fill", fill_value=0)
    return lax.mul(lax.mul(out, lax.broadcast_in_dim(row_scale, out.shape, (0, 1))),
                   lax.broadcast_in_dim(group_scale, out.shape, (0, 1)))


def _rescaled_groups(out: jax.Array, lhs_scale: jax.Array, rhs_scale: jax.Array) -> jax.Array:
    """``out`` ``[g, k, n]``, a float32 weight gradient of float8 operands, times the
    operands' scales: one per (group, k) and per (group, n), or one each (``[1, 1]``)."""
    return lax.mul(lax.mul(out, lax.broadcast_in_dim(lhs_scale, out.shape, (0, 1))),
                   lax.broadcast_in_dim(rhs_scale, out.shape, (0, 2)))

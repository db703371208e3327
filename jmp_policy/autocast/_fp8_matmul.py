"""Autocast's float8 rule: eligible products run on float8 operands, forward and backward.

`float8_matmul` makes a ``Context.matmul`` rule from a `Float8Recipe`. A
product that the recipe leaves alone (see ``_fp8.eligible``) goes to the
default `matmul` rule. An eligible ``dot_general`` becomes `float8_product`:
its operands are quantized with current scaling (``_fp8.quantize``) and go
straight into a ``dot_general`` of float8 operands that accumulates in
float32; the result is rescaled and returned in float32, as the matmul class
returns it. Its derivative is a ``custom_vjp`` whose two backward products
also take float8 operands: the incoming gradient in ``recipe.bwd_dtype``, the
saved forward operand in its forward format. An eligible mixture-of-experts
``ragged_dot_general`` becomes `float8_ragged_product`, built the same way.

>>> import jax, jax.numpy as jnp, jmp_policy
>>> f = jmp_policy.autocast(lambda x, w: x @ w, "mixed_bfloat16", fp8="tensorwise")
>>> module = jax.jit(f).lower(jnp.ones((32, 64)), jnp.ones((64, 16))).as_text()
>>> [line.split(" : ")[-1] for line in module.splitlines() if "stablehlo.dot_general" in line]
['(tensor<32x64xf8E4M3FN>, tensor<64x16xf8E4M3FN>) -> tensor<32x16xf32>']
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence, Union

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import JaxprEqn

from jmp_policy import formats
from jmp_policy.autocast import _blocks
from jmp_policy.autocast._block_matmul import block_product, block_ragged_product
from jmp_policy.autocast._fp8 import (
    RAGGED,
    WEIGHT_GRADIENT,
    Float8Recipe,
    eligible,
    group_ids,
    in_groups,
    native_block_products,
    operand_dtypes,
    quantize,
    quantize_groups,
    ragged_dims,
)
from jmp_policy.autocast._interpreter import Context, MatmulRule, bind
from jmp_policy.autocast._lattice import F32, DType, convert, dtype_of, join
from jmp_policy.autocast._matmul import matmul

Quantized = tuple[jax.Array, jax.Array]
"""A float8 operand and its float32 scale, as `quantize` returns them."""


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
        formats = operand_dtypes(recipe, ctx.scope)
        if recipe.blocks and eqn.primitive.name == RAGGED:
            return block_ragged_product(eqn, recipe, formats, ctx.compute, *invals)
        if recipe.blocks:
            native = native_block_products(recipe)  # when tracing, from the backend
            return block_product(eqn, recipe, formats, ctx.compute, native, *invals)
        if eqn.primitive.name == RAGGED:
            return float8_ragged_product(eqn, recipe, formats, ctx.compute, *invals)
        return float8_product(eqn, recipe, formats, ctx.compute, *invals)

    return rule


def _gradient_seed(recipe: Float8Recipe, g: Any, salt: int) -> Any:
    """The random seed rounding the incoming gradient ``g`` stochastically, if the recipe
    does; ``salt`` tells apart the two backward products' quantizations of ``g``."""
    return formats.seed_from_values(g, salt) if recipe.stochastic_rounding else None


# --- Where each operand axis goes ------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Layout:
    """The axes of ``dot_general(lhs, rhs)``; its output is (batch, lhs free, rhs free)."""

    lhs_contract: tuple[int, ...]
    rhs_contract: tuple[int, ...]
    lhs_batch: tuple[int, ...]
    rhs_batch: tuple[int, ...]
    lhs_free: tuple[int, ...]
    rhs_free: tuple[int, ...]

    @classmethod
    def of(cls, dims: Any, lhs_ndim: int, rhs_ndim: int) -> _Layout:
        (lc, rc), (lb, rb) = dims
        return cls(tuple(lc), tuple(rc), tuple(lb), tuple(rb),
                   _free(lhs_ndim, lc, lb), _free(rhs_ndim, rc, rb))

    @property
    def out_batch(self) -> tuple[int, ...]:
        return tuple(range(len(self.lhs_batch)))

    @property
    def out_lhs_free(self) -> tuple[int, ...]:
        start = len(self.lhs_batch)
        return tuple(range(start, start + len(self.lhs_free)))

    @property
    def out_rhs_free(self) -> tuple[int, ...]:
        start = len(self.lhs_batch) + len(self.lhs_free)
        return tuple(range(start, start + len(self.rhs_free)))

    def lhs_gradient(self) -> tuple[Any, tuple[int, ...]]:
        """``dot_general(g, rhs)`` dimension numbers giving lhs's gradient, and its transpose.

        The product's axes are (batch, lhs free, rhs's contracting axes in
        increasing order); the permutation puts them in lhs's order.
        """
        dims = ((self.out_rhs_free, self.rhs_free), (self.out_batch, self.rhs_batch))
        return dims, _gradient_axes(self.lhs_batch, self.lhs_free, self.lhs_contract,
                                    self.rhs_contract)

    def rhs_gradient(self) -> tuple[Any, tuple[int, ...]]:
        """``dot_general(g, lhs)`` dimension numbers giving rhs's gradient, and its transpose."""
        dims = ((self.out_lhs_free, self.lhs_free), (self.out_batch, self.lhs_batch))
        return dims, _gradient_axes(self.rhs_batch, self.rhs_free, self.rhs_contract,
                                    self.lhs_contract)


def _free(ndim: int, contract: Sequence[int], batch: Sequence[int]) -> tuple[int, ...]:
    return tuple(i for i in range(ndim) if i not in contract and i not in batch)


def _gradient_axes(batch: Sequence[int], free: Sequence[int], contract: Sequence[int],
                   other_contract: Sequence[int]) -> tuple[int, ...]:
    """For each operand axis, its axis in a gradient product laid out as
    (batch, free, the other operand's contracting axes in increasing order)."""
    ndim = len(batch) + len(free) + len(contract)
    rest = sorted(other_contract)
    position = {}
    for i, a in enumerate(batch):
        position[a] = i
    for i, a in enumerate(free):
        position[a] = len(batch) + i
    for a, b in zip(contract, other_contract):
        position[a] = len(batch) + len(free) + rest.index(b)
    return tuple(position[a] for a in range(ndim))


# --- Products ----------------------------------------------------------------------------

def _to_output(scale: jax.Array, contract: Sequence[int], batch: Sequence[int],
               free: Sequence[int], out_free: Sequence[int], out_shape: Sequence[int]) -> Any:
    """An operand's scale (size 1 along its contracting axes) laid out against the output."""
    if math.prod(scale.shape) == 1:
        return lax.reshape(scale, ())
    kept = [a for a in range(scale.ndim) if a not in contract]
    order = tuple(kept.index(a) for a in (*batch, *free))
    squeezed = lax.squeeze(scale, tuple(contract))
    if order != tuple(range(len(order))):  # batch axes after free ones, as in attention
        squeezed = lax.transpose(squeezed, order)
    return lax.broadcast_in_dim(squeezed, tuple(out_shape),
                                tuple(range(len(batch))) + tuple(out_free))


def _scaled_product(a: Quantized, b: Quantized, layout: _Layout, out: jax.Array) -> jax.Array:
    """``out``, the float32 product of float8 ``a`` and ``b``, times both operands' scales."""
    sa = _to_output(a[1], layout.lhs_contract, layout.lhs_batch, layout.lhs_free,
                    layout.out_lhs_free, out.shape)
    sb = _to_output(b[1], layout.rhs_contract, layout.rhs_batch, layout.rhs_free,
                    layout.out_rhs_free, out.shape)
    return lax.mul(lax.mul(out, sa), sb)


def float8_dot(a: Quantized, b: Quantized, dims: Any) -> jax.Array:
    """``dot_general(a, b, dims)`` of quantized operands, float32 accumulation, rescaled."""
    layout = _Layout.of(dims, a[0].ndim, b[0].ndim)
    out = lax.dot_general(a[0], b[0], dims, preferred_element_type=F32)
    return _scaled_product(a, b, layout, out)


Residual = Union[Quantized, jax.Array]
"""A forward operand saved for a backward product: quantized, or as it came."""


def float8_product(eqn: JaxprEqn, recipe: Float8Recipe, formats: tuple[DType, DType],
                   compute: DType, lhs: Any, rhs: Any) -> Any:
    """``eqn``'s ``dot_general`` of ``lhs`` and ``rhs`` on float8 operands.

    ``formats`` are the float8 dtypes of (lhs, rhs). The result is float32
    (at least ``compute``), as the matmul class returns it. Operands are quantized
    from the dtype they come in (not narrowed to the compute dtype first, so
    float16 compute cannot overflow them). Differentiated, the gradient of
    each operand is a float8 product of the incoming gradient (in
    ``recipe.bwd_dtype``) and the other operand, returned in the operand's
    dtype; with ``recipe.float8_weight_gradient`` off, rhs's gradient is a
    product in ``compute``, as the matmul class computes it.
    """
    # This rule runs whenever the product is differentiated, possibly after this trace:
    # it keeps the equation, recipe and dtypes, never a traced value.
    layout = _Layout.of(eqn.params["dimension_numbers"], jnp.ndim(lhs), jnp.ndim(rhs))
    acc, lhs_dtype, rhs_dtype = join(compute, F32), dtype_of(lhs), dtype_of(rhs)
    fwd_params = dict(eqn.params, precision=None, preferred_element_type=F32)
    lhs_format, rhs_format = formats
    tensorwise = recipe.scaling == "tensorwise"

    def q(x: Any, dtype: DType, contract: Sequence[int], seed: Any = None) -> Quantized:
        return quantize(x, dtype, recipe.scaling, contract,
                        power_of_two=recipe.power_of_two_scales, seed=seed)

    def forward(a: Any, b: Any) -> tuple[Any, Quantized, Quantized]:
        qa, qb = q(a, lhs_format, layout.lhs_contract), q(b, rhs_format, layout.rhs_contract)
        out = bind(eqn, (qa[0], qb[0]), fwd_params)  # float8 operands, float32 accumulation
        return convert(_scaled_product(qa, qb, layout, out), acc), qa, qb

    def product(a: Any, b: Any) -> Any:
        return forward(a, b)[0]

    def product_fwd(a: Any, b: Any) -> tuple[Any, tuple[Residual, Quantized]]:
        out, qa, qb = forward(a, b)
        # Tensorwise scales do not depend on the axes: the forward's float8 operands serve
        # the backward products too. Rowwise ones are per row of each backward product.
        if not recipe.float8_weight_gradient:
            a_res: Residual = a
        else:
            a_res = qa if tensorwise else q(a, lhs_format, layout.lhs_free)
        b_res = qb if tensorwise else q(b, rhs_format, layout.rhs_free)
        return out, (a_res, b_res)

    def product_bwd(res: tuple[Residual, Quantized], g: Any) -> tuple[Any, Any]:
        a_res, b_res = res
        g_lhs = q(g, recipe.bwd_dtype, layout.out_rhs_free, _gradient_seed(recipe, g, 1))
        dims, perm = layout.lhs_gradient()
        grad_lhs = lax.transpose(float8_dot(g_lhs, b_res, dims), perm)
        dims, perm = layout.rhs_gradient()
        if isinstance(a_res, tuple):
            g_rhs = g_lhs if tensorwise else q(g, recipe.bwd_dtype, layout.out_lhs_free,
                                               _gradient_seed(recipe, g, 2))
            grad_rhs = float8_dot(g_rhs, a_res, dims)
        else:
            # As the matmul class's backward products: compute-dtype operands and result.
            grad_rhs = lax.dot_general(convert(g, compute), convert(a_res, compute), dims,
                                       preferred_element_type=compute)
        return convert(grad_lhs, lhs_dtype), convert(lax.transpose(grad_rhs, perm), rhs_dtype)

    product.__name__ = f"float8_{eqn.primitive.name}"
    custom = jax.custom_vjp(product)
    custom.defvjp(product_fwd, product_bwd)
    return custom(lhs, rhs)


# --- Ragged products (mixture of experts) --------------------------------------------------

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


def float8_ragged_dot(a: Quantized, b: Quantized, sizes: Any, dims: Any) -> jax.Array:
    """``ragged_dot_general(a, b, sizes, dims)`` of quantized operands, float32
    accumulation, rescaled: lhs ``[m, *]`` ragged along its rows, scaled per row
    (or in all), rhs ``[g, *, *]`` scaled per group and non-contracting column
    (or in all), as `quantize` scales them along their contracting axes."""
    (_, (rhs_contract,)), _ = dims.dot_dimension_numbers
    out = lax.ragged_dot_general(a[0], b[0], sizes, dims, preferred_element_type=F32)
    return _rescaled_rows(out, a[1], lax.squeeze(b[1], (rhs_contract,)), sizes)


def _rescaled_groups(out: jax.Array, lhs_scale: jax.Array, rhs_scale: jax.Array) -> jax.Array:
    """``out`` ``[g, k, n]``, a float32 weight gradient of float8 operands, times the
    operands' scales: one per (group, k) and per (group, n), or one each (``[1, 1]``)."""
    return lax.mul(lax.mul(out, lax.broadcast_in_dim(lhs_scale, out.shape, (0, 1))),
                   lax.broadcast_in_dim(rhs_scale, out.shape, (0, 2)))


def float8_ragged_product(eqn: JaxprEqn, recipe: Float8Recipe, formats: tuple[DType, DType],
                          compute: DType, lhs: Any, rhs: Any, sizes: Any) -> Any:
    """``eqn``'s ``ragged_dot_general`` of ``lhs`` ``[m, k]`` and ``rhs`` ``[g, k, n]`` (or
    ``[g, n, k]``) with group ``sizes`` ``[g]``, on float8 operands.

    As `float8_product`, for the layout of ``lax.ragged_dot``
    (``_fp8.is_plain_ragged``). Rowwise scaling gives each operand of the
    three products one scale per row along its non-contracting axes, a group
    counting as a row: forward, lhs per row and rhs per (group, output
    column); for lhs's gradient ``g @ rhs^T``, the incoming gradient ``g``
    per row and rhs per (group, k); for rhs's gradient, the sum over each
    group's rows of ``lhs^T @ g`` (a ragged product contracting the ragged
    rows), lhs per (group, k) and ``g`` per (group, n). Rows past
    ``sum(sizes)`` give zeros, as in JAX's product. ``sizes`` has no gradient.
    """
    rhs_k = eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers[0][1][0]
    rhs_n = 3 - rhs_k  # rhs is [g, k, n] or [g, n, k]
    acc, lhs_dtype, rhs_dtype = join(compute, F32), dtype_of(lhs), dtype_of(rhs)
    fwd_params = dict(eqn.params, precision=None, preferred_element_type=F32)
    lhs_gradient = ragged_dims((1, rhs_n), True, True)  # [m, n] x rhs -> [m, k]
    lhs_format, rhs_format = formats
    tensorwise = recipe.scaling == "tensorwise"

    def q(x: Any, dtype: DType, contract: int, seed: Any = None) -> Quantized:
        return quantize(x, dtype, recipe.scaling, (contract,),
                        power_of_two=recipe.power_of_two_scales, seed=seed)

    def q_groups(x: Any, dtype: DType, sizes: jax.Array, seed: Any = None) -> Quantized:
        ids = group_ids(sizes, jnp.shape(x)[0])
        return quantize_groups(x, dtype, ids, jnp.shape(sizes)[0],
                               power_of_two=recipe.power_of_two_scales, seed=seed)

    def forward(a: Any, b: Any, sizes: Any) -> tuple[Any, Any, Quantized, Quantized]:
        a = in_groups(a, sizes)
        qa, qb = q(a, lhs_format, 1), q(b, rhs_format, rhs_k)
        out = bind(eqn, (qa[0], qb[0], sizes), fwd_params)  # float8, float32 accumulation
        out = _rescaled_rows(out, qa[1], lax.squeeze(qb[1], (rhs_k,)), sizes)
        return convert(out, acc), a, qa, qb

    def product(a: Any, b: Any, sizes: Any) -> Any:
        return forward(a, b, sizes)[0]

    def product_fwd(a: Any, b: Any, sizes: Any) -> tuple[Any, tuple[Residual, Quantized, Any]]:
        out, a, qa, qb = forward(a, b, sizes)
        # As in float8_product: tensorwise operands serve the backward products as they
        # are; rowwise ones are re-quantized along the other axes.
        if not recipe.float8_weight_gradient:
            a_res: Residual = a
        else:
            a_res = qa if tensorwise else q_groups(a, lhs_format, sizes)
        b_res = qb if tensorwise else q(b, rhs_format, rhs_n)
        return out, (a_res, b_res, sizes)

    def product_bwd(res: tuple[Residual, Quantized, Any], g: Any) -> tuple[Any, Any, None]:
        a_res, b_res, sizes = res
        g = in_groups(g, sizes)
        g_rows = q(g, recipe.bwd_dtype, 1, _gradient_seed(recipe, g, 1))
        grad_lhs = float8_ragged_dot(g_rows, b_res, sizes, lhs_gradient)
        if isinstance(a_res, tuple):
            g_groups = g_rows if tensorwise else q_groups(g, recipe.bwd_dtype, sizes,
                                                          _gradient_seed(recipe, g, 2))
            grad_rhs = _rescaled_groups(
                lax.ragged_dot_general(a_res[0], g_groups[0], sizes, WEIGHT_GRADIENT,
                                       preferred_element_type=F32),
                a_res[1], g_groups[1])
        else:
            # As the matmul class's backward products: compute-dtype operands and result.
            grad_rhs = lax.ragged_dot_general(convert(a_res, compute), convert(g, compute), sizes,
                                              WEIGHT_GRADIENT, preferred_element_type=compute)
        if rhs_k == 2:
            grad_rhs = lax.transpose(grad_rhs, (0, 2, 1))
        # The group sizes are integers: no cotangent.
        return convert(grad_lhs, lhs_dtype), convert(grad_rhs, rhs_dtype), None

    product.__name__ = f"float8_{eqn.primitive.name}"
    custom = jax.custom_vjp(product)
    custom.defvjp(product_fwd, product_bwd)
    return custom(lhs, rhs, sizes)

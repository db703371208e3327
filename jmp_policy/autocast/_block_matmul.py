"""Autocast's block-scaled products (MXFP8, NVFP4), forward and backward.

A product of a recipe with a block scaling becomes `block_product` (or, for
``lax.ragged_dot``, `block_ragged_product`): each operand is quantized in
blocks along the product's contracting dimension (``_blocks``), and the
product is either the backend's native block-scaled GEMM
(``jax.nn.scaled_matmul``) or its exact emulation, the operands dequantized
to float32 and multiplied in float32 (``Precision.HIGHEST``: no TF32 on GPUs
without the native product). The choice is made when tracing
(``_fp8.native_block_products``). Each backward product quantizes its own
operands along its own contracting dimension, the incoming gradient in
``recipe.bwd_dtype``, stochastically rounded if the recipe says so.

>>> import jax, jax.numpy as jnp, jmp_policy
>>> f = jmp_policy.autocast(lambda x, w: x @ w, "mixed_bfloat16", fp8="mxfp8")
>>> text = jax.jit(f).lower(jnp.ones((32, 64)), jnp.ones((64, 32))).as_text()
>>> "x32xf8E4M3FN>" in text   # both operands, in blocks of 32 along the 64 contracted
True
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import JaxprEqn

from jmp_policy import formats
from jmp_policy.autocast import _blocks
from jmp_policy.autocast._fp8 import (
    WEIGHT_GRADIENT, Float8Recipe, group_ids, in_groups, ragged_dims)
from jmp_policy.autocast._lattice import F32, DType, convert, dtype_of, join

_HIGHEST = lax.Precision.HIGHEST
_BMK = (((2,), (2,)), ((0,), (0,)))  # (B, M, K) x (B, N, K) -> (B, M, N)

# Salts of the random seeds of the two backward products' incoming gradients.
_LHS_GRADIENT, _RHS_GRADIENT = 1, 2


def _as_bmk(x: Any, contract: Sequence[int], batch: Sequence[int], pad: int) -> Any:
    """``x`` as ``(batch, free, contracting)``, each flattened, the last padded with ``pad``
    zeros (which add nothing to a product) to whole blocks."""
    shape = jnp.shape(x)
    free = [i for i in range(len(shape)) if i not in contract and i not in batch]
    x = lax.transpose(x, (*batch, *free, *contract))
    x = lax.reshape(x, tuple(math.prod(shape[i] for i in axes) for axes in (batch, free, contract)))
    return _blocks.pad_last(x, pad)


def block_dot(a: Any, b: Any, dims: Any, scaling: str, formats: tuple[DType, DType], *,
              native: bool, seeds: tuple[Optional[jax.Array], Optional[jax.Array]] = (None, None),
              ) -> jax.Array:
    """``dot_general(a, b, dims)`` in float32, both operands block-quantized along their
    contracting axes in ``formats`` (rounded stochastically where ``seeds`` has a seed)."""
    (lc, rc), (lb, rb) = dims
    a_shape, b_shape = jnp.shape(a), jnp.shape(b)
    k = math.prod(a_shape[i] for i in lc)
    pad = -k % _blocks.BLOCK_SIZES[scaling]
    qa = _blocks.quantize_blocks(_as_bmk(a, lc, lb, pad), scaling, formats[0], seed=seeds[0])
    qb = _blocks.quantize_blocks(_as_bmk(b, rc, rb, pad), scaling, formats[1], seed=seeds[1])
    if native:
        scale = _blocks.SCALE_DTYPES[scaling]
        out = jax.nn.scaled_matmul(qa.values, qb.values, convert(qa.scales, scale),
                                   convert(qb.scales, scale), preferred_element_type=F32)
    else:
        out = lax.dot_general(qa.dequantized(), qb.dequantized(), _BMK, precision=_HIGHEST,
                              preferred_element_type=F32)
    out = _tensor_scaled(out, scaling, qa.tensor_scale, qb.tensor_scale)
    free = [[s for i, s in enumerate(shape) if i not in c and i not in bt]
            for shape, c, bt in ((a_shape, lc, lb), (b_shape, rc, rb))]
    return lax.reshape(out, (*(a_shape[i] for i in lb), *free[0], *free[1]))


def _tensor_scaled(out: jax.Array, scaling: str, sa: jax.Array, sb: jax.Array) -> jax.Array:
    """``out`` times the operands' per-tensor scales (NVFP4's; MXFP8 has none)."""
    return lax.mul(out, lax.mul(sa, sb)) if scaling == "nvfp4" else out


def _seeds(recipe: Float8Recipe, g: Any, salt: int) -> tuple[Optional[jax.Array], None]:
    return (formats.seed_from_values(g, salt) if recipe.stochastic_rounding else None), None


def block_product(eqn: JaxprEqn, recipe: Float8Recipe, formats: tuple[DType, DType],
                  compute: DType, native: bool, lhs: Any, rhs: Any) -> Any:
    """``eqn``'s ``dot_general`` of ``lhs`` and ``rhs`` on block-scaled operands, as
    ``_fp8_matmul.float8_product`` is on float8 ones: float32 result (at least
    ``compute``), and a ``custom_vjp`` whose backward products are block-scaled too,
    each quantizing the saved forward operand along its own contracting axes."""
    # Imported when tracing: _fp8_matmul imports this module.
    from jmp_policy.autocast._fp8_matmul import _Layout

    dims = eqn.params["dimension_numbers"]
    layout = _Layout.of(dims, jnp.ndim(lhs), jnp.ndim(rhs))
    acc, lhs_dtype, rhs_dtype = join(compute, F32), dtype_of(lhs), dtype_of(rhs)
    scaling, (lhs_format, rhs_format) = recipe.scaling, formats

    def product(a: Any, b: Any) -> Any:
        return convert(block_dot(a, b, dims, scaling, formats, native=native), acc)

    def product_fwd(a: Any, b: Any) -> tuple[Any, tuple[Any, Any]]:
        return product(a, b), (a, b)

    def product_bwd(res: tuple[Any, Any], g: Any) -> tuple[Any, Any]:
        a, b = res
        dims_lhs, perm_lhs = layout.lhs_gradient()
        grad_lhs = block_dot(g, b, dims_lhs, scaling, (recipe.bwd_dtype, rhs_format),
                             native=native, seeds=_seeds(recipe, g, _LHS_GRADIENT))
        dims_rhs, perm_rhs = layout.rhs_gradient()
        if recipe.float8_weight_gradient:
            grad_rhs = block_dot(g, a, dims_rhs, scaling, (recipe.bwd_dtype, lhs_format),
                                 native=native, seeds=_seeds(recipe, g, _RHS_GRADIENT))
        else:  # as the matmul class's backward products: compute-dtype operands and result
            grad_rhs = lax.dot_general(convert(g, compute), convert(a, compute), dims_rhs,
                                       preferred_element_type=compute)
        return (convert(lax.transpose(grad_lhs, perm_lhs), lhs_dtype),
                convert(lax.transpose(grad_rhs, perm_rhs), rhs_dtype))

    product.__name__ = f"{scaling}_{eqn.primitive.name}"
    custom = jax.custom_vjp(product)
    custom.defvjp(product_fwd, product_bwd)
    return custom(lhs, rhs)


def block_ragged_product(eqn: JaxprEqn, recipe: Float8Recipe, formats: tuple[DType, DType],
                         compute: DType, lhs: Any, rhs: Any, sizes: Any) -> Any:
    """``eqn``'s ``ragged_dot_general`` (``lax.ragged_dot``'s layout) on block-scaled
    operands, emulated on every backend (no backend has a native ragged block-scaled
    product in JAX).

    Blocks run along each product's contracting dimension, so every block
    holds one expert's values: forward, lhs ``[m, k]`` in blocks along each
    row's ``k`` and rhs in blocks along ``k`` per (expert, output column); for
    lhs's gradient, ``g`` along each row's ``n`` and rhs along ``n`` per
    (expert, k); for rhs's gradient, which sums each expert's rows, lhs and
    ``g`` in blocks of rows that start again at each expert's first row
    (``_blocks.dequantized_in_groups``). NVFP4's per-tensor scale is one per
    expert: each expert's rows, and each expert's matrix, are a tensor of their own.
    """
    rhs_k = eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers[0][1][0]
    rhs_n = 3 - rhs_k  # rhs is [g, k, n] or [g, n, k]
    acc, lhs_dtype, rhs_dtype = join(compute, F32), dtype_of(lhs), dtype_of(rhs)
    dims = eqn.params["ragged_dot_dimension_numbers"]
    lhs_gradient = ragged_dims((1, rhs_n), True, True)  # [m, n] x rhs -> [m, k]
    scaling, (lhs_format, rhs_format) = recipe.scaling, formats

    experts = jnp.shape(rhs)[0]
    matrices = (lax.iota(np.int32, experts), experts)  # rhs: one tensor per expert

    def along(x: Any, axis: int, dtype: DType, segments: Any,
              seed: Optional[jax.Array] = None) -> Any:
        return _blocks.dequantized_along(x, axis, scaling, dtype, seed=seed, segments=segments)

    def rows_scaled(out: jax.Array, a: Any, b: Any, rows: Any) -> jax.Array:
        """``out`` ``[m, *]`` times both operands' NVFP4 tensor scales, one per expert."""
        if scaling != "nvfp4":
            return out
        return lax.mul(out, _blocks.per_row(lax.mul(a[1], b[1]), rows, out.ndim))

    def forward(a: Any, b: Any, sizes: Any) -> tuple[Any, Any]:
        a = in_groups(a, sizes)
        rows = (group_ids(sizes, jnp.shape(a)[0]), experts)
        qa, qb = along(a, 1, lhs_format, rows), along(b, rhs_k, rhs_format, matrices)
        out = lax.ragged_dot_general(qa[0], qb[0], sizes, dims, precision=_HIGHEST,
                                     preferred_element_type=F32)
        return convert(rows_scaled(out, qa, qb, rows), acc), a

    def product(a: Any, b: Any, sizes: Any) -> Any:
        return forward(a, b, sizes)[0]

    def product_fwd(a: Any, b: Any, sizes: Any) -> tuple[Any, tuple[Any, Any, Any]]:
        out, a = forward(a, b, sizes)
        return out, (a, b, sizes)

    def product_bwd(res: tuple[Any, Any, Any], g: Any) -> tuple[Any, Any, None]:
        a, b, sizes = res
        g = in_groups(g, sizes)
        ids = group_ids(sizes, jnp.shape(a)[0])
        rows = (ids, experts)
        seed_lhs, _ = _seeds(recipe, g, _LHS_GRADIENT)
        qg, qb = along(g, 1, recipe.bwd_dtype, rows, seed_lhs), along(b, rhs_n, rhs_format, matrices)
        grad_lhs = rows_scaled(lax.ragged_dot_general(qg[0], qb[0], sizes, lhs_gradient,
                                                      precision=_HIGHEST,
                                                      preferred_element_type=F32),
                               qg, qb, rows)
        if recipe.float8_weight_gradient:
            seed_rhs, _ = _seeds(recipe, g, _RHS_GRADIENT)
            qa = _blocks.dequantized_in_groups(a, ids, sizes, scaling, lhs_format)
            qg = _blocks.dequantized_in_groups(g, ids, sizes, scaling, recipe.bwd_dtype,
                                               seed=seed_rhs)
            grad_rhs = lax.ragged_dot_general(qa[0], qg[0], sizes, WEIGHT_GRADIENT,
                                              precision=_HIGHEST, preferred_element_type=F32)
            if scaling == "nvfp4":  # [g, k, n]: one tensor scale per expert on each side
                grad_rhs = lax.mul(grad_rhs, jnp.reshape(lax.mul(qa[1], qg[1]), (-1, 1, 1)))
        else:  # as the matmul class's backward products: compute-dtype operands and result
            grad_rhs = lax.ragged_dot_general(convert(a, compute), convert(g, compute), sizes,
                                              WEIGHT_GRADIENT, preferred_element_type=compute)
        if rhs_k == 2:
            grad_rhs = lax.transpose(grad_rhs, (0, 2, 1))
        return convert(grad_lhs, lhs_dtype), convert(grad_rhs, rhs_dtype), None

    product.__name__ = f"{scaling}_{eqn.primitive.name}"
    custom = jax.custom_vjp(product)
    custom.defvjp(product_fwd, product_bwd)
    return custom(lhs, rhs, sizes)

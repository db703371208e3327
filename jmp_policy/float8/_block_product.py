"""The block-scaled scheme of quantized products (MXFP8, NVFP4): `BlockScaled`.

With an ``"mxfp8"`` or ``"nvfp4"`` recipe, ``_product.quantized_product``
quantizes each operand of each contraction in blocks along the axes that
contraction sums over (``_blocks``): a scale per 32 or 16 values gives each block
its own range. The contraction is either the backend's native block-scaled GEMM
(``jax.nn.scaled_matmul``) or its exact emulation, the operands dequantized to
float32 and multiplied in float32 (``Precision.HIGHEST``: no TF32 on GPUs without
the native product). The choice is made when tracing (``_recipe.native_block_products``).

>>> import jax, jax.numpy as jnp, jmp_policy
>>> f = jmp_policy.autocast(lambda x, w: x @ w, "mixed_bfloat16", fp8="mxfp8")
>>> text = jax.jit(f).lower(jnp.ones((32, 64)), jnp.ones((64, 32))).as_text()
>>> "x32xf8E4M3FN>" in text   # both operands, in blocks of 32 along the 64 contracted
True
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding

from jmp_policy import sharding as _sharding
from jmp_policy.dtypes import F32, DType, convert
from jmp_policy.float8 import _blocks
from jmp_policy.float8._axes import DenseAxes, OperandAxes
from jmp_policy.float8._layout import Contraction
from jmp_policy.float8._quantize import group_ids
from jmp_policy.float8._recipe import Float8Recipe

_HIGHEST = lax.Precision.HIGHEST


def _arranged(x: Any, axes: OperandAxes, block: int) -> Any:
    """``x`` as ``(batch, free, contracting)``, the contracting axes merged into one and
    padded with zeros (which add nothing to a product) to whole blocks of ``block``.

    Under explicit mesh axes, the contracting axis stays sharded where each shard
    holds whole blocks (and as many); otherwise it is gathered, as a block needs all
    its values. Merged contracting axes keep only the first one's sharding, padding
    none (JAX's reshape and pad rules)."""
    shape = jnp.shape(x)
    x = lax.transpose(x, (*axes.batch, *axes.free, *axes.contract))
    kept = len(axes.batch) + len(axes.free)
    if len(axes.contract) != 1:
        for axis in range(kept + 1, len(shape)):
            x = _sharding.gathered(x, axis)
        x = lax.reshape(x, (*jnp.shape(x)[:kept], math.prod(shape[i] for i in axes.contract)))
    pad = -jnp.shape(x)[-1] % block
    if pad:
        x = _blocks.pad_last(_sharding.gathered(x, kept), pad)
    return _sharding.in_whole_blocks(x, kept, block)


def block_dot(a: Any, b: Any, dims: Any, scaling: str, formats: tuple[DType, DType], *,
              native: bool, seeds: tuple[Optional[jax.Array], Optional[jax.Array]] = (None, None),
              tensor_scales: tuple[Optional[jax.Array], Optional[jax.Array]] = (None, None),
              out_sharding: Optional[NamedSharding] = None,
              gemm_dtype: DType = F32) -> jax.Array:
    """``dot_general(a, b, dims)`` in float32, both operands block-quantized along their
    contracting axes in ``formats`` (rounded stochastically where ``seeds`` has a seed;
    NVFP4's per-tensor scales computed unless given in ``tensor_scales``), the result
    sharded as ``out_sharding`` if given (explicit mesh axes). The product itself gives
    ``gemm_dtype`` (accumulated in float32), which NVFP4's tensor scales then widen."""
    axes = DenseAxes.of(dims, jnp.ndim(a), jnp.ndim(b))
    block = _blocks.BLOCK_SIZES[scaling]
    # (batch, free, contracting), quantized along the last axis
    qa, qb = (_blocks.quantize_blocks(_arranged(x, side, block), scaling, fmt, seed=seed,
                                      tensor_scale=scale)
              for x, side, fmt, seed, scale in zip((a, b), axes, formats, seeds, tensor_scales))
    batch = len(axes.lhs.batch)
    if native:
        out = _native(qa, qb, batch, scaling, gemm_dtype)
    else:  # the same layout as dot_general(a, b, dims)'s result: (batch, lhs free, rhs free)
        arranged = (((qa.values.ndim - 1,), (qb.values.ndim - 1,)),
                    (tuple(range(batch)), tuple(range(batch))))
        out = lax.dot_general(qa.dequantized(), qb.dequantized(), arranged, precision=_HIGHEST,
                              preferred_element_type=gemm_dtype, out_sharding=out_sharding)
    return _tensor_scaled(convert(out, F32), scaling, qa.tensor_scale, qb.tensor_scale)


def _native(qa: _blocks.Blocks, qb: _blocks.Blocks, batch: int, scaling: str,
            gemm_dtype: DType) -> jax.Array:
    """The product of arranged block-quantized operands (``batch`` batch axes) as
    ``jax.nn.scaled_matmul`` runs it, on three axes (batch, free, contracting, each
    flattened), returned in the layout of ``dot_general``'s result; without the tensor
    scales."""
    def bmk(x: jax.Array) -> jax.Array:
        shape = jnp.shape(x)
        return lax.reshape(x, (math.prod(shape[:batch]), math.prod(shape[batch:-1]), shape[-1]))

    scale = _blocks.SCALE_DTYPES[scaling]
    out = jax.nn.scaled_matmul(bmk(qa.values), bmk(qb.values), convert(bmk(qa.scales), scale),
                               convert(bmk(qb.scales), scale), preferred_element_type=gemm_dtype)
    return lax.reshape(out, (*jnp.shape(qa.values)[:-1], *jnp.shape(qb.values)[batch:-1]))


def _tensor_scaled(out: jax.Array, scaling: str, sa: jax.Array, sb: jax.Array) -> jax.Array:
    """``out`` times the operands' per-tensor scales (NVFP4's; MXFP8 has none)."""
    return lax.mul(out, lax.mul(sa, sb)) if scaling == "nvfp4" else out


class Deferred(NamedTuple):
    """An operand of a dense block-scaled contraction: `block_dot` quantizes it, in the
    layout it gives the contraction, to ``dtype`` (rounded stochastically with ``seed``).
    NVFP4's ``tensor_scale`` is taken from ``x`` as it is, whatever the layout: every
    contraction that takes ``x`` computes the same one, which XLA computes once (under
    data parallelism, one reduction across shards rather than one per contraction)."""

    x: Any
    dtype: DType
    seed: Optional[jax.Array]
    tensor_scale: Optional[jax.Array]


class Kept(NamedTuple):
    """What the forward pass saves of a dense operand: the operand, and its NVFP4 tensor
    scale (``None`` for MXFP8)."""

    x: Any
    tensor_scale: Optional[jax.Array]


@dataclasses.dataclass(frozen=True)
class BlockScaled:
    """Block-scaled operands (MXFP8, NVFP4), in blocks along each contraction's summed axes,
    multiplied natively (``native``, dense products only) or by the exact emulation.

    Ragged products run emulated on every backend (no backend has a native ragged
    block-scaled product in JAX). Blocks run along each contraction's summed axis,
    so every block holds one expert's values: forward, lhs ``[m, k]`` in blocks
    along each row's ``k`` and rhs in blocks along ``k`` per (expert, output
    column); for lhs's gradient, ``g`` along each row's ``n`` and rhs along ``n``
    per (expert, k); for rhs's gradient, which sums each expert's rows, lhs and
    ``g`` in blocks of rows that start again at each expert's first row
    (``_blocks.dequantized_in_groups``). NVFP4's per-tensor scale is one per
    expert: each expert's rows, and each expert's matrix, are a tensor of their own.
    """

    recipe: Float8Recipe
    native: bool

    def prepare(self, x: Any, dtype: DType, c: Contraction, position: int,
                seed: Optional[jax.Array], rest: Sequence[Any],
                history: Optional[jax.Array] = None) -> Any:
        # Block scales are current by nature (a scale per 16 or 32 values): no history.
        if isinstance(x, Kept):
            return Deferred(x.x, dtype, seed, x.tensor_scale)
        if isinstance(x, tuple):  # prepared already
            return x
        if not c.ragged:
            tensor_scale = (_blocks.marked_tensor_scale(x) if self.recipe.scaling == "nvfp4"
                            else None)
            return Deferred(x, dtype, seed, tensor_scale)
        scaling, sizes = self.recipe.scaling, rest[0]
        if c.grouped:
            ids = group_ids(sizes, jnp.shape(x)[0])
            return _blocks.dequantized_in_groups(x, ids, sizes, scaling, dtype, seed=seed)
        # The left operand is [m, *], one tensor per expert's rows; the right one is rhs,
        # one tensor per expert's matrix.
        experts = jnp.shape(sizes)[0]
        segments = ((group_ids(sizes, jnp.shape(x)[0]), experts) if position == 0
                    else (lax.iota(np.int32, experts), experts))
        return _blocks.dequantized_along(x, c.axes[position][0], scaling, dtype, seed=seed,
                                         segments=segments)

    def keep(self, x: Any, prepared: Any, dtype: DType, c: Contraction, position: int,
             rest: Sequence[Any]) -> Any:
        # Quantized again along each backward contraction's own axes; a dense operand keeps
        # its forward NVFP4 tensor scale (the same whatever the layout).
        return Kept(x, prepared.tensor_scale) if isinstance(prepared, Deferred) else x

    def reuses(self, prepared: Any, c: Contraction) -> bool:
        return False

    def contract(self, c: Contraction, left: Any, right: Any, rest: Sequence[Any],
                 out_sharding: Optional[NamedSharding], gemm_dtype: DType) -> jax.Array:
        scaling = self.recipe.scaling
        if not c.ragged:
            return block_dot(left.x, right.x, c.dims, scaling, (left.dtype, right.dtype),
                             native=self.native, seeds=(left.seed, right.seed),
                             tensor_scales=(left.tensor_scale, right.tensor_scale),
                             out_sharding=out_sharding, gemm_dtype=gemm_dtype)
        out = c.dot(left[0], right[0], rest, precision=_HIGHEST, preferred_element_type=F32)
        if scaling != "nvfp4":
            return out
        tensor_scales = lax.mul(left[1], right[1])  # one per expert
        if c.grouped:  # [experts, k, n]
            return lax.mul(out, jnp.reshape(tensor_scales, (-1, 1, 1)))
        rows = (group_ids(rest[0], out.shape[0]), jnp.shape(rest[0])[0])
        return lax.mul(out, _blocks.per_row(tensor_scales, rows, out.ndim))

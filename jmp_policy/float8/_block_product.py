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
import functools
import math
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding

from jmp_policy import sharding as _sharding
from jmp_policy.dtypes import F32, DType, convert
from jmp_policy.float8 import _blocks, _hadamard
from jmp_policy.float8._axes import DenseAxes, OperandAxes, free_axes
from jmp_policy.float8._layout import Contraction
from jmp_policy.float8._quantize import group_ids
from jmp_policy.float8._recipe import Float8Recipe

_HIGHEST = lax.Precision.HIGHEST


def _dense_batch(c: Contraction) -> tuple[int, ...]:
    """The batch axes of a dense contraction's left operand."""
    return tuple(c.dims[1][0])


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


@functools.partial(jax.tree_util.register_dataclass, data_fields=["scales"],
                   meta_fields=["free", "contract"])
@dataclasses.dataclass(frozen=True)
class Tiles:
    """NVFP4's scales of a layer's weight (the right operand of a product without batch
    dimensions) in 16 x 16 tiles: ``scales`` ``[n / 16, k / 16]`` over the weight's
    ``free`` axes merged (``n``, padded to whole tiles) and its ``contract`` axes merged
    (``k``), each in increasing order. The forward product sums over ``contract``, the
    backward one giving the gradient of its left operand over ``free``: both take the
    scale of each value's tile, hence the same quantized weight."""

    scales: jax.Array
    free: tuple[int, ...]
    contract: tuple[int, ...]


def tiles_of(x: Any, dims: Any, scaling: str, dtype: DType, tensor_scale: jax.Array) -> Tiles:
    """The `Tiles` of ``x``, the right operand of a product of dimension numbers ``dims``
    (without batch dimensions)."""
    contract = tuple(sorted(dims[0][1]))
    free = free_axes(jnp.ndim(x), contract, ())
    arranged = _arranged(x, OperandAxes(contract, (), free, ()), _blocks.TILE)  # (*free, k)
    if len(free) != 1:
        for axis in range(len(free)):
            arranged = _sharding.gathered(arranged, axis)
        shape = jnp.shape(arranged)
        arranged = lax.reshape(arranged, (math.prod(shape[:-1]), shape[-1]))
    rows = jnp.shape(arranged)[0]
    if rows % _blocks.TILE:
        arranged = _sharding.gathered(arranged, 0)
    padded = lax.pad(arranged, jnp.zeros((), jnp.result_type(arranged)),
                     [(0, -rows % _blocks.TILE, 0), (0, 0, 0)])
    padded = _sharding.in_whole_blocks(padded, 0, _blocks.TILE)
    return Tiles(_blocks.tile_scales(padded, scaling, dtype, tensor_scale), free, contract)


def _tile_block_scales(tiles: Tiles, axes: OperandAxes, shape: Sequence[int]) -> jax.Array:
    """The block scales of an operand with ``tiles``, arranged by `_arranged` for a
    contraction over ``axes.contract`` (the weight's ``contract`` or its ``free`` axes):
    one per 16 values along the arranged last axis, ``[*free shape, blocks]``."""
    scales = tiles.scales if tuple(axes.contract) == tiles.contract \
        else lax.transpose(tiles.scales, (1, 0))
    free_shape = [shape[i] for i in axes.free]
    return lax.reshape(_blocks.per_block(scales, math.prod(free_shape)),
                       (*free_shape, jnp.shape(scales)[-1]))


def _sorted_contraction(dims: Any) -> Any:
    """``dims`` with the contracted pairs in the order of rhs's axes: the same product,
    whose rhs merges its contracting axes as its `Tiles` do."""
    (lc, rc), batch = dims
    pairs = sorted(zip(rc, lc))
    return ((tuple(p[1] for p in pairs), tuple(p[0] for p in pairs)), batch)


def block_dot(a: Any, b: Any, dims: Any, scaling: str, formats: tuple[DType, DType], *,
              native: bool, seeds: tuple[Optional[jax.Array], Optional[jax.Array]] = (None, None),
              tensor_scales: tuple[Optional[jax.Array], Optional[jax.Array]] = (None, None),
              tiles: Optional[Tiles] = None, rotate: bool = False,
              four_over_six: bool = False, out_sharding: Optional[NamedSharding] = None,
              gemm_dtype: DType = F32) -> jax.Array:
    """``dot_general(a, b, dims)`` in float32, both operands block-quantized along their
    contracting axes in ``formats`` (rounded stochastically where ``seeds`` has a seed;
    NVFP4's per-tensor scales computed unless given in ``tensor_scales``; ``b``'s block
    scales those of its `Tiles` if given), the result sharded as ``out_sharding`` if given
    (explicit mesh axes). With ``rotate``, both operands' blocks are rotated first
    (``_hadamard``): the same product, quantized after the rotation. With
    ``four_over_six``, NVFP4 operands rounded to nearest take the better of two block
    scales (``_blocks.four_over_six_scale``). The product itself
    gives ``gemm_dtype`` (accumulated in float32), which NVFP4's tensor scales then widen."""
    if tiles is not None:
        dims = _sorted_contraction(dims)
    axes = DenseAxes.of(dims, jnp.ndim(a), jnp.ndim(b))
    block = _blocks.BLOCK_SIZES[scaling]
    # (batch, free, contracting), quantized along the last axis
    arranged = [_arranged(x, side, block) for x, side in zip((a, b), axes)]
    if rotate:  # up to 4 times the maxima: NVFP4's tensor scales are the rotated operands'
        arranged = [_hadamard.rotated(x) for x in arranged]
        tensor_scales = (None, None)
    scales = (None, None if tiles is None
              else _tile_block_scales(tiles, axes.rhs, jnp.shape(b)))
    qa, qb = (_blocks.quantize_blocks(x, scaling, fmt, seed=seed, tensor_scale=scale,
                                      scales=given, four_over_six=four_over_six)
              for x, fmt, seed, scale, given in zip(arranged, formats, seeds, tensor_scales,
                                                    scales))
    batch = len(axes.lhs.batch)
    if native:
        out = _native(qa, qb, batch, scaling, gemm_dtype)
    else:  # the same layout as dot_general(a, b, dims)'s result: (batch, lhs free, rhs free)
        layout = (((qa.values.ndim - 1,), (qb.values.ndim - 1,)),
                  (tuple(range(batch)), tuple(range(batch))))
        out = lax.dot_general(qa.dequantized(), qb.dequantized(), layout, precision=_HIGHEST,
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
    tiles: Optional[Tiles] = None


class Kept(NamedTuple):
    """What the forward pass saves of a dense operand: the operand, its NVFP4 tensor
    scale (``None`` for MXFP8) and a weight's `Tiles` (``None`` if it has none)."""

    x: Any
    tensor_scale: Optional[jax.Array]
    tiles: Optional[Tiles] = None


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
            return Deferred(x.x, dtype, seed, x.tensor_scale, x.tiles)
        if isinstance(x, tuple):  # prepared already
            return x
        scaling, tiled = self.recipe.scaling, self._tiled(c, position)
        if not c.ragged:
            tensor_scale = _blocks.marked_tensor_scale(x) if scaling == "nvfp4" else None
            tiles = (tiles_of(x, c.dims, scaling, dtype, tensor_scale) if tiled and
                     tensor_scale is not None else None)
            return Deferred(x, dtype, seed, tensor_scale, tiles)
        sizes = rest[0]
        if c.grouped:
            ids = group_ids(sizes, jnp.shape(x)[0])
            return _blocks.dequantized_in_groups(x, ids, sizes, scaling, dtype, seed=seed)
        # The left operand is [m, *], one tensor per expert's rows; the right one is rhs,
        # one tensor per expert's matrix.
        experts = jnp.shape(sizes)[0]
        segments = ((group_ids(sizes, jnp.shape(x)[0]), experts) if position == 0
                    else (lax.iota(np.int32, experts), experts))
        if tiled:  # each expert's matrix in tiles: the same values in both products
            return _blocks.dequantized_tiles(x, scaling, dtype, segments)
        return _blocks.dequantized_along(x, c.axes[position][0], scaling, dtype, seed=seed,
                                         four_over_six=self.recipe.four_over_six,
                                         segments=segments)

    def keep(self, x: Any, prepared: Any, dtype: DType, c: Contraction, position: int,
             rest: Sequence[Any]) -> Any:
        # Quantized again along each backward contraction's own axes; a dense operand keeps
        # its forward NVFP4 tensor scale (the same whatever the layout).
        if isinstance(prepared, Deferred):
            return Kept(x, prepared.tensor_scale, prepared.tiles)
        # A ragged product's tiled weight serves its backward product as it is.
        return prepared if self._tiled(c, position) else x

    def _tiled(self, c: Contraction, position: int) -> bool:
        """Whether the operand at ``position`` of ``c`` is a weight that the recipe
        quantizes in tiles: the right operand of a product without batch dimensions
        (a ragged product's experts' matrices)."""
        if not (self.recipe.tiled_weights and c.operands[position] == "rhs"):
            return False
        return c.ragged or not _dense_batch(c)

    def reuses(self, prepared: Any, c: Contraction) -> bool:
        return False

    def contract(self, c: Contraction, left: Any, right: Any, rest: Sequence[Any],
                 out_sharding: Optional[NamedSharding], gemm_dtype: DType) -> jax.Array:
        scaling = self.recipe.scaling
        if not c.ragged:
            rotate = self.recipe.hadamard and c.operands == ("g", "lhs")
            return block_dot(left.x, right.x, c.dims, scaling, (left.dtype, right.dtype),
                             native=self.native, seeds=(left.seed, right.seed),
                             tensor_scales=(left.tensor_scale, right.tensor_scale),
                             tiles=right.tiles, rotate=rotate,
                             four_over_six=self.recipe.four_over_six,
                             out_sharding=out_sharding, gemm_dtype=gemm_dtype)
        out = c.dot(left[0], right[0], rest, precision=_HIGHEST, preferred_element_type=F32)
        if scaling != "nvfp4":
            return out
        tensor_scales = lax.mul(left[1], right[1])  # one per expert
        if c.grouped:  # [experts, k, n]
            return lax.mul(out, jnp.reshape(tensor_scales, (-1, 1, 1)))
        rows = (group_ids(rest[0], out.shape[0]), jnp.shape(rest[0])[0])
        return lax.mul(out, _blocks.per_row(tensor_scales, rows, out.ndim))

"""Block-scaled formats (MXFP8, NVFP4) and stochastic rounding.

A block-scaled operand holds one scale per block of consecutive values along
the contracting dimension of the product it enters:

* ``"mxfp8"`` (OCP microscaling): blocks of 32, each scale a power of two
  (``float8_e8m0fnu``), values in ``float8_e4m3fn`` (or ``float8_e5m2``);
* ``"nvfp4"``: blocks of 16, each scale a ``float8_e4m3fn`` value, values in
  ``float4_e2m1fn`` (0, 0.5, 1, 1.5, 2, 3, 4, 6), and one float32 scale per
  tensor that brings its absolute maximum to ``6 * 448``, so that the block
  scales use e4m3's range.

The quantization is written to give, bit for bit, the operands and scales that
``jax.nn.scaled_dot_general`` gives (the reference quantization of the cuDNN
block-scaled GEMM that Blackwell GPUs run). A product is then either that
GEMM (``jax.nn.scaled_matmul``) or its exact emulation: the operands
dequantized to float32 (exact: a value times its block scale has at most 8
significant bits) and multiplied in float32. Values are read back from their
formats with ``formats.widen``, so that the emulation rounds on every backend
(XLA:GPU removes a plain float round trip), and so are narrow operands before
they are quantized: the values rounded, and the random bits of a stochastic
rounding (``formats.encode`` with a seed), are those the format holds, whatever
excess precision the compiler kept in the program that made them.

>>> import jax.numpy as jnp
>>> x = jnp.array([[0.0, 1.0, 3.0, 448.0] + [0.0] * 28])
>>> q = quantize_blocks(x, "mxfp8", jnp.float8_e4m3fn)
>>> q.values.dtype, q.scales.tolist()   # one power-of-two scale per block of 32
(dtype(float8_e4m3fn), [[1.0]])
>>> [float(v) for v in q.dequantized()[0, :4]]
[0.0, 1.0, 3.0, 448.0]
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_policy import formats
from jmp_policy.formats import unfoldable

BLOCK_SCALINGS = ("mxfp8", "nvfp4")
BLOCK_SIZES = {"mxfp8": 32, "nvfp4": 16}
"""Values per scale along the contracting dimension, as the hardware formats fix them."""

E2M1 = np.dtype(jnp.float4_e2m1fn)
E4M3 = np.dtype(jnp.float8_e4m3fn)
E8M0 = np.dtype(jnp.float8_e8m0fnu)
SCALE_DTYPES = {"mxfp8": E8M0, "nvfp4": E4M3}
"""The format each block scale is stored in for the native product."""

_F32 = np.dtype(np.float32)
_U32 = np.uint32


def _max(dtype: Any) -> float:
    return formats.format_of(dtype).max


NVFP4_RANGE = np.float32(_max(E2M1) * _max(E4M3))
"""What the NVFP4 per-tensor scale maps a tensor's absolute maximum onto: e2m1's largest
value times e4m3's, so that the block scales span e4m3's range."""

_TINY_AMAX = np.float32(2.0 ** -100)
"""The per-tensor absolute maximum below which NVFP4's tensor scale stops shrinking: an
all-zero tensor gets a finite, nonzero scale (its values stay zero)."""


BLOCK_SCALES, TENSOR_SCALES = "block_scales", "tensor_scales"
"""The name scopes that the block and per-tensor scales are made under, so that the
numerics inspector reports their ranges (rows ``.../block_scales`` and
``.../tensor_scales`` next to the products)."""


def _marked(scale: jax.Array, scope: str) -> jax.Array:
    """``scale``, as the result of a multiplication by 1 under ``scope``: the one equation
    of that scope, which the numerics inspector reports (XLA removes it)."""
    with jax.named_scope(scope):
        return lax.mul(scale, np.float32(1))


class Blocks(NamedTuple):
    """A block-quantized array: ``values`` (the data format) times ``scales`` (float32,
    one per block along the last axis) times ``tensor_scale`` (float32: a scalar, or one
    per expert's rows broadcast against the values; 1 for MXFP8) approximates the array."""

    values: jax.Array
    scales: jax.Array
    tensor_scale: jax.Array

    def dequantized(self) -> jax.Array:
        """``values * scales`` in float32, without the tensor scale: exact."""
        shape, count = jnp.shape(self.values), jnp.shape(self.scales)[-1]
        # Each scale repeated over its block: a broadcast and a merge of the two last axes,
        # which keep a sharded array's blocks in their shards (``jnp.repeat`` gathers
        # under explicit mesh axes). The scales enter as float32 numbers (a bit-exact
        # round trip that XLA removes), not as values of their format: the numerics
        # inspector takes the product's operand format from the values alone.
        scales = lax.bitcast_convert_type(lax.bitcast_convert_type(self.scales, _U32), _F32)
        blocked = lax.broadcast_in_dim(scales, (*shape[:-1], count, shape[-1] // count),
                                       tuple(range(len(shape))))
        return lax.mul(formats.widen(self.values), lax.reshape(blocked, shape))


def nv_tensor_scale(x: Any) -> jax.Array:
    """NVFP4's per-tensor scale of ``x``: its absolute maximum over `NVFP4_RANGE` (at least
    ``2**-100`` over it; inf for an inf maximum, NaN for NaN)."""
    return _tensor_scale_of(jnp.max(jnp.abs(formats.widen(x))))


def _tensor_scale_of(amax: jax.Array) -> jax.Array:
    """NVFP4's per-tensor scale of a tensor whose absolute maximum is ``amax``."""
    return lax.div(lax.max(amax, _TINY_AMAX), NVFP4_RANGE)


def marked_tensor_scale(x: Any) -> jax.Array:
    """`nv_tensor_scale` of ``x``, made under the ``tensor_scales`` name scope (which the
    numerics inspector reports)."""
    return _marked(nv_tensor_scale(x), TENSOR_SCALES)


def block_scale(amax: jax.Array, scaling: str, dtype: Any) -> jax.Array:
    """The float32 scale of blocks of ``dtype`` values whose absolute maxima are ``amax``:
    MXFP8's power of two (``formats.e8m0_scale``), NVFP4's e4m3 value
    (``formats.e4m3_scale``; the blocks already divided by the tensor scale)."""
    if scaling == "mxfp8":
        return formats.e8m0_scale(amax, _max(dtype))
    return formats.e4m3_scale(amax, _max(dtype))


def to_format(y: jax.Array, dtype: Any, seed: Optional[jax.Array] = None) -> jax.Array:
    """Float32 ``y``, already scaled into ``dtype``'s range, converted (``formats.encode``):
    rounded stochastically with ``seed`` (two uint32 words), else clipped to the range
    and rounded to nearest even, as ``jax.nn.scaled_dot_general`` does.

    ``float4_e2m1fn`` has neither inf nor NaN: its rounding saturates, which is the
    clip, so the rounding itself sees the values beyond it."""
    if seed is None and np.dtype(dtype) != E2M1:
        top = np.float32(_max(dtype))
        y = jnp.clip(y, -top, top)
    return formats.encode(y, dtype, seed)


def quantize_blocks(x: Any, scaling: str, dtype: Any, *, seed: Optional[jax.Array] = None,
                    tensor_scale: Optional[jax.Array] = None,
                    scales: Optional[jax.Array] = None, four_over_six: bool = False) -> Blocks:
    """``x`` quantized in blocks of ``BLOCK_SIZES[scaling]`` along its last axis (a multiple
    of that size), values in ``dtype``, rounded stochastically if a ``seed`` is given.

    The operations and their order are those of ``jax.nn.scaled_dot_general``'s
    quantization, so the values and scales are the same bit for bit (except in
    blocks so small that they flush to zero either way, and blocks of zeros,
    whose scale JAX's MXFP8 makes a float32 subnormal and JAX's NVFP4 zero,
    and divides by). NVFP4's per-tensor scale is `nv_tensor_scale` unless
    ``tensor_scale`` (broadcastable against ``x``: one per expert's rows, say)
    is given; the block scales are computed unless given in ``scales`` (float32, one
    per block: a weight's 16 x 16 tiles, `tile_scales`). With ``four_over_six`` (NVFP4,
    rounded to nearest, scales computed), each block takes the better of two scales
    (`four_over_six_scale`).

    >>> import jax.numpy as jnp
    >>> x = jnp.array([[0.5, -1.0, 2.9, 6.0] + [0.0] * 12, [0.25] * 16])
    >>> q = quantize_blocks(x, "nvfp4", jnp.float4_e2m1fn)
    >>> round(float(q.tensor_scale) * 2688, 5), q.scales.tolist()  # 448 / 6 = 18.7 -> 18
    (6.0, [[448.0], [18.0]])
    >>> q.values.astype(jnp.float32)[:, :4].tolist()  # 2.9 -> 3; 0.25 * 448 / 18 = 6.2 -> 6
    [[0.5, -1.0, 3.0, 6.0], [6.0, 6.0, 6.0, 6.0]]
    """
    # A constant x (a linear loss's cotangent) is not reduced to its scales when compiled.
    x = unfoldable(formats.widen(x))
    block = BLOCK_SIZES[scaling]
    if jnp.shape(x)[-1] % block:
        raise ValueError(f"{scaling} quantizes blocks of {block} along the last axis, "
                         f"got one of size {jnp.shape(x)[-1]}.")
    if scaling == "nvfp4":
        if tensor_scale is None:
            tensor_scale = marked_tensor_scale(x)
        x = lax.div(x, tensor_scale)
    else:
        tensor_scale = jnp.ones((), _F32)
    blocks = jnp.reshape(x, (*jnp.shape(x)[:-1], jnp.shape(x)[-1] // block, block))
    if scales is not None:
        scale = scales[..., None]
    elif four_over_six and seed is None and scaling == "nvfp4":
        # Only the scale is chosen; the values are rounded once more with it below, so that
        # the product's operand is one conversion, as the numerics inspector reads it.
        scale = _marked(four_over_six_scale(blocks, dtype), BLOCK_SCALES)
    else:
        scale = _marked(block_scale(jnp.max(jnp.abs(blocks), axis=-1, keepdims=True), scaling,
                                    dtype), BLOCK_SCALES)
    q = to_format(lax.div(blocks, _nonzero(scale)), dtype, seed)
    return Blocks(jnp.reshape(q, jnp.shape(x)), scale[..., 0], tensor_scale)


TILE = 16
"""The side of NVFP4's square weight tiles: one scale per 16 x 16 values of a weight."""


def tile_scales(x: Any, scaling: str, dtype: Any, tensor_scale: jax.Array) -> jax.Array:
    """The block scales of ``x`` (float32 ``[..., n, k]``, both last axes multiples of
    `TILE`, already in the layout its tiles are cut in) in square tiles of `TILE` x `TILE`
    over its last two axes: ``[..., n / 16, k / 16]``.

    A weight quantized with one scale per tile, not per 16 values along one axis, has
    the same values whichever of its axes a product sums over: its forward and
    backward products take the same quantized weight.

    >>> import jax.numpy as jnp
    >>> x = jnp.zeros((32, 16)).at[17, 3].set(6.0).at[0, 0].set(3.0)
    >>> scales = tile_scales(x, "nvfp4", jnp.float4_e2m1fn, jnp.ones(()))
    >>> scales.shape, scales.ravel().tolist()  # each tile's amax over 6, in e4m3
    ((2, 1), [0.5, 1.0])
    """
    x = lax.div(unfoldable(formats.widen(x)), tensor_scale)
    # Two reductions, each over 16 values of the last axis (split as the blocks are): an
    # axis sharded in whole tiles stays sharded, where one reshape to tiles cannot.
    amax = jnp.swapaxes(_block_max(jnp.abs(x)), -1, -2)      # [..., k / 16, n]
    amax = jnp.swapaxes(_block_max(amax), -1, -2)            # [..., n / 16, k / 16]
    return _marked(block_scale(amax, scaling, dtype), BLOCK_SCALES)


def _block_max(x: jax.Array) -> jax.Array:
    """The maximum of each block of `TILE` values along ``x``'s last axis."""
    *lead, size = jnp.shape(x)
    return jnp.max(jnp.reshape(x, (*lead, size // TILE, TILE)), axis=-1)


def per_block(tiles: jax.Array, rows: int) -> jax.Array:
    """Tile scales ``[..., n / 16, k / 16]`` as the block scales of the ``rows`` first of
    the tiled array's ``n`` rows, in blocks of 16 along ``k``: ``[..., rows, k / 16]``
    (each tile's scale for each of its 16 rows)."""
    *lead, n_tiles, k_tiles = jnp.shape(tiles)
    repeated = lax.broadcast_in_dim(tiles, (*lead, n_tiles, TILE, k_tiles),
                                    (*range(len(lead)), len(lead), len(lead) + 2))
    return lax.reshape(repeated, (*lead, n_tiles * TILE, k_tiles))[..., :rows, :]


def dequantized_tiles(x: Any, scaling: str, dtype: Any,
                      segments: Segments) -> tuple[jax.Array, jax.Array]:
    """``x`` (``[experts, a, b]``, one matrix per segment) quantized in `TILE` x `TILE` tiles
    over its last two axes (padded with zeros to whole tiles), NVFP4's tensor scale one
    per segment, and dequantized: returns (float32 values of ``x``'s shape, without the
    tensor scales; the tensor scales ``[count]``). A mixture of experts' weights, for the
    emulated ragged products."""
    x = unfoldable(formats.widen(x))
    per_segment = _marked(segment_tensor_scales(x, segments), TENSOR_SCALES)
    tensor_scale = per_row(per_segment, segments, jnp.ndim(x))
    *lead, a, b = jnp.shape(x)
    config = [(0, 0, 0)] * len(lead) + [(0, -a % TILE, 0), (0, -b % TILE, 0)]
    padded = lax.pad(x, np.float32(0), config)
    scales = tile_scales(padded, scaling, dtype, tensor_scale)
    rows = per_block(scales, jnp.shape(padded)[-2])
    q = quantize_blocks(padded, scaling, dtype, tensor_scale=tensor_scale, scales=rows)
    return q.dequantized()[..., :a, :b], per_segment


FOUR = 4.0
"""The other largest value a Four Over Six block scale maps a block's maximum onto."""


def four_over_six_scale(blocks: jax.Array, dtype: Any) -> jax.Array:
    """The NVFP4 block scales (``[..., blocks, 1]``) of blocks ``[..., blocks, 16]``
    (already over their tensor scale) rounded to nearest, each the better of two.

    Four Over Six (Cook et al., arXiv 2512.02010): e2m1 has no value between 4 and 6,
    so a block whose maximum maps onto 6 rounds its values in the top third of its range
    coarsely. Each block is quantized both with its maximum mapped onto 6 and onto 4,
    and takes the scale of smaller squared error (the scale to 6 where they tie, and
    where the errors are not finite). Rounded to nearest only: choosing between two
    stochastic roundings by their error would bias them.

    >>> import jax.numpy as jnp
    >>> four_over_six_scale(jnp.array([[[6.0, 5.0] + [0.0] * 14]]), jnp.float4_e2m1fn)
    Array([[[1.5]]], dtype=float32)
    """
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    scales, errors = [], []
    for largest in (_max(dtype), FOUR):
        scale = formats.e4m3_scale(amax, largest)
        q = to_format(lax.div(blocks, _nonzero(scale)), dtype)
        scales.append(scale)
        errors.append(jnp.sum(jnp.square(formats.widen(q) * scale - blocks), axis=-1,
                              keepdims=True))
    return jnp.where(errors[1] < errors[0], scales[1], scales[0])


Segments = tuple[jax.Array, int]
"""``(ids, count)``: the segment (expert) of each index along an array's first axis, and
how many there are; ids out of range are in no segment."""


def segment_tensor_scales(x: Any, segments: Segments) -> jax.Array:
    """NVFP4's per-tensor scale of each segment of ``x``'s first axis (each expert's rows
    or matrix), ``[count]``: a mixture of experts' operands hold one tensor per expert,
    whose magnitudes may differ by more than the e4m3 block scales span."""
    ids, count = segments
    rows = jnp.max(jnp.abs(unfoldable(formats.widen(x))),
                   axis=tuple(range(1, jnp.ndim(x))))
    return _tensor_scale_of(
        jnp.maximum(jax.ops.segment_max(rows, ids, count, indices_are_sorted=True), 0))


def per_row(values: jax.Array, segments: Segments, ndim: int) -> jax.Array:
    """``values`` (one per segment) for each index of the first axis, shaped to broadcast
    against an array of ``ndim`` axes; indices in no segment get 1."""
    rows = jnp.take(values, segments[0], axis=0, mode="fill", fill_value=1)
    return jnp.reshape(rows, (-1,) + (1,) * (ndim - 1))


def _nonzero(scale: jax.Array) -> jax.Array:
    """A scale to divide by: NVFP4's zero scales (blocks of zeros) become 1."""
    return jnp.where(scale == 0, np.float32(1), scale)


def dequantized_along(x: Any, axis: int, scaling: str, dtype: Any, *,
                      seed: Optional[jax.Array] = None,
                      segments: Optional[Segments] = None,
                      four_over_six: bool = False) -> tuple[jax.Array, jax.Array]:
    """``x`` block-quantized along ``axis`` (padded with zeros to whole blocks) and
    dequantized, without its tensor scale: returns (float32 values of ``x``'s shape,
    tensor scale). For the emulated products, which take float32 operands. With
    ``segments`` (of the first axis, not ``axis``), NVFP4 takes one tensor scale per
    segment, returned ``[count]``."""
    tensor_scale = None
    if scaling == "nvfp4" and segments is not None:
        per_segment = _marked(segment_tensor_scales(x, segments), TENSOR_SCALES)
        tensor_scale = jnp.moveaxis(per_row(per_segment, segments, jnp.ndim(x)), axis, -1)
    x = jnp.moveaxis(x, axis, -1)
    size, block = jnp.shape(x)[-1], BLOCK_SIZES[scaling]
    padded = pad_last(x, -size % block)
    q = quantize_blocks(padded, scaling, dtype, seed=seed, tensor_scale=tensor_scale,
                        four_over_six=four_over_six)
    scale = per_segment if tensor_scale is not None else q.tensor_scale
    return jnp.moveaxis(q.dequantized()[..., :size], -1, axis), scale


def pad_last(x: Any, pad: int) -> Any:
    """``x`` with ``pad`` zeros after its last axis's values (which add nothing to a product)."""
    if not pad:
        return x
    config = [(0, 0, 0)] * (jnp.ndim(x) - 1) + [(0, pad, 0)]
    return lax.pad(x, jnp.zeros((), jnp.result_type(x)), config)


def dequantized_in_groups(x: Any, ids: jax.Array, sizes: jax.Array, scaling: str, dtype: Any,
                          *, seed: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
    """``x`` ``[m, c]`` (rows sorted by group, group ``ids``, group ``sizes``) quantized in
    blocks of rows along axis 0, the blocks of each group starting at its first row so that
    no block mixes two groups' rows, and dequantized: returns (float32 ``[m, c]``, tensor
    scales: NVFP4's one per group, ``[groups]``). The operands of a ragged product's
    weight gradient, which sums each group's rows. Rows in no group must be zero; they
    stay zero."""
    x = unfoldable(formats.widen(x))
    m, block, groups = jnp.shape(x)[0], BLOCK_SIZES[scaling], jnp.shape(sizes)[0]
    tensor_scale = jnp.ones((), _F32)
    if scaling == "nvfp4":  # one per group (expert), as in `dequantized_along`
        tensor_scale = _marked(segment_tensor_scales(x, (ids, groups)), TENSOR_SCALES)
        x = lax.div(x, per_row(tensor_scale, (ids, groups), 2))
    starts = jnp.cumsum(sizes) - sizes
    counts = (sizes + block - 1) // block
    first_block = jnp.cumsum(counts) - counts
    safe = jnp.minimum(ids, groups - 1)
    row = lax.iota(ids.dtype, m)
    blocks = jnp.where(ids < groups, first_block[safe] + (row - starts[safe]) // block,
                       m // block + groups)  # rows in no group: no block
    count = m // block + groups  # sum of ceil(size / block) over the groups is below it
    # Empty blocks get -inf from the scatter-max: 0 (a finite scale); NaN stays NaN.
    amax = jnp.maximum(jax.ops.segment_max(jnp.abs(x), blocks, count, indices_are_sorted=True), 0)
    scale = _marked(block_scale(amax, scaling, dtype), BLOCK_SCALES)
    rows = jnp.take(scale, blocks, axis=0, mode="fill", fill_value=1)
    q = to_format(lax.div(x, _nonzero(rows)), dtype, seed)
    return lax.mul(formats.widen(q), rows), tensor_scale

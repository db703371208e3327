"""The float8 format residuals are stored in: e4m3 values, a power-of-two scale per block.

A residual is cut into blocks of `BLOCK` consecutive values along its last axis
(one block per row when the axis is shorter; the last block of a row padded with
zeros). Each block keeps one scale, the power of two that brings its absolute
maximum within ``float8_e4m3fn``'s 448, stored as its ``float8_e8m0fnu`` bits;
its values are rounded to nearest e4m3 after division by that scale. This is
MXFP8's format: 1 + 1/32 bytes a value, a relative error of at most 2**-4,
and blocks that never cross the last axis, so an array sharded along any axis
(in whole blocks) is quantized where it lies, without a collective.

>>> import jax.numpy as jnp
>>> x = jnp.array([[1.0, -3.0, 1000.0] + [0.0] * 29])
>>> stored = store(x)
>>> stored.values.dtype, stored.scales.dtype, float(stored.scales[0, 0])
(dtype(float8_e4m3fn), dtype(float8_e8m0fnu), 4.0)
>>> load(stored, x.shape, x.dtype)[0, :3].tolist()   # 1000 / 4 = 250 -> 256 in e4m3
[1.0, -3.0, 1024.0]
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_policy import formats
from jmp_policy.float8 import E4M3, E8M0, pad_last, to_format

BLOCK = 32
"""Values per scale along a residual's last axis (MXFP8's block)."""

_LARGEST = float(formats.format_of(E4M3).max)


class Stored(NamedTuple):
    """A residual in float8: ``values`` (``float8_e4m3fn``, the last axis padded to whole
    blocks) times ``scales`` (``float8_e8m0fnu``, one per block)."""

    values: jax.Array
    scales: jax.Array


def block_size(shape: tuple[int, ...]) -> int:
    """The values per scale of a residual of ``shape``: `BLOCK`, or its whole last axis
    where that is shorter."""
    return max(1, min(BLOCK, shape[-1])) if shape else 1


def store(x: Any) -> Stored:
    """``x`` (floating, at least one axis) in float8 blocks along its last axis."""
    x = formats.widen(x)
    block = block_size(jnp.shape(x))
    padded = pad_last(lax.convert_element_type(x, np.float32), -jnp.shape(x)[-1] % block)
    blocks = jnp.reshape(padded, (*jnp.shape(padded)[:-1], -1, block))
    # A block holding inf or NaN gets a NaN scale, so that it loads as NaN: a step that
    # overflowed stays non-finite for loss scaling to see.
    scale = formats.e8m0_scale(jnp.max(jnp.abs(blocks), axis=-1, keepdims=True), _LARGEST)
    values = to_format(lax.div(blocks, scale), E4M3)
    scales = lax.convert_element_type(scale[..., 0], E8M0)  # powers of two: exact
    return Stored(jnp.reshape(values, jnp.shape(padded)), scales)


def load(stored: Stored, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """The residual of ``shape`` and ``dtype`` that `store` made ``stored`` of."""
    scale = formats.widen(stored.scales)
    padded = jnp.shape(stored.values)
    blocks = jnp.reshape(formats.widen(stored.values), (*padded[:-1], -1, block_size(shape)))
    x = jnp.reshape(lax.mul(blocks, scale[..., None]), padded)[..., :shape[-1]]
    return lax.convert_element_type(x, np.dtype(dtype))

"""Counting on the bits of float32 magnitudes, with integer arithmetic only.

The numerics inspector's statistics and the float8 quantization counts are
reductions over every element of large arrays. XLA compiles comparisons,
selects and conversions of booleans inside reductions to scalar loops on
CPUs, several times slower than the integer and bit operations here, which
it vectorizes (and which cost GPUs nothing more). For a float32 magnitude
(sign bit cleared) the bits order like the values: ``+0`` is 0, inf is
`INF_BITS` and NaN is above it.

>>> import jax.numpy as jnp
>>> bits = magnitude_bits(jnp.array([0.0, -2.0, jnp.inf, jnp.nan]))
>>> positive(bits).tolist(), below(bits, INF_BITS).tolist(), finite_mask(bits).tolist()
([0, 1, 1, 1], [1, 1, 0, 0], [-1, -1, 0, 0])
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_policy import formats

I32 = np.int32
INF_BITS = I32(0x7F800000)


def magnitude_bits(x: Any) -> jax.Array:
    """The bits of ``|x|`` as a float32 (int32).

    A narrow ``x`` is read with ``formats.widen``: statistics of its values stay
    those of its format where the compiler removes the round trip to it.
    """
    x32 = lax.convert_element_type(formats.widen(x), np.float32)
    return lax.bitcast_convert_type(x32, I32) & I32(0x7FFFFFFF)


def unfoldable(x: Any) -> jax.Array:
    """Floating ``x`` times a one that XLA cannot see: a reduction of it is never evaluated
    at compile time. (Exact: ``x * 1`` is ``x``, infs and NaNs included.)

    A constant ``x`` (the cotangent of a loss linear in a product, a mask) would
    otherwise be reduced by XLA's constant folding, element by element: minutes for a
    large one, in every backend's compile. Fused into the reduction, the multiplication
    costs no memory traffic.
    """
    one = lax.optimization_barrier(jnp.ones((), jnp.result_type(x)))  # type: ignore[no-untyped-call]
    return lax.mul(x, one)


def finite_mask(bits: jax.Array) -> jax.Array:
    """-1 (all bits set) where the magnitude ``bits`` are finite, 0 for inf and NaN."""
    return lax.shift_right_arithmetic(bits - INF_BITS, I32(31))


def below(bits: jax.Array, limit: Any) -> jax.Array:
    """1 where ``bits < limit`` (both non-negative), else 0."""
    return lax.shift_right_logical(bits - I32(limit), I32(31))


def positive(bits: jax.Array) -> jax.Array:
    """1 where ``bits > 0`` (non-negative), else 0."""
    return lax.shift_right_logical(-bits, I32(31))


def as_float(bits: jax.Array) -> jax.Array:
    """The float32 whose bits are ``bits``."""
    return lax.bitcast_convert_type(bits, np.float32)


def where_bits(mask: jax.Array, x: jax.Array) -> jax.Array:
    """``x`` where ``mask`` is -1, +0.0 where it is 0 (a select without a select)."""
    return as_float(lax.bitcast_convert_type(x, I32) & mask)

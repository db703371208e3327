"""Number formats: what each low-precision float format is, and rounding to it.

Every low-precision feature of the library stands on this module: the float8
and block-scaled products, the numerics inspector, `low_precision_params`,
`cast_state` and `quantize_state`. A format is a grid of values; rounding to it
is written here once, in float32, with ``lax.reduce_precision``, ``lax.round``,
bitcasts and integer operations only.

Why not ``x.astype(dtype).astype(jnp.float32)``? Under ``jit``, XLA:GPU (with
``xla_allow_excess_precision``, its default) replaces a float round trip
``convert(convert(x, narrow), wide)`` by ``x``, also after moving the
conversions across reshapes, transposes and broadcasts: the value is then never
rounded. The operations here are not float conversions, so no compiler rewrite
removes them:

* `round_nearest` gives, in float32, bit for bit the value that
  ``convert(x, dtype)`` gives (rounding to nearest even, subnormals,
  overflow to inf, NaN or the largest value as the format says);
* `round_stochastic` rounds to one of the two neighbours on the grid,
  unbiased, with random bits from `random_bits`;
* `widen` is the float32 value of a narrow array, right whether or not the
  compiler removed the conversion that made it: ``round_nearest`` of its
  conversion to float32 (exact when the conversion was kept, the rounding
  restored when it was not);
* `encode` converts float32 values to the format, rounded either way.

Randomness for stochastic rounding is one counter-based hash
(`random_bits`): the bits of an element are a hash of its index in the array
and a seed of two uint32 words. The optimizer transformations draw the seed of
each step from the PRNG key in their state; a stateless product uses a fixed
seed and salts the bits with the values it rounds (`salted_bits`).

>>> import jax, jax.numpy as jnp
>>> x = jnp.array([1.0, 1.06, 500.0, 1e-3])   # 1e-3: between 2**-10 and 2**-9
>>> round_nearest(x, jnp.float8_e4m3fn).tolist()   # 500 is beyond 448: NaN, as convert gives
[1.0, 1.0, nan, 0.001953125]
>>> jax.jit(lambda x: widen(x.astype(jnp.float16)))(jnp.array([70000.0, 1.0001])).tolist()
[inf, 1.0]
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

__all__ = ["Format", "format_of", "grid", "round_nearest", "round_stochastic",
           "round_magnitude_stochastic", "round_bits_stochastic", "dropped_bits", "widen",
           "encode", "saturate", "scale_exponent", "random_bits", "stream_key", "salted_bits"]

_F32 = np.dtype(np.float32)
_U32 = np.uint32
_MANTISSA_BITS = 23  # float32's


class Format(NamedTuple):
    """A floating format's grid, as far as rounding to it needs.

    The formats of dtypes come from `format_of`; `grid` describes one with no dtype
    (the 4-bit codes of ``quantize_state``), which `round_nearest` and
    `round_stochastic` round to as well.

    Attributes:
      dtype: the numpy dtype, or ``None`` for a grid with no dtype.
      mantissa: explicit mantissa bits (3 for ``float8_e4m3fn``).
      exponent_bits: exponent bits (4).
      min_exponent: exponent of the smallest normal value (-6: ``2**-6``).
      max: the largest finite value (448).
      overflow: what a value that rounds beyond ``max`` becomes: ``"inf"``
        (IEEE formats: float16, bfloat16, float8_e5m2), ``"nan"`` (formats with
        no inf: float8_e4m3fn) or ``"saturate"`` (formats with neither:
        float4_e2m1fn, whose conversion clamps to the largest value).
    """

    dtype: Optional[np.dtype[Any]]
    mantissa: int
    exponent_bits: int
    min_exponent: int
    max: float
    overflow: Literal["inf", "nan", "saturate"]

    @property
    def tiny(self) -> float:
        """The smallest normal magnitude."""
        return 2.0 ** self.min_exponent

    @property
    def smallest(self) -> float:
        """The smallest subnormal magnitude: the grid's spacing below `tiny`."""
        return 2.0 ** (self.min_exponent - self.mantissa)

    @property
    def f32_range(self) -> bool:
        """Whether the format's exponents reach float32's smallest (bfloat16's do): its
        subnormals are float32 subnormals, and ``reduce_precision`` rounds them."""
        return self.min_exponent <= -126


def grid(mantissa: int, min_exponent: int, largest: float) -> Format:
    """The grid of a float format with ``mantissa`` bits whose smallest normal value is
    ``2 ** min_exponent`` (below it, the subnormals' even spacing), up to ``largest``,
    where it saturates. A grid of no mantissa bits holds the powers of two (and zero).

    >>> g = grid(1, 0, 6.0)                        # 1, 1.5, 2, 3, 4, 6 and 0.5 below 1
    >>> round_nearest(jnp.array([1.2, 2.6, 0.3, 9.0]), g).tolist()
    [1.0, 3.0, 0.5, 6.0]
    """
    # The roundings take ``largest`` for a value of the grid (the value that a value
    # beyond it rounds to), as a dtype's largest value is.
    exponent = max(math.frexp(largest)[1] - 1, min_exponent) if largest > 0 else 0
    if not (math.isfinite(largest) and largest > 0
            and (largest / 2.0 ** (exponent - mantissa)).is_integer()):
        raise ValueError(f"grid: largest={largest} is not a positive value of a grid of "
                         f"{mantissa} mantissa bits from 2**{min_exponent}.")
    return Format(None, mantissa, 8, min_exponent, float(largest), "saturate")


@functools.lru_cache(maxsize=None)
def format_of(dtype: Any) -> Format:
    """The `Format` of a floating dtype narrower than float32 (a `Format` as it is).

    >>> fmt = format_of(jnp.float8_e4m3fn)
    >>> fmt.mantissa, fmt.min_exponent, fmt.max, fmt.overflow, fmt.smallest
    (3, -6, 448.0, 'nan', 0.001953125)
    """
    if isinstance(dtype, Format):
        return dtype
    dtype = np.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize >= 4:
        raise ValueError(f"format_of takes a floating dtype narrower than float32, got {dtype}.")
    info = jnp.finfo(dtype)  # type: ignore[no-untyped-call]
    if int(info.nmant) == 0:
        raise ValueError(f"{dtype} has no mantissa (a scale format): its values are powers "
                         "of two, which float32 holds exactly; there is nothing to round.")
    with np.errstate(all="ignore"):
        beyond = float(np.array(np.inf, _F32).astype(dtype).astype(_F32))
    overflow: Literal["inf", "nan", "saturate"] = (
        "inf" if math.isinf(beyond) else "nan" if math.isnan(beyond) else "saturate")
    return Format(dtype, int(info.nmant), int(info.nexp), int(info.minexp), float(info.max),
                  overflow)


def _power_of_two(exponent: int) -> np.float32:
    return np.float32(2.0 ** exponent)


def round_nearest(x: Any, dtype: Any) -> jax.Array:
    """Float32 ``x`` rounded to the nearest value of ``dtype`` (ties to even), as float32:
    the value ``x.astype(dtype)`` holds, bit for bit, including subnormals, overflow
    (inf, NaN or the largest value: `Format.overflow`), infs and NaNs.

    ``dtype`` may also be a `Format` (a `grid` with no dtype). One operation of its own
    in a jaxpr (`rounding_p`), which tools that look at a program (the numerics
    inspector) recognize as a rounding to ``dtype``.

    >>> import jax.numpy as jnp
    >>> round_nearest(jnp.array([0.25, 0.75, 7.0, jnp.inf]), jnp.float4_e2m1fn).tolist()
    [0.0, 1.0, 6.0, 6.0]
    """
    return rounding_p.bind(lax.convert_element_type(x, _F32), format=format_of(dtype))  # type: ignore[no-any-return, no-untyped-call]


def _round_nearest(x: jax.Array, *, format: Format) -> jax.Array:
    """`round_nearest`, in operations that no compiler rewrite of conversions removes: the
    magnitude rounded (`_nearest_magnitude`), then its overflow and sign (`_overflowed`)."""
    if format.f32_range and format.overflow == "inf":  # bfloat16: one reduce_precision does all
        return lax.reduce_precision(x, exponent_bits=format.exponent_bits,
                                    mantissa_bits=format.mantissa)
    sign, magnitude = _split_sign(x)
    return _overflowed(_nearest_magnitude(magnitude, format), sign, format)


rounding_p = Primitive("round_to_format")
"""`round_nearest` as a primitive: float32 in, float32 out, parameter ``format`` (a
`Format`). Its derivative passes the tangent through, as a conversion's does."""
# JAX's registration functions are untyped.
rounding_p.def_impl(_round_nearest)  # type: ignore[no-untyped-call]
rounding_p.def_abstract_eval(lambda x, *, format: x)  # type: ignore[no-untyped-call]
mlir.register_lowering(rounding_p, mlir.lower_fun(_round_nearest, multiple_results=False))
batching.defvectorized(rounding_p)  # type: ignore[no-untyped-call]
ad.defjvp(rounding_p, lambda tangent, x, *, format: tangent)  # type: ignore[no-untyped-call]


# The roundings work on the float32 bit pattern, as int32, with no comparison and no
# select: XLA:GPU splits a transpose fusion (a weight quantized for the backward
# product) at every operation that yields a ``pred`` array, into kernels that write
# that mask to memory and read the float32 input again. The sign bit apart, the
# magnitude's pattern (a non-negative int32) orders as the magnitude does, so ``min``
# and ``max`` on it clamp the value; where two cases meet at a value ``b`` of the grid,
# each computed on the magnitude clamped to its own side gives ``b`` on the other side,
# and their sum less ``b``'s pattern is the case the magnitude is in.
_I32 = np.int32
_SIGN = _I32(-(1 << 31))
_INF = _I32(0x7F800000)
_QUIET_NAN = _I32(0x7FC00000)


def _pattern(value: float) -> np.int32:
    """The bit pattern of float32 ``value``, as int32."""
    return _I32(np.float32(value).view(_I32))


def _split_sign(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Float32 ``x``'s sign bit and magnitude's pattern (int32)."""
    x_bits = lax.bitcast_convert_type(x, _I32)
    sign = lax.bitwise_and(x_bits, _SIGN)
    return sign, lax.bitwise_xor(x_bits, sign)


def _negative_mask(difference: jax.Array) -> jax.Array:
    """-1 (all bits) where int32 ``difference`` is negative, 0 elsewhere: a mask for
    ``bitwise_and``, made by an arithmetic shift instead of a comparison."""
    return lax.shift_right_arithmetic(difference, _I32(31))


def _nearest_normal(magnitude: jax.Array, fmt: Format) -> jax.Array:
    """The pattern of ``magnitude`` (a pattern, at least `Format.tiny`'s unless ``fmt``'s
    subnormals are float32's) rounded to nearest even on ``fmt``'s grid: unbounded above
    except in an IEEE format (`Format.overflow` ``"inf"``), whose own exponent range
    rounds to inf. NaN stays NaN."""
    ieee = fmt.overflow == "inf"
    rounded = lax.reduce_precision(lax.bitcast_convert_type(magnitude, _F32),
                                   exponent_bits=fmt.exponent_bits if ieee else 8,
                                   mantissa_bits=fmt.mantissa)
    return lax.bitcast_convert_type(rounded, _I32)


def _nearest_magnitude(magnitude: jax.Array, fmt: Format) -> jax.Array:
    """The pattern of ``magnitude`` (a pattern) rounded to nearest even on ``fmt``'s grid,
    as `_nearest_normal`, subnormals included."""
    if fmt.f32_range:  # the format's subnormals are float32's: reduce_precision rounds them
        return _nearest_normal(magnitude, fmt)
    # Below `Format.tiny`, reduce_precision flushes to zero: there the grid is the
    # multiples of the smallest subnormal, which `lax.round` finds once scaled to integers.
    # Each part sees the magnitude clamped to its side of tiny, where the other part
    # gives tiny itself, so that the sum of the two less tiny's pattern is the part
    # whose side the magnitude is on (NaN: the normal part's NaN).
    tiny = _pattern(fmt.tiny)
    k = fmt.mantissa - fmt.min_exponent
    low = lax.bitcast_convert_type(lax.min(magnitude, tiny), _F32)
    sub = lax.mul(lax.round(lax.mul(low, _power_of_two(k)), lax.RoundingMethod.TO_NEAREST_EVEN),
                  _power_of_two(-k))
    return lax.add(lax.sub(_nearest_normal(lax.max(magnitude, tiny), fmt), tiny),
                   lax.bitcast_convert_type(sub, _I32))


def _overflowed(rounded: jax.Array, sign: jax.Array, fmt: Format) -> jax.Array:
    """Float32 of ``rounded`` (a magnitude's pattern on ``fmt``'s grid, unbounded above
    unless IEEE) and ``sign``, with what lies beyond ``fmt.max`` made what a conversion to
    ``fmt`` makes of it: inf (already, for IEEE formats), NaN, or the largest value, and
    NaN what the conversion makes of NaN."""
    top = _pattern(fmt.max)
    if fmt.overflow == "nan":  # beyond the largest (inf and NaN too): NaN
        beyond = _negative_mask(lax.sub(top, rounded))
        rounded = lax.bitwise_or(rounded, lax.bitwise_and(beyond, _QUIET_NAN))
    elif fmt.overflow == "saturate":
        # No NaN either: XLA's conversion makes it -0. No finite value rounds to a NaN
        # pattern, so the rounded pattern tells NaN inputs apart.
        nan = _negative_mask(lax.sub(_INF, rounded))
        rounded = lax.bitwise_and(lax.min(rounded, top), lax.bitwise_not(nan))
        sign = lax.bitwise_or(sign, lax.bitwise_and(nan, _SIGN))
    return lax.bitcast_convert_type(lax.bitwise_or(rounded, sign), _F32)


def _random_fraction_bits(bits: jax.Array, count: Any) -> jax.Array:
    """The top ``count`` (an int, or an int32 array of them, 1 to 31) of 32 random
    ``bits``, as the low bits of an int32."""
    shift = (_U32(32 - count) if isinstance(count, int)
             else lax.convert_element_type(lax.sub(_I32(32), count), _U32))
    return lax.convert_element_type(lax.shift_right_logical(bits, shift), _I32)


def round_bits_stochastic(pattern: Any, count: Any, bits: jax.Array) -> jax.Array:
    """The int32 bit pattern of a non-negative float32 (``pattern``) with its low ``count``
    bits rounded away stochastically: the top ``count`` of the 32 random ``bits`` added,
    then the low ``count`` bits cleared. ``count`` is an int or an int32 array (one per
    element), 1 to 23.

    The result is the multiple of ``2**count`` just below the pattern or the one above
    (the carry runs into the exponent where it should), the one above with probability
    (the dropped bits' value) / ``2**count`` for uniform ``bits``: the classic stochastic
    rounding of a float to fewer mantissa bits, exact and unbiased wherever the grid's
    spacing in that binade is ``2**count`` patterns (`dropped_bits`).

    >>> one_and_a_quarter = np.float32(1.25).view(np.int32)   # 1, 1.5: mantissa bit 22
    >>> up = round_bits_stochastic(one_and_a_quarter, 22, jnp.array([0, 2**31], jnp.uint32))
    >>> jax.lax.bitcast_convert_type(up, jnp.float32).tolist()   # up where bits >= 2**31
    [1.0, 1.5]
    """
    count_mask = (_I32(-(1 << count)) if isinstance(count, int)
                  else lax.shift_left(_I32(-1), count))
    return lax.bitwise_and(lax.add(pattern, _random_fraction_bits(bits, count)), count_mask)


def dropped_bits(magnitude: Any, dtype: Any) -> jax.Array:
    """How many low bits of the pattern of float32 ``magnitude`` (a non-negative pattern,
    int32) lie below ``dtype``'s grid: ``23 - mantissa`` from `Format.tiny` up, one more
    per binade below (the subnormals' even spacing), at most 23, which a magnitude below
    the smallest subnormal's binade reaches before it is on the grid (it rounds to a power
    of two below `Format.smallest`). With `round_bits_stochastic`, stochastic rounding
    from the smallest subnormal to the largest value in a handful of integer operations.

    >>> pattern = np.float32([1.0, 2.0 ** -7, 2.0 ** -9]).view(np.int32)
    >>> dropped_bits(pattern, jnp.float8_e4m3fn).tolist()   # float8's 3 mantissa bits
    [20, 21, 23]
    """
    fmt = format_of(dtype)
    kept = _MANTISSA_BITS - fmt.mantissa
    if fmt.f32_range:  # float32's subnormals have float32's spacing too
        return jnp.full(jnp.shape(magnitude), kept, _I32)
    field = lax.shift_right_logical(lax.convert_element_type(magnitude, _I32), _I32(23))
    # The exponent field of tiny, less the field, is how many binades below tiny.
    below = lax.sub(_I32(kept + fmt.min_exponent + 127), field)
    return lax.clamp(_I32(kept), below, _I32(_MANTISSA_BITS))


def round_stochastic(x: Any, dtype: Any, bits: jax.Array) -> jax.Array:
    """Float32 ``x`` rounded to one of its two neighbours in ``dtype``, as float32: the one
    above with probability (distance from the one below) / (their distance), so that
    ``E[round(x)] = x``. ``bits`` are uniform uint32 random bits of ``x``'s shape
    (`random_bits`).

    In the normal range (and bfloat16's subnormals, which are float32's), the bits below
    ``dtype``'s mantissa are dropped after adding as many random bits
    (`round_bits_stochastic`): exact. Below `Format.tiny`, the value in fixed point, with
    ``31 - mantissa`` bits below the smallest subnormal, gets as many random bits and is
    truncated: unbiased to ``2**-(31 - mantissa)`` of the smallest subnormal. Values
    beyond the largest finite one, infs and NaNs round as `round_nearest` does; a value
    below the largest never rounds above it.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> bits = random_bits(jnp.array([1, 2], jnp.uint32), (4000,))
    >>> draws = round_stochastic(jnp.full(4000, 4.5), jnp.float4_e2m1fn, bits)
    >>> sorted(set(draws.tolist())), abs(float(draws.mean()) - 4.5) < 0.05   # 4 or 6
    ([4.0, 6.0], True)
    """
    fmt = format_of(dtype)
    x = lax.convert_element_type(x, _F32)
    if fmt.f32_range and fmt.overflow == "inf":
        return _stochastic_in_f32_range(x, fmt, bits)
    sign, magnitude = _split_sign(x)
    # As in `_nearest_magnitude`, each case sees the magnitude clamped to its side of a
    # boundary that is on the grid, where the other cases give the boundary itself: the
    # largest value (a value below it never rounds above it) and tiny.
    top = _pattern(fmt.max)
    rounded = round_magnitude_stochastic(lax.min(magnitude, top), fmt, bits)
    # At least the largest value: to nearest (tiny is below, so no subnormal part).
    beyond = _nearest_normal(lax.max(magnitude, top), fmt)
    return _overflowed(lax.add(lax.sub(beyond, top), rounded), sign, fmt)


def round_magnitude_stochastic(magnitude: Any, dtype: Any, bits: jax.Array) -> jax.Array:
    """The int32 pattern of a float32 magnitude (``magnitude``: a pattern, int32, at most
    ``dtype``'s largest value) rounded stochastically to ``dtype``'s grid, as
    `round_stochastic` rounds it: for callers that keep the sign apart and know their
    values within the format's range (the codes of ``quantize_state``).

    >>> pattern = np.float32([4.5, 0.25]).view(np.int32)     # float4: 4 or 6; 0 or 0.5
    >>> f = lambda u: jax.lax.bitcast_convert_type(round_magnitude_stochastic(
    ...     pattern, jnp.float4_e2m1fn, jnp.full(2, u * 2**32, jnp.uint32)), jnp.float32)
    >>> f(0.25).tolist(), f(0.75).tolist()   # up where the random fraction is at least 1 - p
    ([4.0, 0.0], [6.0, 0.5])
    """
    fmt = format_of(dtype)
    dropped = _MANTISSA_BITS - fmt.mantissa
    if fmt.f32_range:
        return round_bits_stochastic(magnitude, dropped, bits)
    # As in `_nearest_magnitude`, each part sees the magnitude clamped to its side of
    # tiny, where the other part gives tiny itself.
    tiny = _pattern(fmt.tiny)
    return lax.add(lax.sub(round_bits_stochastic(lax.max(magnitude, tiny), dropped, bits), tiny),
                   _subnormal_stochastic(lax.min(magnitude, tiny), fmt, bits))


def _subnormal_stochastic(low: jax.Array, fmt: Format, bits: jax.Array) -> jax.Array:
    """The pattern of magnitude ``low`` (a pattern, at most `Format.tiny`'s) rounded
    stochastically to a multiple of `Format.smallest`: in fixed point with ``31 - mantissa``
    bits below the smallest (tiny is ``2**31``; the conversion truncates), as many random
    bits added and dropped, and the count of smallest subnormals back in float32 (exact:
    at most ``2**mantissa``)."""
    fraction = 31 - fmt.mantissa
    fixed = lax.convert_element_type(
        lax.mul(lax.bitcast_convert_type(low, _F32), _power_of_two(31 - fmt.min_exponent)),
        _U32)
    count = lax.shift_right_logical(
        lax.add(fixed, lax.shift_right_logical(bits, _U32(32 - fraction))), _U32(fraction))
    value = lax.mul(lax.convert_element_type(count, _F32), np.float32(fmt.smallest))
    return lax.bitcast_convert_type(value, _I32)


def _stochastic_in_f32_range(x: jax.Array, fmt: Format, bits: jax.Array) -> jax.Array:
    """`round_stochastic` to an IEEE format of float32's exponent range (bfloat16), whose
    subnormals are float32's: random bits added below the kept mantissa and dropped, on
    the signed pattern (no carry reaches the sign bit below the largest value); beyond the
    largest value (infs and NaNs too), no random bits and nothing dropped, so that the
    final ``reduce_precision``, the identity on the grid, rounds those to nearest."""
    x_bits = lax.bitcast_convert_type(x, _I32)
    magnitude = lax.bitwise_and(x_bits, _I32(0x7FFFFFFF))
    beyond = _negative_mask(lax.sub(_pattern(fmt.max), magnitude))  # -1 beyond the largest
    dropped = _MANTISSA_BITS - fmt.mantissa
    random = lax.bitwise_and(_random_fraction_bits(bits, dropped), lax.bitwise_not(beyond))
    truncated = lax.bitwise_and(lax.add(x_bits, random),
                                lax.bitwise_or(_I32(-(1 << dropped)), beyond))
    return lax.reduce_precision(lax.bitcast_convert_type(truncated, _F32),
                                exponent_bits=fmt.exponent_bits, mantissa_bits=fmt.mantissa)


def widen(q: Any) -> jax.Array:
    """The float32 value of ``q`` (an array of a format narrower than float32), right on
    every backend: if the compiler removed the conversion that made ``q`` (its input then
    reaches here unrounded), the rounding is made again. Float32 and wider pass through.

    >>> import jax.numpy as jnp
    >>> widen(jnp.array([1.5, 448.0], jnp.float8_e4m3fn)).tolist()
    [1.5, 448.0]
    """
    dtype = np.dtype(jnp.result_type(q))
    if dtype.itemsize >= 4 or not jnp.issubdtype(dtype, jnp.floating):
        return jnp.asarray(q)
    if int(jnp.finfo(dtype).nmant) == 0:  # type: ignore[no-untyped-call]
        # A scale format (float8_e8m0fnu): the library only converts powers of two to it,
        # which float32 holds exactly; nothing was rounded.
        return lax.convert_element_type(q, _F32)
    return round_nearest(lax.convert_element_type(q, _F32), dtype)


def encode(x: Any, dtype: Any, bits: Optional[jax.Array] = None) -> jax.Array:
    """Float32 ``x`` in ``dtype``: rounded to nearest, or stochastically with random
    ``bits`` (`round_stochastic`). Read it back with `widen`.

    The rounding is made here, so the conversion that follows is exact: the values
    are the format's on every backend, whatever its conversion does (XLA:CPU's older
    emitters round to float4_e2m1fn twice: 0.7499 becomes 1).
    """
    x = lax.convert_element_type(x, _F32)
    x = round_nearest(x, dtype) if bits is None else round_stochastic(x, dtype, bits)
    return lax.convert_element_type(x, np.dtype(dtype))


def saturate(x: Any, bound: float) -> jax.Array:
    """Float32 ``x`` with finite values beyond ``±bound`` (a positive float32) made
    ``±bound``; inf and NaN stay as they are (a value that overflowed stays
    non-finite, so what it enters is not finite either).

    In integer operations on the bit pattern, without a comparison (see
    `round_nearest`: a ``pred`` array splits XLA:GPU's transpose fusions).

    >>> import jax.numpy as jnp
    >>> saturate(jnp.array([1.0, -500.0, jnp.inf, jnp.nan]), 448.0).tolist()
    [1.0, -448.0, inf, nan]
    """
    sign, magnitude = _split_sign(lax.convert_element_type(x, _F32))
    # -1 where the magnitude is inf or NaN (its pattern at least inf's), else 0.
    special = lax.bitwise_not(_negative_mask(lax.sub(magnitude, _INF)))
    clamped = lax.min(magnitude, _pattern(bound))
    magnitude = lax.bitwise_or(lax.bitwise_and(magnitude, special),
                               lax.bitwise_and(clamped, lax.bitwise_not(special)))
    return lax.bitcast_convert_type(lax.bitwise_or(magnitude, sign), _F32)


def scale_exponent(amax: Any, bound: float, *, strict: bool = False) -> jax.Array:
    """Block scaling's power-of-two rule: the biased float32 exponent (int32, not clipped)
    of the smallest power of two ``s`` with ``amax / s <= bound`` (``< bound`` if
    ``strict``), read from the bits of the float32 quotient ``amax / bound`` (exact for a
    power-of-two ``bound``). ``amax`` is a non-negative absolute maximum; below float32's
    normal range the exponent is 0 or 1, for an inf or NaN ``amax`` 255 or more.

    >>> scale_exponent(jnp.array([448.0, 449.0, 1.0]), 448.0).tolist()   # 2**0, 2**1, 2**-8
    [127, 128, 119]
    >>> scale_exponent(jnp.array([256.0, 255.0]), 256.0, strict=True).tolist()   # 2, 1
    [128, 127]
    """
    ratio = lax.div(lax.convert_element_type(amax, _F32), np.float32(bound))
    bits = lax.bitcast_convert_type(ratio, np.int32)
    exponent = lax.shift_right_logical(bits, np.int32(_MANTISSA_BITS))
    if strict:
        return lax.add(exponent, np.int32(1))
    inexact = lax.bitwise_and(bits, np.int32((1 << _MANTISSA_BITS) - 1)) > 0
    return lax.add(exponent, lax.convert_element_type(inexact, np.int32))


# --- Random bits ---------------------------------------------------------------------------

def _mix(x: jax.Array) -> jax.Array:
    """A bijection of 32 bits (the "lowbias32" integer hash): nearby inputs give
    unrelated outputs."""
    x = lax.bitwise_xor(x, lax.shift_right_logical(x, _U32(16)))
    x = lax.mul(x, _U32(0x7FEB352D))
    x = lax.bitwise_xor(x, lax.shift_right_logical(x, _U32(15)))
    x = lax.mul(x, _U32(0x846CA68B))
    return lax.bitwise_xor(x, lax.shift_right_logical(x, _U32(16)))


def random_bits(seed: jax.Array, shape: tuple[int, ...],
                salt: Optional[jax.Array] = None) -> jax.Array:
    """Uniform uint32 bits of ``shape``: each a hash of the element's index (in row-major
    order) and ``seed``, two uint32 words (or their `stream_key`), and of the element's
    ``salt`` if given.

    The two words are hashed into one stream key first (a scalar, `stream_key`), so
    that words drawn from one another still give unrelated streams. An element's bits
    are one hash, `_mix` (a bijection of 32 bits), of its counter: ``index * odd + key``,
    xor its salt. For a uniformly random key the counter is uniform over 32 bits, and
    so are the bits, exactly, whatever the salt; elements with different counters get
    unrelated bits. Computed in the kernel that uses them (``jax.random.bits`` is
    written to memory and read back), and from the global index, so a sharded array
    gets the bits the whole one would. One hash per element, not two: each is a dozen
    operations in the kernel of every array rounded, which the step's compile time
    pays for.

    ``salt`` (uint32 of ``shape``, e.g. the bits of the values to round) is mixed in
    before the hash: for any fixed salt the bits stay exactly uniform, and arrays of
    the same shape rounded with one seed get unrelated bits where their salts differ.
    It lets one seed serve every array of a step (below).

    The seed of a stateful rounding: `low_precision_params`, `cast_state` and
    `quantize_state` keep a PRNG key in their state; each step draws from it the next
    key's words and one more, a uniform word that is the stream key of every array the
    step rounds, salted with the bits of the values rounded. One seed,
    not one per array: the kernels that round arrays of the same shape are then the
    same computation, which XLA compiles once (a seed per array, sliced from an array
    of seeds, is a constant in each kernel and makes every kernel distinct).

    >>> bits = random_bits(jnp.array([1, 2], jnp.uint32), (3,))
    >>> salted = random_bits(jnp.array([1, 2], jnp.uint32), (3,), jnp.zeros(3, jnp.uint32))
    >>> bool((bits == salted).all())   # a zero salt changes nothing
    True
    """
    key = stream_key(seed)
    index = lax.iota(_U32, max(1, math.prod(shape)))
    index = lax.reshape(index, shape) if len(shape) != 1 else index
    counter = lax.add(lax.mul(index, _U32(0x9E3779B1)), key)
    if salt is not None:
        counter = lax.bitwise_xor(counter, lax.convert_element_type(salt, _U32))
    return _mix(counter)


def stream_key(seed: jax.Array) -> jax.Array:
    """The uint32 scalar that `random_bits` hashes ``seed`` (two uint32 words) into; a
    scalar passes through, as a key already made. Made once for many arrays, it spares
    each kernel that rounds one the scalar hashing.

    >>> seed = jnp.array([1, 2], jnp.uint32)
    >>> bool((random_bits(stream_key(seed), (3,)) == random_bits(seed, (3,))).all())
    True
    """
    seed = lax.convert_element_type(jnp.asarray(seed), _U32)
    if seed.ndim == 0:
        return seed
    return _mix(lax.bitwise_xor(seed[0], _mix(lax.add(seed[1], _U32(0x9E3779B9)))))


def salted_bits(seed: jax.Array, x: jax.Array) -> jax.Array:
    """`random_bits` for rounding float32 ``x`` with ``seed``, salted with ``x``'s own bits:
    one seed then serves every array a step rounds (see `random_bits`)."""
    return random_bits(seed, jnp.shape(x), lax.bitcast_convert_type(x, _U32))


# --- Bits of float32 magnitudes ---------------------------------------------------------

I32 = np.int32
INF_BITS = I32(0x7F800000)


def magnitude_bits(x: Any) -> jax.Array:
    """The bits of ``|x|`` as a float32 (int32).

    A narrow ``x`` is read with `widen`: statistics of its values stay
    those of its format where the compiler removes the round trip to it.
    """
    x32 = lax.convert_element_type(widen(x), np.float32)
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

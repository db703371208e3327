"""Number formats: what each float format is, its bit patterns, and rounding to it.

Every low-precision feature of the library asks this module, and no other knows
a bit pattern: the float8 and block-scaled products, the numerics inspector,
`low_precision_params`, `cast_state` and `quantize_state`. In order:

* **Formats and their facts**: `Format` (mantissa and exponent bits, smallest
  and largest values, what overflow gives), from `format_of` for a dtype that
  rounding targets, `facts_of` for any floating dtype, `grid` for one with no
  dtype (the 4-bit codes of ``quantize_state``);
* **bit patterns** of float32 values, as int32: sign and magnitude, masks made
  by shifts instead of comparisons, exponent fields and the powers of two they
  stand for (`power_of_two`, `floor_power_of_two`), float32 as two halves
  (`split_float32`);
* **rounding**, in float32, with ``lax.reduce_precision``, ``lax.round``,
  bitcasts and integer operations only: `round_nearest` gives bit for bit the
  value that ``convert(x, dtype)`` gives (ties to even, subnormals, overflow to
  inf, NaN or the largest value as the format says); `round_stochastic` rounds
  to one of the two neighbours on the grid, unbiased; `widen` reads a narrow
  array back, right whether or not the compiler removed the conversion that
  made it; `encode` converts float32 values to a format, rounded to nearest or,
  with a seed, stochastically;
* **block scales**: the power-of-two rule of MXFP8 and ``quantize_state``
  (`scale_exponent`, `block_exponent`, `e8m0_scale`) and NVFP4's float8 one
  (`e4m3_scale`);
* **random bits** for stochastic rounding (`random_bits`), and the one table of
  the seed streams of the library's roundings (`SEED_STREAMS`);
* `unfoldable`, which keeps XLA from reducing a constant array when it compiles
  (the statistics and scales computed from bit patterns reduce whole arrays).

Why not ``x.astype(dtype).astype(jnp.float32)``? Under ``jit``, XLA:GPU (with
``xla_allow_excess_precision``, its default) replaces a float round trip
``convert(convert(x, narrow), wide)`` by ``x``, also after moving the
conversions across reshapes, transposes and broadcasts: the value is then never
rounded. The operations here are not float conversions, so no compiler rewrite
removes them.

**Random bits do not depend on the sharding.** An element's random bits are a
hash of the seed, the element's index in the whole array (row-major, counted
on the global shape, never a shard's) and, where the rounding is salted, the
bits of its value as its format holds it: the quantizers read a narrow operand
that they round stochastically with `widen`, so excess precision that the
compiler keeps in one program and not in another (a sharded one) changes no
draw. A sharded array therefore rounds, bit for bit, as the same array on one
device. The other side of the rule: a value repeated at the same
position of an array of the same shape, rounded with the same seed, rounds the
same way. The optimizer transformations draw a new seed every step; the
stateless products use a fixed seed (`fixed_seed`), so there an element that
holds exactly the same value at the same position step after step rounds the
same way each time (values that change by one bit get unrelated bits).

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

__all__ = [
    # formats and their facts
    "Format", "format_of", "facts_of", "grid",
    # bit patterns
    "SIGN_BIT", "INF_BITS", "pattern", "split_sign", "magnitude_bits", "as_float",
    "negative_mask", "nonzero_mask", "finite_mask", "below", "positive", "where_bits",
    "exponent_field", "power_of_two", "floor_power_of_two", "bits_of", "split_float32",
    "join_float32",
    # rounding
    "round_nearest", "rounding_p", "round_stochastic", "round_magnitude_stochastic",
    "round_bits_stochastic", "dropped_bits", "widen", "encode", "saturate",
    # block scales
    "scale_exponent", "block_exponent", "e8m0_scale", "e4m3_scale",
    # random bits
    "random_bits", "stream_key", "salted_bits", "SeedStreams", "SEED_STREAMS", "fixed_seed",
    # reductions
    "unfoldable",
]

_F32 = np.dtype(np.float32)
_U32 = np.uint32
_MANTISSA_BITS = 23  # float32's
_EXPONENT_BIAS = 127  # float32's


# --- Formats and their facts -----------------------------------------------------------------

class Format(NamedTuple):
    """A floating format's facts: its grid, its range and what overflow gives.

    The formats of dtypes come from `format_of` (those that rounding targets) and
    `facts_of` (any floating dtype); `grid` describes one with no dtype (the 4-bit
    codes of ``quantize_state``), which `round_nearest` and `round_stochastic` round
    to as well.

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
    def spacing_at_max(self) -> float:
        """The grid's spacing in the binade of its largest value."""
        return 2.0 ** (math.frexp(self.max)[1] - 1 - self.mantissa)

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
def facts_of(dtype: Any) -> Format:
    """The `Format` of any floating dtype: float32 and wider, and scale formats with no
    mantissa (``float8_e8m0fnu``), included. For reading a format's facts (its largest
    value, its smallest normal one); the roundings take `format_of`'s.

    >>> facts_of(jnp.float32).min_exponent, facts_of(jnp.float16).max
    (-126, 65504.0)
    """
    if isinstance(dtype, Format):
        return dtype
    dtype = np.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"facts_of takes a floating dtype, got {dtype}.")
    info = jnp.finfo(dtype)  # type: ignore[no-untyped-call]
    with np.errstate(all="ignore"):
        beyond = float(np.array(np.inf, _F32).astype(dtype).astype(_F32))
    overflow: Literal["inf", "nan", "saturate"] = (
        "inf" if math.isinf(beyond) else "nan" if math.isnan(beyond) else "saturate")
    return Format(dtype, int(info.nmant), int(info.nexp), int(info.minexp), float(info.max),
                  overflow)


@functools.lru_cache(maxsize=None)
def format_of(dtype: Any) -> Format:
    """The `Format` of a floating dtype narrower than float32 with a mantissa, which the
    roundings round to (a `Format` as it is).

    >>> fmt = format_of(jnp.float8_e4m3fn)
    >>> fmt.mantissa, fmt.min_exponent, fmt.max, fmt.overflow, fmt.smallest
    (3, -6, 448.0, 'nan', 0.001953125)
    """
    if isinstance(dtype, Format):
        return dtype
    if not jnp.issubdtype(dtype, jnp.floating) or np.dtype(dtype).itemsize >= 4:
        raise ValueError(f"format_of takes a floating dtype narrower than float32, "
                         f"got {np.dtype(dtype)}.")
    fmt = facts_of(dtype)
    if fmt.mantissa == 0:
        raise ValueError(f"{np.dtype(dtype)} has no mantissa (a scale format): its values are "
                         "powers of two, which float32 holds exactly; there is nothing to round.")
    return fmt


def _two_to(exponent: int) -> np.float32:
    return np.float32(2.0 ** exponent)


# --- Bit patterns ----------------------------------------------------------------------------
#
# The roundings work on the float32 bit pattern, as int32, with no comparison and no
# select: XLA:GPU splits a transpose fusion (a weight quantized for the backward
# product) at every operation that yields a ``pred`` array, into kernels that write
# that mask to memory and read the float32 input again. The sign bit apart, the
# magnitude's pattern (a non-negative int32) orders as the magnitude does, so ``min``
# and ``max`` on it clamp the value; where two cases meet at a value ``b`` of the grid,
# each computed on the magnitude clamped to its own side gives ``b`` on the other side,
# and their sum less ``b``'s pattern is the case the magnitude is in. Masks are -1 (all
# bits) or 0, made by arithmetic shifts of a difference's sign bit.

I32 = np.int32
SIGN_BIT = I32(-(1 << 31))
INF_BITS = I32(0x7F800000)
_MAGNITUDE = I32(0x7FFFFFFF)
_QUIET_NAN = I32(0x7FC00000)


def pattern(value: float) -> np.int32:
    """The bit pattern of float32 ``value``, as int32."""
    return I32(np.float32(value).view(I32))


def split_sign(x: Any) -> tuple[jax.Array, jax.Array]:
    """Float32 ``x``'s sign bit (int32: `SIGN_BIT` or 0) and magnitude's pattern (int32)."""
    x_bits = lax.bitcast_convert_type(lax.convert_element_type(x, _F32), I32)
    sign = lax.bitwise_and(x_bits, SIGN_BIT)
    return sign, lax.bitwise_xor(x_bits, sign)


def magnitude_bits(x: Any) -> jax.Array:
    """The bits of ``|x|`` as a float32 (int32).

    A narrow ``x`` is read with `widen`: statistics of its values stay
    those of its format where the compiler removes the round trip to it.
    """
    x32 = lax.convert_element_type(widen(x), _F32)
    return lax.bitcast_convert_type(x32, I32) & _MAGNITUDE


def as_float(bits: jax.Array) -> jax.Array:
    """The float32 whose bits are ``bits``."""
    return lax.bitcast_convert_type(bits, _F32)


def negative_mask(difference: jax.Array) -> jax.Array:
    """-1 (all bits) where int32 ``difference`` is negative, 0 elsewhere."""
    return lax.shift_right_arithmetic(difference, I32(31))


def nonzero_mask(bits: jax.Array) -> jax.Array:
    """-1 where the non-negative ``bits`` are nonzero, 0 where zero."""
    return negative_mask(lax.neg(bits))


def finite_mask(bits: jax.Array) -> jax.Array:
    """-1 where the magnitude ``bits`` are finite, 0 for inf and NaN."""
    return negative_mask(bits - INF_BITS)


def below(bits: jax.Array, limit: Any) -> jax.Array:
    """1 where ``bits < limit`` (both non-negative), else 0."""
    return lax.shift_right_logical(bits - I32(limit), I32(31))


def positive(bits: jax.Array) -> jax.Array:
    """1 where ``bits > 0`` (non-negative), else 0."""
    return lax.shift_right_logical(-bits, I32(31))


def where_bits(mask: jax.Array, x: jax.Array) -> jax.Array:
    """``x`` where ``mask`` is -1, +0.0 where it is 0 (a select without a select)."""
    return as_float(lax.bitcast_convert_type(x, I32) & mask)


def exponent_field(magnitude: Any) -> jax.Array:
    """The biased exponent field (int32, 0 to 255) of non-negative float32 ``magnitude``
    (or of the magnitude's pattern): the binade it lies in, ``2 ** (field - 127)``."""
    bits = magnitude if jnp.result_type(magnitude) == I32 else \
        lax.bitcast_convert_type(lax.convert_element_type(magnitude, _F32), I32)
    return lax.shift_right_logical(bits, I32(_MANTISSA_BITS))


def power_of_two(biased: Any) -> jax.Array:
    """``2.0 ** (biased - 127)`` as float32, exactly, for integer ``biased`` in [1, 254]
    (a biased exponent field; 0 gives 0.0, 255 inf).

    >>> power_of_two(jnp.array([127, 130, 1], jnp.uint8)).tolist()
    [1.0, 8.0, 1.1754943508222875e-38]
    """
    field = lax.convert_element_type(biased, I32)
    return as_float(lax.shift_left(field, I32(_MANTISSA_BITS)))


def floor_power_of_two(x: Any) -> jax.Array:
    """The largest power of two not above each non-negative float32 ``x`` (its binade's),
    exactly, where ``exp2(floor(log2(x)))`` may round on some backends; 0 and float32
    subnormals give 0, inf inf, NaN NaN.

    >>> floor_power_of_two(jnp.array([3.0, 0.3, 0.0, jnp.nan])).tolist()
    [2.0, 0.25, 0.0, nan]
    """
    x = lax.convert_element_type(x, _F32)
    return lax.select(lax.ne(x, x), x, power_of_two(exponent_field(x)))


def bits_of(x: Any) -> jax.Array:
    """The bit pattern of floating ``x``, as the unsigned integer of its width (a bitwise
    comparison tells -0.0 from 0.0 and one NaN from another)."""
    x = jnp.asarray(x)
    return lax.bitcast_convert_type(x, np.dtype(f"uint{8 * x.dtype.itemsize}"))


def split_float32(x: Any) -> tuple[jax.Array, jax.Array]:
    """Float32 ``x`` as its high 16 bits, a bfloat16 (``x`` truncated), and its low 16
    bits (uint16): bfloat16 is float32's upper half.

    >>> high, low = split_float32(jnp.array([1.0 + 2.0 ** -12]))
    >>> high.tolist(), low.tolist(), join_float32(high, low).tolist()
    ([1.0], [2048], [1.000244140625])
    """
    x_bits = bits_of(lax.convert_element_type(x, _F32))
    high = lax.bitcast_convert_type((x_bits >> 16).astype(jnp.uint16), jnp.bfloat16)
    return high, (x_bits & 0xFFFF).astype(jnp.uint16)


def join_float32(high: Any, low: Any) -> jax.Array:
    """The inverse of `split_float32`: the float32 of bfloat16 ``high`` and uint16 ``low``."""
    x_bits = (bits_of(high).astype(jnp.uint32) << 16) | jnp.asarray(low).astype(jnp.uint32)
    return lax.bitcast_convert_type(x_bits, _F32)


# --- Rounding to nearest ---------------------------------------------------------------------

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
    sign, magnitude = split_sign(x)
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


def _nearest_normal(magnitude: jax.Array, fmt: Format) -> jax.Array:
    """The pattern of ``magnitude`` (a pattern, at least `Format.tiny`'s unless ``fmt``'s
    subnormals are float32's) rounded to nearest even on ``fmt``'s grid: unbounded above
    except in an IEEE format (`Format.overflow` ``"inf"``), whose own exponent range
    rounds to inf. NaN stays NaN."""
    ieee = fmt.overflow == "inf"
    rounded = lax.reduce_precision(lax.bitcast_convert_type(magnitude, _F32),
                                   exponent_bits=fmt.exponent_bits if ieee else 8,
                                   mantissa_bits=fmt.mantissa)
    return lax.bitcast_convert_type(rounded, I32)


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
    tiny = pattern(fmt.tiny)
    k = fmt.mantissa - fmt.min_exponent
    low = lax.bitcast_convert_type(lax.min(magnitude, tiny), _F32)
    sub = lax.mul(lax.round(lax.mul(low, _two_to(k)), lax.RoundingMethod.TO_NEAREST_EVEN),
                  _two_to(-k))
    return lax.add(lax.sub(_nearest_normal(lax.max(magnitude, tiny), fmt), tiny),
                   lax.bitcast_convert_type(sub, I32))


def _overflowed(rounded: jax.Array, sign: jax.Array, fmt: Format) -> jax.Array:
    """Float32 of ``rounded`` (a magnitude's pattern on ``fmt``'s grid, unbounded above
    unless IEEE) and ``sign``, with what lies beyond ``fmt.max`` made what a conversion to
    ``fmt`` makes of it: inf (already, for IEEE formats), NaN, or the largest value, and
    NaN what the conversion makes of NaN."""
    top = pattern(fmt.max)
    if fmt.overflow == "nan":  # beyond the largest (inf and NaN too): NaN
        beyond = negative_mask(lax.sub(top, rounded))
        rounded = lax.bitwise_or(rounded, lax.bitwise_and(beyond, _QUIET_NAN))
    elif fmt.overflow == "saturate":
        # No NaN either: XLA's conversion makes it -0. No finite value rounds to a NaN
        # pattern, so the rounded pattern tells NaN inputs apart.
        nan = negative_mask(lax.sub(INF_BITS, rounded))
        rounded = lax.bitwise_and(lax.min(rounded, top), lax.bitwise_not(nan))
        sign = lax.bitwise_or(sign, lax.bitwise_and(nan, SIGN_BIT))
    return lax.bitcast_convert_type(lax.bitwise_or(rounded, sign), _F32)



# --- Stochastic rounding ---------------------------------------------------------------------

def _random_fraction_bits(bits: jax.Array, count: Any) -> jax.Array:
    """The top ``count`` (an int, or an int32 array of them, 1 to 31) of 32 random
    ``bits``, as the low bits of an int32."""
    shift = (_U32(32 - count) if isinstance(count, int)
             else lax.convert_element_type(lax.sub(I32(32), count), _U32))
    return lax.convert_element_type(lax.shift_right_logical(bits, shift), I32)


def round_bits_stochastic(magnitude: Any, count: Any, bits: jax.Array) -> jax.Array:
    """The int32 bit pattern of a non-negative float32 (``magnitude``) with its low ``count``
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
    count_mask = (I32(-(1 << count)) if isinstance(count, int)
                  else lax.shift_left(I32(-1), count))
    return lax.bitwise_and(lax.add(magnitude, _random_fraction_bits(bits, count)), count_mask)


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
        return jnp.full(jnp.shape(magnitude), kept, I32)
    field = lax.shift_right_logical(lax.convert_element_type(magnitude, I32), I32(23))
    # The exponent field of tiny, less the field, is how many binades below tiny.
    below = lax.sub(I32(kept + fmt.min_exponent + 127), field)
    return lax.clamp(I32(kept), below, I32(_MANTISSA_BITS))


def round_stochastic(x: Any, dtype: Any, bits: jax.Array) -> jax.Array:
    """Float32 ``x`` rounded to one of its two neighbours in ``dtype``, as float32: the one
    above with probability (distance from the one below) / (their distance), so that
    ``E[round(x)] = x``. ``bits`` are uniform uint32 random bits of ``x``'s shape
    (`random_bits`).

    In the normal range (and bfloat16's subnormals, which are float32's), the bits below
    ``dtype``'s mantissa are dropped after adding as many random bits
    (`round_bits_stochastic`): exact. Below `Format.tiny`, as
    `round_magnitude_stochastic` says. Values beyond the largest finite one, infs and
    NaNs round as `round_nearest` does; a value below the largest never rounds above it.

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
    sign, magnitude = split_sign(x)
    # As in `_nearest_magnitude`, each case sees the magnitude clamped to its side of a
    # boundary that is on the grid, where the other cases give the boundary itself: the
    # largest value (a value below it never rounds above it) and tiny.
    top = pattern(fmt.max)
    rounded = round_magnitude_stochastic(lax.min(magnitude, top), fmt, bits)
    # At least the largest value: to nearest (tiny is below, so no subnormal part).
    beyond = _nearest_normal(lax.max(magnitude, top), fmt)
    return _overflowed(lax.add(lax.sub(beyond, top), rounded), sign, fmt)


def round_magnitude_stochastic(magnitude: Any, dtype: Any, bits: jax.Array, *,
                               raised_below_smallest: bool = False) -> jax.Array:
    """The int32 pattern of a float32 magnitude (``magnitude``: a pattern, int32, at most
    ``dtype``'s largest value, or inf's pattern, which stays inf) rounded stochastically
    to ``dtype``'s grid, as `round_stochastic` rounds it: for callers that keep the sign
    apart and know their values within the format's range (the codes of
    ``quantize_state``).

    From `Format.tiny` up, the bits below the mantissa are rounded away
    (`round_bits_stochastic`): exact. Below it, the value in fixed point, with
    ``31 - mantissa`` bits below the smallest subnormal, gets as many random bits and
    is truncated: unbiased to ``2**-(31 - mantissa)`` of the smallest subnormal.

    With ``raised_below_smallest``, for a caller that raises every nonzero magnitude to
    at least the smallest subnormal (``quantize_state``'s "nonzero stays nonzero"),
    the rounding is a handful of integer operations fewer: the bits below the grid
    (`dropped_bits`, one more per binade below tiny) are rounded away, exact from the
    smallest subnormal up; a magnitude below it rounds to a power of two at most the
    smallest, off the grid, which the caller raises.

    >>> pattern = np.float32([4.5, 0.25]).view(np.int32)     # float4: 4 or 6; 0 or 0.5
    >>> f = lambda u: jax.lax.bitcast_convert_type(round_magnitude_stochastic(
    ...     pattern, jnp.float4_e2m1fn, jnp.full(2, u * 2**32, jnp.uint32)), jnp.float32)
    >>> f(0.25).tolist(), f(0.75).tolist()   # up where the random fraction is at least 1 - p
    ([4.0, 0.0], [6.0, 0.5])
    """
    fmt = format_of(dtype)
    dropped = _MANTISSA_BITS - fmt.mantissa
    if fmt.f32_range:  # float32's subnormals have float32's spacing too
        return round_bits_stochastic(magnitude, dropped, bits)
    if raised_below_smallest:
        return round_bits_stochastic(magnitude, dropped_bits(magnitude, fmt), bits)
    # As in `_nearest_magnitude`, each part sees the magnitude clamped to its side of
    # tiny, where the other part gives tiny itself.
    tiny = pattern(fmt.tiny)
    return lax.add(lax.sub(round_bits_stochastic(lax.max(magnitude, tiny), dropped, bits), tiny),
                   _subnormal_stochastic(lax.min(magnitude, tiny), fmt, bits))


def _subnormal_stochastic(low: jax.Array, fmt: Format, bits: jax.Array) -> jax.Array:
    """The pattern of magnitude ``low`` (a pattern, at most `Format.tiny`'s) rounded
    stochastically to a multiple of `Format.smallest`: in fixed point with ``31 - mantissa``
    bits below the smallest (tiny is ``2**31``; the conversion truncates), as many random
    bits added and dropped, and the count of smallest subnormals back in float32 (exact:
    at most ``2**mantissa``)."""
    fraction = 31 - fmt.mantissa
    fixed = lax.convert_element_type(lax.mul(as_float(low), _two_to(31 - fmt.min_exponent)),
                                     _U32)
    count = lax.shift_right_logical(
        lax.add(fixed, lax.shift_right_logical(bits, _U32(32 - fraction))), _U32(fraction))
    value = lax.mul(lax.convert_element_type(count, _F32), np.float32(fmt.smallest))
    return lax.bitcast_convert_type(value, I32)


def _stochastic_in_f32_range(x: jax.Array, fmt: Format, bits: jax.Array) -> jax.Array:
    """`round_stochastic` to an IEEE format of float32's exponent range (bfloat16), whose
    subnormals are float32's: random bits added below the kept mantissa and dropped, on
    the signed pattern (no carry reaches the sign bit below the largest value); beyond the
    largest value (infs and NaNs too), no random bits and nothing dropped, so that the
    final ``reduce_precision``, the identity on the grid, rounds those to nearest."""
    x_bits = lax.bitcast_convert_type(x, I32)
    magnitude = lax.bitwise_and(x_bits, I32(0x7FFFFFFF))
    beyond = negative_mask(lax.sub(pattern(fmt.max), magnitude))  # -1 beyond the largest
    dropped = _MANTISSA_BITS - fmt.mantissa
    random = lax.bitwise_and(_random_fraction_bits(bits, dropped), lax.bitwise_not(beyond))
    truncated = lax.bitwise_and(lax.add(x_bits, random),
                                lax.bitwise_or(I32(-(1 << dropped)), beyond))
    return lax.reduce_precision(lax.bitcast_convert_type(truncated, _F32),
                                exponent_bits=fmt.exponent_bits, mantissa_bits=fmt.mantissa)



# --- Reading and writing formats -------------------------------------------------------------

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
    if facts_of(dtype).mantissa == 0:
        # A scale format (float8_e8m0fnu): the library only converts powers of two to it,
        # which float32 holds exactly; nothing was rounded.
        return lax.convert_element_type(q, _F32)
    return round_nearest(lax.convert_element_type(q, _F32), dtype)


def encode(x: Any, dtype: Any, seed: Optional[jax.Array] = None) -> jax.Array:
    """Float32 ``x`` in ``dtype``: rounded to nearest, or, with a ``seed`` (two uint32
    words, or their `stream_key`), stochastically (`round_stochastic`) with random bits
    salted with ``x``'s own (`salted_bits`). Read it back with `widen`.

    The rounding is made here, so the conversion that follows is exact: the values
    are the format's on every backend, whatever its conversion does (XLA:CPU's older
    emitters round to float4_e2m1fn twice: 0.7499 becomes 1).

    >>> seed = jnp.array([1, 2], jnp.uint32)
    >>> x = jnp.full(4000, 4.5)
    >>> draws = encode(x, jnp.float4_e2m1fn, seed).astype(jnp.float32)
    >>> sorted(set(draws.tolist())), encode(x[:2], jnp.float4_e2m1fn).tolist()  # 4 or 6; even
    ([4.0, 6.0], [4.0, 4.0])
    """
    x = lax.convert_element_type(x, _F32)
    x = round_nearest(x, dtype) if seed is None else round_stochastic(
        x, dtype, salted_bits(seed, x))
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
    sign, magnitude = split_sign(lax.convert_element_type(x, _F32))
    # -1 where the magnitude is inf or NaN (its pattern at least inf's), else 0.
    special = lax.bitwise_not(negative_mask(lax.sub(magnitude, INF_BITS)))
    clamped = lax.min(magnitude, pattern(bound))
    magnitude = lax.bitwise_or(lax.bitwise_and(magnitude, special),
                               lax.bitwise_and(clamped, lax.bitwise_not(special)))
    return lax.bitcast_convert_type(lax.bitwise_or(magnitude, sign), _F32)



# --- Block scales ----------------------------------------------------------------------------

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


def block_exponent(amax: Any, bound: float, *, strict: bool = False) -> jax.Array:
    """`scale_exponent`, clipped to the exponents of normal float32 scales and their
    inverses ([1, 254], int32): the stored exponent of a power-of-two block scale. A
    block of zeros gets the smallest scale; an inf or NaN ``amax`` the largest (callers
    that must see it make it NaN, as `e8m0_scale` does).

    >>> block_exponent(jnp.array([0.0, 1.0, jnp.inf]), 448.0).tolist()
    [1, 119, 254]
    """
    return lax.clamp(I32(1), scale_exponent(amax, bound, strict=strict), I32(254))


def e8m0_scale(amax: Any, largest: float) -> jax.Array:
    """MXFP8's block scale (``float8_e8m0fnu``) for blocks whose absolute maxima are
    ``amax``, holding values up to ``largest``: ``amax / largest`` rounded up to a power of
    two (so nothing saturates), as float32.

    As ``jax.nn.scaled_dot_general``'s rounding to ``float8_e8m0fnu``, except
    that scales below ``2**-126`` become ``2**-126`` (e8m0's ``2**-127`` is a
    float32 subnormal, which some backends flush to zero); an inf or NaN
    maximum gives a NaN scale.

    >>> e8m0_scale(jnp.array([448.0, 449.0, 1.0, 0.0]), 448.0).tolist()
    [1.0, 2.0, 0.00390625, 1.1754943508222875e-38]
    """
    amax = lax.convert_element_type(amax, _F32)
    # A finite maximum over ``largest`` stays below e8m0's largest scale, so only the
    # smallest ones are clipped.
    scale = power_of_two(block_exponent(amax, largest))
    return jnp.where(jnp.isfinite(amax), scale, np.float32(np.nan))


def e4m3_scale(amax: Any, largest: float) -> jax.Array:
    """NVFP4's block scale for blocks whose absolute maxima are ``amax``, holding values up
    to ``largest`` (6, float4_e2m1fn's): ``amax / largest`` rounded to the nearest
    ``float8_e4m3fn`` (at most its largest), as float32.

    Not the power-of-two rule of `e8m0_scale` and ``quantize_state``: the scale has
    e4m3's 3 mantissa bits, so a block's largest value lands within a sixteenth of
    ``largest`` rather than anywhere in its top binade, which the 8 values of e2m1 need;
    the value that rounds up (by at most ``2**-4``) saturates in e2m1's rounding.

    >>> e4m3_scale(jnp.array([6.0, 112.0, 1e4]), 6.0).tolist()   # 112 / 6 = 18.7 -> 18
    [1.0, 18.0, 448.0]
    """
    e4m3 = np.dtype(jnp.float8_e4m3fn)
    quotient = lax.div(lax.convert_element_type(amax, _F32), np.float32(largest))
    # Converted, not only rounded: the scale is an e4m3 value in the program, which the
    # numerics inspector and the native product see as such.
    clipped = jnp.clip(quotient, 0, np.float32(format_of(e4m3).max))
    return widen(lax.convert_element_type(clipped, e4m3))



# --- Random bits -----------------------------------------------------------------------------

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


class SeedStreams(NamedTuple):
    """The seed streams of the library's stochastic roundings, one per user, so that no
    two round with the same random bits from the same seed.

    The optimizer transformations fold their stream into the PRNG key they are given
    (``jax.random.fold_in``), so one key may seed all three; the float8 products are
    stateless and round with `fixed_seed` of theirs.

    Attributes:
      low_precision_params: the weights of ``low_precision_params(..., "stochastic")``.
      cast_state: the optimizer state that ``cast_state`` stores narrowly.
      quantize_state: the codes of ``quantize_state``.
      lhs_gradient: a quantized product's incoming gradient, rounded for the
        contraction that gives its left operand's gradient.
      rhs_gradient: the same, for its right operand's gradient.
      hadamard_signs: the random signs of NVFP4's Hadamard transform (drawn once, a
        constant of every program; not a rounding, but a draw all the same).
    """

    low_precision_params: int
    cast_state: int
    quantize_state: int
    lhs_gradient: int
    rhs_gradient: int
    hadamard_signs: int


SEED_STREAMS = SeedStreams(low_precision_params=1, cast_state=2, quantize_state=3,
                           lhs_gradient=4, rhs_gradient=5, hadamard_signs=6)
"""The stream of each of the library's stochastic roundings."""

_FIXED_WORD = 0x5EED5A17


def fixed_seed(stream: int) -> jax.Array:
    """The seed (two uint32 words) of a stateless rounding of ``stream`` (`SEED_STREAMS`):
    the same every call, so what varies the bits from step to step is the values' salt.

    >>> fixed_seed(SEED_STREAMS.lhs_gradient).dtype
    dtype('uint32')
    """
    return jnp.asarray(np.array([stream, _FIXED_WORD], np.uint32))



# --- Reductions that XLA does not fold ---------------------------------------------------------

def unfoldable(x: Any) -> jax.Array:
    """Floating ``x`` as a value that XLA cannot see when it compiles: a reduction of it is
    never evaluated at compile time. (Exact: ``x`` times a one behind an optimization
    barrier, infs and NaNs included; on XLA:CPU, ``x`` itself behind the barrier.)

    A constant ``x`` (the cotangent of a loss linear in a product, a mask) would
    otherwise be reduced by XLA's constant folding, element by element: minutes for a
    large one, in every backend's compile. Fused into the reduction, the multiplication
    costs no memory traffic. XLA:CPU removes optimization barriers after it folds
    constants and before it fuses: the hidden one would be a constant there, whose
    broadcast it writes whole and shares between the products of one shape, alive from
    the forward pass to the backward; nothing of a barrier on ``x`` is left.
    """
    def times_one(x: Any) -> jax.Array:
        one = lax.optimization_barrier(  # type: ignore[no-untyped-call]
            jnp.ones((), jnp.result_type(x)))
        return lax.mul(x, one)

    def hidden(x: Any) -> jax.Array:
        barred: jax.Array = lax.optimization_barrier(x)  # type: ignore[no-untyped-call]
        return barred

    out: jax.Array = lax.platform_dependent(x, cpu=hidden, default=times_one)
    return out

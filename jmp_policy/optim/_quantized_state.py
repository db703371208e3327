"""Optimizer states in 8 or 4 bits: block-scaled codes with stochastic rounding.

`quantize_state` stores the large floating arrays of any optax optimizer's
state (Adam's moments, momentum, Lion's ``mu``...) in 8 bits (float8_e4m3fn
values) or 4 bits (int4 codes, which XLA stores two per byte), with one
power-of-two scale per block of consecutive values along the last axis,
stored as its 8-bit exponent.
Each ``update`` rebuilds the float32 state, runs the inner optimizer in float32
and quantizes the new state again.

* **Scales per block.** A block's scale is the power of two just above its
  largest magnitude (divided by 256 for float8 and the non-negative 4-bit
  codes, whose values then stay below their largest), so the values of one
  block share their range and an outlier costs only its block's precision.
  Power-of-two scales cost one byte and are exact: scaling changes no
  mantissa bit. Blocks run along the last axis, so a state sharded like its
  parameter keeps its sharding (a block never straddles a shard when the
  shard's last dimension is a multiple of the block).
* **Shards that split blocks.** Where a parameter's last axis is sharded into
  pieces smaller than a block (or not a whole number of blocks), the blocks
  stay what they are on one device, so the state holds the same numbers on
  every mesh and a checkpoint restores onto any other. The codes are still
  sharded like the parameter; the exponents of such an array are replicated
  along its last axis, and each step combines each block's maximum from its
  shards (a byte per block and shard moves between devices).
* **Codes suited to each moment.** 8 bits: float8_e4m3fn, signed, about 17
  binades of range. 4 bits: signed powers of two (0, ±2**-6 ... ±1 of the
  block's scale) for signed states such as momentum; for states that are
  never negative (``nonnegative`` paths: Adam's second moment ``nu``...),
  the float8 values 2**m and 1.5 * 2**m from 1.5 to 256 (about half a binade
  apart, below a scale that puts the state below 2**8 as for float8), without
  zero. Every code decodes through a float8 conversion.
* **Stochastic rounding.** Each value rounds to one of its two neighbouring
  codes with probabilities that make the stored mean the float32 value: a
  slowly moving average (Adam's second moment) still moves.
* **Nonzero stays nonzero.** A nonzero value below the smallest code of its
  block is stored as that smallest code (8 bits: with its sign; non-negative
  4-bit codes have no zero) rather than as zero: a second moment flushed to
  zero turns Adam's step ``mu / (sqrt(nu) + eps)`` into a huge one (the
  "zero-point problem" of low-bit second moments).

A block is ``block_size`` values (256 for 8 bits, 32 for 4), or, where the
last dimension is not a multiple of it, their greatest common divisor if that
is at least 32. Small arrays (fewer than ``min_size`` values), arrays without
such a block, scalars (step counts, injected hyperparameters) and leaves whose
path matches a ``keep`` rule stay in float32.

>>> import jax.numpy as jnp, optax
>>> import jmp_policy
>>> tx = jmp_policy.quantize_state(optax.adam(1e-3), min_size=0)
>>> state = tx.init({"w": jnp.zeros((4, 256))})
>>> updates, state = tx.update({"w": jnp.ones((4, 256))}, state)
>>> mu = state.inner_state[0].mu["w"]
>>> mu.values.dtype, mu.values.shape, mu.exponents.shape
(dtype(float8_e4m3fn), (4, 256), (4, 1))
>>> # (1 - 0.9) * 1, as in float32 Adam, to float8's precision (3 mantissa bits)
>>> bool(jnp.allclose(jmp_policy.dequantize(mu), 0.1, rtol=2.0 ** -3))
True
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jmp_policy import formats
from jmp_policy import sharding as _sharding
from jmp_policy.optim._low_precision import (
    ROUNDINGS, Seed, _check_choice, _key_data, _refuse_inner_loss_scaling, _step_seed)

BITS = (8, 4)
DEFAULT_BLOCK_SIZE = {8: 256, 4: 32}
# The state arrays quantize_state quantizes by default: the moments of optax's
# optimizers (first and second moments, momentum traces, EMAs, sums of squares,
# adafactor's factors, adadelta's and adan's accumulators). Not parameter copies
# (schedule-free's z, L-BFGS's memory, lookahead's slow weights) nor accumulated or
# previous gradients (MultiSteps' acc_grads, adan's g), which need float32's precision.
MOMENTS = (r"\.mu\b", r"\.nu\b", r"\.nu_max\b", r"\.trace\b", r"\.ema\b",
           r"\.sum_of_squares\b", r"\.v_row\b", r"\.v_col\b", r"\.v\b", r"\.m\b",
           r"\.n\b", r"\.e_g\b", r"\.e_x\b")
# optax's states that are never negative: second moments (adam, adamw, lamb,
# rmsprop, adabelief, amsgrad's running maximum), adagrad's sums of squares,
# adafactor's factored moments.
NONNEGATIVE = (r"\.nu\b", r"\.nu_max\b", r"\.sum_of_squares\b", r"\.v_row\b",
               r"\.v_col\b", r"\.v\b")

# The codes, by name: "float8" (8 bits), "signed4" and "nonnegative4" (4 bits).
FLOAT8, SIGNED4, NONNEGATIVE4 = "float8", "signed4", "nonnegative4"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """A float32 array stored as 8- or 4-bit codes and one power-of-two scale per block.

    Attributes:
      values: the codes, in the array's shape. ``"float8"``: float8_e4m3fn;
        ``"signed4"`` and ``"nonnegative4"``: int4 holding the code's bits.
      exponents: uint8, the array's shape with the last dimension divided by
        the block size: block ``i``'s scale is ``2.0 ** (exponents[i] - 127)``.
      code: how the codes read (static: not a leaf): ``"float8"``, ``"signed4"``
        or ``"nonnegative4"``.
    """

    values: jax.Array
    exponents: jax.Array
    code: str = dataclasses.field(default=FLOAT8, metadata=dict(static=True))


class QuantizedState(NamedTuple):
    """State of `quantize_state`.

    Attributes:
      inner_state: the wrapped optimizer's state, its large floating arrays as
        `QuantizedArray`.
      key: the raw data of the PRNG key of the next stochastic rounding
        (``None`` when rounding to nearest).
    """

    inner_state: optax.OptState
    key: Optional[jax.Array]


def quantize_state(
    inner: optax.GradientTransformation, *, bits: int = 8, block_size: Optional[int] = None,
    min_size: int = 4096, keep: Union[str, Sequence[str]] = (),
    moments: Union[str, Sequence[str]] = MOMENTS,
    nonnegative: Optional[Union[str, Sequence[str]]] = None, rounding: str = "stochastic",
    seed: Seed = 0,
) -> optax.GradientTransformationExtraArgs:
    """Stores ``inner``'s large state arrays in 8 or 4 bits; ``inner`` still computes in float32.

    Args:
      inner: the optimizer whose state to quantize (any optax transformation).
      bits: 8 (float8 values: about 1.004 bytes per value) or 4 (about 0.53).
      block_size: values per scale, along each array's last axis (at most: see
        above for last dimensions that are not multiples of it); default 256
        for 8 bits, 32 for 4 (whose coarser codes need the block's values
        closer in range).
      min_size: arrays with fewer values stay in float32 (their scales would
        cost more than they save).
      keep: regular expressions; a state array whose key path
        (``jax.tree_util.keystr``, e.g. ``"[0].nu['embed']['embedding']"``)
        matches one stays in float32 (embeddings, as bitsandbytes advises).
      moments: regular expressions naming (by key path) the state arrays that
        may be quantized; default `MOMENTS`, the moments of optax's optimizers.
        Other state (a schedule-free optimizer's parameter iterate, MultiSteps'
        accumulated gradients) stays in float32, unless named here.
      nonnegative: 4 bits only: regular expressions naming (by key path) the
        state arrays that are never negative, stored with non-negative codes;
        default `NONNEGATIVE`, optax's second moments.
      rounding: ``"stochastic"`` (default) or ``"nearest"``.
      seed: an int or a PRNG key for stochastic rounding.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      `QuantizedState`. Put `loss_scaling` outside it: a skipped step then
      leaves the quantized state unchanged, bit for bit.
    """
    plan = _plan(bits, block_size, min_size, keep, moments, nonnegative)
    rounding = _check_choice("quantize_state", "rounding", rounding, ROUNDINGS)
    data, impl = _key_data(seed, formats.SEED_STREAMS.quantize_state, "quantize_state")
    key = data if rounding == "stochastic" else None
    inner = optax.with_extra_args_support(inner)
    # One program: called eagerly, as optax's init usually is, each of the
    # quantization's operations would compile apart (a program per leaf shape).
    initially_quantized = jax.jit(plan.initially_quantized)

    def init_fn(params: optax.Params) -> QuantizedState:
        inner_state = inner.init(params)
        _refuse_inner_loss_scaling("quantize_state", inner_state)
        plan.check(inner_state)
        return QuantizedState(initially_quantized(inner_state), key)

    def update_fn(grads: optax.Updates, state: QuantizedState,
                  params: Optional[optax.Params] = None,
                  **extra_args: Any) -> Tuple[optax.Updates, QuantizedState]:
        if not isinstance(state, QuantizedState):
            raise TypeError("quantize_state.update expected the QuantizedState made by this "
                            f"transformation's init, got {type(state).__name__}.")
        widened = jax.tree_util.tree_map(dequantize, state.inner_state, is_leaf=_is_quantized)
        updates, inner_state = inner.update(grads, widened, params, **extra_args)
        next_key, seed = (None, None) if state.key is None else _step_seed(state.key, impl)
        return updates, QuantizedState(plan.quantized(inner_state, seed), next_key)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Which state arrays `quantize_state` quantizes, and with which code."""

    bits: int
    block_size: int
    min_size: int
    keep: list[re.Pattern[str]]
    moments: list[re.Pattern[str]]
    nonnegative: list[re.Pattern[str]]
    user_moments: bool  # rules the user gave are checked for matching something
    user_nonnegative: bool

    def code(self, path: Any, unit: Any) -> Optional[str]:
        """The code of one state array (or of the node standing for it), or ``None``
        for an array kept as it is."""
        if not _quantized_leaf(path, _array(unit), self.block_size, self.min_size,
                               self.moments, self.keep):
            return None
        if self.bits == 8:
            return FLOAT8
        name = jax.tree_util.keystr(path)
        return NONNEGATIVE4 if any(r.search(name) for r in self.nonnegative) else SIGNED4

    def initially_quantized(self, inner_state: Any) -> Any:
        # The initial state is usually constant (zeros): behind the barrier, XLA does
        # not fold its quantization at compile time, element by element.
        inner_state = jax.lax.optimization_barrier(inner_state)  # type: ignore[no-untyped-call]
        return self.quantized(inner_state, None)

    def quantized(self, state: Any, seed: Optional[jax.Array]) -> Any:
        units, treedef = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_array_node)
        return jax.tree_util.tree_unflatten(treedef, [
            _quantized_unit(unit, self.code(path, unit), self.block_size, seed)
            for path, unit in units])

    def check(self, inner_state: Any) -> None:
        """Warns of rules that match nothing, and of a state with nothing to quantize."""
        sizes = (self.block_size, self.min_size)
        _check_rules(inner_state, self.keep, *sizes, "keep")
        if self.user_moments:
            _check_rules(inner_state, self.moments, *sizes, "moments")
        _check_some_quantized(inner_state, self.moments, *sizes)
        if self.user_nonnegative:
            _check_rules(inner_state, self.nonnegative, *sizes, "nonnegative")


def _plan(bits: int, block_size: Optional[int], min_size: int,
          keep: Union[str, Sequence[str]], moments: Union[str, Sequence[str]],
          nonnegative: Optional[Union[str, Sequence[str]]]) -> _Plan:
    """`quantize_state`'s arguments checked and compiled."""
    if bits not in BITS:
        raise ValueError(f"quantize_state: bits must be 8 or 4, got {bits!r}.")
    if bits == 8 and nonnegative is not None:
        raise ValueError("quantize_state: nonnegative applies to 4-bit states (bits=4); "
                         "8-bit states are float8, signed, for every array.")
    block_size = DEFAULT_BLOCK_SIZE[bits] if block_size is None else block_size
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"quantize_state: block_size must be a positive int, got {block_size!r}.")
    return _Plan(bits, block_size, min_size, _compiled(keep), _compiled(moments),
                 _compiled(NONNEGATIVE if nonnegative is None else nonnegative),
                 moments is not MOMENTS, nonnegative is not None)


# --------------------------------------------------------------------------- #
# Block scales: powers of two, stored as their float32 exponents (uint8, biased
# by 127).
# --------------------------------------------------------------------------- #

# Each code's scaled values stay below this power of two: float8_e4m3fn's
# largest is 448, so 256 (also for the non-negative 4-bit codes, float8 values
# up to 256); the signed 4-bit codes span [-1, 1].
_LOG2_RANGE = {FLOAT8: 8, SIGNED4: 0, NONNEGATIVE4: 8}


def _exponents(x: Any, block_size: int, code: str) -> jax.Array:
    """The uint8 exponent of each block's scale: the smallest power of two that puts
    every scaled value below ``2 ** _LOG2_RANGE[code]`` (``formats.block_exponent``).

    MXFP8's rule (``formats.e8m0_scale``) with two differences: the bound is a power of
    two at most the code's largest value, and strict, so that a block's largest value
    lands in the binade just below it, whatever the code, and a value stochastically
    rounded up stays a code; and only the largest magnitude's binade is read (an exponent field, a byte),
    which gives the same power of two for a power-of-two bound."""
    x = jnp.asarray(x, jnp.float32)
    magnitude = jnp.abs(x).reshape(*x.shape[:-1], -1, block_size)
    # XLA:GPU reduces in the kernel that computes the magnitudes and stores nothing:
    # there the halving below would only add operations to every quantizing kernel.
    largest = jax.lax.platform_dependent(magnitude, cpu=_halved_largest_field,
                                         default=_largest_field)
    # 0 for a block of zeros and subnormals, inf for inf/NaN.
    binade = formats.power_of_two(largest)
    exponent = formats.block_exponent(binade, 2.0 ** _LOG2_RANGE[code], strict=True)
    return exponent.astype(jnp.uint8)


def _largest_field(magnitude: jax.Array) -> jax.Array:
    """The largest float32 exponent field along the last axis (a block): the rule needs
    no more of the largest magnitude than its binade."""
    return jnp.max(formats.exponent_field(magnitude).astype(jnp.uint8), axis=-1)


def _halved_largest_field(magnitude: jax.Array) -> jax.Array:
    """`_largest_field` for XLA:CPU, the block halved by elementwise maxima first: they
    fuse with the computation of the magnitudes, while a reduction's input may be
    stored (XLA:CPU stores it), so it is an eighth of theirs, in bytes. Maxima of
    neighbours, not of a block's two halves: where XLA partitions a block between
    devices (a last axis sharded into pieces smaller than a block), neighbours lie on
    one device and halves do not (XLA would move them between devices)."""
    span = magnitude.shape[-1]
    while magnitude.shape[-1] % 2 == 0 and magnitude.shape[-1] > span // 8:
        pairs = magnitude.reshape(*magnitude.shape[:-1], -1, 2)
        magnitude = jnp.maximum(pairs[..., 0], pairs[..., 1])
    return _largest_field(magnitude)


def _split_blocks(x: Any, block_size: int) -> Optional[NamedSharding]:
    """Where an explicit sharding of ``x``'s last axis puts the values of a block on
    several devices, the sharding of its block exponents: ``x``'s, with the last axis
    replicated; else ``None`` (also under automatic axes, where no type says it)."""
    sharding = _sharding.explicit(x)
    parts = _sharding.shards(x, -1)
    if sharding is None or parts == 1 or (np.shape(x)[-1] // block_size) % parts == 0:
        return None
    spec = list(sharding.spec) + [None] * (np.ndim(x) - len(sharding.spec))
    return sharding.update(spec=PartitionSpec(*spec[:-1], None))  # type: ignore[no-untyped-call]


def _partitioned(fun: Callable[..., Any], x: jax.Array, block_size: int,
                 out: Callable[[NamedSharding], Any], *args: Any) -> Any:
    """``fun(x, *args)``, in XLA's hands where an explicit sharding splits blocks.

    Explicit types cannot cut such an axis into blocks (a reshape across shards);
    XLA's partitioner can, as under automatic axes: each device keeps its values, and
    each block's maximum is combined from its shards (a byte per block and shard).
    ``out(exponent_sharding)``: the shardings of ``fun``'s results."""
    split = _split_blocks(x, block_size)
    if split is None:
        return fun(x, *args)
    return jax.sharding.auto_axes(fun, out_sharding=out(split))(x, *args)


def quantize(x: Any, block_size: int, code: str = FLOAT8,
             seed: Optional[jax.Array] = None) -> QuantizedArray:
    """``x`` as a `QuantizedArray` with blocks of ``block_size`` along its last axis,
    rounded stochastically with the seed ``seed`` (two uint32 words or their stream key,
    see ``formats.random_bits``), or to nearest if ``None``."""
    x = jnp.asarray(x, jnp.float32)

    def quantized(x: jax.Array, *seed: jax.Array) -> Tuple[jax.Array, jax.Array]:
        exponents = _exponents(x, block_size, code)
        blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
        y = blocks * formats.power_of_two(254 - exponents.astype(jnp.int32))[..., None]
        # Salted with the values' bits: one seed serves every array of a step.
        bits = formats.salted_bits(seed[0], y) if seed else None
        if code == FLOAT8:
            values = _float8(y, bits)
        else:
            values = _nonnegative4(y, bits) if code == NONNEGATIVE4 else _signed4(y, bits)
        return values.reshape(x.shape), exponents

    # Codes sharded as ``x``; exponents too, but where blocks are split (see below).
    values, exponents = _partitioned(quantized, x, block_size,
                                     lambda split: (_sharding.explicit(x), split),
                                     *(() if seed is None else (seed,)))
    return QuantizedArray(values, exponents, code)


def dequantize(x: Any) -> Any:
    """The float32 array a `QuantizedArray` stores; anything else as it is."""
    if not _is_quantized(x):
        return x
    codes, exponents = _array(x.values), _array(x.exponents)
    want = jnp.float8_e4m3fn if x.code == FLOAT8 else jnp.int4
    if codes.dtype != want:
        raise ValueError(
            f"dequantize: {x.code!r} codes are {jnp.dtype(want).name} in the state's shape, "
            f"got {codes.dtype}{list(codes.shape)} (a state saved before 4-bit codes "
            "became int4?): initialise the optimizer state again.")
    if x.code == FLOAT8:
        values = codes.astype(jnp.float32)
    else:
        values = (_nonnegative4_values(codes) if x.code == NONNEGATIVE4
                  else _signed4_values(codes))
    return _partitioned(_times_scales, values, values.shape[-1] // exponents.shape[-1],
                        lambda split: _sharding.explicit(values), exponents)


def _times_scales(values: jax.Array, exponents: jax.Array) -> jax.Array:
    """``values`` times the power-of-two scale of each one's block."""
    blocks = values.reshape(*exponents.shape, -1)
    return (blocks * formats.power_of_two(exponents)[..., None]).reshape(values.shape)


# --------------------------------------------------------------------------- #
# The codes. Each rounds scaled values ``y`` to its grid, the grid of a float format
# (``formats``): stochastically with random ``bits`` (uint32, see
# ``formats.random_bits``), else to nearest (ties to even). The scale puts every finite
# value within the code's range, so the codes round the magnitude's bit pattern
# (int32), the sign kept apart, with none of ``formats.round_stochastic``'s handling of
# values beyond the largest: a few integer operations per value, which keeps the
# kernels that quantize each array small (their size is the step's compile time).
# --------------------------------------------------------------------------- #

def _rounded(magnitude: jax.Array, grid: Any, bits: Optional[jax.Array],
             raised_below_smallest: bool = False) -> jax.Array:
    """``magnitude`` (a pattern, within ``grid``'s range) rounded to ``grid`` (a dtype or a
    ``formats.Format``), as a pattern (see ``formats.round_magnitude_stochastic`` for
    ``raised_below_smallest``)."""
    if bits is None:
        return jax.lax.bitcast_convert_type(
            formats.round_nearest(formats.as_float(magnitude), grid), jnp.int32)
    return formats.round_magnitude_stochastic(magnitude, grid, bits,
                                              raised_below_smallest=raised_below_smallest)


# float8_e4m3fn's subnormals are 2**-9 apart.
_F8 = jnp.float8_e4m3fn
_F8_SMALLEST = formats.pattern(formats.format_of(_F8).smallest)


def _float8(y: jax.Array, bits: Optional[jax.Array]) -> jax.Array:
    sign, magnitude = formats.split_sign(y)
    # NaN as inf: the conversion makes both NaN (float8_e4m3fn has no inf).
    rounded = _rounded(jnp.minimum(magnitude, formats.INF_BITS), _F8, bits,
                       raised_below_smallest=True)
    # Nonzero stays nonzero: a nonzero magnitude rounded below the smallest float8 one
    # is that one (with the value's sign).
    rounded = jnp.maximum(rounded, _F8_SMALLEST & formats.nonzero_mask(magnitude))
    return formats.as_float(rounded | sign).astype(_F8)


# The 4-bit codes are int4, which XLA stores two per byte in the state's shape,
# so that XLA:GPU writes the new codes in the kernel that writes the new
# weights (a donated state is then updated in place); int4 rather than uint4:
# orbax saves it. Each decodes into the bits of a float8_e4m3fn with two
# integer operations: cheap enough that XLA:GPU recomputes the state in each
# kernel that reads it rather than store it.

# signed4: bit 3 the sign, bits 0-2 ``k``: 0 for zero, else the magnitude
# 2**(k - 7), which is the float8_e4m3fn of exponent field k and no mantissa: the grid
# of no mantissa bits, the powers of two from 2**-6 to 1, and below them 0.
_S4_GRID = formats.grid(0, -6, 1.0)


def _signed4(y: jax.Array, bits: Optional[jax.Array]) -> jax.Array:
    sign, magnitude = formats.split_sign(y)
    # Below 1, or inf or NaN: 1, the largest code.
    rounded = _rounded(jnp.minimum(magnitude, formats.pattern(1.0)), _S4_GRID, bits)
    # k from the exponent field: 2**-6 (field 121) is 1 ... 1 (field 127) is 7; zero's is 0.
    k = jnp.maximum(formats.exponent_field(rounded) - 120, 0)
    # The int4 of bits (sign, k): k, or k - 8 with the sign bit (the arithmetic shift
    # spreads it).
    return (k | ((sign >> 31) & -8)).astype(jnp.int4)


def _signed4_values(codes: jax.Array) -> jax.Array:
    # Shifted by 3, the sign-extended int8 puts the sign at float8's bit 7 and k at
    # its exponent field; the mask clears bit 6 (set with the sign).
    bits = (codes.astype(jnp.int8) << 3) & np.int8(-72)   # 0b10111000
    return jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(jnp.float32)


# nonnegative4: the float8_e4m3fn values 2**m and 1.5 * 2**m (m = 0 ... 8) from 1.5
# to 256 (the scale puts the state below 2**8, as for float8): 16 values, about
# half a binade apart, 7.4 binades; no zero. About half a binade, because Adam
# divides by the square root of the second moment: stochastic rounding keeps the
# moment unbiased, but not its inverse square root, which is larger on average
# the coarser the grid. In increasing order their float8 bits are consecutive
# multiples of 4, (c + 23) * 4 for the int4 c = -8 ... 7.
_N4_SMALLEST, _N4_LARGEST = 1.5, 256.0
_N4_GRID = formats.grid(1, 0, _N4_LARGEST)  # in [b, 2b): b and 1.5b


def _nonnegative4(y: jax.Array, bits: Optional[jax.Array]) -> jax.Array:
    # Clamped on the bit pattern, which orders as the values do from -0 up (a negative
    # value's is a negative int32): below the smallest (0 too) rounds up to it; inf and
    # NaN to the largest.
    magnitude = jnp.clip(jax.lax.bitcast_convert_type(y, jnp.int32),
                         formats.pattern(_N4_SMALLEST), formats.pattern(_N4_LARGEST))
    if bits is None:
        rounded = _rounded(magnitude, _N4_GRID, None)
    else:  # from 1.5 up, the grid's normal range: its one mantissa bit kept
        rounded = formats.round_bits_stochastic(magnitude, 23 - _N4_GRID.mantissa, bits)
    # float32 bits 30-22 (the exponent and the top mantissa bit) count the same
    # steps: 2**0 is 254 there, 1.5 (c = -8) 255.
    return ((rounded >> 22) - 263).astype(jnp.int4)


def _nonnegative4_values(codes: jax.Array) -> jax.Array:
    bits = (codes.astype(jnp.int8) + 23) << 2
    return jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(jnp.float32)


def _block(last: int, block_size: int) -> int:
    """The block of an array whose last dimension is ``last``: 0 for none."""
    block = math.gcd(last, block_size)
    return block if block >= min(block_size, _MIN_BLOCK) else 0


_MIN_BLOCK = 32


def _is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedArray)


def _is_array_node(x: Any) -> bool:
    """A pytree node that stands for one array, its only leaf: it defines
    ``__jax_array__``, as Flax NNX's ``Variable`` does."""
    return (hasattr(x, "__jax_array__") and not isinstance(x, jax.Array)
            and len(jax.tree_util.tree_leaves(x)) == 1)


def _array(unit: Any) -> Any:
    """The array of a state leaf, or of a node standing for one."""
    return jax.tree_util.tree_leaves(unit)[0] if _is_array_node(unit) else unit


def _quantized_unit(unit: Any, code: Optional[str], block_size: int,
                    seed: Optional[jax.Array]) -> Any:
    """``unit`` quantized with ``code`` (as it is for ``None``). A node standing for
    an array (an NNX ``Variable``) wraps each field of the `QuantizedArray`, so
    that what holds one array still does (``nnx.Optimizer`` keeps one per array)."""
    if code is None:
        return unit
    x = _array(unit)
    q = quantize(x, _block(np.shape(x)[-1], block_size), code, seed)
    if x is unit:
        return q
    node = jax.tree_util.tree_structure(unit)
    return QuantizedArray(jax.tree_util.tree_unflatten(node, [q.values]),
                          jax.tree_util.tree_unflatten(node, [q.exponents]), code)


def _large_float(x: Any, min_size: int) -> bool:
    dtype = getattr(x, "dtype", None)
    return (dtype is not None and jnp.issubdtype(dtype, jnp.floating) and jnp.ndim(x) > 0
            and np.size(x) >= min_size)


def _quantized_leaf(path: Any, x: Any, block_size: int, min_size: int,
                    allowed: Sequence[re.Pattern[str]], rules: Sequence[re.Pattern[str]]) -> bool:
    if not _large_float(x, min_size) or not _block(np.shape(x)[-1], block_size):
        return False
    name = jax.tree_util.keystr(path)
    return any(r.search(name) for r in allowed) and not any(r.search(name) for r in rules)


def _check_some_quantized(state: Any, allowed: Sequence[re.Pattern[str]], block_size: int,
                          min_size: int) -> None:
    """Warns if large float arrays exist and ``moments`` names none of them: then every
    step would store the whole state in float32, as if quantize_state were not there."""
    large = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(state)
             if _large_float(x, min_size)]
    if large and not any(r.search(name) for name in large for r in allowed):
        warnings.warn(
            f"quantize_state: no state array is quantized: the moments rules name none of "
            f"the {len(large)} large ones (e.g. {large[0]!r}). Pass moments=[...] with "
            "regular expressions naming the optimizer's moment fields.",
            UserWarning, stacklevel=4)


def _compiled(rules: Union[str, Sequence[str]]) -> list[re.Pattern[str]]:
    return [re.compile(r) for r in ([rules] if isinstance(rules, str) else list(rules))]


def _check_rules(state: Any, rules: Sequence[re.Pattern[str]], block_size: int,
                 min_size: int, argument: str) -> None:
    """Warns of a rule that matches no state array, and (for ``keep``) of large arrays
    left in float32 because of their shape."""
    paths = [(jax.tree_util.keystr(p), x)
             for p, x in jax.tree_util.tree_leaves_with_path(state)]
    for rule in rules:
        if not any(rule.search(name) for name, _ in paths):
            warnings.warn(f"quantize_state: the {argument} rule {rule.pattern!r} matches no "
                          f"array of the optimizer state (its paths look like "
                          f"{paths[0][0]!r}).", UserWarning, stacklevel=4)
    if argument != "keep":
        return
    odd = [name for name, x in paths
           if _large_float(x, min_size) and not _block(np.shape(x)[-1], block_size)]
    if odd:
        warnings.warn(
            f"quantize_state: {len(odd)} state array(s) stay in float32 because their last "
            f"dimension and block_size={block_size} have no common divisor of at least "
            f"{min(block_size, _MIN_BLOCK)} (e.g. {odd[0]}); pass a block_size that divides "
            "it.", UserWarning, stacklevel=4)

"""Optimizer states in 8 bits: block-scaled float8 with stochastic rounding.

`quantize_state` stores the large floating arrays of any optax optimizer's
state (Adam's moments, momentum, Lion's ``mu``...) as float8_e4m3fn values with
one float32 scale per block of ``block_size`` consecutive values along the
last axis: about 1.02 bytes per value instead of 4. Each ``update`` rebuilds
the float32 state, runs the inner optimizer in float32 and quantizes the new
state again.

* **Scales per block.** A block's largest magnitude maps onto float8's largest
  value (448), so the values of one block share their range and an outlier
  costs only its block's precision. Blocks run along the last axis, so a
  state sharded like its parameter keeps its sharding (a block never
  straddles a shard when the shard's last dimension is a multiple of
  ``block_size``).
* **Stochastic rounding.** Each value rounds to one of its two float8
  neighbours with probabilities that make the stored mean the float32 value:
  a slowly moving average (Adam's second moment) still moves.
* **Nonzero stays nonzero.** A nonzero value too small for its block's range
  is stored as the smallest float8 value of its sign rather than zero: a second
  moment flushed to zero would turn Adam's step ``mu / (sqrt(nu) + eps)`` into a
  huge one (the "zero-point problem" of low-bit second moments).

A block is ``block_size`` values, or, where the last dimension is not a
multiple of it, their greatest common divisor (64 for a last dimension of 64 or
192) if that is at least 32. Small arrays (fewer than ``min_size`` values),
arrays without such a block, scalars (step counts, injected hyperparameters)
and leaves whose path matches a ``keep`` rule stay in float32.

>>> import jax.numpy as jnp, optax
>>> import jmp_policy
>>> tx = jmp_policy.quantize_state(optax.adam(1e-3), min_size=0)
>>> state = tx.init({"w": jnp.zeros((4, 256))})
>>> updates, state = tx.update({"w": jnp.ones((4, 256))}, state)
>>> mu = state.inner_state[0].mu["w"]
>>> mu.values.dtype, mu.values.shape, mu.scales.shape
(dtype(float8_e4m3fn), (4, 256), (4, 1))
>>> round(float(jmp_policy.dequantize(mu)[0, 0]), 6)  # (1 - 0.9) * 1, as in float32 Adam
0.1
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Any, NamedTuple, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_policy.low_precision import (
    ROUNDINGS, Seed, _check_choice, _key_data, _leaf_seeds, _noise16,
    _refuse_inner_loss_scaling, _split_key)

VALUES = jnp.float8_e4m3fn
_MAX = 448.0  # float8_e4m3fn's largest value
# The float8 grid: spacing 2**(e - 3) for magnitudes in [2**e, 2**(e + 1)), e >= -6;
# below 2**-6, the subnormals, spacing 2**-9.
_MANTISSA_BITS = 3
_MIN_EXPONENT = -6
_SMALLEST = 2.0 ** (_MIN_EXPONENT - _MANTISSA_BITS)


class QuantizedArray(NamedTuple):
    """A float32 array stored as float8 values and one float32 scale per block.

    Attributes:
      values: float8_e4m3fn, the array's shape; a value times its block's scale
        is the stored number.
      scales: float32, the array's shape with the last dimension divided by the
        block size.
    """

    values: jax.Array
    scales: jax.Array


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
    inner: optax.GradientTransformation,
    *,
    block_size: int = 256,
    min_size: int = 4096,
    keep: Union[str, Sequence[str]] = (),
    rounding: str = "stochastic",
    seed: Seed = 0,
) -> optax.GradientTransformationExtraArgs:
    """Stores ``inner``'s large state arrays in 8 bits; ``inner`` still computes in float32.

    Args:
      inner: the optimizer whose state to quantize (any optax transformation).
      block_size: values per scale, along each array's last axis (at most: see
        above for last dimensions that are not multiples of it).
      min_size: arrays with fewer values stay in float32 (their scales would
        cost more than they save).
      keep: regular expressions; a state array whose key path
        (``jax.tree_util.keystr``, e.g. ``"[0].nu['embed']['embedding']"``)
        matches one stays in float32 (embeddings, as bitsandbytes advises).
      rounding: ``"stochastic"`` (default) or ``"nearest"``.
      seed: an int or a PRNG key for stochastic rounding.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      `QuantizedState`. Put `loss_scaling` outside it: a skipped step then
      leaves the quantized state unchanged, bit for bit.
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"quantize_state: block_size must be a positive int, got {block_size!r}.")
    rounding = _check_choice("quantize_state", "rounding", rounding, ROUNDINGS)
    rules = [re.compile(r) for r in ([keep] if isinstance(keep, str) else list(keep))]
    data, impl = _key_data(seed, 3, "quantize_state")
    key = data if rounding == "stochastic" else None
    inner = optax.with_extra_args_support(inner)

    def quantized(state: Any, step_key: Optional[jax.Array]) -> Any:
        seeds = (_leaf_seeds(step_key, state) if step_key is not None
                 else jax.tree_util.tree_map(lambda x: None, state))

        def one(path: Any, x: Any, leaf_seed: Optional[jax.Array]) -> Any:
            if not _quantized_leaf(path, x, block_size, min_size, rules):
                return x
            return quantize(x, _block(np.shape(x)[-1], block_size), leaf_seed)

        return jax.tree_util.tree_map_with_path(one, state, seeds,
                                                is_leaf=lambda x: x is None)

    def init_fn(params: optax.Params) -> QuantizedState:
        inner_state = inner.init(params)
        _refuse_inner_loss_scaling("quantize_state", inner_state)
        _check_rules(inner_state, rules, block_size, min_size)
        return QuantizedState(quantized(inner_state, None), key)

    def update_fn(grads: optax.Updates, state: QuantizedState,
                  params: Optional[optax.Params] = None,
                  **extra_args: Any) -> Tuple[optax.Updates, QuantizedState]:
        if not isinstance(state, QuantizedState):
            raise TypeError("quantize_state.update expected the QuantizedState made by this "
                            f"transformation's init, got {type(state).__name__}.")
        widened = jax.tree_util.tree_map(dequantize, state.inner_state, is_leaf=_is_quantized)
        updates, inner_state = inner.update(grads, widened, params, **extra_args)
        if state.key is None:
            return updates, QuantizedState(quantized(inner_state, None), None)
        next_key, step_key = _split_key(state.key, impl)
        return updates, QuantizedState(quantized(inner_state, step_key), next_key)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def quantize(x: Any, block_size: int, seed: Optional[jax.Array] = None) -> QuantizedArray:
    """``x`` as a `QuantizedArray` with blocks of ``block_size`` along its last axis,
    rounded stochastically with the uint32 words ``seed`` (to nearest if ``None``)."""
    x = jnp.asarray(x, jnp.float32)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
    absmax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    inv = jnp.where(absmax > 0, _MAX / jnp.where(absmax > 0, absmax, 1), 0.0)
    y = blocks * inv
    if seed is None:
        q = y.astype(VALUES)
    else:  # noise hashed from each value's index, in the kernel that rounds
        u = _noise16(seed, y.shape).astype(jnp.float32) * 2.0 ** -16
        q = _stochastic(y, u).astype(VALUES)
    # Nonzero stays nonzero: the smallest float8 magnitude, with the value's sign.
    q = jnp.where((q == 0) & (y != 0), jnp.sign(y) * _SMALLEST, q.astype(jnp.float32))
    return QuantizedArray(q.astype(VALUES).reshape(x.shape),
                          jnp.where(absmax > 0, absmax / _MAX, 0.0)[..., 0])


def dequantize(x: Any) -> Any:
    """The float32 array a `QuantizedArray` stores; anything else as it is."""
    if not _is_quantized(x):
        return x
    values = x.values.astype(jnp.float32)
    blocks = values.reshape(*x.scales.shape, -1)
    return (blocks * x.scales[..., None]).reshape(values.shape)


def _stochastic(y: jax.Array, u: jax.Array) -> jax.Array:
    """``y`` (within float8's range) rounded to a float8 neighbour: up with probability
    the distance to the lower one over their spacing (all exact in float32)."""
    magnitude = jnp.abs(y)
    exponent = jnp.floor(jnp.log2(jnp.where(magnitude > 0, magnitude, 1.0)))
    spacing = jnp.exp2(jnp.maximum(exponent, _MIN_EXPONENT) - _MANTISSA_BITS)
    low = jnp.floor(magnitude / spacing) * spacing
    up = (u * spacing) < (magnitude - low)
    return jnp.sign(y) * jnp.minimum(low + jnp.where(up, spacing, 0.0), _MAX)


def _block(last: int, block_size: int) -> int:
    """The block of an array whose last dimension is ``last``: 0 for none."""
    block = math.gcd(last, block_size)
    return block if block >= min(block_size, _MIN_BLOCK) else 0


_MIN_BLOCK = 32


def _is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedArray)


def _quantized_leaf(path: Any, x: Any, block_size: int, min_size: int,
                    rules: Sequence[re.Pattern[str]]) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or jnp.ndim(x) == 0:
        return False
    if np.size(x) < min_size or not _block(np.shape(x)[-1], block_size):
        return False
    name = jax.tree_util.keystr(path)
    return not any(r.search(name) for r in rules)


def _check_rules(state: Any, rules: Sequence[re.Pattern[str]], block_size: int,
                 min_size: int) -> None:
    """Warns of a ``keep`` rule that matches no state array, and of large arrays left in
    float32 because of their shape."""
    paths = [(jax.tree_util.keystr(p), x)
             for p, x in jax.tree_util.tree_leaves_with_path(state)]
    for rule in rules:
        if not any(rule.search(name) for name, _ in paths):
            warnings.warn(f"quantize_state: the keep rule {rule.pattern!r} matches no array of "
                          f"the optimizer state (its paths look like {paths[0][0]!r}).",
                          UserWarning, stacklevel=3)
    odd = [name for name, x in paths
           if getattr(x, "dtype", None) is not None and jnp.issubdtype(x.dtype, jnp.floating)
           and np.size(x) >= min_size and jnp.ndim(x) > 0
           and not _block(np.shape(x)[-1], block_size)]
    if odd:
        warnings.warn(
            f"quantize_state: {len(odd)} state array(s) stay in float32 because their last "
            f"dimension and block_size={block_size} have no common divisor of at least "
            f"{min(block_size, _MIN_BLOCK)} (e.g. {odd[0]}); pass a block_size that divides "
            "it.", UserWarning, stacklevel=3)

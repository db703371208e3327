"""Float8 quantization with current or delayed scaling: one scale per tensor, row or group.

`quantize` converts an operand to float8 with current scaling (one scale per
tensor or per row, from its absolute maximum, no state); `quantize_delayed`
takes its scale from an amax history; `quantize_groups` gives one scale per
group of rows and column (the weight gradient of a ragged product); and
`quantization_counts` says how many of its values the conversion loses.

A product ``dot_general(lhs, rhs)`` is computed as
``dot_general(q_lhs, q_rhs, preferred_element_type=float32) * s_lhs * s_rhs``
where ``(q, s) = quantize(operand, ...)`` and ``q * s`` approximates the
operand:

>>> import jax.numpy as jnp
>>> x = jnp.array([[1e-4, -3e-4], [2e4, 5e3]])
>>> q, scale = quantize(x, jnp.float8_e4m3fn, "rowwise", contracting_axes=(1,))
>>> q.dtype, scale.shape        # one scale per row: the contracting axis is reduced
(dtype(float8_e4m3fn), (2, 1))
>>> bool(jnp.allclose(q.astype(jnp.float32) * scale, x, rtol=0.07))
True
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_policy import formats
from jmp_policy.formats import INF_BITS, below, magnitude_bits, positive, unfoldable, widen
from jmp_policy.dtypes import F32, dtype_of
from jmp_policy.float8._recipe import SCALINGS


def _reduced_axes(ndim: int, scaling: str, contracting_axes: Sequence[int]) -> tuple[int, ...]:
    if scaling in ("tensorwise", "delayed"):
        return tuple(range(ndim))
    if scaling == "rowwise":
        return tuple(sorted(a % ndim for a in contracting_axes)) if ndim else ()
    raise ValueError(f"scaling must be one of {', '.join(map(repr, SCALINGS))}, got {scaling!r}.")


def inverse_scale(x: Any, dtype: Any, scaling: str, contracting_axes: Sequence[int],
                  power_of_two: bool = False) -> jax.Array:
    """The float32 factor that maps ``x``'s absolute maximum onto ``dtype``'s largest value.

    Its shape is ``x``'s with the reduced axes (all of them for
    ``"tensorwise"``, the contracting ones for ``"rowwise"``) kept as size 1.
    The factor is at most `MAX_FACTOR`: an all-zero row (padding, a dropped
    example) or one far below the format's range gets that (its values stay
    zero or tiny, and finite). A row holding inf gets 0 and one holding NaN
    gets NaN, so that its quantized values, and every product they enter, are
    NaN rather than finite.
    """
    axes = _reduced_axes(jnp.ndim(x), scaling, contracting_axes)
    x = unfoldable(x)  # a constant x (a linear loss's cotangent) is not reduced when compiled
    amax = lax.convert_element_type(lax.reduce_max(lax.abs(x), axes), F32) if axes \
        else lax.abs(lax.convert_element_type(x, F32))
    return lax.expand_dims(_factor(amax, dtype, power_of_two), axes)


def _factor(amax: jax.Array, dtype: Any, power_of_two: bool) -> jax.Array:
    """The inverse scales of values whose absolute maxima are ``amax`` (see `inverse_scale`)."""
    top = np.float32(formats.format_of(dtype).max)
    # The maximum is bounded below rather than the factor above: max/0 is never formed,
    # and a factor far below float32's largest value stays finite when XLA folds it
    # with the constants around it ((g / keep_prob) * factor becomes g * (factor /
    # keep_prob) under jit). lax.max keeps NaN; inf gives a factor of 0.
    factor = lax.div(top, lax.max(amax, np.float32(top / MAX_FACTOR)))
    return formats.floor_power_of_two(factor) if power_of_two else factor


MAX_FACTOR = 2.0 ** 64
"""The largest inverse scale: operands whose absolute maximum is below ``max / 2**64``
(all-zero ones included) are scaled by it, and stay finite."""


def quantize(x: Any, dtype: Any, scaling: str, contracting_axes: Sequence[int], *,
             power_of_two: bool = False,
             seed: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
    """``x`` in the float8 ``dtype`` with current scaling: returns ``(q, scale)``.

    ``q * scale`` approximates ``x``. ``scale`` is float32, of ``x``'s shape
    with the reduced axes kept as size 1: every axis for ``"tensorwise"``
    (one scale), the ``contracting_axes`` for ``"rowwise"`` (one scale per row
    along the other axes). Each scale maps the absolute maximum of its
    values onto ``dtype``'s largest finite value (with ``power_of_two``, the
    power of two at or below that), so nothing saturates and small values
    flush to zero only when they are that far below the maximum. A row
    (tensor) holding inf or NaN gets an inf or NaN scale and NaN values, so
    every product it enters is NaN, never finite. With a ``seed`` (two uint32 words), values
    are rounded stochastically, else to nearest (``formats.encode``; see `_operand`).

    >>> import jax.numpy as jnp
    >>> q, scale = quantize(jnp.array([3e-5, 1e-4]), jnp.float8_e4m3fn, "tensorwise", (0,))
    >>> scale.shape, [f"{v:.4g}" for v in (q.astype(jnp.float32) * scale).tolist()]
    ((1,), ['2.857e-05', '0.0001'])
    """
    x = _operand(x, seed)
    inv = inverse_scale(x, dtype, scaling, contracting_axes, power_of_two)
    scaled = lax.mul(lax.convert_element_type(x, F32), inv)
    # No clamp needed: |x| * inv <= max * (1 + 2^-24)^2, which rounds to the format's max.
    q = formats.encode(scaled, dtype, seed)
    return q, lax.div(np.float32(1), inv)


def quantize_delayed(x: Any, dtype: Any, history: jax.Array, reduction: str, *,
                     power_of_two: bool = False,
                     seed: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``x`` in the float8 ``dtype`` with one scale from ``history``, its earlier absolute
    maxima (delayed scaling): returns ``(q, scale, amax)``, ``amax`` being ``x``'s own,
    for the history of the next step.

    The scale maps the history's maximum (``reduction="max"``) or its latest entry
    (``"most_recent"``) onto ``dtype``'s largest value; an empty history (all zeros)
    gives a scale of 1. Finite values beyond the range saturate to the largest
    value; inf and NaN stay non-finite, so a product they enter is not finite. The
    scale does not depend on ``x``: the cast and ``x``'s maximum are one pass over it.

    >>> import jax.numpy as jnp
    >>> history = jnp.array([0.0, 2.0, 0.5])   # the latest step first
    >>> q, scale, amax = quantize_delayed(jnp.array([1.0, 4.0]), jnp.float8_e4m3fn, history, "max")
    >>> (q.astype(jnp.float32) * scale).tolist(), float(amax)   # 4.0 saturates at 2.0
    ([1.0, 2.0], 4.0)
    """
    x32 = lax.convert_element_type(_operand(x, seed), F32)
    top = formats.format_of(dtype).max
    amax = lax.reduce_max(lax.abs(x32), tuple(range(jnp.ndim(x))))
    recent = jnp.max(history) if reduction == "max" else history[0]
    factor = jnp.where(recent > 0, _factor(recent, dtype, power_of_two), np.float32(1))
    # Finite values beyond the history's range saturate; inf and NaN stay non-finite.
    q = formats.encode(formats.saturate(lax.mul(x32, factor), top), dtype, seed)
    # The scale does not wait for x: XLA:GPU can cast x in the kernel that produces it
    # (next to its maximum), if the cast is kept from fusing into each consumer instead
    # (a transposed copy per backward product, re-reading x in float32).
    q = lax.optimization_barrier(q)  # type: ignore[no-untyped-call]
    scale = lax.broadcast_in_dim(lax.div(np.float32(1), factor), (1,) * jnp.ndim(x), ())
    return q, scale, amax


def _operand(x: Any, seed: Optional[jax.Array]) -> Any:
    """The operand ``x`` to quantize: read as its format holds it (``formats.widen``) when
    rounded stochastically (with a ``seed``), whose random bits are salted with the
    values, so that excess precision the compiler keeps in one program and not in
    another (a sharded one) changes no draw; as the program gives it otherwise, at a
    conversion's cost."""
    return x if seed is None else widen(x)


def group_ids(group_sizes: jax.Array, rows: int) -> jax.Array:
    """The group of each of ``rows`` rows sorted by group into ``group_sizes``; rows
    past ``sum(group_sizes)`` get ``len(group_sizes)``, which is no group."""
    ends = jnp.cumsum(group_sizes)
    # Unrolled binary search: log2(groups) vectorized steps, no loop for XLA to run.
    return jnp.searchsorted(ends, lax.iota(ends.dtype, rows), side="right",
                            method="scan_unrolled")


def ragged_dims(contract: tuple[int, int], lhs_ragged: bool, rhs_grouped: bool) -> Any:
    """Dimension numbers of a ragged product contracting ``contract`` of (lhs, rhs), no batch."""
    return lax.RaggedDotDimensionNumbers(  # type: ignore[no-untyped-call]
        (((contract[0],), (contract[1],)), ((), ())),
        lhs_ragged_dimensions=(0,) if lhs_ragged else (),
        rhs_group_dimensions=(0,) if rhs_grouped else ())


WEIGHT_GRADIENT = ragged_dims((0, 0), True, False)
"""``[m, k] x [m, n] -> [g, k, n]``: per group, the sum over its rows (ragged contracting)."""


def in_groups(x: Any, sizes: jax.Array) -> Any:
    """``x`` with its rows past ``sum(sizes)`` set to zero.

    Those rows take no part in a ragged product (their output and gradient
    are zero), so they must not count in its scales either: a large or
    non-finite value there would spoil, or make NaN, a tensorwise product.
    """
    rows = lax.broadcasted_iota(sizes.dtype, jnp.shape(x), 0)
    return jnp.where(rows < jnp.sum(sizes), x, jnp.zeros((), dtype_of(x)))


def quantize_groups(x: Any, dtype: Any, ids: jax.Array, num_groups: int, *,
                    power_of_two: bool = False,
                    seed: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
    """``x`` (rows sorted by group, group ``ids``) in the float8 ``dtype``, one scale per
    group and column: returns ``(q, scale)``, ``scale`` of shape ``(num_groups, *x.shape[1:])``.

    The scaling of the right operand of a product summing over each group's rows
    (a ragged product's weight gradient): row ``i`` of ``q`` times
    ``scale[ids[i]]`` approximates row ``i`` of ``x``. An empty group gets a
    finite scale, as an all-zero row does in `quantize`; the finite values of
    rows in no group (ids out of range) quantize to zero.

    >>> import jax.numpy as jnp
    >>> x = jnp.array([[1e-3, 1.0], [2e-3, -4.0], [500.0, 0.0]])
    >>> q, scale = quantize_groups(x, jnp.float8_e4m3fn, jnp.array([0, 0, 1]), 2)
    >>> [f"{v:.3g}" for v in (q.astype(jnp.float32) * scale[jnp.array([0, 0, 1])]).ravel()]
    ['0.001', '1', '0.002', '-4', '500', '0']
    """
    # Per-group maxima by a scatter-max: rows in no group are dropped, empty groups get
    # -inf (the bound in _factor makes them finite), NaN propagates as in lax.max.
    x = lax.convert_element_type(_operand(x, seed), F32)
    amax = jax.ops.segment_max(lax.abs(unfoldable(x)), ids, num_groups,
                               indices_are_sorted=True)
    inv = _factor(amax, dtype, power_of_two)
    rows = jnp.take(inv, ids, axis=0, mode="fill", fill_value=0)
    q = formats.encode(lax.mul(x, rows), dtype, seed)  # rounded as in `quantize`
    return q, lax.div(np.float32(1), inv)


class QuantizationCounts(NamedTuple):
    """What a quantization loses, as int32 counts (see `quantization_counts`)."""

    saturated: jax.Array
    flushed_to_zero: jax.Array


def quantization_counts(x: Any, quantized: tuple[jax.Array, jax.Array]) -> QuantizationCounts:
    """How many values of ``x`` its `quantize` result ``(q, scale)`` lost.

    ``saturated``: values that became no finite float8 value, inf and NaN
    included (with current scaling, finite values never do).
    ``flushed_to_zero``: nonzero values that became zero (outside rows holding
    inf or NaN, whose products are NaN anyway).

    >>> import jax.numpy as jnp
    >>> x = jnp.array([[1e4, 1e-3, 0.0], [1.0, 1e-3, jnp.inf]])
    >>> q = quantize(x, jnp.float8_e4m3fn, "rowwise", (1,))
    >>> [int(c) for c in quantization_counts(x, q)]
    [1, 1]
    """
    q, scale = quantized
    q_bits, x_bits = magnitude_bits(q), magnitude_bits(x)
    scale_bits = lax.broadcast_in_dim(magnitude_bits(scale), jnp.shape(x),
                                      tuple(range(jnp.ndim(x))))
    saturated = 1 - below(q_bits, INF_BITS)
    flushed = positive(x_bits) & below(q_bits, 1) & below(scale_bits, INF_BITS)
    # One reduction of both over every axis, in integer arithmetic (no pred array).
    zero = np.int32(0)
    totals = lax.reduce((saturated, flushed), (zero, zero),
                        lambda a, b: (lax.add(a[0], b[0]), lax.add(a[1], b[1])),
                        tuple(range(jnp.ndim(x))))
    return QuantizationCounts(*totals)

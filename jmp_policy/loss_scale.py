"""Loss scales: keep small float16 gradients from flushing to zero.

Multiplying the loss by a large scale before differentiating shifts every
gradient up into float16's representable range; dividing the gradients by the
same scale afterwards restores their true value. A *dynamic* loss scale finds
the largest scale that does not overflow: it grows after ``period`` finite
steps in a row and shrinks whenever a step overflows.

The three classes have DeepMind jmp's signatures and pytree layout, so code
written for ``jmp`` runs unchanged, with jmp's known bugs fixed:

* the scale is always a float32 scalar (a float16 ``2.0**15`` used to overflow
  when it grew), and ``scale``/``unscale`` keep every leaf's dtype;
* ``period``, ``factor``, ``min_loss_scale`` and ``max_loss_scale`` are static
  pytree data, so they survive ``jit``, ``tree_map`` and checkpointing;
* a dynamic scale never becomes inf, 0 or NaN.

>>> import jax.numpy as jnp
>>> import jmp_policy
>>> ls = jmp_policy.DynamicLossScale(period=2)
>>> ls = ls.adjust(jnp.array(True)).adjust(jnp.array(True))
>>> float(ls.loss_scale)
65536.0
>>> float(ls.adjust(jnp.array(False)).loss_scale)
32768.0
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import warnings
from typing import Any, Optional, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._dtypes import is_floating_dtype

T = TypeVar("T")

# A dynamic scale stops here even with ``min_loss_scale=0``: below it float32
# turns subnormal and then zero, and a zero scale could never grow back.
_SMALLEST_SCALE = float(np.finfo(np.float32).tiny)
_INT32_MAX = int(np.iinfo(np.int32).max)


# ---------------------------------------------------------------------------
# Helpers shared by the three loss scales.


def _is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def _leaf_dtype(x: Any) -> Optional[np.dtype]:
    """The dtype of an array-like leaf, or None for leaves that are not numbers."""
    dtype = getattr(x, "dtype", None)
    if dtype is not None:
        return dtype
    if isinstance(x, (bool, int, float, complex)):
        return jnp.result_type(x)
    return None


def _warn_if_not_floating(x: Any, name: str) -> None:
    dtype = _leaf_dtype(x)
    if dtype is None or not is_floating_dtype(dtype):
        # jmp's message: users filter warnings on it.
        warnings.warn(
            f"Expected floating type for {name}, got {dtype} (stored as float32).",
            stacklevel=4,
        )


def _float_setting(x: Any, name: str) -> float:
    """A static float setting (``min_loss_scale``...) from a Python or concrete array scalar."""
    if _is_tracer(x):
        raise TypeError(
            f"{name} is a static setting and must be a concrete number, got a traced "
            f"value {x}; build the loss scale outside jit or pass a Python float."
        )
    if isinstance(x, bool) or np.ndim(x) != 0:
        raise TypeError(f"{name} must be a scalar number, got {x!r}.")
    try:
        return float(x)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a scalar number, got {x!r}.") from None


def _float32_setting(x: Any, name: str) -> float:
    """`_float_setting` rounded to float32, the precision the scale is computed in.

    Rounding first keeps comparisons exact: ``min_loss_scale=0.7`` with
    ``loss_scale=0.7`` must hold ``min <= scale`` after both become float32.
    """
    value = _float_setting(x, name)
    with np.errstate(over="ignore"):
        return float(np.float32(value)) if math.isfinite(value) else value


def _scale_leaves(tree: T, factor: Any) -> T:
    """Multiplies floating leaves by float32 ``factor``, keeping each leaf's dtype.

    The product is taken in (at least) float32 and cast back, so a float16 leaf
    times 65536 is not computed as float16(65536) = inf times the leaf.
    """

    def scale_leaf(x):
        dtype = _leaf_dtype(x)
        if dtype is None or not is_floating_dtype(dtype):
            return x  # integer / boolean / key leaves carry no gradient signal
        return (x * factor).astype(dtype)

    return jax.tree_util.tree_map(scale_leaf, tree)


def _as_float32_scalar(x: Any, name: str) -> jax.Array:
    if np.ndim(x) != 0:
        raise ValueError(f"{name} must be a scalar, got shape {np.shape(x)}.")
    return jnp.asarray(x, dtype=jnp.float32)


def _check_scale_value(value: float, name: str, *, allow_zero: bool) -> None:
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        valid = "a finite number >= 0" if allow_zero else "a finite number > 0"
        raise ValueError(f"{name} must be {valid}, got {value}.")


# ---------------------------------------------------------------------------
# The loss scales.


@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
    """No loss scaling: ``scale`` and ``unscale`` return their input unchanged.

    >>> import jmp_policy
    >>> jmp_policy.NoOpLossScale().scale(2.0)
    2.0
    """

    @property
    def loss_scale(self) -> np.float32:
        return np.float32(1.0)

    def scale(self, tree: T) -> T:
        return tree

    def unscale(self, tree: T) -> T:
        return tree

    def adjust(self, grads_finite: Any) -> "NoOpLossScale":
        del grads_finite
        return self


@dataclasses.dataclass(frozen=True)
class StaticLossScale:
    """Scales and unscales by a fixed float32 constant.

    The scale is static pytree data (the object has no leaves), so it may be
    closed over or passed to ``jit`` as a static argument.

    >>> import jax.numpy as jnp
    >>> import jmp_policy
    >>> ls = jmp_policy.StaticLossScale(128.0)
    >>> ls.scale(jnp.float16(2.0)).dtype
    dtype('float16')
    >>> float(ls.unscale(ls.scale(jnp.float32(3.0))))
    3.0
    """

    loss_scale: Any

    def __post_init__(self) -> None:
        value = self.loss_scale
        _warn_if_not_floating(value, "loss_scale")
        if _is_tracer(value):  # only usable inside the trace that made it
            object.__setattr__(self, "loss_scale", _as_float32_scalar(value, "loss_scale"))
            return
        value = _float32_setting(value, "loss_scale")
        _check_scale_value(value, "StaticLossScale loss_scale", allow_zero=True)
        object.__setattr__(self, "loss_scale", np.float32(value))

    def scale(self, tree: T) -> T:
        return _scale_leaves(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        return _scale_leaves(tree, 1 / self.loss_scale)

    def adjust(self, grads_finite: Any) -> "StaticLossScale":
        del grads_finite
        return self


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """A loss scale that grows while gradients stay finite and shrinks when they overflow.

    The schedule is PyTorch's ``GradScaler`` / TF's ``LossScaleOptimizer``::

        if grads_finite:
            counter += 1
            if counter == period:
                counter = 0
                if isfinite(loss_scale * factor):
                    loss_scale = min(loss_scale * factor, max_loss_scale)
        else:
            counter = 0
            loss_scale = max(loss_scale * (1 / factor), min_loss_scale, smallest normal float32)

    Leaves are exactly ``[loss_scale, counter]`` (float32 and int32 scalars);
    ``period``, ``factor``, ``min_loss_scale`` and ``max_loss_scale`` are static.

    >>> import jax, jax.numpy as jnp
    >>> import jmp_policy
    >>> ls = jmp_policy.DynamicLossScale(2.0**15, period=100, min_loss_scale=1.0)
    >>> ls = jax.jit(lambda s, f: s.adjust(f))(ls, jnp.array(False))
    >>> float(ls.loss_scale), ls.period
    (16384.0, 100)
    """

    loss_scale: Any = 2.0**15
    counter: Any = 0
    period: int = 2000
    factor: Union[int, float] = 2
    min_loss_scale: Any = 1.0
    max_loss_scale: Optional[Any] = None

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # frozen dataclass
        _warn_if_not_floating(self.loss_scale, "loss_scale")
        _warn_if_not_floating(self.min_loss_scale, "min_loss_scale")

        # Static settings: always concrete, validated here.
        period = self.period
        if isinstance(period, bool) or not isinstance(period, numbers.Integral) or period < 1:
            raise ValueError(f"period must be an integer >= 1, got {period!r}.")
        if period > _INT32_MAX:
            raise ValueError(f"period must be at most {_INT32_MAX} (int32 counter), got {period}.")
        set_("period", int(period))

        factor = _float_setting(self.factor, "factor")
        if not (math.isfinite(factor) and factor > 1):
            raise ValueError(f"factor must be a finite number > 1, got {self.factor!r}.")
        # Keep an integral factor an int (jmp's default ``2``), so the repr round-trips.
        set_("factor", int(factor) if factor.is_integer() else factor)

        min_scale = _float32_setting(self.min_loss_scale, "min_loss_scale")
        _check_scale_value(min_scale, "min_loss_scale", allow_zero=True)
        set_("min_loss_scale", min_scale)
        if self.max_loss_scale is not None:
            max_scale = _float32_setting(self.max_loss_scale, "max_loss_scale")
            _check_scale_value(max_scale, "max_loss_scale", allow_zero=False)
            if max_scale < min_scale:
                raise ValueError(
                    f"min_loss_scale ({min_scale}) must be <= max_loss_scale ({max_scale})."
                )
            set_("max_loss_scale", max_scale)

        # Leaves: may be tracers when built inside jit; only concrete values are checked.
        loss_scale = _as_float32_scalar(self.loss_scale, "loss_scale")
        counter = self.counter
        if np.ndim(counter) != 0:
            raise ValueError(f"counter must be a scalar, got shape {np.shape(counter)}.")
        if not _is_tracer(self.loss_scale):
            value = float(loss_scale)
            low, high = max(min_scale, _SMALLEST_SCALE), self.max_loss_scale
            if not math.isfinite(value) or value < low or (high is not None and value > high):
                bounds = f"[{low}, {high if high is not None else 'float32 max'}]"
                raise ValueError(
                    f"DynamicLossScale loss_scale must be finite and within "
                    f"[max(min_loss_scale, smallest normal float32), max_loss_scale] = "
                    f"{bounds}, got {float(np.asarray(self.loss_scale))}."
                )
        if not _is_tracer(counter):
            if not (0 <= int(counter) < period) or int(counter) != counter:
                raise ValueError(f"counter must be an integer in [0, period={period}), got {counter!r}.")
        set_("loss_scale", loss_scale)
        set_("counter", jnp.asarray(counter, dtype=jnp.int32))

    def scale(self, tree: T) -> T:
        return _scale_leaves(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        return _scale_leaves(tree, 1 / self.loss_scale)

    def adjust(self, grads_finite: Any) -> "DynamicLossScale":
        """Returns the next loss scale given whether this step's gradients were finite."""
        grads_finite = _check_bool_scalar(grads_finite, "adjust(grads_finite)")
        counter = self.counter + 1
        grow = grads_finite & (counter >= self.period)

        grown = self.loss_scale * self.factor
        # PyTorch/TF rule: a growth that overflows float32 is not taken.
        grown = jnp.where(jnp.isfinite(grown), grown, self.loss_scale)
        if self.max_loss_scale is not None:
            grown = jnp.minimum(grown, self.max_loss_scale)
        # Multiplying by float32(1/factor) is PyTorch's ``backoff_factor`` rule,
        # and what XLA turns a division by a constant into anyway.
        shrunk = jnp.maximum(
            self.loss_scale * np.float32(1 / self.factor), max(self.min_loss_scale, _SMALLEST_SCALE)
        )
        loss_scale = jnp.where(
            grads_finite, jnp.where(grow, grown, self.loss_scale), shrunk
        ).astype(jnp.float32)
        counter = jnp.where(grads_finite & ~grow, counter, 0).astype(jnp.int32)
        return self._replace_leaves(loss_scale, counter)

    def _replace_leaves(self, loss_scale: Any, counter: Any) -> "DynamicLossScale":
        # Through the pytree machinery, not __init__: the settings are already
        # validated and the new leaves are usually tracers.
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(self), [loss_scale, counter])


def _register_leafless(cls: type) -> None:
    jax.tree_util.register_pytree_with_keys(
        cls, lambda x: ((), x), lambda aux, _: aux, flatten_func=lambda x: ((), x)
    )


_register_leafless(NoOpLossScale)
_register_leafless(StaticLossScale)


def _dynamic_flatten_with_keys(ls: DynamicLossScale):
    keys = (jax.tree_util.GetAttrKey("loss_scale"), jax.tree_util.GetAttrKey("counter"))
    static = (ls.period, ls.factor, ls.min_loss_scale, ls.max_loss_scale)
    return tuple(zip(keys, (ls.loss_scale, ls.counter))), static


def _dynamic_flatten(ls: DynamicLossScale):
    return (ls.loss_scale, ls.counter), (ls.period, ls.factor, ls.min_loss_scale, ls.max_loss_scale)


def _dynamic_unflatten(static, leaves) -> DynamicLossScale:
    new = object.__new__(DynamicLossScale)
    period, factor, min_scale, max_scale = static
    loss_scale, counter = leaves
    for name, value in (
        ("loss_scale", loss_scale), ("counter", counter), ("period", period),
        ("factor", factor), ("min_loss_scale", min_scale), ("max_loss_scale", max_scale),
    ):
        object.__setattr__(new, name, value)
    return new


jax.tree_util.register_pytree_with_keys(
    DynamicLossScale, _dynamic_flatten_with_keys, _dynamic_unflatten, flatten_func=_dynamic_flatten
)

#: The type to annotate loss-scale arguments with (as in jmp).
LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]


def as_loss_scale(loss_scale: Any, *, also: str = "") -> LossScale:
    """The loss-scale object meant by a ``loss_scale=`` argument.

    ``"dynamic"`` (default `DynamicLossScale`), a number or a 0-d array (a
    `StaticLossScale`), ``None`` (`NoOpLossScale`) or a loss-scale object.
    ``also`` names further forms a caller accepts, for the error message.
    """
    if loss_scale is None:
        return NoOpLossScale()
    if isinstance(loss_scale, str):
        if loss_scale == "dynamic":
            return DynamicLossScale()
        raise ValueError(
            f"Unknown loss_scale {loss_scale!r}: expected 'dynamic', a number (a static scale), "
            f"None (no scaling), a NoOpLossScale/StaticLossScale/DynamicLossScale{also}.")
    if isinstance(loss_scale, (NoOpLossScale, StaticLossScale, DynamicLossScale)):
        return loss_scale
    is_number = isinstance(loss_scale, numbers.Real) and not isinstance(loss_scale, bool)
    is_array = (isinstance(loss_scale, (np.ndarray, np.generic, jax.Array))
                and np.ndim(loss_scale) == 0 and loss_scale.dtype != np.bool_)
    if is_number or is_array:
        return StaticLossScale(loss_scale)  # validates, and warns on integers like jmp
    raise TypeError(
        f"loss_scale must be 'dynamic', a number, None or a loss-scale object "
        f"(NoOpLossScale/StaticLossScale/DynamicLossScale){also}, got {loss_scale!r} "
        f"of type {type(loss_scale).__name__}.")


# ---------------------------------------------------------------------------
# Tree utilities.


def _check_bool_scalar(pred: Any, what: str) -> jax.Array:
    dtype = _leaf_dtype(pred)
    if dtype is None or np.ndim(pred) != 0 or dtype != np.bool_:
        raise ValueError(
            f"{what}: expected boolean scalar (a bool array of shape ()), got "
            f"{'shape ' + str(np.shape(pred)) + ' ' if dtype is not None else ''}"
            f"{dtype if dtype is not None else type(pred).__name__}."
        )
    return jnp.asarray(pred)


# Leaves below this many elements are concatenated before the reduction: a
# kernel per small shape (biases, norm scales) costs more compile time than
# copying them (8M-param transformer: 27K elements in 66 leaves).
_SMALL_LEAF = 4096

# On XLA:CPU, float32 leaves of at least this many elements are checked by a
# matrix-vector product instead (see `_matvec_nonfinite_sum`): each such
# product costs ~6 ms of compile time, which below this size the faster check
# does not win back within a few thousand steps.
_MATVEC_LEAF = 1 << 16
# ... if its rows are this long: a longer zero vector is no longer small next to
# the leaf, and XLA turns a product over short rows back into elementwise work.
_MATVEC_ROW = (16, 1 << 12)


def _concatenable(x: jax.Array) -> bool:
    """Whether ``x`` is small and not on a mesh, so concatenating it is free.

    Concatenating arrays that live on a mesh makes XLA all-gather each of
    them (and explicit-sharding mode rejects the reshape); those keep their
    own per-shape reductions.
    """
    return x.size < _SMALL_LEAF and jax.typeof(x).sharding.mesh.empty


def _nonfinite_sum(leaves, multiplier: Any = None) -> jax.Array:
    """0 if every floating leaf is finite, else NaN (a float32 scalar).

    Per leaf, ``sum(x * 0)`` is 0 for finite data and NaN as soon as one
    element is inf or NaN (IEEE arithmetic, whatever the backend's min/max
    conventions), and a sum of zeros cannot overflow. On XLA:CPU the large
    float32 leaves compute that sum as a matrix-vector product with a zero
    vector, which XLA:CPU runs 1.4x-1.7x as fast as the fused reduction.

    With ``multiplier`` (``1 / loss_scale``, when it may exceed 1), the result
    is also NaN when some ``x * multiplier``, cast back to the leaf's dtype as
    `unscale` does, overflows (see `_grouped_nonfinite_sum`).
    """
    leaves = [jnp.asarray(x) for x in leaves
              if (dtype := _leaf_dtype(x)) is not None and is_floating_dtype(dtype) and np.size(x)]
    if multiplier is not None or not leaves:
        return _grouped_nonfinite_sum(leaves, multiplier)
    # Resolved when the step is lowered for a platform: no runtime branch.
    return jax.lax.platform_dependent(
        leaves, cpu=_matvec_nonfinite_sum, default=_grouped_nonfinite_sum)


def _matvec_nonfinite_sum(leaves) -> jax.Array:
    """`_grouped_nonfinite_sum`, with each large float32 leaf as ``x @ 0``.

    ``x.reshape(-1, n) @ zeros(n)`` adds up ``x * 0`` row by row (IEEE: 0 for
    finite rows, NaN otherwise), reading ``x`` once in XLA:CPU's vectorised
    matrix-vector kernel: 0.12x-0.15x of a donated Adam step for 8M parameters,
    where the fused ``sum(x * 0)`` takes 0.20x-0.22x (``bench_check_floor.py``).
    Each product is compiled as a kernel of its own (~6-9 ms of compile time).
    """
    dotted, rest = [], []
    for x in leaves:
        (dotted if _matvec_checkable(x) else rest).append(x)
    total = _grouped_nonfinite_sum(rest)
    if not dotted:
        return total
    # One product per leaf; products of the same length are added elementwise
    # first, so that the HLO holds one small reduction per length, not per leaf.
    rows: dict = {}
    for x in dotted:
        m = x.reshape(-1, x.shape[-1])
        zeros = jnp.zeros(m.shape[1:], m.dtype)
        # HIGHEST: a reduced-precision pass could round values near the float32
        # maximum up to inf, and inf * 0 would read as non-finite.
        rows.setdefault(m.shape[0], []).append(
            jax.lax.dot(m, zeros, precision=jax.lax.Precision.HIGHEST))
    for same_length in rows.values():
        total = total + jnp.sum(functools.reduce(jnp.add, same_length))
    return total


def _matvec_checkable(x: jax.Array) -> bool:
    return (x.dtype == jnp.float32 and x.ndim >= 2 and x.size >= _MATVEC_LEAF
            and _MATVEC_ROW[0] <= x.shape[-1] <= _MATVEC_ROW[1]
            and jax.typeof(x).sharding.mesh.empty)


def _grouped_nonfinite_sum(leaves, multiplier: Any = None) -> jax.Array:
    """`_nonfinite_sum` on any backend: one fused ``sum(x * 0)`` per group.

    Leaves of the same shape are added elementwise into one reduction, so XLA
    reads each leaf once in a few fused kernels (one per shape) and no boolean
    mask is written; small leaves of one dtype are concatenated into one
    reduction.

    With ``multiplier``, the same pass tracks ``max(|x|)``: rounding is
    monotonic, so ``max(|x|) * multiplier`` overflows exactly when some
    element's product does.
    """
    groups: dict = {}  # one reduction per (shape, dtype), or per dtype for small leaves
    for x in leaves:
        key = (None if _concatenable(x) else x.shape, np.dtype(x.dtype))
        groups.setdefault(key, []).append(x)
    total = jnp.zeros((), jnp.float32)
    for (shape, _), xs in groups.items():
        if shape is None:
            xs = [jnp.concatenate([jnp.ravel(x) for x in xs])]
        # An elementwise sum of the zeroed leaves feeds a single reduction:
        # XLA fuses it into the reduction's input, reads each leaf once and
        # emits one kernel and one scalar per group.
        zero = jnp.zeros((), xs[0].dtype)
        zeros = functools.reduce(jnp.add, [x * zero for x in xs])
        dims = tuple(range(zeros.ndim))
        if multiplier is None:
            # lax.reduce in the leaves' own dtype: jnp.sum would widen float16
            # to float32 first, which XLA:CPU then writes out before reducing.
            total = total + jax.lax.reduce(zeros, zero, jax.lax.add, dims).astype(jnp.float32)
            continue
        # Same pass: max(|x|) over the group (one dtype), whose unscaled value
        # overflows iff some element's does (rounding is monotonic).
        absmax = functools.reduce(jnp.maximum, [jnp.abs(x) for x in xs])
        nonfinite, largest = jax.lax.reduce(
            (zeros, absmax), (zero, zero),
            # max may drop NaNs on some backends: the sum catches them.
            lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1])),
            dims)
        unscaled = (largest * multiplier).astype(zeros.dtype)
        total = total + nonfinite.astype(jnp.float32) + (unscaled * 0).astype(jnp.float32)
    return total


def all_finite(tree: Any) -> jax.Array:
    """A scalar bool array: True iff every floating leaf of ``tree`` is finite.

    Non-floating leaves are ignored; an empty tree (or ``None``) is finite.
    Under jit each leaf is read once and no boolean mask is written: a fused
    ``sum(x * 0)`` reduction per group of same-shape leaves (small leaves are
    concatenated into one), or on XLA:CPU, for large float32 leaves, the same
    sum as a product with a zero vector. One scalar ``isfinite`` test reads
    the per-group results.

    >>> import jax.numpy as jnp
    >>> import jmp_policy
    >>> bool(jmp_policy.all_finite({"a": jnp.ones(3), "step": jnp.int32(1)}))
    True
    >>> bool(jmp_policy.all_finite([jnp.array([1.0, jnp.inf])]))
    False
    """
    return jnp.isfinite(_nonfinite_sum(jax.tree_util.tree_leaves(tree)))


def select_tree(pred: Any, a: T, b: T) -> T:
    """Returns ``a`` where the scalar bool ``pred`` is True, else ``b`` (leaf by leaf).

    >>> import jax.numpy as jnp
    >>> import jmp_policy
    >>> jmp_policy.select_tree(jnp.array(False), {"x": jnp.ones(2)}, {"x": jnp.zeros(2)})["x"]
    Array([0., 0.], dtype=float32)
    """
    pred = _check_bool_scalar(pred, "select_tree(pred, a, b)")
    return jax.tree_util.tree_map(lambda x, y: jax.lax.select(pred, x, y), a, b)

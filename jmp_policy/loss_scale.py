"""Loss scales: keep small float16 gradients from flushing to zero.

Multiplying the loss by a large scale before differentiating shifts every
gradient up into float16's representable range; dividing the gradients by the
same scale afterwards restores their true value. A *dynamic* loss scale finds
the largest scale that does not overflow: it grows after ``period`` finite
steps in a row and shrinks whenever a step overflows.

The three classes have DeepMind jmp's signatures and pytree layout, so code
written for ``jmp`` runs unchanged, with jmp's known bugs fixed:

* the scale is always a float32 scalar (a float16 ``2.0**15`` overflows when
  it grows), and ``scale``/``unscale`` keep every leaf's dtype;
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
from typing import Any, Hashable, Literal, Optional, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from jmp_policy.formats import facts_of

__all__ = [
    "DEFAULT_DYNAMIC",
    "NO_SCALING",
    "DynamicLossScale",
    "LossScale",
    "LossScaleConfig",
    "NoOpLossScale",
    "StaticLossScale",
    "all_finite",
    "is_inexact",
    "scale_leaves",
    "select_tree",
    "unscaled_all_finite",
]

T = TypeVar("T")

# A dynamic scale stops here even with ``min_loss_scale=0``: below it float32
# turns subnormal and then zero, and a zero scale could never grow back.
_SMALLEST_SCALE = facts_of(np.float32).tiny
_INT32_MAX = int(np.iinfo(np.int32).max)


# ---------------------------------------------------------------------------
# Validating settings.


def _is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def _real(x: Any, name: str) -> float:
    """A concrete real scalar setting as a Python float; strings and arrays are TypeErrors."""
    if _is_tracer(x):
        raise TypeError(
            f"{name} is a static setting and must be a concrete number, got a traced value; "
            "pass a Python number (it may be built inside jit).")
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (numbers.Real, np.ndarray, jax.Array)):
        raise TypeError(f"{name} must be a real number, got {x!r} of type {type(x).__name__}.")
    value = np.asarray(x)
    # jnp.issubdtype knows bfloat16 and float8 are numbers; numpy does not.
    if value.ndim != 0 or not jnp.issubdtype(value.dtype, jnp.number):
        raise TypeError(f"{name} must be a real scalar, got {x!r}.")
    return float(value)


def _float32(x: Any, name: str) -> float:
    """`_real` rounded to float32, the precision the scale is computed in.

    Rounding first keeps comparisons exact: ``min_loss_scale=0.7`` with
    ``loss_scale=0.7`` must hold ``min <= scale`` once both are float32.
    """
    value = _real(x, name)
    with np.errstate(over="ignore"):
        return float(np.float32(value)) if math.isfinite(value) else value


def _warn_if_integer(x: Any, name: str) -> None:
    if not is_inexact(x):
        # jmp's message: users filter warnings on it.
        dtype = getattr(x, "dtype", type(x).__name__)
        warnings.warn(f"Expected floating type for {name}, got {dtype} (stored as float32).",
                      stacklevel=4)


def _check_scale(value: float, name: str, *, allow_zero: bool) -> None:
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        valid = "a finite number >= 0" if allow_zero else "a finite number > 0"
        raise ValueError(f"{name} must be {valid}, got {value}.")


def _scale_leaf(x: Any, name: str) -> Any:
    """A float32 scalar: a tracer stays traced, a concrete number becomes ``np.float32``.

    Concrete values are converted with numpy, never with ``jnp``: inside a jit
    trace ``jnp.asarray(2.0)`` is a traced value, and the settings could no
    longer be checked (a loss scale built from Python numbers inside a jitted
    ``init`` must work).
    """
    if _is_tracer(x):
        if np.ndim(x) != 0:
            raise ValueError(f"{name} must be a scalar, got shape {np.shape(x)}.")
        return x.astype(jnp.float32)
    return np.float32(_float32(x, name))


def scale_leaves(tree: T, factor: Any) -> T:
    """Multiplies floating leaves by float32 ``factor``, keeping each leaf's dtype.

    The product is taken in (at least) float32 and cast back, so a float16 leaf
    times 65536 is not computed as float16(65536) = inf times the leaf.
    Non-floating leaves (integers, booleans, keys) are returned as they are.
    """

    def scale(x: Any) -> Any:
        if not is_inexact(x):
            return x
        dtype = getattr(x, "dtype", None)
        if dtype is None:  # a Python float: a (weakly typed) float32 to JAX
            dtype = jnp.result_type(x)
        return (x * factor).astype(dtype)

    scaled: T = jax.tree_util.tree_map(scale, tree)
    return scaled


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
        value = _scale_leaf(self.loss_scale, "loss_scale")
        _warn_if_integer(self.loss_scale, "loss_scale")
        if not _is_tracer(value):
            _check_scale(float(value), "StaticLossScale loss_scale", allow_zero=True)
        object.__setattr__(self, "loss_scale", value)

    def scale(self, tree: T) -> T:
        return scale_leaves(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        return scale_leaves(tree, 1 / self.loss_scale)

    def adjust(self, grads_finite: Any) -> "StaticLossScale":
        del grads_finite
        return self


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """A loss scale that grows while gradients stay finite and shrinks when they overflow.

    The schedule is PyTorch's ``GradScaler`` and TF's ``LossScaleOptimizer``::

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
    As in jmp, ``period`` and ``factor`` may be floats with integral values.

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
        def set_(name: str, value: Any) -> None:  # a frozen dataclass
            object.__setattr__(self, name, value)

        set_("period", _period(self.period))
        factor = _real(self.factor, "factor")
        if not (math.isfinite(factor) and factor > 1):
            raise ValueError(f"factor must be a finite number > 1, got {self.factor!r}.")
        # An integral factor stays an int (jmp's default is ``2``), so the repr round-trips.
        set_("factor", int(factor) if factor.is_integer() else factor)
        min_scale = _float32(self.min_loss_scale, "min_loss_scale")
        _warn_if_integer(self.min_loss_scale, "min_loss_scale")
        set_("min_loss_scale", min_scale)
        _check_scale(self.min_loss_scale, "min_loss_scale", allow_zero=True)
        if self.max_loss_scale is not None:
            set_("max_loss_scale", _float32(self.max_loss_scale, "max_loss_scale"))
            _check_scale(self.max_loss_scale, "max_loss_scale", allow_zero=False)
            if self.max_loss_scale < self.min_loss_scale:
                raise ValueError(f"min_loss_scale ({self.min_loss_scale}) must be <= "
                                 f"max_loss_scale ({self.max_loss_scale}).")
        # Leaves: tracers when built from traced values; only concrete ones are checked.
        scale = _scale_leaf(self.loss_scale, "loss_scale")
        _warn_if_integer(self.loss_scale, "loss_scale")
        if not _is_tracer(scale):
            self._check_initial_scale(float(scale))
        set_("loss_scale", scale)
        set_("counter", _counter(self.counter, self.period))

    def _check_initial_scale(self, value: float) -> None:
        low, high = max(self.min_loss_scale, _SMALLEST_SCALE), self.max_loss_scale
        if not math.isfinite(value) or value < low or (high is not None and value > high):
            raise ValueError(
                "DynamicLossScale loss_scale must be finite and within [max(min_loss_scale, "
                "smallest normal float32), max_loss_scale] = "
                f"[{low}, {high if high is not None else 'float32 max'}], got {value}.")

    def scale(self, tree: T) -> T:
        return scale_leaves(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        return scale_leaves(tree, 1 / self.loss_scale)

    def adjust(self, grads_finite: Any) -> "DynamicLossScale":
        """The next loss scale, given whether this step's gradients were finite."""
        grads_finite = _check_bool_scalar(grads_finite, "adjust(grads_finite)")
        counter = self.counter + 1
        grow = grads_finite & (counter >= self.period)
        grown = self.loss_scale * self.factor
        # PyTorch and TF: a growth that overflows float32 is not taken.
        grown = jnp.where(jnp.isfinite(grown), grown, self.loss_scale)
        if self.max_loss_scale is not None:
            grown = jnp.minimum(grown, self.max_loss_scale)
        # Times float32(1/factor): PyTorch's ``backoff_factor`` rule.
        shrunk = jnp.maximum(self.loss_scale * np.float32(1 / self.factor),
                             max(self.min_loss_scale, _SMALLEST_SCALE))
        loss_scale = jnp.where(grads_finite, jnp.where(grow, grown, self.loss_scale), shrunk)
        counter = jnp.where(grads_finite & ~grow, counter, 0)
        # Without __init__: the settings are already checked and the new
        # leaves are usually traced.
        return _dynamic_unflatten(
            (self.period, self.factor, self.min_loss_scale, self.max_loss_scale),
            (loss_scale.astype(jnp.float32), counter.astype(jnp.int32)))


def _period(period: Any) -> int:
    value = _real(period, "period")
    if not value.is_integer() or value < 1:
        raise ValueError(f"period must be an integer >= 1 (an integral float such as 5.0 is "
                         f"fine), got {period!r}.")
    if value > _INT32_MAX:
        raise ValueError(f"period must be at most {_INT32_MAX} (an int32 counter), got {period}.")
    return int(value)


def _counter(counter: Any, period: int) -> Any:
    if _is_tracer(counter):
        if np.ndim(counter) != 0:
            raise ValueError(f"counter must be a scalar, got shape {np.shape(counter)}.")
        return counter.astype(jnp.int32)
    value = _real(counter, "counter")
    if not value.is_integer() or not 0 <= value < period:
        raise ValueError(f"counter must be an integer in [0, period={period}), got {counter!r}.")
    return np.int32(value)


def _register_leafless(cls: type) -> None:
    jax.tree_util.register_pytree_with_keys(
        cls, lambda x: ((), x), lambda aux, _: aux, flatten_func=lambda x: ((), x))


_register_leafless(NoOpLossScale)
_register_leafless(StaticLossScale)

_DYNAMIC_LEAVES = ("loss_scale", "counter")
_DYNAMIC_STATIC = ("period", "factor", "min_loss_scale", "max_loss_scale")


def _dynamic_unflatten(static: tuple[Any, ...], leaves: Any) -> DynamicLossScale:
    # Without __init__: JAX unflattens with placeholder leaves (object(), None).
    new = object.__new__(DynamicLossScale)
    for name, value in zip(_DYNAMIC_LEAVES + _DYNAMIC_STATIC, (*leaves, *static)):
        object.__setattr__(new, name, value)
    return new


jax.tree_util.register_pytree_with_keys(
    DynamicLossScale,
    lambda ls: (tuple((jax.tree_util.GetAttrKey(n), getattr(ls, n)) for n in _DYNAMIC_LEAVES),
                tuple(getattr(ls, n) for n in _DYNAMIC_STATIC)),
    _dynamic_unflatten,
    flatten_func=lambda ls: (tuple(getattr(ls, n) for n in _DYNAMIC_LEAVES),
                             tuple(getattr(ls, n) for n in _DYNAMIC_STATIC)),
)

#: The type to annotate loss-scale arguments with (as in jmp).
LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]


# ---------------------------------------------------------------------------
# A loss scale's configuration, and its text form.


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    """The static, hashable settings of a loss scale, and their text form.

    A loss-scale object holds arrays; its configuration holds Python numbers,
    so a `jmp_policy.Policy` can keep it as part of its value (compared,
    hashed, and written in its name). ``str(config)`` is the form written after
    ``loss_scale=`` in a policy name, and `LossScaleConfig.parse` reads it back.

    >>> config = LossScaleConfig.of(DynamicLossScale(1024.0, period=100))
    >>> str(config)
    'dynamic(initial=1024.0;period=100;factor=2;min=1.0;max=none)'
    >>> LossScaleConfig.parse(str(config)) == config
    True
    >>> LossScaleConfig.parse("128").build()
    StaticLossScale(loss_scale=np.float32(128.0))
    """

    kind: Literal["none", "static", "dynamic"]
    scale: float = 1.0
    period: int = 2000
    factor: Union[int, float] = 2
    min_scale: float = 1.0
    max_scale: Optional[float] = None

    @classmethod
    def of(cls, loss_scale: LossScale) -> LossScaleConfig:
        """The configuration of a loss-scale object (its values must be concrete)."""
        if isinstance(loss_scale, NoOpLossScale):
            return NO_SCALING
        if isinstance(loss_scale, StaticLossScale):
            return cls("static", scale=_concrete_float(loss_scale.loss_scale, "loss_scale"))
        max_ = loss_scale.max_loss_scale
        return cls(
            "dynamic",
            scale=_concrete_float(loss_scale.loss_scale, "loss_scale"),
            period=int(loss_scale.period),
            factor=loss_scale.factor,
            min_scale=_concrete_float(loss_scale.min_loss_scale, "min_loss_scale"),
            max_scale=None if max_ is None else _concrete_float(max_, "max_loss_scale"),
        )

    @classmethod
    def parse(cls, text: str) -> LossScaleConfig:
        """Parses what follows ``loss_scale=`` in a policy name (the inverse of ``str``)."""
        if text == "none":
            return NO_SCALING
        if text == "dynamic":
            return DEFAULT_DYNAMIC
        if text.startswith("dynamic(") and text.endswith(")"):
            return cls.of(_dynamic_from_text(text))
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"Unknown loss_scale {text!r} in policy name: expected 'dynamic', "
                             "'none' or a number (a static scale).") from None
        return cls.of(StaticLossScale(np.float32(value)))

    def build(self) -> LossScale:
        """A fresh loss-scale object with these settings."""
        if self.kind == "none":
            return NoOpLossScale()
        if self.kind == "static":
            return StaticLossScale(np.float32(self.scale))
        return DynamicLossScale(
            loss_scale=np.float32(self.scale), period=self.period, factor=self.factor,
            min_loss_scale=np.float32(self.min_scale),
            max_loss_scale=None if self.max_scale is None else np.float32(self.max_scale))

    def __str__(self) -> str:
        """The form written after ``loss_scale=`` in a policy name."""
        if self.kind == "none":
            return "none"
        if self.kind == "static":
            return repr(self.scale)
        if self == DEFAULT_DYNAMIC:
            return "dynamic"
        max_ = "none" if self.max_scale is None else repr(self.max_scale)
        return (f"dynamic(initial={self.scale!r};period={self.period};factor={self.factor!r};"
                f"min={self.min_scale!r};max={max_})")


#: No loss scaling.
NO_SCALING = LossScaleConfig("none")
#: The settings of ``DynamicLossScale()``, written out so that building a policy
#: does not create arrays (which would start JAX's backends at import time).
DEFAULT_DYNAMIC = LossScaleConfig("dynamic", scale=2.0**15)


def _concrete_float(x: Any, what: str) -> float:
    try:
        return float(np.asarray(x))
    except (TypeError, jax.errors.ConcretizationTypeError):
        raise TypeError(
            f"A policy's loss scale is static configuration, but {what} is a traced value; "
            "build the policy outside jit, or pass the loss scale to loss_scaling() instead."
        ) from None


def _dynamic_from_text(text: str) -> DynamicLossScale:
    """``dynamic(initial=..;period=..;factor=..;min=..;max=..)`` as a loss-scale object."""
    fields = dict(item.split("=", 1) for item in text[len("dynamic("):-1].split(";") if "=" in item)
    if sorted(fields) != ["factor", "initial", "max", "min", "period"]:
        raise ValueError(f"Malformed dynamic loss scale {text!r}: expected "
                         "dynamic(initial=..;period=..;factor=..;min=..;max=..).")
    factor, max_ = fields["factor"], fields["max"]
    return DynamicLossScale(
        loss_scale=np.float32(float(fields["initial"])), period=int(fields["period"]),
        factor=int(factor) if factor.isdigit() else float(factor),
        min_loss_scale=np.float32(float(fields["min"])),
        max_loss_scale=None if max_ == "none" else np.float32(float(max_)))


# ---------------------------------------------------------------------------
# select_tree (jmp).


def _check_bool_scalar(pred: Any, what: str) -> jax.Array:
    dtype = getattr(pred, "dtype", None)
    if dtype is None and isinstance(pred, bool):
        dtype = np.dtype(np.bool_)
    if dtype is None or np.ndim(pred) != 0 or dtype != np.bool_:
        got = f"shape {np.shape(pred)} {dtype}" if dtype is not None else type(pred).__name__
        raise ValueError(f"{what}: expected boolean scalar (a bool array of shape ()), got {got}.")
    return jnp.asarray(pred)


def select_tree(pred: Any, a: T, b: T) -> T:
    """Returns ``a`` where the scalar bool ``pred`` is True, else ``b`` (leaf by leaf).

    >>> import jax.numpy as jnp
    >>> import jmp_policy
    >>> jmp_policy.select_tree(jnp.array(False), {"x": jnp.ones(2)}, {"x": jnp.zeros(2)})["x"]
    Array([0., 0.], dtype=float32)
    """
    pred = _check_bool_scalar(pred, "select_tree(pred, a, b)")
    selected: T = jax.tree_util.tree_map(lambda x, y: jax.lax.select(pred, x, y), a, b)
    return selected


# ---------------------------------------------------------------------------
# Finiteness.


def is_inexact(x: Any) -> bool:
    """Whether ``x`` is a floating or complex array (or scalar)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return isinstance(x, (float, complex))
    try:
        return bool(jnp.issubdtype(dtype, jnp.inexact))
    except TypeError:  # extended dtypes such as PRNG keys
        return False


def all_finite(tree: Any) -> jax.Array:
    """A scalar bool array: True iff every floating leaf of ``tree`` is finite.

    Non-floating leaves (integers, booleans, keys) are ignored; an empty tree,
    or ``None``, is finite. Under ``jit`` each leaf is read once, in one
    reduction, and nothing leaf-sized is written.

    >>> import jax.numpy as jnp
    >>> import jmp_policy
    >>> bool(jmp_policy.all_finite({"w": jnp.ones(3), "step": jnp.int32(1)}))
    True
    >>> bool(jmp_policy.all_finite([jnp.array([1.0, jnp.inf])]))
    False
    """
    return unscaled_all_finite(tree, None)


def unscaled_all_finite(tree: Any, inverse: Optional[Any]) -> jax.Array:
    """``all_finite`` of ``tree`` unscaled by ``inverse``, without writing the unscaled values.

    Each floating leaf ``x`` is checked as ``(x * inverse).astype(x.dtype)``, the
    value a loss scale's ``unscale`` produces, so that a gradient that overflows
    only once unscaled (a loss scale below 1) is caught. XLA fuses the multiply
    into the reduction's read. ``inverse=None`` checks ``tree`` as it is.
    """
    groups: dict[Hashable, list[jax.Array]] = {}
    for x in jax.tree_util.tree_leaves(tree):
        if is_inexact(x) and np.size(x):
            x = jnp.asarray(x)
            groups.setdefault(_group(x), []).append(x)
    total = jnp.zeros((), jnp.float32)
    for xs in groups.values():
        if inverse is not None:
            xs = [(x * inverse).astype(x.dtype) for x in xs]
        zeros = functools.reduce(jnp.add, [x - x for x in xs])
        # lax.reduce_sum in the leaves' own dtype: jnp.sum would first widen
        # float16 to float32, an extra elementwise pass. (And ``x - x`` rather
        # than ``x * 0``: no zero array for XLA to share and write out.) Not
        # lax.reduce with lax.add: under an explicit mesh it traces the adder
        # with sharding constraints in its body, and XLA:CPU's promotion of a
        # bfloat16 or float16 all-reduce (FSDP-sharded gradients) aborts the
        # process on such a body ("Invalid binary instruction opcode copy").
        total += jnp.real(jax.lax.reduce_sum(zeros, tuple(range(zeros.ndim))))
    return jnp.isfinite(total)


def _group(x: jax.Array) -> Hashable:
    """Leaves with equal keys are added elementwise and reduced once.

    One reduction per group rather than per leaf means fewer kernels, but
    adding two leaves makes XLA give both the same sharding. So leaves are
    grouped only where their sharding is known when tracing (one device, or
    an explicit sharding in their type); on a mesh with automatic axes, where
    XLA picks shardings later, each leaf is reduced where it lives.
    """
    sharding = jax.typeof(x).sharding
    automatic = sharding.mesh.empty or AxisType.Auto in sharding.mesh.axis_types
    if automatic and jax.device_count() > 1:
        return id(x)
    return (x.shape, x.dtype, sharding)

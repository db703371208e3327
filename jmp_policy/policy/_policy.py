"""Dtype policies: which dtype parameters are stored in, computed in, and returned in.

A `Policy` is an immutable, hashable value with no pytree leaves, so it can be
closed over, passed to `jax.jit` as a normal or a static argument, and used as
a dictionary key. Names follow Keras/TF (``"mixed_float16"``) and jmp
(``"params=float32,compute=bfloat16,output=float32"``).

>>> import jax.numpy as jnp
>>> import jmp_policy
>>> policy = jmp_policy.Policy("mixed_bfloat16")
>>> policy.cast_to_compute({"w": jnp.ones(2)})["w"].dtype
dtype(bfloat16)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import numbers
import threading
import warnings
from typing import Any, Callable, Iterator, Mapping, Optional, ParamSpec, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jmp_policy import dtypes as _dtypes
from jmp_policy.loss_scale import (
    DEFAULT_DYNAMIC,
    NO_SCALING,
    DynamicLossScale,
    LossScale,
    LossScaleConfig,
    NoOpLossScale,
    StaticLossScale,
)
from jmp_policy.policy import _casting

T = TypeVar("T")
P = ParamSpec("P")
R = TypeVar("R")

#: What functions taking a policy accept: a `Policy`, a name, or ``None`` (the global policy).
PolicyLike = Union["Policy", str, None]

# A policy's dtype as type checkers see it: a numpy dtype "or anything"
# (typeshed's "Any trick"). Every policy has dtypes except the deprecated infer
# ones, whose inferred dtypes are None; so ``policy.compute_dtype.name``
# type-checks without a None check, and code that checks for None is not
# flagged either.
_PolicyDType = Union[np.dtype[Any], Any]

_F32 = np.dtype("float32")
_F16 = np.dtype("float16")
_BF16 = np.dtype("bfloat16")

_KEYS = {"p": "params", "params": "params", "c": "compute", "compute": "compute",
         "o": "output", "output": "output", "loss_scale": "loss_scale"}
_SPECIAL_NAMES = ("mixed_float16", "mixed_bfloat16", "<dtype>_with_float32_vars",
                  "params=<dtype>,compute=<dtype>,output=<dtype> (or p=,c=,o=)",
                  "infer (deprecated)", "infer_float32_vars (deprecated)")
_WITH_F32_VARS = "_with_float32_vars"
_INFER_NAMES = ("infer", "infer_float32_vars", "infer_with_float32_vars")


def _default_loss_scale(compute: Optional[np.dtype[Any]]) -> LossScaleConfig:
    # float16's 5 exponent bits flush small gradients to zero; bfloat16 and
    # float32 share float32's exponent range and never need scaling.
    return DEFAULT_DYNAMIC if compute == _F16 else NO_SCALING


# ---------------------------------------------------------------------------
# Name grammar.
# ---------------------------------------------------------------------------
_DTypes = tuple[Optional[np.dtype[Any]], Optional[np.dtype[Any]], Optional[np.dtype[Any]]]


def _bad_name(name: str, problem: str) -> ValueError:
    return ValueError(
        f"Invalid policy name {name!r}: {problem}. Valid names: a dtype "
        f"({', '.join(_dtypes.VALID_DTYPE_NAMES)}), {', '.join(_SPECIAL_NAMES)}; "
        "optionally followed by ',loss_scale=dynamic|none|<number>'."
    )


def _warn_deprecated(name: str, replacement: str) -> None:
    warnings.warn(
        f"Policy name {name!r} is deprecated (the compute dtype is inferred from the first "
        f"floating input at call time); use an explicit name such as {replacement!r}.",
        DeprecationWarning, stacklevel=6)  # the caller of Policy(...)


def _dtype_in_name(text: str, full: str, role: str) -> np.dtype[Any]:
    try:
        dtype = _dtypes.canonical_dtype(text)
    except (ValueError, TypeError):
        raise ValueError(
            f"Unknown dtype {text!r} in policy name {full!r}: expected one of "
            f"{', '.join(_dtypes.VALID_DTYPE_NAMES)} or a special name "
            f"({', '.join(_SPECIAL_NAMES)})."
        ) from None
    if not _dtypes.is_floating_dtype(dtype):
        raise ValueError(
            f"Policy name {full!r}: the {role} dtype must be floating (float32, float16, "
            f"bfloat16, ...), got {dtype.name!r}.")
    return dtype


def _parse_simple(name: str, full: str) -> _DTypes:
    """A name without ``=``; a compute dtype of None means inferred at call time."""
    if name == "infer":
        _warn_deprecated(name, "float32")
        return None, None, None
    if name in _INFER_NAMES:
        _warn_deprecated(name, "mixed_float16")
        return _F32, None, None
    if name.startswith("mixed_"):
        half = name[len("mixed_"):]
        if half not in ("float16", "bfloat16"):
            raise _bad_name(full, f"unknown mixed precision type {half!r} "
                                  "(expected mixed_float16 or mixed_bfloat16)")
        dtype = np.dtype(half)
        return _F32, dtype, dtype
    if name.endswith(_WITH_F32_VARS):
        dtype = _dtype_in_name(name[: -len(_WITH_F32_VARS)], full, "compute")
        return _F32, dtype, dtype
    dtype = _dtype_in_name(name, full, "params")
    return dtype, dtype, dtype


def _split_parts(full: str) -> tuple[Optional[str], dict[str, str]]:
    """``"a,k=v,..."`` -> (``"a"`` or None, {canonical key: value}), rejecting malformed parts."""
    parts = [part.strip() for part in full.split(",")]
    if any(not part for part in parts):
        raise _bad_name(full, "empty part (check for doubled or trailing commas)")
    simple = parts[0] if "=" not in parts[0] else None
    values: dict[str, str] = {}
    for part in parts[1:] if simple is not None else parts:
        key, equals, value = (s.strip() for s in part.partition("="))
        if not equals or ("=" in value and key != "loss_scale"):  # dynamic(...) has '=' inside
            raise _bad_name(full, f"part {part!r} is not of the form key=value")
        if key not in _KEYS:
            raise _bad_name(full, f"unknown key {key!r} (expected one of "
                                  "params/p, compute/c, output/o, loss_scale)")
        canon = _KEYS[key]
        if canon in values:
            raise _bad_name(full, f"{canon!r} is given twice")
        if not value:
            raise _bad_name(full, f"empty value for {key!r}")
        values[canon] = value
    return simple, values


def _parse_name(full: str) -> tuple[_DTypes, Optional[LossScaleConfig]]:
    """A policy name -> its dtypes, and its loss scale if the name gives one."""
    simple, values = _split_parts(full)
    ls_text = values.pop("loss_scale", None)
    ls = None if ls_text is None else LossScaleConfig.parse(ls_text)
    if simple is not None:
        if values:
            raise _bad_name(full, f"a name ({simple!r}) cannot be combined with "
                                  f"{'/'.join(values)}=; use params=,compute=,output= alone")
        return _parse_simple(simple, full), ls
    if not values:
        raise _bad_name(full, "no dtype given")
    params = _dtype_in_name(values["params"], full, "params") if "params" in values else _F32
    compute = _dtype_in_name(values["compute"], full, "compute") if "compute" in values else params
    output = _dtype_in_name(values["output"], full, "output") if "output" in values else compute
    return (params, compute, output), ls


def _dtypes_from_args(
    first: Union[PolicyLike, DTypeLike], compute: Optional[DTypeLike], output: Optional[DTypeLike]
) -> tuple[_DTypes, Optional[LossScaleConfig]]:
    """`Policy`'s positional arguments -> dtypes, and a loss scale if they carry one."""
    if compute is None and output is None:
        if first is None:
            first = global_policy()
        if isinstance(first, Policy):
            return (first.param_dtype, first.compute_dtype, first.output_dtype), first._loss_scale
        if isinstance(first, str):
            return _parse_name(first)
    elif isinstance(first, Policy) or (isinstance(first, str) and ("," in first or "=" in first)):
        raise TypeError(
            f"Policy(name) takes a name alone; got name {str(first)!r} together with "
            "compute/output dtypes. Pass three dtypes, or a single name.")
    params = _F32 if first is None else _dtypes.floating_dtype(first, "param_dtype")
    compute_ = params if compute is None else _dtypes.floating_dtype(compute, "compute_dtype")
    output_ = compute_ if output is None else _dtypes.floating_dtype(output, "output_dtype")
    return (params, compute_, output_), None


# ---------------------------------------------------------------------------
# Policy.
# ---------------------------------------------------------------------------
_UNSET: Any = object()


# Frozen, so type checkers reject assignments too. Not slotted: on Python 3.11 a
# frozen slotted dataclass answers ``policy.typo = x`` with an unrelated TypeError
# from ``super()`` instead of FrozenInstanceError.
@dataclasses.dataclass(frozen=True, init=False, eq=False, repr=False)
class Policy:
    """A mixed-precision policy: parameter, compute and output dtypes, and a loss scale.

    Construct from a name (``Policy("mixed_float16")``, ``Policy("p=f32,c=bf16,o=f32")``,
    or as Keras spells it, ``Policy(name="mixed_float16")``), from dtypes
    (``Policy(jnp.float32, jnp.bfloat16, jnp.float32)``), or with no argument for
    the global policy. ``loss_scale=`` overrides the default loss scale (dynamic
    when computing in float16, none otherwise).

    Attributes:
      param_dtype: the dtype parameters are stored in (alias ``variable_dtype``).
      compute_dtype: the dtype computations run in.
      output_dtype: the dtype results are returned in.

    Each is a ``numpy.dtype``; the deprecated ``infer`` names leave the dtypes
    they infer at call time ``None``.

    >>> import jax, jax.numpy as jnp
    >>> policy = Policy("mixed_bfloat16")
    >>> policy.compute_dtype.name
    'bfloat16'
    >>> f = policy.wrap(lambda w, x: x @ w)
    >>> f(jnp.ones((3, 2)), jnp.ones((4, 3))).dtype
    dtype(bfloat16)
    >>> jax.grad(lambda w: f(w, jnp.ones((4, 3))).sum())(jnp.ones((3, 2))).dtype
    dtype('float32')
    """

    param_dtype: _PolicyDType
    compute_dtype: _PolicyDType
    output_dtype: _PolicyDType
    _loss_scale: LossScaleConfig

    def __init__(
        self,
        param_dtype: Union[PolicyLike, DTypeLike] = None,
        compute_dtype: Optional[DTypeLike] = None,
        output_dtype: Optional[DTypeLike] = None,
        *,
        name: Optional[str] = None,
        loss_scale: LossScaleLike = _UNSET,
        _loss_scale: Optional[LossScaleConfig] = None,
    ) -> None:
        # ``_loss_scale`` is the field as ``dataclasses.replace`` passes it back (jmp's
        # Policy is a dataclass, and code written for jmp replaces its dtypes).
        if name is not None:
            if not isinstance(name, str):
                raise TypeError(f"Policy(name=...) takes a policy name such as 'mixed_float16', "
                                f"got {name!r} of type {type(name).__name__}.")
            if (param_dtype, compute_dtype, output_dtype) != (None, None, None):
                raise TypeError(
                    f"Policy(name={name!r}) takes the name alone, got dtypes as well; pass "
                    "either a name or param_dtype/compute_dtype/output_dtype.")
            param_dtype = name
        dtypes, ls = _dtypes_from_args(param_dtype, compute_dtype, output_dtype)
        if _loss_scale is not None:
            ls = _loss_scale
        if loss_scale is not _UNSET:
            ls = LossScaleConfig.of(as_loss_scale(loss_scale))
        elif ls is None:
            ls = _default_loss_scale(dtypes[1])
        _set_fields(self, dtypes, ls)

    # -- value semantics ---------------------------------------------------
    def _key(self) -> tuple[Optional[str], Optional[str], Optional[str], LossScaleConfig]:
        # By dtype name: numpy's dtype equality holds float64 equal to None
        # (np.dtype(None) is float64), which would make "infer" equal "float64".
        p, c, o = self.param_dtype, self.compute_dtype, self.output_dtype
        return (_dtype_name(p), _dtype_name(c), _dtype_name(o), self._loss_scale)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    # -- names ---------------------------------------------------------------
    @property
    def name(self) -> str:
        """Canonical dtype name: ``"float32"``, ``"mixed_bfloat16"``, ``"params=...,compute=...,output=..."``."""
        p, c, o = self.param_dtype, self.compute_dtype, self.output_dtype
        if c is None:
            return "infer" if p is None else "infer_float32_vars"
        if p == c == o:
            return c.name
        if p == _F32 and c == o and c in (_F16, _BF16):
            return f"mixed_{c.name}"
        return f"params={p.name},compute={c.name},output={o.name}"

    def __str__(self) -> str:
        if self._loss_scale == _default_loss_scale(self.compute_dtype):
            return self.name
        return f"{self.name},loss_scale={self._loss_scale}"

    def __repr__(self) -> str:
        return f'<Policy "{self}">'

    def get_config(self) -> dict[str, str]:
        """Keras-style config; ``Policy.from_config(p.get_config()) == p``."""
        return {"name": str(self)}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Policy:
        """The policy of a `get_config` dictionary."""
        if not isinstance(config, Mapping) or set(config) != {"name"}:
            raise ValueError(f"Policy.from_config expects {{'name': <policy name>}}, got {config!r}.")
        with warnings.catch_warnings():  # the user was warned when the policy was made
            warnings.simplefilter("ignore", DeprecationWarning)
            return cls(config["name"])

    # -- properties ----------------------------------------------------------
    @property
    def variable_dtype(self) -> _PolicyDType:
        """Alias of ``param_dtype`` (Keras's name)."""
        return self.param_dtype

    @property
    def should_cast_variables(self) -> bool:
        """Whether parameters are cast before computing (param dtype != compute dtype)."""
        return bool(self.param_dtype != self.compute_dtype)

    @property
    def loss_scale(self) -> LossScale:
        """A fresh loss-scale object built from this policy's loss-scale settings."""
        return self._loss_scale.build()

    def with_output_dtype(self, output_dtype: DTypeLike) -> Policy:
        """The same policy with another output dtype."""
        output = _dtypes.floating_dtype(output_dtype, "output_dtype")
        return _make(self.param_dtype, self.compute_dtype, output, self._loss_scale)

    # -- casting -------------------------------------------------------------
    def cast_to_param(self, tree: T) -> T:
        """Casts floating arrays in ``tree`` to the parameter dtype."""
        return _casting.cast_tree(tree, self.param_dtype)

    def cast_to_compute(self, tree: T) -> T:
        """Casts floating arrays in ``tree`` to the compute dtype."""
        return _casting.cast_tree(tree, self.compute_dtype)

    def cast_to_output(self, tree: T) -> T:
        """Casts floating arrays in ``tree`` to the output dtype."""
        return _casting.cast_tree(tree, self.output_dtype)

    def wrap(self, fn: Callable[P, R]) -> Callable[P, R]:
        """Returns ``fn`` with floating arguments cast to compute and results to output dtype.

        Works with ``jit``, ``grad`` and ``vmap`` and on ``flax.linen.Module.apply``;
        gradients with respect to float32 arguments come back float32.
        """
        check_callable(fn, "Policy.wrap(fn)")

        @functools.wraps(fn)
        def wrapped(*args: P.args, **kwargs: P.kwargs) -> R:
            compute = self.compute_dtype
            if compute is None:  # a deprecated infer policy
                compute = _casting.first_floating_dtype((args, kwargs))
            args, kwargs = _casting.cast_tree((args, kwargs), compute)
            out = fn(*args, **kwargs)
            return _casting.cast_tree(out, compute if self.output_dtype is None else self.output_dtype)

        return wrapped


def _dtype_name(dtype: Optional[np.dtype[Any]]) -> Optional[str]:
    return None if dtype is None else dtype.name


def _set_fields(policy: Policy, dtypes: _DTypes, loss_scale: LossScaleConfig) -> None:
    # The one place fields are written: a frozen dataclass is set up through object.
    for field, value in zip(("param_dtype", "compute_dtype", "output_dtype"), dtypes):
        object.__setattr__(policy, field, value)
    object.__setattr__(policy, "_loss_scale", loss_scale)


def _make(
    param: Optional[np.dtype[Any]],
    compute: Optional[np.dtype[Any]],
    output: Optional[np.dtype[Any]],
    loss_scale: LossScaleConfig,
) -> Policy:
    """A policy from validated fields, without parsing."""
    policy = object.__new__(Policy)
    _set_fields(policy, (param, compute, output), loss_scale)
    return policy


# Leafless pytree: the dtypes are static, so a policy can cross jit boundaries.
jax.tree_util.register_static(Policy)


def check_callable(fn: object, call: str) -> None:
    """Raises ``TypeError`` now, not when called, if ``fn`` cannot be wrapped by ``call``."""
    if isinstance(fn, Policy):
        raise TypeError(
            f"{call} takes the function to wrap, got the policy {fn!r}; the function comes "
            "first: jmp_policy.wrap(fn, policy) or policy.wrap(fn).")
    if not callable(fn):
        raise TypeError(f"{call} takes a function (any callable) to wrap, got {fn!r} of type "
                        f"{type(fn).__name__}.")


def get_policy(name: Union[str, Policy]) -> Policy:
    """jmp's constructor by name: same as ``Policy(name)``."""
    if not isinstance(name, (str, Policy)):
        raise TypeError(f"get_policy expects a policy name such as 'mixed_float16', got {name!r}.")
    return Policy(name)


def as_policy(policy: PolicyLike) -> Policy:
    """``None`` -> the global policy; a name -> ``Policy(name)``; a `Policy` -> itself."""
    if policy is None:
        return global_policy()
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        return Policy(policy)
    raise TypeError(
        f"Expected a Policy, a policy name such as 'mixed_bfloat16', or None; got "
        f"{policy!r} of type {type(policy).__name__}.")


# ---------------------------------------------------------------------------
# jmp's free functions.
# ---------------------------------------------------------------------------
def cast_to_full(tree: T) -> T:
    """Casts floating arrays in ``tree`` to float32 (jmp)."""
    return _casting.cast_tree(tree, _F32)


def cast_to_half(tree: T) -> T:
    """Casts floating arrays in ``tree`` to the platform's half type (jmp)."""
    return _casting.cast_tree(tree, np.dtype(_dtypes.half_dtype()))


def wrap(fn: Callable[P, R], policy: PolicyLike = None) -> Callable[P, R]:
    """``as_policy(policy).wrap(fn)``; ``None`` is the global policy now, at wrap time.

    >>> import jax.numpy as jnp
    >>> wrap(jnp.sin, "bfloat16")(jnp.ones(2)).dtype
    dtype(bfloat16)
    """
    check_callable(fn, "jmp_policy.wrap(fn, policy)")
    return as_policy(policy).wrap(fn)


# ---------------------------------------------------------------------------
# Global policy (process-wide) and thread-local scopes.
# ---------------------------------------------------------------------------
_FLOAT32 = _make(_F32, _F32, _F32, NO_SCALING)
_global = _FLOAT32  # one assignment replaces it, so threads see the old or the new policy
_local = threading.local()


def set_global_policy(policy: PolicyLike) -> None:
    """Sets the process-wide policy (``None`` restores ``"float32"``). Aliases: set_policy, set_dtype_policy."""
    global _global
    _global = _FLOAT32 if policy is None else as_policy(policy)


set_policy = set_global_policy
set_dtype_policy = set_global_policy


def global_policy() -> Policy:
    """The policy in force in this thread: the innermost `policy_scope`, else the global one."""
    stack: Optional[list[Policy]] = getattr(_local, "stack", None)
    return stack[-1] if stack else _global


dtype_policy = global_policy


@contextlib.contextmanager
def policy_scope(policy: PolicyLike) -> Iterator[Policy]:
    """Overrides the global policy in the current thread only; restored on exit, also on error.

    >>> with policy_scope("mixed_bfloat16") as p:
    ...     Policy() == p
    True
    """
    new = as_policy(policy)
    stack: Optional[list[Policy]] = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(new)
    try:
        yield new
    finally:
        stack.pop()


# --- Loss scales named by policies ----------------------------------------------------------

LossScaleLike = Union[LossScale, "Policy", str, float, jax.Array, np.ndarray, None]


def as_loss_scale(loss_scale: Any) -> LossScale:
    """The loss-scale object meant by a ``loss_scale=`` argument.

    ``"dynamic"`` (a default `DynamicLossScale`), a number or a 0-d array (a
    `StaticLossScale`), ``None`` (`NoOpLossScale`), a `jmp_policy.Policy` or a
    policy name (its loss scale) or a loss-scale object (returned as it is).

    >>> as_loss_scale(128.0)
    StaticLossScale(loss_scale=np.float32(128.0))
    >>> as_loss_scale("mixed_bfloat16")
    NoOpLossScale()
    """
    if loss_scale is None:
        return NoOpLossScale()
    if isinstance(loss_scale, (NoOpLossScale, StaticLossScale, DynamicLossScale)):
        return loss_scale
    if isinstance(loss_scale, Policy):
        return loss_scale.loss_scale
    if isinstance(loss_scale, str):
        if loss_scale == "dynamic":
            return DynamicLossScale()
        try:
            return Policy(loss_scale).loss_scale
        except ValueError as error:
            raise ValueError(f"Unknown loss_scale {loss_scale!r}: {_FORMS}. As a policy name: "
                             f"{error}") from None
    is_number = isinstance(loss_scale, numbers.Real) and not isinstance(loss_scale, bool)
    is_array = (isinstance(loss_scale, (np.ndarray, np.generic, jax.Array))
                and np.ndim(loss_scale) == 0 and jnp.issubdtype(loss_scale.dtype, jnp.number))
    if is_number or is_array:
        return StaticLossScale(loss_scale)
    raise TypeError(f"loss_scale must be one of: {_FORMS}; got {loss_scale!r} of type "
                    f"{type(loss_scale).__name__}.")


_FORMS = ("'dynamic', a number (a static scale), None (no scaling), a jmp_policy.Policy or "
          "policy name such as 'mixed_float16', or a NoOpLossScale / StaticLossScale / "
          "DynamicLossScale")

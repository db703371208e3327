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
import functools
import threading
import warnings
from typing import Any, Callable, Iterator, Mapping, Optional, Tuple, TypeVar, Union

import jax
import numpy as np

from jmp_policy import _casting
from jmp_policy import _dtypes
from jmp_policy import loss_scale as _ls

T = TypeVar("T")
DTypeLike = Any
PolicyLike = Union["Policy", str, None]

_F32 = np.dtype("float32")
_F16 = np.dtype("float16")
_BF16 = np.dtype("bfloat16")

_KEYS = {"p": "params", "params": "params", "c": "compute", "compute": "compute",
         "o": "output", "output": "output", "loss_scale": "loss_scale"}
_SPECIAL_NAMES = ("mixed_float16", "mixed_bfloat16", "<dtype>_with_float32_vars",
                  "params=<dtype>,compute=<dtype>,output=<dtype> (or p=,c=,o=)",
                  "infer (deprecated)", "infer_float32_vars (deprecated)")
_WITH_F32_VARS = "_with_float32_vars"

# ---------------------------------------------------------------------------
# Loss-scale configuration: the static, hashable part of a loss scale that a
# policy carries as part of its value.
#   ("none",) | ("static", scale) | ("dynamic", initial, period, factor, min, max)
# ---------------------------------------------------------------------------
_LS_NONE = ("none",)
_DYNAMIC_DEFAULTS = (2.0**15, 2000, 2, 1.0, None)
_LS_DYNAMIC = ("dynamic",) + _DYNAMIC_DEFAULTS
_UNSET: Any = object()


def _concrete_float(x: Any, what: str) -> float:
    try:
        return float(np.asarray(x))
    except (TypeError, jax.errors.ConcretizationTypeError):
        raise TypeError(
            f"A policy's loss scale is static configuration, but {what} is a traced value; "
            "build the policy outside jit, or pass the loss scale to loss_scaling() instead."
        ) from None


def _ls_config(loss_scale: Any) -> tuple:
    """Normalises the ``loss_scale=`` argument of `Policy` into a hashable config."""
    loss_scale = _ls.as_loss_scale(loss_scale)
    if isinstance(loss_scale, _ls.NoOpLossScale):
        return _LS_NONE
    if isinstance(loss_scale, _ls.StaticLossScale):
        return ("static", _concrete_float(loss_scale.loss_scale, "loss_scale"))
    max_ = loss_scale.max_loss_scale
    return (
        "dynamic",
        _concrete_float(loss_scale.loss_scale, "loss_scale"),
        int(loss_scale.period),
        loss_scale.factor,
        _concrete_float(loss_scale.min_loss_scale, "min_loss_scale"),
        None if max_ is None else _concrete_float(max_, "max_loss_scale"),
    )


def _ls_object(config: tuple) -> Any:
    kind = config[0]
    if kind == "none":
        return _ls.NoOpLossScale()
    if kind == "static":
        return _ls.StaticLossScale(np.float32(config[1]))
    initial, period, factor, min_, max_ = config[1:]
    return _ls.DynamicLossScale(
        loss_scale=np.float32(initial), period=period, factor=factor,
        min_loss_scale=np.float32(min_),
        max_loss_scale=None if max_ is None else np.float32(max_))


def _ls_to_str(config: tuple) -> str:
    kind = config[0]
    if kind == "none":
        return "none"
    if kind == "static":
        return repr(config[1])
    if config == _LS_DYNAMIC:
        return "dynamic"
    initial, period, factor, min_, max_ = config[1:]
    return (f"dynamic(initial={initial!r};period={period};factor={factor!r};"
            f"min={min_!r};max={'none' if max_ is None else repr(max_)})")


def _ls_from_str(text: str) -> tuple:
    if text == "none":
        return _LS_NONE
    if text == "dynamic":
        return _LS_DYNAMIC
    if text.startswith("dynamic(") and text.endswith(")"):
        fields = dict(item.split("=", 1) for item in text[8:-1].split(";") if "=" in item)
        expected = ["initial", "period", "factor", "min", "max"]
        if sorted(fields) != sorted(expected):
            raise ValueError(f"Malformed dynamic loss scale {text!r}: expected "
                             "dynamic(initial=..;period=..;factor=..;min=..;max=..).")
        factor = fields["factor"]
        return _ls_config(_ls.DynamicLossScale(
            loss_scale=np.float32(float(fields["initial"])), period=int(fields["period"]),
            factor=int(factor) if factor.isdigit() else float(factor),
            min_loss_scale=np.float32(float(fields["min"])),
            max_loss_scale=None if fields["max"] == "none" else np.float32(float(fields["max"]))))
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"Unknown loss_scale {text!r} in policy name: expected 'dynamic', "
                         "'none' or a number (a static scale).") from None
    return _ls_config(np.float32(value))


def _default_ls(compute: Optional[np.dtype]) -> tuple:
    # float16's 5 exponent bits flush small gradients to zero; bfloat16 and
    # float32 share float32's exponent range and never need scaling.
    return _LS_DYNAMIC if compute == _F16 else _LS_NONE


# ---------------------------------------------------------------------------
# Name grammar.
# ---------------------------------------------------------------------------
def _bad_name(name: str, problem: str) -> ValueError:
    return ValueError(
        f"Invalid policy name {name!r}: {problem}. Valid names: a dtype "
        f"({', '.join(_dtypes.VALID_DTYPE_NAMES)}), {', '.join(_SPECIAL_NAMES)}; "
        "optionally followed by ',loss_scale=dynamic|none|<number>'."
    )


def _deprecated(name: str, replacement: str) -> None:
    warnings.warn(
        f"Policy name {name!r} is deprecated (the compute dtype is inferred from the first "
        f"floating input at call time); use an explicit name such as {replacement!r}.",
        DeprecationWarning, stacklevel=4)


def _parse_simple(name: str, full: str) -> Tuple[Optional[np.dtype], ...]:
    """A name without ``=``: returns (params, compute, output); compute None means inferred."""
    if name == "infer":
        _deprecated(name, "float32")
        return None, None, None
    if name in ("infer_float32_vars", "infer_with_float32_vars"):
        _deprecated(name, "mixed_float16")
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


def _dtype_in_name(text: str, full: str, role: str) -> np.dtype:
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


def _parse_name(full: str) -> Tuple[Optional[np.dtype], Optional[np.dtype], Optional[np.dtype], Any]:
    parts = [part.strip() for part in full.split(",")]
    if any(not part for part in parts):
        raise _bad_name(full, "empty part (check for doubled or trailing commas)")
    simple = parts[0] if "=" not in parts[0] else None
    values: dict = {}
    for part in parts[1:] if simple is not None else parts:
        key, _, value = (s.strip() for s in part.partition("="))
        if not _ or ("=" in value and key != "loss_scale"):  # dynamic(...) has '=' inside
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
    ls = _ls_from_str(values.pop("loss_scale")) if "loss_scale" in values else _UNSET
    if simple is not None:
        if values:
            raise _bad_name(full, f"a name ({simple!r}) cannot be combined with "
                                  f"{'/'.join(values)}=; use params=,compute=,output= alone")
        return (*_parse_simple(simple, full), ls)
    if not values:
        raise _bad_name(full, "no dtype given")
    params = _dtype_in_name(values["params"], full, "params") if "params" in values else _F32
    compute = _dtype_in_name(values["compute"], full, "compute") if "compute" in values else params
    output = _dtype_in_name(values["output"], full, "output") if "output" in values else compute
    return params, compute, output, ls


# ---------------------------------------------------------------------------
# Policy.
# ---------------------------------------------------------------------------
class Policy:
    """A mixed-precision policy: parameter, compute and output dtypes, and a loss scale.

    Construct from a name (``Policy("mixed_float16")``, ``Policy("p=f32,c=bf16,o=f32")``),
    from dtypes (``Policy(jnp.float32, jnp.bfloat16, jnp.float32)``), or with no
    argument for the global policy.

    >>> import jax, jax.numpy as jnp
    >>> policy = Policy("mixed_bfloat16")
    >>> f = policy.wrap(lambda w, x: x @ w)
    >>> f(jnp.ones((3, 2)), jnp.ones((4, 3))).dtype
    dtype(bfloat16)
    >>> jax.grad(lambda w: f(w, jnp.ones((4, 3))).sum())(jnp.ones((3, 2))).dtype
    dtype('float32')
    """

    __slots__ = ("_param", "_compute", "_output", "_ls")

    def __init__(
        self,
        param_dtype: Union[DTypeLike, str, "Policy", None] = None,
        compute_dtype: Optional[DTypeLike] = None,
        output_dtype: Optional[DTypeLike] = None,
        *,
        loss_scale: Any = _UNSET,
    ):
        if compute_dtype is None and output_dtype is None and (
            param_dtype is None or isinstance(param_dtype, (str, Policy))
        ):
            if param_dtype is None:
                base = global_policy()
            elif isinstance(param_dtype, Policy):
                base = param_dtype
            else:
                base = None
            if base is not None:
                params, compute, output, ls = (
                    base._param, base._compute, base._output, base._ls)
            else:
                params, compute, output, ls = _parse_name(param_dtype)
        else:
            if isinstance(param_dtype, (str, Policy)) and not _is_dtype_str(param_dtype):
                raise TypeError(
                    f"Policy(name) takes a name alone; got name {param_dtype!r} together with "
                    "compute/output dtypes. Pass three dtypes, or a single name.")
            params = (_F32 if param_dtype is None
                      else _dtypes.floating_dtype(param_dtype, "param_dtype"))
            compute = (params if compute_dtype is None
                       else _dtypes.floating_dtype(compute_dtype, "compute_dtype"))
            output = (compute if output_dtype is None
                      else _dtypes.floating_dtype(output_dtype, "output_dtype"))
            ls = _UNSET
        if loss_scale is not _UNSET:
            ls = _ls_config(loss_scale)
        elif ls is _UNSET:
            ls = _default_ls(compute)
        object.__setattr__(self, "_param", params)
        object.__setattr__(self, "_compute", compute)
        object.__setattr__(self, "_output", output)
        object.__setattr__(self, "_ls", ls)

    # -- value semantics ---------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Policy is immutable; cannot set {name!r}. "
                             "Build a new one, e.g. with with_output_dtype().")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("Policy is immutable.")

    def _key(self) -> tuple:
        return (self._param, self._compute, self._output, self._ls)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __reduce__(self):
        return (_restore, self._key())

    def __copy__(self) -> "Policy":
        return self

    def __deepcopy__(self, memo: Any) -> "Policy":
        return self

    # -- names ---------------------------------------------------------------
    @property
    def name(self) -> str:
        """Canonical dtype name: ``"float32"``, ``"mixed_bfloat16"``, ``"params=...,compute=...,output=..."``."""
        p, c, o = self._param, self._compute, self._output
        if c is None:
            return "infer" if p is None else "infer_float32_vars"
        if p == c == o:
            return c.name
        if p == _F32 and c == o and c in (_F16, _BF16):
            return f"mixed_{c.name}"
        return f"params={p.name},compute={c.name},output={o.name}"

    def __str__(self) -> str:
        if self._ls == _default_ls(self._compute):
            return self.name
        return f"{self.name},loss_scale={_ls_to_str(self._ls)}"

    def __repr__(self) -> str:
        return f'<Policy "{self}">'

    def get_config(self) -> dict:
        """Keras-style config; ``Policy.from_config(p.get_config()) == p``."""
        return {"name": str(self)}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "Policy":
        if not isinstance(config, Mapping) or set(config) != {"name"}:
            raise ValueError(f"Policy.from_config expects {{'name': <policy name>}}, got {config!r}.")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return cls(config["name"])

    # -- properties ----------------------------------------------------------
    @property
    def param_dtype(self) -> Optional[np.dtype]:
        return self._param

    variable_dtype = param_dtype

    @property
    def compute_dtype(self) -> Optional[np.dtype]:
        """``None`` for the deprecated infer policies (taken from the inputs at call time)."""
        return self._compute

    @property
    def output_dtype(self) -> Optional[np.dtype]:
        return self._output

    @property
    def should_cast_variables(self) -> bool:
        return self._param != self._compute

    @property
    def loss_scale(self) -> Any:
        """A fresh loss-scale object built from this policy's loss-scale configuration."""
        return _ls_object(self._ls)

    def with_output_dtype(self, output_dtype: DTypeLike) -> "Policy":
        """The same policy with another output dtype."""
        new = object.__new__(Policy)
        for slot, value in zip(self.__slots__, self._key()):
            object.__setattr__(new, slot, value)
        object.__setattr__(new, "_output", _dtypes.floating_dtype(output_dtype, "output_dtype"))
        return new

    # -- casting -------------------------------------------------------------
    def cast_to_param(self, tree: T) -> T:
        """Casts floating arrays in ``tree`` to the parameter dtype."""
        return _casting.cast_tree(tree, self._param)

    def cast_to_compute(self, tree: T) -> T:
        """Casts floating arrays in ``tree`` to the compute dtype."""
        return _casting.cast_tree(tree, self._compute)

    def cast_to_output(self, tree: T) -> T:
        """Casts floating arrays in ``tree`` to the output dtype."""
        return _casting.cast_tree(tree, self._output)

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Returns ``fn`` with floating arguments cast to compute and results to output dtype.

        Works with ``jit``, ``grad`` and ``vmap`` and on ``flax.linen.Module.apply``;
        gradients with respect to float32 arguments come back float32.
        """
        policy = self

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            compute = policy._compute
            if compute is None:
                compute = _casting.first_floating_dtype((args, kwargs))
            args, kwargs = _casting.cast_tree((args, kwargs), compute)
            out = fn(*args, **kwargs)
            return _casting.cast_tree(out, policy._output or compute)

        return wrapped


def _is_dtype_str(x: Any) -> bool:
    return isinstance(x, str) and "," not in x and "=" not in x


def _restore(param, compute, output, ls) -> Policy:
    new = object.__new__(Policy)
    for slot, value in zip(Policy.__slots__, (param, compute, output, ls)):
        object.__setattr__(new, slot, value)
    return new


# Leafless pytree: the dtypes are static, so a policy can cross jit boundaries.
jax.tree_util.register_static(Policy)


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


def wrap(fn: Callable[..., Any], policy: PolicyLike = None) -> Callable[..., Any]:
    """``as_policy(policy).wrap(fn)``; ``None`` is the global policy now, at wrap time."""
    return as_policy(policy).wrap(fn)


# ---------------------------------------------------------------------------
# Global policy (process-wide) and thread-local scopes.
# ---------------------------------------------------------------------------
_global_lock = threading.Lock()
_global: Optional[Policy] = None  # lazily Policy("float32")
_local = threading.local()


def set_global_policy(policy: PolicyLike) -> None:
    """Sets the process-wide policy (``None`` restores ``"float32"``). Aliases: set_policy, set_dtype_policy."""
    global _global
    new = Policy("float32") if policy is None else as_policy(policy)
    with _global_lock:
        _global = new


set_policy = set_global_policy
set_dtype_policy = set_global_policy


def global_policy() -> Policy:
    """The policy in force in this thread: the innermost `policy_scope`, else the global one."""
    stack = getattr(_local, "stack", None)
    if stack:
        return stack[-1]
    global _global
    if _global is None:
        with _global_lock:
            if _global is None:
                _global = _restore(_F32, _F32, _F32, _LS_NONE)
    return _global


dtype_policy = global_policy


@contextlib.contextmanager
def policy_scope(policy: PolicyLike) -> Iterator[Policy]:
    """Overrides the global policy in the current thread only; restored on exit, also on error.

    >>> with policy_scope("mixed_bfloat16") as p:
    ...     Policy() == p
    True
    """
    new = as_policy(policy)
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(new)
    try:
        yield new
    finally:
        stack.pop()

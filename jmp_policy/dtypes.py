"""Dtype helpers shared by policies, policy maps and autocast.

Everything here works on ``numpy.dtype`` objects, which is what ``jnp.dtype``
returns and what JAX arrays, numpy arrays and tracers all expose as ``.dtype``.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_policy.formats import facts_of

__all__ = ["DType", "F32", "VALID_DTYPE_NAMES", "canonical_dtype", "convert", "dtype_of",
           "floating_dtype", "half_dtype", "has_float32_range", "holds", "is_floating",
           "is_floating_dtype", "join", "represents", "retyped", "struct",
           "widest"]

# Short forms accepted in policy names, besides every name numpy/JAX knows.
_ALIASES = {
    "f64": "float64",
    "f32": "float32",
    "full": "float32",
    "f16": "float16",
    "bf16": "bfloat16",
}

# Shown in error messages; "half" is resolved per platform by `half_dtype`.
VALID_DTYPE_NAMES = (
    "float64", "f64", "float32", "f32", "full",
    "float16", "f16", "bfloat16", "bf16", "half",
)


def half_dtype() -> Any:
    """The platform's half type: ``bfloat16`` on TPU, ``float16`` elsewhere (as in jmp).

    >>> import jmp_policy
    >>> jmp_policy.half_dtype() in (jnp.float16, jnp.bfloat16)
    True
    """
    return jnp.bfloat16 if jax.default_backend() == "tpu" else jnp.float16


@functools.lru_cache(maxsize=None)
def is_floating_dtype(dtype: Any) -> bool:
    """True for real floating dtypes (float64..float8, bfloat16 included)."""
    try:
        return bool(jnp.issubdtype(dtype, jnp.floating))
    except TypeError:  # extended dtypes such as PRNG key dtypes
        return False


def canonical_dtype(x: Any) -> np.dtype[Any]:
    """Turns a dtype-like (``jnp.float16``, ``np.float32``, ``"bf16"``, ``"half"``) into ``np.dtype``.

    Raises ``ValueError`` containing "Unknown dtype" (jmp's message) for names
    that are not dtypes, and ``TypeError`` for objects that are not dtype-like.
    """
    if isinstance(x, np.dtype):
        return x
    if isinstance(x, str):
        name = _ALIASES.get(x, x)
        if name == "half":
            return _numpy_dtype(half_dtype())
        if name != x or name in VALID_DTYPE_NAMES or _is_dtype_name(name):
            return _numpy_dtype(name)
        raise ValueError(
            f"Unknown dtype {x!r}: expected one of {', '.join(VALID_DTYPE_NAMES)} "
            "(or another floating dtype name known to JAX such as 'float8_e4m3fn')."
        )
    try:
        return _numpy_dtype(x)
    except TypeError:
        raise TypeError(
            f"Expected a dtype (e.g. jnp.float16, np.float32, 'bfloat16'), got {x!r} "
            f"of type {type(x).__name__}."
        ) from None


def _numpy_dtype(x: Any) -> np.dtype[Any]:
    # Through JAX, which knows bfloat16 and the float8 types by name.
    dtype: np.dtype[Any] = np.dtype(jnp.dtype(x))
    return dtype


@functools.lru_cache(maxsize=None)
def _is_dtype_name(name: str) -> bool:
    try:
        jnp.dtype(name)
    except TypeError:
        return False
    return True


def floating_dtype(x: Any, what: str) -> np.dtype[Any]:
    """`canonical_dtype` that also insists on a floating dtype; `what` names the role in errors."""
    dtype = canonical_dtype(x)
    if not is_floating_dtype(dtype):
        raise ValueError(
            f"{what} must be a floating dtype (float64, float32, float16, bfloat16, ...), "
            f"got {dtype.name!r}: only floating values are cast by a policy."
        )
    return dtype


# --- How floating dtypes order (autocast's lattice) -------------------------------------

DType = np.dtype[Any]

F32: DType = np.dtype(np.float32)


def dtype_of(x: Any) -> Any:
    """The dtype of an array, tracer or Python scalar; ``None`` for anything else.

    Extended dtypes (PRNG keys) are returned as they are, not as ``np.dtype``.
    """
    dtype = getattr(x, "dtype", None)
    if dtype is None and isinstance(x, (bool, int, float, complex)):
        # Python scalars are weakly typed: JAX sees 2.0 as float32, not numpy's float64.
        dtype = jnp.result_type(x)
    if dtype is None or jnp.issubdtype(dtype, jax.dtypes.extended):
        return dtype
    return np.dtype(dtype)


def is_floating(x: Any) -> bool:
    """True for a value with a real floating dtype (float8 to float64)."""
    dtype = dtype_of(x)
    return dtype is not None and is_floating_dtype(dtype)


@functools.lru_cache(maxsize=None)
def represents(wide: DType, narrow: DType) -> bool:
    """True when every value of ``narrow`` is exactly a value of ``wide``."""
    a, b = facts_of(wide), facts_of(narrow)
    return a.exponent_bits >= b.exponent_bits and a.mantissa >= b.mantissa


@functools.lru_cache(maxsize=None)
def has_float32_range(dtype: Any) -> bool:
    """Whether ``dtype`` reaches float32's largest values (bfloat16 does, float16 does not):
    what overflows float16 does not overflow it."""
    return facts_of(dtype).exponent_bits >= facts_of(F32).exponent_bits


@functools.lru_cache(maxsize=None)
def join(a: DType, b: DType) -> DType:
    """The narrowest floating dtype that represents both ``a`` and ``b``."""
    if represents(a, b):
        return a
    if represents(b, a):
        return b
    try:
        return np.dtype(jnp.promote_types(a, b))
    except TypeError:  # float8 types refuse implicit promotion
        return F32 if max(a.itemsize, b.itemsize) <= 4 else np.dtype(np.float64)


def widest(values: Sequence[Any], weak: Sequence[bool],
           constants: Optional[Sequence[Any]] = None) -> DType:
    """The join of the floating dtypes of ``values``, as JAX would promote them.

    Weakly typed values (Python scalars in ``fn``) do not widen strongly typed
    ones: ``x * 2.0`` stays in ``x``'s dtype. Nor do scalar constants of ``fn``
    (``constants[i]`` the value of a jaxpr literal, else ``None``) that the
    result's dtype holds to within its rounding (finite and zero or normal, or
    not finite): their dtype is the one ``fn`` was traced in (``jax.nn.gelu``
    writes its coefficients in its input's dtype), float32 for float32
    parameters, where the policy computes in half precision. A constant the
    narrower dtype cannot hold (``-1e30`` under float16) widens as JAX's
    promotion says. At least one value must be floating.
    """
    constants = constants if constants is not None else [None] * len(values)
    floating = [(dtype_of(x), w, c) for x, w, c in zip(values, weak, constants)
                if is_floating(x)]
    deciding = [d for d, w, c in floating if not w and c is None]
    if not deciding:  # only constants and Python scalars: JAX's promotion
        deciding = [d for d, w, _ in floating if not w] or [d for d, _, _ in floating]
        return functools.reduce(join, deciding)
    target: DType = functools.reduce(join, deciding)
    unheld = [d for d, w, c in floating if c is not None and not w and not holds(target, c)]
    return functools.reduce(join, unheld, target)


def holds(dtype: DType, value: Any) -> bool:
    """Whether ``dtype`` holds the scalar ``value`` to within its rounding: ``value`` is
    not finite, zero, or a normal number of ``dtype`` (neither overflows nor flushes)."""
    v = abs(float(np.asarray(value, np.float64)))
    fmt = facts_of(dtype)
    return not np.isfinite(v) or v == 0 or fmt.tiny <= v <= fmt.max


def struct(shape: Sequence[int], dtype: Any, weak_type: bool = False) -> jax.ShapeDtypeStruct:
    """A ``jax.ShapeDtypeStruct``, for tracing a jaxpr at new input dtypes."""
    return jax.ShapeDtypeStruct(shape, dtype, weak_type=weak_type)  # type: ignore[no-untyped-call]


def retyped(aval: Any, dtype: Any) -> Any:
    """An input of a jaxpr (its abstract value) at ``dtype``, for tracing the jaxpr again.

    It keeps the value's weak type and, inside ``shard_map``, whether it varies
    across the manual mesh axes: a loop body traced again there must see its
    carry as varying as it was, or its first product with a varying value fails.
    """
    return aval if dtype == aval.dtype else aval.update(dtype=dtype)


def convert(x: Any, dtype: Any) -> Any:
    """``x`` cast to ``dtype`` when both are floating; anything else as it is.

    A numpy value (a literal of the jaxpr) stays a numpy value, so it is still
    embedded as a constant rather than converted at run time.
    """
    if not is_floating(x) or not is_floating_dtype(dtype) or dtype_of(x) == dtype:
        return x
    if isinstance(x, (np.ndarray, np.generic)):
        return np.asarray(x, dtype)
    return lax.convert_element_type(x, dtype)

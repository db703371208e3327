"""Dtype helpers shared by policies, policy maps and autocast.

Everything here works on ``numpy.dtype`` objects, which is what ``jnp.dtype``
returns and what JAX arrays, numpy arrays and tracers all expose as ``.dtype``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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


def round_to(x: jax.Array, dtype: Any) -> jax.Array:
    """``x`` rounded to nearest in ``dtype`` and kept in ``x``'s wider dtype.

    The value of ``x.astype(dtype).astype(x.dtype)``, infinities and overflow to
    them included, for every ``x`` in the range of a ``dtype`` with infinities
    (bfloat16, float16, float8_e5m2) and every ``x`` within the largest finite
    value of one without (float8_e4m3fn). Written as two conversions, XLA may
    drop the rounding: its GPU backend removes such convert pairs under ``jit``
    (excess precision is allowed by default), which silently breaks any
    algorithm that measures a rounding error. `jax.lax.reduce_precision` is the
    operation XLA keeps; it flushes the narrow type's subnormals to zero, so
    those are rounded here on their own grid, a multiple of the smallest
    subnormal (exact in ``x``'s dtype).

    >>> x = jnp.float32(1 + 2**-9)
    >>> float(round_to(x, jnp.bfloat16)), float(x.astype(jnp.bfloat16))
    (1.0, 1.0)
    >>> float(round_to(jnp.float32(3e-6), jnp.float16)) == float(jnp.float16(3e-6))
    True
    """
    info = jnp.finfo(dtype)  # type: ignore[no-untyped-call]
    # A type without infinities spends its top exponent on numbers: one more
    # exponent bit keeps those finite.
    has_inf = bool(np.isinf(np.asarray(np.inf).astype(dtype)))
    normal = jax.lax.reduce_precision(x, exponent_bits=info.nexp + (not has_inf),
                                      mantissa_bits=info.nmant)
    wide = jnp.finfo(x.dtype)  # type: ignore[no-untyped-call]
    if wide.smallest_normal >= info.smallest_normal:
        return normal  # the narrow type's subnormals are the wide type's (bfloat16 in float32)
    quantum = jnp.asarray(info.smallest_subnormal, x.dtype)
    subnormal = jax.lax.round(x / quantum, jax.lax.RoundingMethod.TO_NEAREST_EVEN) * quantum
    return jnp.where(jnp.abs(x) < jnp.asarray(info.smallest_normal, x.dtype), subnormal, normal)

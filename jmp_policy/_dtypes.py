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

"""The floating dtypes autocast moves values between, and how they order.

A dtype *represents* another when every value of the other is exactly one of
its values (float32 represents float16 and bfloat16). The *join* of two dtypes
is the narrowest one that represents both. A cast is *narrowing* when its
target does not represent its source: float32 -> float16, and also
float16 <-> bfloat16, since neither holds the other (float16 has more mantissa
bits, bfloat16 more exponent bits).

>>> import jax.numpy as jnp, numpy as np
>>> join(np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
dtype('float32')
>>> represents(np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
False
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_policy._dtypes import is_floating_dtype

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
    a, b = jnp.finfo(wide), jnp.finfo(narrow)  # type: ignore[no-untyped-call]
    return bool(a.nexp >= b.nexp and a.nmant >= b.nmant)


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


def widest(values: Sequence[Any], weak: Sequence[bool]) -> DType:
    """The join of the floating dtypes of ``values``, as JAX would promote them.

    Weakly typed values (Python scalars in ``fn``) do not widen strongly typed
    ones: ``x * 2.0`` stays in ``x``'s dtype. At least one value must be floating.
    """
    strong = [dtype_of(x) for x, w in zip(values, weak) if is_floating(x) and not w]
    dtypes = strong or [dtype_of(x) for x in values if is_floating(x)]
    return functools.reduce(join, dtypes)


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

"""Whether every value in a pytree is finite: one exact check for every backend.

For any number ``x``, ``x - x`` is ``0`` when ``x`` is finite and NaN when it
is inf or NaN (IEEE 754). A sum of zeros can neither overflow nor round, so
``sum(x - x)`` is ``0`` exactly when every element of ``x`` is finite, in any
summation order and on any backend. XLA reads each leaf once and writes no
boolean mask.
"""

from __future__ import annotations

import functools
from typing import Any, Hashable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType


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

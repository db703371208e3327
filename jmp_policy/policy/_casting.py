"""The cast engine behind `Policy` and `PolicyMap`.

Only floating arrays are cast (JAX arrays, numpy arrays and scalars, tracers);
everything else, including Python floats, passes through; a leaf already in
the target dtype is returned as the same object.

Speed matters when casting eagerly: each `astype` is one dispatch, with its
Python and runtime overhead, which dominates for pytrees of many small
parameters. So concrete JAX arrays are converted in one
jitted call per target dtype (one dispatch for the whole tree); under a trace
the converts are emitted directly, exactly as a hand-written cast would.
"""

from __future__ import annotations

import functools
import typing
from typing import Any, Callable, Optional, Sequence, TypeVar

import jax
import numpy as np

from jmp_policy.dtypes import canonical_dtype, is_floating_dtype

T = TypeVar("T")

# Below this many converts, per-leaf dispatch is as cheap as one batched call.
_BATCH_MIN = 4


@functools.lru_cache(maxsize=None)
def _converter(dtype: np.dtype[Any]) -> Callable[[list[jax.Array]], list[jax.Array]]:
    # One jitted function per target dtype (no static argument to hash per
    # call); jax.jit's own cache then keys executables by the tree signature.
    return jax.jit(lambda xs: [x.astype(dtype) for x in xs])


# The concrete jax.Array class, for a fast type check. Learnt from the first
# array cast rather than by creating one at import, which would initialise
# JAX's backends before users can configure them (jax.distributed, platforms).
_ARRAY_IMPL: Optional[type[jax.Array]] = None


def cast_leaves(leaves: Sequence[Any], dtypes: Sequence[Optional[np.dtype[Any]]]) -> list[Any]:
    """Casts ``leaves[i]`` to ``dtypes[i]`` (``None``: leave it) following the casting rules."""
    global _ARRAY_IMPL
    out = list(leaves)
    # (dtype, sharding) -> indices of the jax arrays to convert: one jitted call may only
    # take arrays on the same devices.
    batches: dict[tuple[np.dtype[Any], Any], list[int]] = {}
    for i, (x, dtype) in enumerate(zip(leaves, dtypes)):
        if dtype is None:
            continue
        if type(x) is _ARRAY_IMPL:  # the common case first: a concrete jax array
            if x.dtype != dtype and is_floating_dtype(x.dtype):
                batches.setdefault((dtype, x.sharding), []).append(i)
            continue
        x_dtype: Any = getattr(x, "dtype", None)
        if x_dtype is None or x_dtype == dtype or not is_floating_dtype(x_dtype):
            continue
        if isinstance(x, jax.core.Tracer):
            out[i] = x.astype(dtype)
        elif isinstance(x, jax.Array):
            _ARRAY_IMPL = type(x)
            batches.setdefault((dtype, x.sharding), []).append(i)
        elif isinstance(x, (np.ndarray, np.generic)):
            out[i] = x.astype(dtype)  # stays a host value, as given
    for (dtype, _), idx in batches.items():
        if len(idx) < _BATCH_MIN:
            for i in idx:
                out[i] = leaves[i].astype(dtype)
        else:
            converted = _converter(dtype)([leaves[i] for i in idx])
            for i, y in zip(idx, converted):
                out[i] = y
    return out


def cast_tree(tree: T, dtype: Optional[np.dtype[Any]]) -> T:
    """Casts every floating array leaf of ``tree`` to ``dtype`` (identity for ``None``)."""
    if dtype is None:
        return tree
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return typing.cast(T, jax.tree_util.tree_unflatten(treedef, cast_leaves(leaves, [dtype] * len(leaves))))


def first_floating_dtype(tree: Any) -> Optional[np.dtype[Any]]:
    """The dtype of the first floating array leaf of ``tree`` (used by the deprecated infer policies)."""
    for leaf in jax.tree_util.tree_leaves(tree):
        dtype = getattr(leaf, "dtype", None)
        if (
            dtype is not None
            and isinstance(leaf, (jax.Array, np.ndarray, np.generic))
            and is_floating_dtype(dtype)
        ):
            return canonical_dtype(dtype)
    return None

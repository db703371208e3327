"""The cast engine behind `Policy` and `PolicyMap`.

Rules (SPEC section 1): only floating arrays are cast (JAX arrays, numpy arrays
and scalars, tracers); everything else, including Python floats, passes
through; a leaf already in the target dtype is returned as the same object.

Speed matters when casting eagerly: dispatching one `astype` per leaf costs a
few microseconds of Python and runtime overhead each, which dominates for
pytrees of many small parameters. So concrete JAX arrays are converted in one
jitted call per target dtype (one dispatch for the whole tree); under a trace
the converts are emitted directly, exactly as a hand-written cast would.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np

from jmp_policy._dtypes import is_floating_dtype

# Below this many converts, per-leaf dispatch is as cheap as one batched call.
_BATCH_MIN = 4


@functools.lru_cache(maxsize=None)
def _converter(dtype: np.dtype) -> Callable[[list], list]:
    # One jitted function per target dtype (no static argument to hash per
    # call); jax.jit's own cache then keys executables by the tree signature.
    return jax.jit(lambda xs: [x.astype(dtype) for x in xs])


# The concrete jax.Array class, for a fast type check. Learnt from the first
# array cast rather than by creating one at import, which would initialise
# JAX's backends before users can configure them (jax.distributed, platforms).
_ARRAY_IMPL: Optional[type] = None


def cast_leaves(leaves: Sequence[Any], dtypes: Sequence[Optional[np.dtype]]) -> list:
    """Casts ``leaves[i]`` to ``dtypes[i]`` (``None``: leave it) following the casting rules."""
    global _ARRAY_IMPL
    out = list(leaves)
    batches: dict = {}  # dtype -> indices of concrete jax arrays to convert
    for i, (x, dtype) in enumerate(zip(leaves, dtypes)):
        if dtype is None:
            continue
        if type(x) is _ARRAY_IMPL:  # the common case first: a concrete jax array
            x_dtype = x.dtype
            if x_dtype != dtype and is_floating_dtype(x_dtype):
                batches.setdefault(dtype, []).append(i)
            continue
        x_dtype = getattr(x, "dtype", None)
        if x_dtype is None or x_dtype == dtype or not is_floating_dtype(x_dtype):
            continue
        if isinstance(x, jax.core.Tracer):
            out[i] = x.astype(dtype)
        elif isinstance(x, jax.Array):
            _ARRAY_IMPL = type(x)
            batches.setdefault(dtype, []).append(i)
        elif isinstance(x, (np.ndarray, np.generic)):
            out[i] = x.astype(dtype)  # stays a host value, as given
    for dtype, idx in batches.items():
        if len(idx) < _BATCH_MIN:
            for i in idx:
                out[i] = leaves[i].astype(dtype)
        else:
            converted = _converter(dtype)([leaves[i] for i in idx])
            for i, y in zip(idx, converted):
                out[i] = y
    return out


def cast_tree(tree: Any, dtype: Optional[np.dtype]) -> Any:
    """Casts every floating array leaf of ``tree`` to ``dtype`` (identity for ``None``)."""
    if dtype is None:
        return tree
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return jax.tree_util.tree_unflatten(treedef, cast_leaves(leaves, [dtype] * len(leaves)))


def cast_tree_by_path(tree: Any, dtype_for_path: Callable[[str], Optional[np.dtype]]) -> Any:
    """Like `cast_tree`, with the target dtype chosen per leaf from its ``/``-joined key path."""
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [leaf for _, leaf in path_leaves]
    dtypes = [dtype_for_path(path_str(path)) for path, _ in path_leaves]
    return jax.tree_util.tree_unflatten(treedef, cast_leaves(leaves, dtypes))


def path_str(path: Sequence[Any]) -> str:
    """A key path as the ``/``-joined string policies match on, e.g. ``params/Dense_0/kernel``."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def first_floating_dtype(tree: Any) -> Optional[np.dtype]:
    """The dtype of the first floating array leaf of ``tree`` (used by the deprecated infer policies)."""
    for leaf in jax.tree_util.tree_leaves(tree):
        dtype = getattr(leaf, "dtype", None)
        if (
            dtype is not None
            and isinstance(leaf, (jax.Array, np.ndarray, np.generic))
            and is_floating_dtype(dtype)
        ):
            return np.dtype(dtype)
    return None

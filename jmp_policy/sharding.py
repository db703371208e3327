"""Sharding in array types: explicit shardings, and ``shard_map``'s varying axes.

Under a mesh with ``AxisType.Explicit`` axes (``jax.set_mesh``), every array's type
carries its sharding and JAX checks it while tracing: a product whose two operands
are both sharded along the axes it sums over must say how its result is sharded
(``out_sharding``), a reshape must keep each sharded axis divisible into its
shards, and a ``custom_vjp``'s gradients must have the types of its operands.
The quantized products follow the plain ones: each contraction's result takes
the sharding that JAX gives the plain product (the forward) or the gradient of
the plain product (the operand's own sharding), and an axis cut into blocks that
do not fall within its shards is gathered first, as the blocks need all their
values together.

Under ``Auto`` axes (or no mesh) types carry no sharding: those functions do
nothing, and XLA's partitioner places the arrays.

Inside ``shard_map`` (with ``check_vma``, its default) a value's type also says
along which mesh axes it *varies*, holding a different value on each device,
rather than being the same on all of them (`varying`). Where two values must
have one type (the branches of a ``lax.cond``, a cotangent and its primal), an
invariant one is cast to varying (``lax.pcast``) or reduced over the axes
(``lax.psum``, ``lax.pmax``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

__all__ = ["explicit", "explicit_or_replicated", "gathered", "in_whole_blocks", "permuted", "shards", "varying"]


def explicit(x: Any) -> Optional[NamedSharding]:
    """The sharding in ``x``'s type (an array or an abstract value) where its mesh has
    explicit axes, else ``None``."""
    aval = x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x)
    sharding = getattr(aval, "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh.empty:
        return None
    if not any(t == AxisType.Explicit for t in sharding.mesh.axis_types):
        return None
    return sharding


def explicit_or_replicated(x: Any) -> Optional[NamedSharding]:
    """`explicit` of ``x``, or, for an ``x`` whose type has no mesh (an uncommitted array
    passed to ``jit``) under a mesh of explicit axes (``jax.set_mesh``), replicated on it:
    how JAX types such an array's gradient."""
    sharding = explicit(x)
    if sharding is not None:
        return sharding
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not any(t == AxisType.Explicit for t in mesh.axis_types):
        return None
    return NamedSharding(mesh, PartitionSpec())  # type: ignore[no-untyped-call]


def permuted(sharding: Optional[NamedSharding], perm: Optional[Sequence[int]]
             ) -> Optional[NamedSharding]:
    """The sharding of an array that ``lax.transpose(·, perm)`` takes to one sharded as
    ``sharding``: axis ``perm[i]`` takes the sharding of axis ``i``."""
    if sharding is None or perm is None:
        return sharding
    spec = _partitions(sharding, len(perm))
    out: list[Any] = [None] * len(perm)
    for i, p in enumerate(perm):
        out[p] = spec[i]
    return sharding.update(spec=PartitionSpec(*out))  # type: ignore[no-untyped-call]


def _partitions(sharding: NamedSharding, ndim: int) -> tuple[Any, ...]:
    spec = tuple(sharding.spec)
    return spec + (None,) * (ndim - len(spec))


def shards(x: Any, axis: int) -> int:
    """How many shards ``x``'s type splits ``axis`` into (1 if not explicitly sharded)."""
    sharding = explicit(x)
    if sharding is None:
        return 1
    names = _partitions(sharding, jax.numpy.ndim(x))[axis]
    if names is None:
        return 1
    count = 1
    for name in names if isinstance(names, tuple) else (names,):
        count *= sharding.mesh.shape[name]
    return count


def gathered(x: Any, axis: int) -> Any:
    """``x`` with ``axis`` no longer sharded (its other axes as they were): an explicit
    reshard, where the type shards it."""
    sharding = explicit(x)
    if sharding is None or shards(x, axis) == 1:
        return x
    spec = list(_partitions(sharding, jax.numpy.ndim(x)))
    spec[axis] = None
    target = sharding.update(spec=PartitionSpec(*spec))  # type: ignore[no-untyped-call]
    return jax.sharding.reshard(x, target)  # type: ignore[no-untyped-call]


def in_whole_blocks(x: Any, axis: int, block: int) -> Any:
    """``x``, its ``axis`` gathered unless each of its shards holds whole blocks of
    ``block`` values and as many blocks: so that cutting the axis into blocks keeps
    every block within one shard, as the blocks' scales need."""
    parts = shards(x, axis)
    size = jax.numpy.shape(x)[axis]
    if parts == 1 or (size % block == 0 and (size // block) % parts == 0):
        return x
    return gathered(x, axis)


def varying(x: Any) -> frozenset[str]:
    """The ``shard_map`` mesh axes along which ``x`` varies: none outside ``shard_map``.

    ``x`` is an array, a tracer, an abstract value or a ``jax.ShapeDtypeStruct``
    (as ``jax.eval_shape`` gives them, which keep the axes of the traced value).

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> def f(x, y):
    ...     print(sorted(varying(x)), sorted(varying(jax.eval_shape(jnp.sin, y))))
    ...     return x
    >>> _ = jax.shard_map(f, mesh=mesh, in_specs=(P("batch"), P()), out_specs=P("batch"))(
    ...     jnp.ones(2), jnp.ones(2))
    ['batch'] []
    >>> varying(jnp.ones(2))
    frozenset()
    """
    aval = x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying) if manual is not None else frozenset()

"""`autocast`: trace ``fn`` once per call signature, then evaluate it under autocast."""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import numpy as np
from jax.core import Tracer
from jax.extend.core import ClosedJaxpr

from jmp_policy.autocast._interpreter import Context, eval_jaxpr, higher_order_names
from jmp_policy.autocast._lattice import F32, DType, convert, dtype_of, is_floating
from jmp_policy.autocast._fp8 import Float8Like, Float8Recipe, as_recipe
from jmp_policy.autocast._fp8_matmul import float8_matmul
from jmp_policy.autocast._matmul import matmul
from jmp_policy._rules import UnmatchedRuleWarning
from jmp_policy.autocast._rules import Rules, parse_rules
from jmp_policy.policy import Policy, PolicyLike, as_policy


def autocast(
    fn: Callable[..., Any],
    policy: PolicyLike = None,
    *,
    rules: Optional[Mapping[str, Any]] = None,
    fp8: Float8Like = None,
) -> Callable[..., Any]:
    """Returns ``fn`` evaluated with per-operation mixed precision.

    Matrix work runs in the policy's compute dtype with float32 accumulation,
    numerically sensitive primitives in float32, everything else at the widest
    dtype of its inputs; floating outputs come back in the policy's output
    dtype. See ``jmp_policy.autocast``'s module documentation for the rules.

    Args:
      fn: any function of pytrees of arrays (a ``flax.linen`` ``apply``, an NNX
        module call, a loss function...). Non-array leaves (strings, ``None``,
        static configuration) are treated as static, as ``jax.jit`` would with
        ``static_argnums``.
      policy: a policy name or `Policy`; ``None`` means the global policy in
        force now (at construction, not at call time).
      rules: optional mapping changing the defaults:
        ``{"matmul": [...], "float32": [...], "follow": [...]}`` move
        primitives (by name, or ``jax.extend.core.Primitive`` object) into that
        class; ``{"float32_scopes": ["attention", "block/softmax"]}`` runs every
        primitive under a matching ``jax.named_scope`` (a contiguous run of
        scope names, at any depth) in float32, matrix work included. A scope
        that no operation of ``fn`` is in is reported with an
        ``UnmatchedRuleWarning``, once per trace.
      fp8: ``None`` (no float8), ``"tensorwise"``, ``"rowwise"`` or a
        `jmp_policy.Float8Recipe`: every eligible ``dot_general`` of ``fn``,
        forward and backward, runs on float8 operands with current scaling
        (one scale per tensor, or per row) and float32 accumulation, and
        returns float32 like the matmul class. Products in a float32 scope,
        in a scope the recipe excludes (by default an LM head: ``logits``,
        ``lm_head``...) or smaller than its ``min_size`` stay in the compute
        dtype. Inputs that are not finite give non-finite products.

    >>> import jax, jax.numpy as jnp, jmp_policy
    >>> def layer(w, x):
    ...     return jax.nn.softmax(x @ w)
    >>> f = jmp_policy.autocast(layer, "mixed_float16")
    >>> f(jnp.ones((4, 4)), jnp.ones((2, 4))).dtype   # outputs in the policy's output dtype
    dtype('float16')
    >>> f8 = jmp_policy.autocast(layer, "mixed_bfloat16", fp8="rowwise")
    >>> f8(jnp.ones((32, 32)), jnp.ones((16, 32))).dtype   # a float8 product inside
    dtype(bfloat16)
    """
    if not callable(fn):
        raise TypeError(f"autocast expects a callable, got {fn!r}.")
    policy = as_policy(policy)
    parsed = parse_rules(rules, higher_order_names())
    recipe = as_recipe(fp8)
    cache: dict[Any, tuple[Any, Callable[..., list[Any]], Callable[..., list[Any]]]] = {}

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        dynamic = [i for i, leaf in enumerate(leaves) if _is_dynamic(leaf)]
        values = [leaves[i] for i in dynamic]
        key = _signature(treedef, leaves, values)
        entry = cache.get(key) if key is not None else None
        if entry is None:
            closed, out_tree = _trace(fn, leaves, treedef, dynamic, values)
            run: Callable[..., list[Any]] = functools.partial(
                _run, closed, policy, parsed, recipe, _name(fn))
            if key is not None and not any(_is_tracer(c) for c in closed.consts):
                entry = cache[key] = (out_tree, run, jax.jit(run))
            else:
                entry = (out_tree, run, run)  # a one-off trace: no point compiling it
        out_tree, run, jitted = entry
        # Called eagerly, the jaxpr runs as one compiled computation: the same values as
        # op by op (fn's Python already ran when it was traced), without a compile per op.
        outs = run(*values) if any(_is_tracer(x) for x in values) else jitted(*values)
        return jax.tree_util.tree_unflatten(out_tree, outs)

    return wrapped


def _is_dynamic(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex, bool))


def _is_tracer(x: Any) -> bool:
    return isinstance(x, Tracer)


def _signature(treedef: Any, leaves: list[Any], values: list[Any]) -> Optional[tuple[Any, ...]]:
    """What a trace of ``fn`` depends on, or ``None`` when a static leaf is unhashable."""
    static = tuple(None if _is_dynamic(leaf) else leaf for leaf in leaves)
    key = (treedef, static, tuple(jax.typeof(x) for x in values))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _trace(fn: Callable[..., Any], leaves: list[Any], treedef: Any, dynamic: list[int],
           values: list[Any]) -> tuple[ClosedJaxpr, Any]:
    """``fn`` as a closed jaxpr of its dynamic leaves, with the tree of its outputs."""
    out_tree = []

    def flat_fn(*values: Any) -> list[Any]:
        full = list(leaves)
        for i, v in zip(dynamic, values):
            full[i] = v
        args, kwargs = jax.tree_util.tree_unflatten(treedef, full)
        out_leaves, tree = jax.tree_util.tree_flatten(fn(*args, **kwargs))
        out_tree.append(tree)
        return out_leaves

    closed: ClosedJaxpr = jax.make_jaxpr(flat_fn)(*values)
    return closed, out_tree[0]


def _run(closed: ClosedJaxpr, policy: Policy, rules: Rules, recipe: Optional[Float8Recipe],
         name: str, *values: Any) -> list[Any]:
    compute, output = _call_dtypes(policy, values)
    ctx = Context(compute, rules, matmul if recipe is None else float8_matmul(recipe))
    outs = eval_jaxpr(ctx, closed.jaxpr, closed.consts, values)
    for scope, near in ctx.unmatched_scopes():
        hint = f" Did you mean {' or '.join(map(repr, near))}?" if near else ""
        warnings.warn(
            f"autocast rules['float32_scopes'] entry {scope!r} matched no operation of "
            f"{name} (none is inside a jax.named_scope path containing {scope!r}).{hint}",
            UnmatchedRuleWarning, stacklevel=2)
    return [convert(o, output) for o in outs]


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _call_dtypes(policy: Policy, values: Sequence[Any]) -> tuple[DType, DType]:
    compute, output = policy.compute_dtype, policy.output_dtype
    if compute is None:  # deprecated infer policies: compute follows the first floating input
        compute = next((dtype_of(x) for x in values if is_floating(x)), F32)
    if output is None:
        output = compute
    return np.dtype(compute), np.dtype(output)

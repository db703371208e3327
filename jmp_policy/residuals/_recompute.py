"""Fewer arrays to store: residuals that element-wise work makes from one array are
recomputed from it.

JAX's backward pass keeps every value its rules read: GELU's input and four
values computed from it, a norm's centered and normalized input, a weight's
bfloat16 copy. XLA, compiling both passes together, keeps one of them and
recomputes the rest in the backward pass's kernels. Stored in float8 one by
one, they would cost more than that one wide array. `plan` finds, in the
forward pass's jaxpr, the arrays to hand over instead (the **roots**) and the
element-wise equations that make the residuals from them again:

* a value made by a product, a reduction, a gather, a call or a loop is a root;
* so is an element-wise value computed from two large roots (a residual
  connection ``x + f(x)``, a gate ``silu(g) * u``): recomputing it would pull in
  both, and their own roots;
* so is ``x - max(x)`` (max-subtracted logits, kept by the rule) and what is
  computed from it;
* so is the output of an exponential, a sine, a cosine or a power, whose
  relative error grows with its input's size: float8 holds ``exp(x)`` to 2**-4,
  where ``exp`` of a float8 ``x`` is off by a factor ``exp(2**-4 * x)``;
* any other element-wise value (casts, broadcasts and reshapes included, and
  the outputs of a call made of them, as ``jnp.where``'s, ``jnp.tril``'s and
  ``jax.nn.relu``'s are) is recomputed from the one large root it comes from,
  the small ones (a norm's statistics, under a quarter of its size) and the
  function's arguments, which are in memory anyway.

>>> import jax, jax.numpy as jnp
>>> from jmp_policy.residuals._origins import vjp_jaxpr
>>> def gelu_layer(w, x):
...     return jnp.sum(jax.nn.gelu(x @ w))
>>> closed, n, _ = vjp_jaxpr(gelu_layer, [jnp.ones((8, 8)), jnp.ones((4, 8))])
>>> found = plan(closed.jaxpr, n)
>>> [str(r.aval) for r in found.roots]   # x @ w: the root of GELU's residuals
['float32[4,8]']
>>> len(closed.jaxpr.outvars) - n > len(found.roots)   # recomputed from it
True
"""

from __future__ import annotations

import functools
import math
from typing import Any, Collection, NamedTuple, Optional, Sequence

import jax.numpy as jnp
from jax.extend.core import Jaxpr, JaxprEqn, Literal

from jmp_policy.jaxprs import bind, sub_jaxprs
from jmp_policy.residuals._origins import Producers
from jmp_policy.residuals._rule import Producer, max_subtracted

_ELEMENTWISE = frozenset({
    "neg", "sign", "floor", "ceil", "round", "is_finite", "exp", "exp2", "log", "log1p",
    "expm1", "tanh", "one_minus_square", "logistic", "sin", "cos", "tan", "atan", "sqrt",
    "rsqrt", "cbrt", "integer_pow",
    "square", "abs", "erf", "erfc", "erf_inv", "not", "add", "add_any", "sub", "mul", "div",
    "max", "min", "pow", "and", "or", "xor", "eq", "ne", "lt", "le", "gt", "ge", "select_n",
    "clamp", "nextafter", "atan2", "rem", "convert_element_type", "broadcast_in_dim",
    "reshape", "squeeze", "expand_dims", "copy", "copy_p", "reduce_precision", "iota",
})
"""Primitives whose outputs are recomputed rather than stored: element-wise arithmetic
(``one_minus_square`` is ``tanh``'s derivative from JAX 0.11), casts, and the shape changes
that copy nothing."""

_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "custom_jvp_call": "call_jaxpr"}
"""Calls recomputed when their body is element-wise (``jnp.where``, ``jax.nn.relu``), by
the parameter holding the body."""

_STORED_OUTPUTS = frozenset({"exp", "exp2", "expm1", "sin", "cos", "tan", "pow"})
"""Element-wise primitives whose outputs are roots: their relative error grows with their
input's size (``exp(x)`` is off by a factor ``exp(dx)``), so float8's rounding of the input
would be amplified where float8's rounding of the output is not."""

_SMALL = 4
"""A root under 1/_SMALL of a value's size is a statistic of it, not a source to count."""

_DEPTH = 24
"""The longest chain of equations recomputed for a residual."""


class Plan(NamedTuple):
    """How the forward pass hands its residuals over: the ``roots`` (vars of the jaxpr to
    store, by the rule), the ``inputs`` (its arguments and constants the recomputation
    reads, in memory anyway), the ``eqns`` that recompute the ``residuals`` (the jaxpr's
    residual outputs) from both, in program order; the operands of those equations that
    no needed output reads (``unread``: zeros are passed, and compiled away)."""

    roots: tuple[Any, ...]
    inputs: tuple[Any, ...]
    eqns: tuple[JaxprEqn, ...]
    residuals: tuple[Any, ...]
    unread: tuple[Any, ...]


def plan(jaxpr: Jaxpr, n_out: int, stored_args: Collection[int] = (),
         producers: Optional[Producers] = None) -> Plan:
    """The `Plan` of ``jaxpr`` (`vjp_jaxpr`'s: ``n_out`` outputs, then the residuals).
    The arguments at ``stored_args`` (a loop body's carry, which the loop stacks) are
    roots; the others are inputs."""
    producers = Producers() if producers is None else producers
    producer = functools.partial(producers.eqn, jaxpr)
    free = {v for i, v in enumerate(jaxpr.invars) if i not in stored_args}
    free |= set(jaxpr.constvars)
    roots: set[Any] = {jaxpr.invars[i] for i in stored_args}
    sources: dict[Any, frozenset[Any]] = {}  # recomputable value -> its large roots
    depth: dict[Any, int] = {}
    unsafe: set[Any] = set()  # max-subtracted roots: what reads them is a root too
    for eqn in jaxpr.eqns:
        if not _recomputable(eqn, roots, sources, depth, unsafe, free, producer):
            roots.update(eqn.outvars)
    residuals = tuple(jaxpr.outvars[n_out:])
    needed_roots, inputs, eqns, unread = _needed(jaxpr, residuals, roots, free)
    return Plan(tuple(needed_roots), tuple(inputs), tuple(eqns), residuals, tuple(unread))


def _elementwise(eqn: JaxprEqn) -> bool:
    """Whether ``eqn`` is element-wise work whose outputs are recomputed: an element-wise
    primitive, or a call of them (library functions such as ``jnp.where``, ``jax.nn.relu``)."""
    name = eqn.primitive.name
    if name in _CALLS:
        return all(_elementwise(e) for e in sub_jaxprs(eqn, _CALLS[name])[0].eqns)
    return name in _ELEMENTWISE and name not in _STORED_OUTPUTS and len(eqn.outvars) == 1


def _recomputable(eqn: JaxprEqn, roots: set[Any], sources: dict[Any, frozenset[Any]],
                  depth: dict[Any, int], unsafe: set[Any], free: set[Any],
                  producer: Producer) -> bool:
    """Whether ``eqn``'s outputs are recomputed (recording their sources) or roots."""
    if not _elementwise(eqn):
        return False
    size = max((_size(out) for out in eqn.outvars), default=0)
    found: set[Any] = set()
    deepest = 0
    for v in eqn.invars:
        if isinstance(v, Literal) or v in free:
            continue
        if v in unsafe:
            return False  # stored itself, not recomputed from an unsafe root
        if v in roots:
            found.add(v)
        else:
            found |= sources[v]
            deepest = max(deepest, depth[v])
    large = {r for r in found if _size(r) * _SMALL >= size}
    if len(large) > 1 or deepest + 1 > _DEPTH:
        return False
    if max_subtracted(eqn, producer):
        unsafe.update(eqn.outvars)
        return False
    for out in eqn.outvars:
        sources[out], depth[out] = frozenset(found), deepest + 1
    return True


def _needed(jaxpr: Jaxpr, residuals: Sequence[Any], roots: set[Any], free: set[Any]
            ) -> tuple[list[Any], list[Any], list[JaxprEqn], list[Any]]:
    """The roots, inputs and equations (in program order) that recompute ``residuals``,
    and the operands of those equations that no needed output reads (an input of a
    ``jnp.where`` call whose residual is its mask alone): found backwards."""
    live = {v for v in residuals if not isinstance(v, Literal)}
    needed_roots = [v for v in jaxpr.invars if v in live and v in roots]
    inputs = [v for v in (*jaxpr.invars, *jaxpr.constvars) if v in live and v in free]
    eqns: list[JaxprEqn] = []
    unread: dict[Any, None] = {}  # ordered: the recomputation is traced the same each time
    for eqn in reversed(jaxpr.eqns):
        wanted = [v in live for v in eqn.outvars]
        if not any(wanted):
            continue
        if eqn.outvars[0] in roots:  # an equation's outputs are all roots, or none
            needed_roots += [v for v, w in zip(eqn.outvars, wanted) if w]
            continue
        eqns.append(eqn)
        reads = _reads(eqn, wanted)
        for v, read in zip(eqn.invars, reads):
            if isinstance(v, Literal):
                continue
            if not read:
                unread[v] = None
                continue
            if v not in live and v in free:
                inputs.append(v)
            elif v not in live and v in roots and v in jaxpr.invars:
                needed_roots.append(v)
            live.add(v)
    eqns.reverse()
    return needed_roots, inputs, eqns, [v for v in unread if v not in live]


def _reads(eqn: JaxprEqn, wanted: Sequence[bool]) -> list[bool]:
    """Which of ``eqn``'s operands its ``wanted`` outputs read: all of them, but for a
    call, whose body says."""
    if eqn.primitive.name not in _CALLS:
        return [True] * len(eqn.invars)
    body = sub_jaxprs(eqn, _CALLS[eqn.primitive.name])[0]
    live = {v for v, w in zip(body.outvars, wanted) if w and not isinstance(v, Literal)}
    for inner in reversed(body.eqns):
        inner_wanted = [v in live for v in inner.outvars]
        if any(inner_wanted):
            live.update(v for v, read in zip(inner.invars, _reads(inner, inner_wanted))
                        if read and not isinstance(v, Literal))
    return [v in live for v in body.invars]


def recompute(found: Plan, values: dict[Any, Any]) -> list[Any]:
    """The residuals, from ``values`` of the plan's roots and inputs."""
    env = dict(values)
    env.update((v, jnp.zeros(v.aval.shape, v.aval.dtype)) for v in found.unread)

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    for eqn in found.eqns:
        outs = bind(eqn, [read(v) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]))
    return [read(v) for v in found.residuals]


def _size(v: Any) -> int:
    return math.prod(getattr(v.aval, "shape", ()))


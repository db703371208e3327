"""Fewer arrays to store: residuals that element-wise work makes from one array are
recomputed from it.

JAX's backward pass keeps every value its rules read: GELU's input and four
values computed from it, a norm's centered and normalized input, a weight's
bfloat16 copy. XLA, compiling both passes together, keeps one of them and
recomputes the rest in the backward pass's kernels. Stored in float8 one by
one, they would cost more than that one wide array. `plan` finds, in the
forward pass's jaxpr, the arrays to hand over instead (the **roots**) and the
element-wise equations that make the residuals from them again:

* a value made by a product, a reduction, a gather, a loop or a call that
  `vjp_jaxpr` does not inline (a ``custom_vjp``, a ``jax.checkpoint``) is a root;
* so is an element-wise value computed from two large roots (a residual
  connection ``x + f(x)``, a gate ``silu(g) * u``): recomputing it would pull in
  both, and their own roots;
* so is ``x - max(x)`` (max-subtracted logits, kept by the rule) and what is
  computed from it;
* so is a boolean or integer value computed from a large floating root (a
  comparison, as a dropout mask compares uniform random numbers with its rate):
  computed again from the root's float8 copy, some of its elements would flip.
  A sign test (``x > 0``, ReLU's mask) is recomputed: rounding keeps signs;
* so is the output of an exponential, a sine, a cosine or a power, whose
  relative error grows with its input's size: float8 holds ``exp(x)`` to 2**-4,
  where ``exp`` of a float8 ``x`` is off by a factor ``exp(2**-4 * x)``;
* any other element-wise value (casts, broadcasts and reshapes included) is
  recomputed from the one large root it comes from, the small ones (a norm's
  statistics, under a quarter of its size) and the function's arguments, which
  are in memory anyway. ``jit`` and ``custom_jvp`` calls (``jnp.where``'s,
  ``jax.nn.relu``'s, a jitted block) are inlined by `vjp_jaxpr` first: what is
  inside them is read as if written in place.

`Recompute` makes the residuals again in the backward pass, each from the roots
it needs, when that pass first reads it.

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

import copy
import functools
import math
from typing import Any, Collection, NamedTuple, Optional, Sequence

import numpy as np
from jax.extend.core import Jaxpr, JaxprEqn, Literal

from jmp_policy.dtypes import is_floating_dtype
from jmp_policy.jaxprs import bind
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
    residual outputs) from both, in program order."""

    roots: tuple[Any, ...]
    inputs: tuple[Any, ...]
    eqns: tuple[JaxprEqn, ...]
    residuals: tuple[Any, ...]


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
    needed_roots, inputs, eqns = _needed(jaxpr, residuals, roots, free)
    return Plan(tuple(needed_roots), tuple(inputs), tuple(eqns), residuals)


def _recomputable(eqn: JaxprEqn, roots: set[Any], sources: dict[Any, frozenset[Any]],
                  depth: dict[Any, int], unsafe: set[Any], free: set[Any],
                  producer: Producer) -> bool:
    """Whether ``eqn``'s output is recomputed (recording its sources) or a root."""
    name = eqn.primitive.name
    if name not in _ELEMENTWISE or name in _STORED_OUTPUTS or len(eqn.outvars) != 1:
        return False
    out = eqn.outvars[0]
    size = _size(out)
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
    if not _is_float(out) and any(_is_float(r) for r in large) and not _sign_test(eqn):
        return False  # a comparison of stored values would flip (a dropout mask of uniforms)
    if max_subtracted(eqn, producer):
        unsafe.add(out)
        return False
    sources[out], depth[out] = frozenset(found), deepest + 1
    return True


def _needed(jaxpr: Jaxpr, residuals: Sequence[Any], roots: set[Any], free: set[Any]
            ) -> tuple[list[Any], list[Any], list[JaxprEqn]]:
    """The roots, inputs and equations (in program order) that recompute ``residuals``,
    found backwards."""
    live = {v for v in residuals if not isinstance(v, Literal)}
    needed_roots = [v for v in jaxpr.invars if v in live and v in roots]
    inputs = [v for v in (*jaxpr.invars, *jaxpr.constvars) if v in live and v in free]
    eqns: list[JaxprEqn] = []
    for eqn in reversed(jaxpr.eqns):
        wanted = [v in live for v in eqn.outvars]
        if not any(wanted):
            continue
        if eqn.outvars[0] in roots:  # an equation's outputs are all roots, or none
            needed_roots += [v for v, w in zip(eqn.outvars, wanted) if w]
            continue
        eqns.append(eqn)
        for v in eqn.invars:
            if isinstance(v, Literal) or v in live:
                continue
            if v in free:
                inputs.append(v)
            elif v in roots and v in jaxpr.invars:
                needed_roots.append(v)
            live.add(v)
    eqns.reverse()
    return needed_roots, inputs, eqns


class Recompute:
    """The residuals of a `Plan`, made on demand: `sources` names the roots and inputs
    that some residuals are made from, and once `env` holds those, `make` recomputes the
    residuals, running only the equations they need (each once)."""

    def __init__(self, found: Plan) -> None:
        self.env: dict[Any, Any] = {}
        self._made_by = {v: i for i, eqn in enumerate(found.eqns) for v in eqn.outvars}
        self._eqns = found.eqns

    def fork(self) -> Recompute:
        """A `Recompute` of the same residuals whose `env` starts as a copy of this one's."""
        forked = copy.copy(self)
        forked.env = dict(self.env)
        return forked

    def sources(self, wanted: Sequence[Any]) -> list[Any]:
        """The roots and inputs that ``wanted`` (vars of the forward jaxpr) are made from
        and `env` lacks, in the order first reached."""
        reached = [v for i in self._needed(wanted) for v in self._eqns[i].invars]
        return [v for v in dict.fromkeys(v for v in [*reached, *wanted]
                                         if not isinstance(v, Literal)) if self._missing(v)]

    def make(self, wanted: Sequence[Any]) -> list[Any]:
        """The values of ``wanted``, their `sources` being in `env`."""
        for i in sorted(self._needed(wanted)):  # program order
            eqn = self._eqns[i]
            outs = bind(eqn, [self._read(v) for v in eqn.invars])
            self.env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]))
        return [self._read(v) for v in wanted]

    def _needed(self, wanted: Sequence[Any]) -> set[int]:
        """The equations (indices) that ``wanted`` need and `env` lacks the outputs of."""
        needed: set[int] = set()
        stack = [v for v in wanted if not isinstance(v, Literal)]
        while stack:
            v = stack.pop()
            i = self._made_by.get(v)
            if i is None or v in self.env or i in needed:
                continue
            needed.add(i)
            stack += [u for u in self._eqns[i].invars if not isinstance(u, Literal)]
        return needed

    def _missing(self, v: Any) -> bool:
        return v not in self.env and v not in self._made_by

    def _read(self, v: Any) -> Any:
        return v.val if isinstance(v, Literal) else self.env[v]


def _sign_test(eqn: JaxprEqn) -> bool:
    """Whether ``eqn`` compares a value with zero (``x > 0``: ReLU's mask), which its float8
    copy answers alike: rounding keeps signs, and flushes to zero only values far below
    their block's largest."""
    return eqn.primitive.name in ("gt", "ge", "lt", "le") and any(
        isinstance(v, Literal) and not np.any(v.val) for v in eqn.invars)


def _is_float(v: Any) -> bool:
    return is_floating_dtype(v.aval.dtype)


def _size(v: Any) -> int:
    return math.prod(getattr(v.aval, "shape", ()))


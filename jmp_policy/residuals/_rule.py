"""Which residuals stay as they are when the others are stored in float8.

A residual stays in its own dtype when storing it in float8 would save nothing
or change the gradient beyond float8's rounding of an activation:

* it is not an activation: an argument of the function or a constant, in
  memory anyway;
* it is not floating, is one byte a value already (a float8 operand a product
  saved, a scale), or has fewer than 32 values;
* it is a **statistic**: computed by a reduction (a norm's mean and variance, a
  softmax's sum), or from reductions and constants alone (``rsqrt(var + eps)``,
  a broadcast of either); such values are small before they are broadcast, and
  a norm's backward pass divides by them;
* it is **max-subtracted**: ``x - max(x)``, a softmax's shifted logits, whose
  exponential would turn float8's relative error into a factor;
* its scope is excluded by the user (``Float8Residuals.exclude``).

>>> import jax, jax.numpy as jnp
>>> from jmp_policy.residuals._origins import origins, vjp_jaxpr
>>> def norm(x):
...     centered = x - jnp.mean(x, axis=-1, keepdims=True)
...     return centered * jax.lax.rsqrt(jnp.mean(centered ** 2, axis=-1, keepdims=True))
>>> closed, n, _ = vjp_jaxpr(lambda x: jnp.sum(norm(x)), [jnp.ones((64, 64))])
>>> kept = [v.aval for v in closed.jaxpr.outvars[n:]]
>>> rule = Rule()
>>> [(o.eqn.primitive.name, a.shape, rule.why_kept(o, a.shape, a.dtype))
...  for o, a in zip(origins(closed, n), kept)]  # doctest: +NORMALIZE_WHITESPACE
[('mul', (64, 64), None), ('mul', (64, 1), 'a statistic'),
 ('rsqrt', (64, 1), 'a statistic'), ('sub', (64, 64), None)]
"""

from __future__ import annotations

import functools

from typing import Any, Callable, Optional, Sequence

import numpy as np
from jax.extend.core import Jaxpr, JaxprEqn, Literal

from jmp_policy.dtypes import is_floating_dtype
from jmp_policy.jaxprs import sub_jaxprs
from jmp_policy.paths import search_scopes
from jmp_policy.residuals._format import BLOCK
from jmp_policy.residuals._origins import Origin, Producers

Producer = Callable[[Any], Optional[JaxprEqn]]
"""The equation computing a variable of a jaxpr (``None`` for a literal, an input, a
constant)."""

_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod",
                         "reduce_and", "reduce_or", "argmax", "argmin"})


class Rule:
    """The rule above, for the residuals of one forward pass (a jaxpr's equations are
    indexed once)."""

    def __init__(self, exclude: Sequence[str] = (),
                 producers: Optional[Producers] = None) -> None:
        self.exclude = tuple(exclude)
        self._producers = Producers() if producers is None else producers
        self._graphs: dict[int, tuple[Jaxpr, _Graph]] = {}

    def why_kept(self, origin: Origin, shape: tuple[int, ...], dtype: Any) -> Optional[str]:
        """Why a residual of ``shape`` and ``dtype`` made at ``origin`` stays as it is, in
        a few words; ``None`` for a residual to store in float8."""
        if origin.kind != "activation":
            return "an argument" if origin.kind == "argument" else "a constant"
        dtype = np.dtype(dtype)
        if not is_floating_dtype(dtype) or dtype.itemsize <= 1:
            return "not a wider float"
        if self.exclude and search_scopes(self.exclude, origin.path):
            return "in an excluded scope"
        eqn, jaxpr = origin.eqn, origin.jaxpr
        if eqn is None or jaxpr is None:  # an argument that a loop stacks (its carry)
            return None
        graph = self._graph(jaxpr)
        if graph.statistic(eqn):
            return "a statistic"
        if max_subtracted(eqn, graph.producer):
            return "max-subtracted"
        if not shape or int(np.prod(shape, dtype=np.int64)) < BLOCK:
            return "small"
        return None

    def _graph(self, jaxpr: Jaxpr) -> _Graph:
        made = self._graphs.get(id(jaxpr))
        if made is None:
            made = self._graphs[id(jaxpr)] = (  # holds the jaxpr: its id stays its own
                jaxpr, _Graph(jaxpr, functools.partial(self._producers.eqn, jaxpr)))
        return made[1]


class _Graph:
    """The statistics among one jaxpr's equations (``producer``: the equation computing a
    variable of it)."""

    def __init__(self, jaxpr: Jaxpr, producer: Producer) -> None:
        self.producer = producer
        self.constvars = set(jaxpr.constvars)
        self.statistics: dict[int, bool] = {}

    def statistic(self, eqn: JaxprEqn) -> bool:
        """Whether ``eqn`` computes a reduction, or from reductions and constants alone."""
        known = self.statistics.get(id(eqn))
        if known is None:
            self.statistics[id(eqn)] = False  # while the operands are looked at
            name = eqn.primitive.name
            known = name in _REDUCTIONS or (
                not sub_jaxprs(eqn) and all(self._constant_or_statistic(v) for v in eqn.invars))
            self.statistics[id(eqn)] = known
        return known

    def _constant_or_statistic(self, atom: Any) -> bool:
        if isinstance(atom, Literal) or atom in self.constvars:
            return True
        eqn = self.producer(atom)
        return eqn is not None and self.statistic(eqn)


def max_subtracted(eqn: JaxprEqn, producer: Producer) -> bool:
    """Whether ``eqn`` is ``x - m`` with ``m`` computed from a ``reduce_max`` (within 8
    equations, through broadcasts and ``stop_gradient``): a softmax's shifted logits."""
    return eqn.primitive.name == "sub" and _reaches(eqn.invars[1], "reduce_max", producer, 8)


def _reaches(atom: Any, primitive: str, producer: Producer, steps: int) -> bool:
    eqn = producer(atom)
    if eqn is None or steps == 0:
        return False
    return eqn.primitive.name == primitive or any(
        _reaches(v, primitive, producer, steps - 1) for v in eqn.invars)

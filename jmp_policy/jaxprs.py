"""Jaxpr equations, read and evaluated again: what autocast, float8 and the inspector share.

`bind` evaluates an equation again; `sub_jaxprs` finds the jaxprs a
higher-order equation holds (a ``jit``'s body, a ``cond``'s branches) and
`scoped_eqns` walks every equation, nested ones included, with its scope path;
`scan_sizes` reads a ``scan``'s operand counts on every supported JAX;
`inline_calls` puts the bodies of ``jit`` and ``custom_jvp`` calls in their place;
`in_place` is the context (call site, scope) an equation is emitted again in.

>>> import jax, jax.numpy as jnp
>>> eqn = jax.make_jaxpr(jnp.sin)(1.0).jaxpr.eqns[0]
>>> float(bind(eqn, [0.0]))
0.0
>>> def f(x):
...     with jax.named_scope("block"):
...         return jax.jit(jnp.sin)(x)
>>> [(path, e.primitive.name) for path, e in scoped_eqns(jax.make_jaxpr(f)(1.0))]
[('block', 'jit'), ('block', 'sin')]
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Callable, Generic, Hashable, Iterator, Optional, Sequence, TypeVar, Union

import jax
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal

from jmp_policy.paths import join_scope

__all__ = ["Kept", "bind", "in_place", "inline_calls", "scan_sizes", "scoped_eqns", "sub_jaxprs"]

T = TypeVar("T")


def bind(eqn: JaxprEqn, invals: Sequence[Any], params: Optional[dict[str, Any]] = None) -> Any:
    """Binds ``eqn``'s primitive to ``invals``, with ``params`` instead of its own if given."""
    params = eqn.params if params is None else params
    bind_params = eqn.primitive.get_bind_params(params)  # type: ignore[no-untyped-call]
    return eqn.primitive.bind(*invals, **bind_params)  # type: ignore[no-untyped-call]


def sub_jaxprs(eqn: JaxprEqn, param: Optional[str] = None) -> list[Jaxpr]:
    """The jaxprs in ``eqn``'s parameters (only in ``param`` if given), closed ones opened,
    in parameter order: a call's body, a loop's condition and body, a ``cond``'s
    branches; none for a first-order equation."""
    values = eqn.params.values() if param is None else [eqn.params[param]]
    return [x.jaxpr if isinstance(x, ClosedJaxpr) else x
            for value in values
            for x in (value if isinstance(value, (tuple, list)) else (value,))
            if isinstance(x, (Jaxpr, ClosedJaxpr))]


def scan_sizes(params: Any) -> tuple[int, int]:
    """``(constants, carries)``: how many of a ``scan`` equation's operands are each (its
    ``xs`` follow them), from its parameters.

    >>> import jax, jax.numpy as jnp
    >>> step = lambda c, x: (c + x, x)
    >>> eqn = jax.make_jaxpr(lambda xs: jax.lax.scan(step, 0.0, xs))(jnp.ones(3)).eqns[0]
    >>> scan_sizes(eqn.params)
    (0, 1)
    """
    if "num_consts" in params:  # jax 0.10
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry, _ = params["ft_in"].unpack()  # jax >= 0.11: a flat tree (consts, carry, xs)
    return len(consts), len(carry)


_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "custom_jvp_call": "call_jaxpr"}
"""The calls `inline_calls` inlines, by the parameter that holds the body."""


def inline_calls(closed: ClosedJaxpr, args: Sequence[Any]) -> ClosedJaxpr:
    """``closed`` traced again at ``args`` with the bodies of its ``jit`` and
    ``custom_jvp`` calls (``jnp.where``'s, ``jax.nn.relu``'s, a user's jitted block) in
    place of the calls, at any depth outside loops and other higher-order primitives;
    every equation keeps its scope. For a pass that is not differentiated again (a
    ``custom_jvp`` call is then its primal computation).

    >>> import jax, jax.numpy as jnp
    >>> closed = jax.make_jaxpr(lambda x: jnp.where(x > 0, x, 0.0))(jnp.ones(3))
    >>> [e.primitive.name for e in inline_calls(closed, [jnp.ones(3)]).eqns]
    ['gt', 'broadcast_in_dim', 'select_n']
    """
    return jax.make_jaxpr(lambda *a: _inlined(closed.jaxpr, closed.consts, a))(*args)


def _inlined(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env = {**dict(zip(jaxpr.constvars, consts)), **dict(zip(jaxpr.invars, args))}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        with in_place(eqn):
            if eqn.primitive.name in _CALLS:
                body = eqn.params[_CALLS[eqn.primitive.name]]
                outs = _inlined(body.jaxpr, body.consts, invals)
            else:
                out = bind(eqn, invals)
                outs = out if eqn.primitive.multiple_results else [out]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


@contextlib.contextmanager
def in_place(eqn: JaxprEqn) -> Iterator[None]:
    """The context in which to emit ``eqn`` again: its call site and scope (under the
    current scope) and its own context, as ``jax.core.eval_jaxpr`` does."""
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), \
            eqn.ctx.manager:
        yield


def scoped_eqns(jaxpr: Union[Jaxpr, ClosedJaxpr],
                scope: str = "") -> Iterator[tuple[str, JaxprEqn]]:
    """``(scope path, equation)`` for every equation of ``jaxpr`` in order, each followed
    by those of its sub-jaxprs, whose paths start with its own (see `paths.join_scope`)."""
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        path = join_scope(scope, str(eqn.source_info.name_stack))
        yield path, eqn
        for sub in sub_jaxprs(eqn):
            yield from scoped_eqns(sub, path)


class Kept(Generic[T]):
    """What was made from a jaxpr (a compiled program), kept while a function traces to
    the same jaxpr: the newest ``size`` kept, the oldest dropped.

    A jaxpr's text, scopes included, says what it computes, so a function that traces
    the same jaxpr again (its closures unchanged but for array values, its Python
    choices the same) reuses what was made; ``extra`` tells apart what else it depends on.

    >>> import jax, jax.numpy as jnp
    >>> kept = Kept[int](size=2)
    >>> jaxpr = jax.make_jaxpr(jnp.sin)(1.0).jaxpr
    >>> kept.get(jaxpr, "f32", lambda: 1), kept.get(jaxpr, "f32", lambda: 2)
    (1, 1)
    """

    def __init__(self, size: int) -> None:
        self._size = size
        self._kept: collections.OrderedDict[tuple[str, Hashable], T] = collections.OrderedDict()

    def get(self, jaxpr: Jaxpr, extra: Hashable, make: Callable[[], T]) -> T:
        """What ``make`` made for ``jaxpr`` and ``extra``, made now if it was not kept."""
        key = (jaxpr.pretty_print(name_stack=True), extra)
        value = self._kept.pop(key) if key in self._kept else make()
        self._kept[key] = value
        while len(self._kept) > self._size:
            self._kept.popitem(last=False)
        return value

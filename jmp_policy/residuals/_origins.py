"""Where each residual of a backward pass comes from: the equation that computed it.

``jax.vjp(fn, *args)`` returns a function whose pytree leaves are the residuals
that the forward pass hands to the backward pass. Traced to a jaxpr
(`vjp_jaxpr`), each leaf is an output of that jaxpr, and `origin_of` follows it
back, through calls, ``jax.checkpoint`` and ``scan`` bodies, to what computed
it: an equation (with its scope path and the jaxpr it is in), an argument of
``fn`` or a constant. The residual report and float8 residuals both read this.

>>> import jax.numpy as jnp
>>> closed, n_out, _ = vjp_jaxpr(lambda x: jnp.sum(jnp.sin(x)), [jnp.ones(3)])
>>> [origin.kind for origin in origins(closed, n_out)]   # cos(x), and x kept for sin
['activation']
>>> origins(closed, n_out)[0].eqn.primitive.name
'cos'
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Literal, Optional, Sequence

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal as JaxprLiteral

from jmp_policy import formats
from jmp_policy.jaxprs import inline_calls, scan_sizes, sub_jaxprs
from jmp_policy.paths import display_scope, join_scope

Kind = Literal["activation", "argument", "constant"]


def vjp_jaxpr(fn: Callable[..., Any], args: Sequence[Any],
              wrt: Optional[Sequence[int]] = None) -> tuple[ClosedJaxpr, int, Any]:
    """The jaxpr of ``fn``'s forward pass under ``jax.vjp`` with respect to the arguments at
    ``wrt`` (all by default), at ``args`` (a flat list of arrays), all of them its inputs:
    its outputs are ``fn``'s output leaves, then the residuals. Its ``jit`` and
    ``custom_jvp`` calls are inlined (`jaxprs.inline_calls`), so that each residual is
    made by the operation that computes it. Returns the jaxpr, the number of output
    leaves and the treedefs ``(outputs, vjp function)``."""
    wrt = range(len(args)) if wrt is None else wrt
    trees: list[Any] = []

    def forward(*values: Any) -> tuple[list[Any], list[Any]]:
        def of_wrt(*diff: Any) -> Any:
            full = list(values)
            for i, v in zip(wrt, diff):
                full[i] = v
            return fn(*full)

        out, vjp = jax.vjp(of_wrt, *[values[i] for i in wrt])
        outs, out_tree = jax.tree_util.tree_flatten(out)
        leaves, vjp_tree = jax.tree_util.tree_flatten(vjp)
        trees.extend([out_tree, vjp_tree])
        return outs, leaves

    closed = inline_calls(jax.make_jaxpr(forward)(*args), args)
    return closed, trees[0].num_leaves, (trees[0], trees[1])


def origins(closed: ClosedJaxpr, skip: int = 0) -> list[Origin]:
    """The origin of each output of ``closed`` after the first ``skip``."""
    producers = Producers()
    top = Frame(closed.jaxpr)
    return [origin_of(var, top, producers) for var in closed.jaxpr.outvars[skip:]]


@dataclasses.dataclass(frozen=True)
class Frame:
    """A jaxpr being read: the top-level one, or the body of an equation of its parent.

    ``stacking`` is set in the body of a ``scan`` whose stacked outputs are being traced
    back, ``loop`` is the scope of the outermost such ``scan``.
    """

    jaxpr: Jaxpr
    path: str = ""
    parent: Optional[Frame] = None
    eqn: Optional[JaxprEqn] = None  # the parent's equation whose body this is
    key: tuple[Hashable, ...] = ()  # which call of a shared body (equations, outermost first)
    order: tuple[int, ...] = ()  # the equation's place in the program
    stacking: bool = False
    loop: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Origin:
    """What a residual is: an equation's result, an argument, or a constant."""

    kind: Kind
    key: Hashable  # one row per key: the same array kept twice is one
    eqn: Optional[JaxprEqn] = None
    path: str = ""
    order: tuple[int, ...] = ()
    argument: int = -1  # the index among the traced values
    loop: Optional[str] = None
    jaxpr: Optional[Jaxpr] = None  # the jaxpr whose equation ``eqn`` is


class Producers:
    """``var -> (index, equation)`` for the equations of each jaxpr met, made once per jaxpr."""

    def __init__(self) -> None:
        self._made: dict[int, tuple[Jaxpr, dict[Any, tuple[int, JaxprEqn]]]] = {}

    def of(self, jaxpr: Jaxpr) -> dict[Any, tuple[int, JaxprEqn]]:
        made = self._made.get(id(jaxpr))
        if made is None:
            made = self._made[id(jaxpr)] = (jaxpr, {
                v: (i, eqn) for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars})
        return made[1]

    def eqn(self, jaxpr: Jaxpr, atom: Any) -> Optional[JaxprEqn]:
        """The equation of ``jaxpr`` that computes ``atom``; ``None`` for a literal, an
        input or a constant."""
        found = None if isinstance(atom, JaxprLiteral) else self.of(jaxpr).get(atom)
        return None if found is None else found[1]


def origin_of(atom: Any, frame: Frame, producers: Producers) -> Origin:
    """Where the value ``atom`` of ``frame``'s jaxpr was computed, through calls and loops."""
    if isinstance(atom, JaxprLiteral):
        return Origin("constant", ("literal", id(atom)))
    jaxpr = frame.jaxpr
    if atom in jaxpr.constvars:
        return Origin("constant", ("constant", frame.key, id(atom)))
    if atom in jaxpr.invars:
        return _from_caller(jaxpr.invars.index(atom), frame, producers)
    index, eqn = producers.of(jaxpr)[atom]
    k = eqn.outvars.index(atom)
    path = join_scope(frame.path, str(eqn.source_info.name_stack))
    body = _body(eqn)
    if body is not None:
        stacking = eqn.primitive.name == "scan" and k >= scan_sizes(eqn.params)[1]
        loop = frame.loop if frame.loop is not None or not stacking else display_scope(path)
        inner = Frame(body, path, frame, eqn, (*frame.key, id(eqn), stacking),
                       (*frame.order, index), stacking, loop)
        return origin_of(body.outvars[k], inner, producers)
    here = Origin("activation", (frame.key, id(atom)), eqn, path, (*frame.order, index),
                  loop=frame.loop, jaxpr=jaxpr)
    if _is_identity(eqn):
        # A value passed on unchanged (a checkpoint name, a reduce_precision to its own
        # format, which a checkpoint policy adds to what it saves) is named by what
        # computed it.
        source = origin_of(eqn.invars[0], frame, producers)
        if source.kind == "activation":
            return dataclasses.replace(source, key=here.key, order=here.order)
    return here


def _from_caller(i: int, frame: Frame, producers: Producers) -> Origin:
    """Where the ``i``-th input of ``frame``'s jaxpr comes from: an argument of ``fn``, or
    its caller's operand."""
    eqn, parent = frame.eqn, frame.parent
    if eqn is None or parent is None:
        return Origin("argument", ("argument", i), argument=i)
    if eqn.primitive.name == "scan" and frame.stacking:
        if i >= sum(scan_sizes(eqn.params)):
            return origin_of(eqn.invars[i], parent, producers)  # the xs: the same stacked array
        # A constant or carry kept by every iteration: a stack of copies that the scan makes.
        return Origin("activation", (frame.key, i), eqn, frame.path, frame.order,
                      loop=frame.loop, jaxpr=parent.jaxpr)
    return origin_of(eqn.invars[i], parent, producers)


def _body(eqn: JaxprEqn) -> Optional[Jaxpr]:
    """The jaxpr whose outputs are ``eqn``'s, input for input: a ``scan``'s body, a call's
    (``jit``, ``checkpoint``, ``custom_jvp``, ``shard_map``); ``None`` for a primitive, a
    ``cond`` (one output from several branches) or a ``while_loop``."""
    subs = sub_jaxprs(eqn, "jaxpr") if eqn.primitive.name == "scan" else sub_jaxprs(eqn)
    if len(subs) != 1:
        return None
    body = subs[0]
    if len(body.invars) != len(eqn.invars) or len(body.outvars) != len(eqn.outvars):
        return None
    return body


def _is_identity(eqn: JaxprEqn) -> bool:
    """Whether ``eqn`` passes its operand on unchanged (a name, a no-op rounding)."""
    if eqn.primitive.name == "name":
        return True
    if eqn.primitive.name != "reduce_precision":
        return False
    facts = formats.facts_of(eqn.invars[0].aval.dtype)  # type: ignore[attr-defined]
    return bool(eqn.params["exponent_bits"] == facts.exponent_bits and
                eqn.params["mantissa_bits"] == facts.mantissa)

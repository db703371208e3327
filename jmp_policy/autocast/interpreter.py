"""The autocast interpreter: a jaxpr evaluated equation by equation, each at its precision.

`eval_jaxpr` walks a jaxpr and re-emits every equation through `eval_equation`,
which picks the precision:

* a higher-order primitive (``jit``, ``scan``, ``custom_vjp_call``...) goes to
  the handler registered for it with `register` (see ``_higher_order``);
* a primitive without floating inputs, or whose parameters fix its dtypes,
  runs as traced;
* otherwise its rule and class decide (see ``rules``): matrix work goes to
  ``Context.matmul``, float32 primitives get inputs widened to at least
  float32, the others take the widest dtype of their inputs.

Everything an evaluation needs is in a `Context`, created once per trace and
narrowed per equation with `Context.at`: there is no module-level state.
Another module can run the same dispatch with its own matrix rule or watch
every equation through ``observe``:

>>> import jax, jax.numpy as jnp, numpy as np
>>> from jmp_policy.autocast.interpreter import matmul
>>> from jmp_policy.autocast.rules import parse_rules
>>> seen = []
>>> ctx = Context(np.dtype(jnp.float16), parse_rules(None), matmul,
...               observe=lambda ctx, eqn, ins, outs: seen.append(eqn.primitive.name))
>>> closed = jax.make_jaxpr(lambda x: jnp.exp(x @ x))(jnp.ones((2, 2)))
>>> [out.dtype for out in eval_jaxpr(ctx, closed.jaxpr, closed.consts, [jnp.ones((2, 2))])]
[dtype('float32')]
>>> seen
['dot_general', 'exp']
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref
from typing import Any, Callable, ContextManager, Optional, Sequence

import jax
import numpy as np
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Primitive, Var

from jmp_policy.dtypes import is_floating_dtype
from jmp_policy.dtypes import (
    F32, DType, convert, dtype_of, is_floating, join, represents, retyped, widest)
from jmp_policy.autocast.rules import FLOAT32_PRIMITIVES, AutocastWarning, Rules, rule_of
from jmp_policy.jaxprs import bind, scoped_eqns
from jmp_policy.residuals import Float8Residuals
from jmp_policy.paths import join_scope
from jmp_policy.policy import Policy

__all__ = ["Context", "Handler", "MatmulRule", "Observer", "Params", "autocast_jaxpr",
           "compute_dtype", "eval_equation", "eval_jaxpr", "higher_order_names", "jax_roundings", "matmul",
           "register"]

Handler = Callable[["Context", JaxprEqn, list[Any]], Any]
"""Evaluates one equation under autocast: ``(ctx, eqn, invals) -> outputs``.

Returns what ``eqn.primitive.bind`` would: a list of outputs when the
primitive has multiple results, else one output."""

MatmulRule = Handler
"""Evaluates one equation of the matmul class (not pinned to float32)."""

Observer = Callable[["Context", JaxprEqn, Sequence[Any], Sequence[Any]], None]
"""Called after each equation with its context, inputs and outputs (lists)."""

_HANDLERS: dict[Primitive, Handler] = {}


def register(*primitives: Primitive) -> Callable[[Handler], Handler]:
    """Makes the decorated function the handler of ``primitives``.

    Autocast rewrites a higher-order primitive rather than classifying it: its
    handler evaluates the jaxprs in its parameters with `eval_jaxpr` (or
    `autocast_jaxpr`) and binds the primitive again, so that the primitive
    keeps its own semantics. A primitive named twice (some JAX versions alias
    ``call_p`` to ``closed_call_p``) is registered once.
    """
    def decorator(handler: Handler) -> Handler:
        for primitive in dict.fromkeys(primitives):
            if primitive in _HANDLERS:
                raise ValueError(f"autocast already has a handler for {primitive.name!r}.")
            _HANDLERS[primitive] = handler
        return handler
    return decorator


def higher_order_names() -> frozenset[str]:
    """The names of the primitives that have a handler."""
    return frozenset(p.name for p in _HANDLERS)


# --- The context --------------------------------------------------------------------

class _Casts:
    """The casts made while one jaxpr is evaluated, so each value is converted once per dtype.

    Entries hold values of that evaluation's trace; `close` drops them when it
    ends, so no tracer outlives its trace through a context that a derivative
    rule keeps.
    """

    def __init__(self) -> None:
        self._done: Optional[dict[tuple[int, DType], tuple[Any, Any]]] = {}

    def __call__(self, x: Any, dtype: DType) -> Any:
        if self._done is None or not is_floating(x) or dtype_of(x) == dtype:
            return convert(x, dtype)
        hit = self._done.get((id(x), dtype))
        if hit is not None and hit[0] is x:  # the entry holds x, so its id is not reused
            return hit[1]
        y = convert(x, dtype)
        self._done[(id(x), dtype)] = (x, y)
        return y

    def close(self) -> None:
        self._done = None


@dataclasses.dataclass
class _TraceState:
    """What one trace of an autocast function learns as it goes."""

    warned: set[str] = dataclasses.field(default_factory=set)
    paths: set[str] = dataclasses.field(default_factory=set)
    tallies: dict[str, int] = dataclasses.field(default_factory=dict)
    # Sub-jaxprs already rewritten: JAX's own helpers (`_where`, `clip`...) are nested
    # jits whose one jaxpr is called many times.
    jaxprs: dict[tuple[Any, ...], tuple[ClosedJaxpr, ClosedJaxpr]] = dataclasses.field(
        default_factory=dict)
    # Whether a sub-jaxpr (by id, held) has matrix products, nested ones included.
    products: dict[int, tuple[ClosedJaxpr, bool]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Context:
    """How to evaluate the equations of one trace under autocast.

    Attributes:
      compute: the dtype of matrix work.
      rules: the primitive classes and float32 scopes.
      matmul: the rule for equations of the matmul class (see `matmul`).
      observe: called after every equation, nested ones included.
      scope: the ``jax.named_scope`` path of the current equation
        (``"block/attention"``), once narrowed with `at`.
      pinned: whether the current equation runs in float32 because it is
        inside a float32 scope.
      as_traced: evaluate first-order equations at the dtypes they were traced
        with, rules aside: a program that is already autocast is replayed, its
        higher-order primitives through the same handlers (the numerics
        inspector observes it so).
      observe_jaxpr: entered around the evaluation of each jaxpr, nested ones
        included, inside its trace: an observer that groups its work for a
        jaxpr finishes it there.
      float8_slots: where delayed-scaling float8 products take their amax
        histories (``_delayed.Slots``); ``None`` without delayed scaling.
      residuals: how the residuals of a loop body are kept
        (``jmp_policy.Float8Residuals``); ``None``: as computed.
    """

    compute: DType
    rules: Rules
    matmul: MatmulRule
    observe: Optional[Observer] = None
    as_traced: bool = False
    observe_jaxpr: Optional[Callable[[], ContextManager[None]]] = None
    float8_slots: Any = None
    residuals: Optional[Float8Residuals] = None
    scope: str = ""
    pinned: bool = False
    # Ids of the casts of the evaluated jaxpr that round a float32 result back to the
    # half precision JAX widened it from (see `jax_roundings`).
    _jax_roundings: frozenset[int] = frozenset()
    _state: _TraceState = dataclasses.field(default_factory=_TraceState, repr=False)
    _casts: _Casts = dataclasses.field(default_factory=_Casts, repr=False)

    def at(self, eqn: JaxprEqn) -> Context:
        """The context of ``eqn``, an equation of the jaxpr this context evaluates."""
        scope = join_scope(self.scope, str(eqn.source_info.name_stack))
        matched = self.rules.scopes_in(scope)
        if self.rules.float32_scopes:
            self._state.paths.add(scope)
        return dataclasses.replace(self, scope=scope, pinned=self.pinned or bool(matched))

    def cast(self, x: Any, dtype: DType) -> Any:
        """``x`` in ``dtype`` if both are floating, converted once per evaluated jaxpr."""
        return self._casts(x, dtype)

    def tally(self, what: str) -> None:
        """Counts one more ``what`` in this trace (a rule's way to say what it did)."""
        self._state.tallies[what] = self._state.tallies.get(what, 0) + 1

    def tallied(self, what: str) -> int:
        """How many ``what`` this trace counted so far."""
        return self._state.tallies.get(what, 0)

    def unmatched_scopes(self) -> list[tuple[str, list[str]]]:
        """The float32 scopes no equation was in so far, each with near misses."""
        return self.rules.unmatched(self._state.paths)


# --- Evaluation ------------------------------------------------------------------------

def eval_jaxpr(ctx: Context, jaxpr: Jaxpr, consts: Sequence[Any],
               args: Sequence[Any]) -> list[Any]:
    """Evaluates ``jaxpr`` under autocast, like ``jax.core.eval_jaxpr(jaxpr, consts, *args)``.

    Returns the outputs as a list, at the dtypes autocast gave them.
    """
    level = dataclasses.replace(ctx, _casts=_Casts(), _jax_roundings=jax_roundings(jaxpr))
    env: dict[Var, Any] = {**dict(zip(jaxpr.constvars, consts)), **dict(zip(jaxpr.invars, args))}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    try:
        with ctx.observe_jaxpr() if ctx.observe_jaxpr is not None else contextlib.nullcontext():
            return _eval_equations(level, jaxpr, env, read)
    finally:
        level._casts.close()


def _eval_equations(level: Context, jaxpr: Jaxpr, env: dict[Var, Any],
                    read: Callable[[Any], Any]) -> list[Any]:
    for eqn in jaxpr.eqns:
        eqn_ctx = level.at(eqn)
        invals = [read(v) for v in eqn.invars]
        # Re-emitted with its call site and name scope, as jax.core.eval_jaxpr does,
        # so profiles, error messages and scopes of nested autocasts still see them.
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback,
                                           name_stack=name_stack), eqn.ctx.manager:
            outs = eval_equation(eqn_ctx, eqn, invals)
        if level.observe is not None:
            level.observe(eqn_ctx, eqn, invals, outs)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def eval_equation(ctx: Context, eqn: JaxprEqn, invals: list[Any]) -> list[Any]:
    """Evaluates one equation at the precision autocast gives it; returns its outputs."""
    handler = _HANDLERS.get(eqn.primitive)
    outs = handler(ctx, eqn, invals) if handler is not None else _first_order(ctx, eqn, invals)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _first_order(ctx: Context, eqn: JaxprEqn, invals: list[Any]) -> Any:
    """A first-order equation at the precision its rule (``rules.PRIMITIVES``) and class
    give it."""
    if ctx.as_traced or not any(is_floating(x) for x in invals):
        return bind(eqn, invals)
    rule = rule_of(eqn.primitive.name)
    operands = "promoted" if rule is None else rule.operands
    if operands == "cast":
        return _convert(ctx, eqn, invals[0])
    if eqn.params.get("out_dtype") is not None or operands == "traced":
        return bind(eqn, _at_traced_dtypes(ctx, eqn, invals))
    cls = "float32" if ctx.pinned else ctx.rules.class_of(eqn.primitive)
    if cls is None:
        _warn_unknown(ctx, eqn.primitive.name)
        return bind(eqn, _at_traced_dtypes(ctx, eqn, invals))
    if cls == "matmul":
        return ctx.matmul(ctx, eqn, invals)
    if operands == "independent":  # each operand keeps its dtype (widened for float32)
        return bind(eqn, [ctx.cast(x, join(dtype_of(x), F32)) if cls == "float32" else x
                          for x in invals])
    params = dict(eqn.params)
    target = widest(invals, [getattr(v.aval, "weak_type", False) for v in eqn.invars],
                    [v.val if isinstance(v, Literal) and np.ndim(v.val) == 0 else None
                     for v in eqn.invars])
    if cls == "float32":
        target = join(target, F32)
        if params.get("preferred_element_type") is not None:  # matrix work pinned to float32
            params["preferred_element_type"] = target
    return bind(eqn, [ctx.cast(x, target) for x in invals], params)


def _convert(ctx: Context, eqn: JaxprEqn, x: Any) -> Any:
    """A float-to-float cast written in ``fn`` is made, narrowing or widening.

    A narrowing cast rounds as it does without autocast (fake quantization,
    ``x.astype(jnp.bfloat16)`` before a custom kernel). Widening casts make no
    difference to matrix work, whose operands autocast casts to the compute
    dtype anyway (so Flax's promotion of inputs to its parameters' dtype is
    overridden there).
    """
    new = eqn.params["new_dtype"]
    if not is_floating_dtype(new):
        return bind(eqn, [x])
    if id(eqn) in ctx._jax_roundings and represents(dtype_of(x), F32):
        return x  # a float32 result stays float32 (see `jax_roundings`)
    return ctx.cast(x, np.dtype(new))


def jax_roundings(jaxpr: Jaxpr, depth: int = 8) -> frozenset[int]:
    """The ids of ``jaxpr``'s casts that JAX itself writes to round a float32 result back
    to half precision.

    ``jnp.sum``, ``jnp.mean``, ``jnp.var`` and the like compute half-precision
    inputs in float32 and round the result back: ``convert(x, float32)``, then
    float32 work ending in a numerically sensitive primitive, then
    ``convert(result, x.dtype)``. Under autocast that result stays float32, as the
    result of a sensitive primitive does (it is narrowed where it feeds matrix
    work): rounding it back would overflow float16 where float32 does not, and
    XLA:GPU removes the round trip anyway, so CPUs and GPUs would compute
    different things. A cast is taken for JAX's when its input comes from a
    sensitive primitive and, at most ``depth`` float32 equations up, from a cast
    of the same half-precision dtype to float32; the same pattern written by
    hand (``jnp.sum(x.astype(jnp.float32)).astype(jnp.float16)``) is taken so too.
    """
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "convert_element_type" or isinstance(eqn.invars[0], Literal):
            continue
        source, new = eqn.invars[0], eqn.params["new_dtype"]
        if _dtype(source) != F32 or not is_floating_dtype(new) \
                or represents(np.dtype(new), F32):
            continue
        start = producer.get(source)
        if start is not None and start.primitive.name in FLOAT32_PRIMITIVES \
                and _widened_from(start, np.dtype(new), producer, depth):
            found.add(id(eqn))
    return frozenset(found)


def _dtype(v: Any) -> DType:
    dtype: DType = np.dtype(v.aval.dtype)
    return dtype


def _widened_from(eqn: JaxprEqn, narrow: DType, producer: dict[Any, JaxprEqn],
                  depth: int) -> bool:
    """Whether float32 operands of ``eqn`` come, at most ``depth`` float32 equations up,
    from a cast of a ``narrow`` value to float32."""
    frontier, seen = [eqn], set()
    for _ in range(depth):
        operands = [v for e in frontier for v in e.invars
                    if isinstance(v, Var) and _dtype(v) == F32 and v not in seen]
        seen.update(operands)
        frontier = [producer[v] for v in operands if v in producer]
        for e in frontier:
            if e.primitive.name == "convert_element_type" and _dtype(e.invars[0]) == narrow:
                return True
        if not frontier:
            return False
    return False


def _at_traced_dtypes(ctx: Context, eqn: JaxprEqn, invals: list[Any]) -> list[Any]:
    return [ctx.cast(x, dtype_of(v.aval)) for x, v in zip(invals, eqn.invars)]


def _warn_unknown(ctx: Context, name: str) -> None:
    if name in ctx._state.warned:
        return
    ctx._state.warned.add(name)
    warnings.warn(
        f"autocast does not know the primitive {name!r}; it is evaluated at the dtypes "
        "it was traced with. Classify it with autocast(..., rules={'follow': [prim]}) "
        "(or 'float32' / 'matmul') to silence this warning.",
        AutocastWarning, stacklevel=2)


# --- Helpers for rules and handlers -------------------------------------------------------

class Params(dict[str, Any]):
    """An equation's parameters, for handlers: a missing one means JAX changed the primitive.

    Handlers read JAX-internal parameters of higher-order primitives; a renamed
    one is a clear error naming primitive and parameter, not a ``KeyError`` or,
    worse, a wrong result.
    """

    def __init__(self, eqn: JaxprEqn):
        super().__init__(eqn.params)
        self.primitive = eqn.primitive.name

    def __missing__(self, key: str) -> Any:
        raise NotImplementedError(
            f"autocast: the {self.primitive!r} primitive of jax {jax.__version__} has no "
            f"parameter {key!r} (it has {sorted(self)}), so this JAX version changed its "
            "internals and autocast cannot rewrite it. Please report this with your JAX version.")


def autocast_jaxpr(ctx: Context, closed: ClosedJaxpr, in_dtypes: Sequence[Any],
                   out_dtypes: Optional[Sequence[Any]] = None) -> ClosedJaxpr:
    """``closed`` rewritten by autocast for inputs of ``in_dtypes``, as a new closed jaxpr.

    Where ``out_dtypes`` has a dtype (not ``None``), that floating output is
    cast to it: loops and branches use this to give their outputs agreed types.

    Rewrites are kept for the trace, and across traces for jaxprs that JAX
    itself keeps (``jnp.where``, ``jnp.clip``: the jitted functions of libraries):
    re-binding a ``jit`` with the same rewritten jaxpr reuses its compiled
    executable, which an eager call would otherwise compile again each time.
    """
    # The scope is part of the key where it matters: for float32 scopes, for an observer,
    # which tells call sites apart, and for the products of a rule that decides by scope
    # (float8's exclude and kept layers: one jitted block called in every layer).
    scoped = ctx.rules.float32_scopes or ctx.observe or (
        ctx.matmul is not matmul and _has_products(ctx, closed))
    key = (tuple(in_dtypes), None if out_dtypes is None else tuple(out_dtypes), ctx.pinned,
           ctx.scope if scoped else None)
    hit = ctx._state.jaxprs.get((id(closed), *key))
    if hit is not None and hit[0] is closed:  # the entry holds `closed`, so its id is not reused
        return hit[1]
    rewrite = _REWRITES.get(ctx, closed, key)
    if rewrite is not None:
        rewrite.replay(ctx)
        ctx._state.jaxprs[(id(closed), *key)] = (closed, rewrite.jaxpr)
        return rewrite.jaxpr
    taken = getattr(ctx.float8_slots, "taken", 0)
    rewrite = _Rewrite.of(ctx, closed, in_dtypes, out_dtypes)
    if getattr(ctx.float8_slots, "taken", 0) != taken:
        # Its products took amax histories (delayed scaling): another evaluation of the
        # same jaxpr (a second call, a loop body's next trace) takes its own.
        return rewrite.jaxpr
    _REWRITES.put(ctx, closed, key, rewrite)
    ctx._state.jaxprs[(id(closed), *key)] = (closed, rewrite.jaxpr)
    return rewrite.jaxpr


def _has_products(ctx: Context, closed: ClosedJaxpr) -> bool:
    """Whether ``closed`` has a matrix-class equation, nested ones included (once per trace)."""
    known = ctx._state.products.get(id(closed))
    if known is not None and known[0] is closed:
        return known[1]
    found = any(ctx.rules.class_of(e.primitive) == "matmul" for _, e in scoped_eqns(closed))
    ctx._state.products[id(closed)] = (closed, found)
    return found


@dataclasses.dataclass(frozen=True)
class _Rewrite:
    """A rewritten jaxpr and what rewriting it told the trace (to tell a later trace too)."""

    jaxpr: ClosedJaxpr
    paths: frozenset[str]
    tallies: tuple[tuple[str, int], ...]
    unknown: tuple[str, ...]

    @classmethod
    def of(cls, ctx: Context, closed: ClosedJaxpr, in_dtypes: Sequence[Any],
           out_dtypes: Optional[Sequence[Any]]) -> _Rewrite:
        state = ctx._state
        paths, tallies, warned = set(state.paths), dict(state.tallies), set(state.warned)
        structs = [retyped(a, d) for a, d in zip(closed.in_avals, in_dtypes)]

        def body(*args: Any) -> list[Any]:
            outs = eval_jaxpr(ctx, closed.jaxpr, closed.consts, args)
            if out_dtypes is None:
                return outs
            return [o if d is None else convert(o, d) for o, d in zip(outs, out_dtypes)]

        jaxpr: ClosedJaxpr = jax.make_jaxpr(body)(*structs)
        return cls(jaxpr, frozenset(state.paths - paths),
                   tuple((k, v - tallies.get(k, 0)) for k, v in state.tallies.items()
                         if v != tallies.get(k, 0)),
                   tuple(sorted(state.warned - warned)))

    def replay(self, ctx: Context) -> None:
        """Records in ``ctx``'s trace what rewriting recorded in the trace that rewrote it."""
        state = ctx._state
        state.paths |= self.paths
        for what, n in self.tallies:
            state.tallies[what] = state.tallies.get(what, 0) + n
        for name in self.unknown:
            _warn_unknown(ctx, name)


class _RewriteCache:
    """Rewrites of jaxprs that outlive a trace, per jaxpr object, while JAX keeps it.

    Only jaxprs that hold no traced value are kept, and only for contexts
    without an observer (which must see every evaluation). An entry is keyed by
    the context's compute dtype, rules and matmul rule (each `autocast` holds
    its own; the entry references them, so that a match by id is a match) and
    the rewrite's dtypes and scope.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[Any, dict[tuple[Any, ...], tuple[Any, Any, _Rewrite]]]] = {}

    def get(self, ctx: Context, closed: ClosedJaxpr, key: tuple[Any, ...]) -> Optional[_Rewrite]:
        entry = self._entries.get(id(closed))
        if ctx.observe is not None or entry is None or entry[0]() is not closed:
            return None
        found = entry[1].get((ctx.compute, id(ctx.rules), id(ctx.matmul), *key))
        if found is None or found[0] is not ctx.rules or found[1] is not ctx.matmul:
            return None
        return found[2]

    def put(self, ctx: Context, closed: ClosedJaxpr, key: tuple[Any, ...],
            rewrite: _Rewrite) -> None:
        if ctx.observe is not None or _holds_tracer(closed) or _holds_tracer(rewrite.jaxpr):
            return
        entry = self._entries.get(id(closed))
        if entry is None or entry[0]() is not closed:
            key_id = id(closed)

            def forget(_: Any) -> None:
                self._entries.pop(key_id, None)

            entry = self._entries[key_id] = (weakref.ref(closed, forget), {})
        variants = entry[1]
        if len(variants) >= _VARIANTS_PER_JAXPR:  # autocast functions made over and over
            del variants[next(iter(variants))]  # the oldest goes
        variants[(ctx.compute, id(ctx.rules), id(ctx.matmul), *key)] = (
            ctx.rules, ctx.matmul, rewrite)


def _holds_tracer(closed: ClosedJaxpr) -> bool:
    return any(isinstance(c, jax.core.Tracer) for c in closed.consts)


_VARIANTS_PER_JAXPR = 16
_REWRITES = _RewriteCache()


# --- The matmul class -------------------------------------------------------------------

def compute_dtype(policy: Policy, values: Sequence[Any]) -> DType:
    """The dtype of matrix work for a call of ``policy`` on the array leaves ``values``:
    the policy's, or for the deprecated infer policies (no compute dtype) the dtype of the
    first floating value, float32 without one.

    >>> import jax.numpy as jnp, jmp_policy
    >>> compute_dtype(jmp_policy.get_policy("mixed_bfloat16"), [])
    dtype(bfloat16)
    """
    compute = policy.compute_dtype
    if compute is None:
        compute = next((np.dtype(x.dtype) for x in values if is_floating(x)), F32)
    dtype: DType = np.dtype(compute)
    return dtype


def matmul(ctx: Context, eqn: JaxprEqn, invals: list[Any]) -> Any:
    """Floating operands and result in ``ctx.compute``, accumulated in float32.

    ``dot_general``, ``conv_general_dilated`` and ``ragged_dot_general`` take
    their result dtype from ``preferred_element_type``, and accumulate in
    float32 whatever it is (XLA does so on every backend): a sum of many
    products is rounded to half precision once, at the end. The result is in the
    compute dtype, as in plain JAX and ``torch.autocast``: what a
    ``jax.checkpoint`` policy saves of a product (it sees the ``dot_general``
    itself), and the activations after it, take half the memory of float32.

    JAX's own derivative then keeps the backward pass in the compute dtype too:
    a product's cotangent has its result's dtype, so both transposed products
    take half-precision operands and give half-precision results.
    """
    operands = [ctx.cast(x, ctx.compute) for x in invals]
    if "preferred_element_type" not in eqn.params:
        return bind(eqn, operands)
    return bind(eqn, operands, dict(eqn.params, preferred_element_type=ctx.compute))

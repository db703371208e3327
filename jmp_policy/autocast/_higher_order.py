"""Handlers of higher-order primitives: their jaxprs are autocast, the primitive kept.

Inlining a ``jit`` or a ``custom_vjp`` would lose what makes it one (shardings,
a derivative rule, a rematerialization policy), so each handler rewrites the
jaxprs in its primitive's parameters and binds the primitive again, or
re-enters it through JAX's public API where its parameters are too internal
to rebuild. Supporting another higher-order primitive is one more handler here.

Handlers read some JAX-internal parameters through `Params`, which turns a
parameter a new JAX version renamed into a clear error.

>>> import jax, jax.numpy as jnp, jmp_policy
>>> f = jmp_policy.autocast(lambda x: jax.jit(jnp.tanh)(x @ x), "mixed_float16")
>>> (jit,) = [e for e in jax.make_jaxpr(f)(jnp.ones((2, 2))).eqns if e.primitive.name == "jit"]
>>> jit.params["name"], jit.params["jaxpr"].in_avals[0].dtype   # still a jit, on the product
('tanh', dtype('float16'))
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.extend.core.primitives as P
import jax.numpy as jnp
import numpy as np
from jax import core, lax
from jax.extend.core import ClosedJaxpr, JaxprEqn, Primitive, jaxpr_as_fun

from jmp_policy.dtypes import is_floating_dtype
from jmp_policy.autocast.interpreter import (
    Context, Params, autocast_jaxpr, eval_jaxpr, matmul, register)
from jmp_policy.jaxprs import bind, scan_sizes
from jmp_policy.residuals import in_float8
from jmp_policy.float8 import AmaxHistory, Refused, Slots, saving_scales, stacked
from jmp_policy.dtypes import convert, dtype_of, join, struct


def _shard_map_p() -> Primitive:
    """``shard_map``'s primitive, which ``jax.extend`` does not export: read off a trace
    (on the mesh in force, if ``jmp_policy`` is imported under ``jax.set_mesh``)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        mesh = jax.sharding.AbstractMesh((1,), ("i",))
    spec = jax.sharding.PartitionSpec()  # type: ignore[no-untyped-call]
    shard_map = jax.shard_map(lambda x: x, mesh=mesh, in_specs=spec, out_specs=spec)
    (eqn,) = jax.make_jaxpr(shard_map)(np.float32(0)).jaxpr.eqns
    primitive: Primitive = eqn.primitive
    return primitive


def _dtypes(values: Sequence[Any]) -> list[Any]:
    return [dtype_of(x) for x in values]


# --- Calls ---------------------------------------------------------------------------

@register(P.jit_p)
def _jit(ctx: Context, eqn: JaxprEqn, invals: list[Any]) -> Any:
    # Binding the primitive again (rather than inlining its jaxpr) keeps in/out shardings,
    # donation, layouts, the name and compiler options exactly as the user wrote them.
    jaxpr = autocast_jaxpr(ctx, Params(eqn)["jaxpr"], _dtypes(invals))
    if any(isinstance(c, core.Tracer) for c in jaxpr.consts):
        return _jit_with_operands(eqn, jaxpr, invals)
    return bind(eqn, invals, dict(eqn.params, jaxpr=jaxpr))


def _jit_with_operands(eqn: JaxprEqn, jaxpr: ClosedJaxpr, invals: list[Any]) -> Any:
    """The ``jit`` of ``jaxpr``, which closes over traced values (the amax histories of
    delayed-scaling products inside): they become leading operands, unsharded by the
    ``jit`` (its own operands keep their shardings), never donated."""
    p = Params(eqn)
    hoisted, consts = _hoist(jaxpr)
    n = len(consts)
    params = dict(p, jaxpr=hoisted,
                  in_shardings=(_unspecified(),) * n + tuple(p["in_shardings"]),
                  in_layouts=(None,) * n + tuple(p["in_layouts"]),
                  donated_invars=(False,) * n + tuple(p["donated_invars"]))
    return bind(eqn, [*consts, *invals], params)


@functools.lru_cache(maxsize=None)
def _unspecified() -> Any:
    """``jit``'s in-sharding value for an operand with none given (read off a trace)."""
    eqn = jax.make_jaxpr(jax.jit(lambda x: x))(np.float32(0)).eqns[0]
    return eqn.params["in_shardings"][0]


@register(P.closed_call_p, P.call_p)
def _call(ctx: Context, eqn: JaxprEqn, invals: list[Any]) -> Any:
    # A plain call has nothing of its own to keep: its body is evaluated in place.
    jaxpr = Params(eqn)["call_jaxpr"]
    if isinstance(jaxpr, ClosedJaxpr):
        return eval_jaxpr(ctx, jaxpr.jaxpr, jaxpr.consts, invals)
    return eval_jaxpr(ctx, jaxpr, (), invals)


@register(P.remat_p)
def _remat(ctx: Context, eqn: JaxprEqn, invals: list[Any]) -> Any:
    p = Params(eqn)
    jaxpr = p["jaxpr"]

    def body(*args: Any) -> list[Any]:
        return eval_jaxpr(ctx, jaxpr, (), args)

    # With float8 products, the policy also keeps their forward scales (`saving_scales`).
    policy = p["policy"] if ctx.matmul is matmul else saving_scales(p["policy"])
    return jax.checkpoint(body, prevent_cse=p["prevent_cse"], policy=policy)(*invals)


@register(_shard_map_p())
def _shard_map(ctx: Context, eqn: JaxprEqn, invals: list[Any]) -> Any:
    # Re-entered through the public API, which sets up the manual-axes context that the
    # body's collectives and varying-manual-axes types need.
    p = Params(eqn)
    jaxpr = p["jaxpr"]

    def body(*args: Any) -> tuple[Any, ...]:
        return tuple(eval_jaxpr(ctx, jaxpr, (), args))

    mapped = jax.shard_map(body, mesh=p["mesh"], in_specs=p["in_specs"],
                           out_specs=p["out_specs"], check_vma=p["check_vma"],
                           axis_names=set(p["newly_manual_axes"]))
    return mapped(*invals)


# --- Custom derivatives ----------------------------------------------------------------
#
# The derivative rules below run whenever the function is differentiated, possibly
# after this trace has ended, so they keep jaxprs, avals and the context, not traced
# values. (The exception, a custom_vjp's consts, exists only where the function closes
# over traced values, which JAX differentiates only within the trace that made them.)

def _func_name(closed: ClosedJaxpr) -> str:
    info = getattr(closed.jaxpr, "debug_info", None)
    return getattr(info, "func_name", None) or "autocast_custom"


def _zero_tangent(aval: Any) -> Any:
    if is_floating_dtype(aval.dtype):
        return jnp.zeros(aval.shape, aval.dtype)
    return np.zeros(aval.shape, jax.dtypes.float0)


def _refusing(ctx: Context, where: str) -> Context:
    """``ctx`` for a body that cannot take amax histories as operands: a delayed-scaling
    product there raises an error saying what to do."""
    if ctx.float8_slots is None:
        return ctx
    return dataclasses.replace(ctx, float8_slots=Refused(where))


_CUSTOM = "a function with its own derivative rule (jax.custom_jvp or jax.custom_vjp)"


@dataclasses.dataclass(frozen=True)
class _Custom:
    """A call of a function with its own derivative rule, its primal autocast.

    Attributes:
      ctx: the context, refusing delayed float8 histories (see `_refusing`).
      params: the equation's parameters.
      consts, args: its operands: the constants of its jaxpr, then its arguments.
      call: its primal jaxpr, autocast for the operands' dtypes.
    """

    ctx: Context
    params: Params
    consts: list[Any]
    args: list[Any]
    call: ClosedJaxpr

    @classmethod
    def of(cls, ctx: Context, eqn: JaxprEqn, invals: list[Any]) -> _Custom:
        p = Params(eqn)
        n = p["num_consts"]
        ctx = _refusing(ctx, _CUSTOM)
        return cls(ctx, p, invals[:n], invals[n:], autocast_jaxpr(ctx, p["call_jaxpr"],
                                                                  _dtypes(invals)))

    def primal(self) -> Callable[..., Any]:
        """The autocast primal as a function of the arguments, named as the user's."""
        call_fn, consts = jaxpr_as_fun(self.call), self.consts

        def fn(*args: Any) -> Any:
            return call_fn(*consts, *args)

        fn.__name__ = _func_name(self.params["call_jaxpr"])
        return fn


@register(P.custom_jvp_call_p)
def _custom_jvp(ctx: Context, eqn: JaxprEqn, invals: list[Any]) -> Any:
    c = _Custom.of(ctx, eqn, invals)
    ctx, out_avals = c.ctx, c.call.out_avals
    jvp_jaxpr_fun, n_args = c.params["jvp_jaxpr_fun"], len(c.args)

    def fn_jvp(primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        # The user's rule, traced by JAX at the original input types, autocast like the
        # primal; its outputs are then made to agree with the primal's types.
        jvp_jaxpr, jvp_consts, out_zeros = jvp_jaxpr_fun.call_wrapped(*[False] * n_args)
        outs = eval_jaxpr(ctx, jvp_jaxpr, jvp_consts, [*primals, *tangents])
        n_out = len(out_zeros)
        primals_out = [convert(o, a.dtype) for o, a in zip(outs[:n_out], out_avals)]
        nonzero = iter(outs[n_out:])
        tangents_out = [_zero_tangent(a) if zero else convert(next(nonzero), a.dtype)
                        for zero, a in zip(out_zeros, out_avals)]
        return primals_out, tangents_out

    custom = jax.custom_jvp(c.primal())
    custom.defjvp(fn_jvp)
    return custom(*c.args)


@register(P.custom_vjp_call_p)
def _custom_vjp(ctx: Context, eqn: JaxprEqn, invals: list[Any]) -> Any:
    c = _Custom.of(ctx, eqn, invals)
    ctx, p, consts, out_avals = c.ctx, c.params, c.consts, c.call.out_avals
    orig_call: ClosedJaxpr = p["call_jaxpr"]
    fwd_jaxpr_thunk, bwd, out_trees = p["fwd_jaxpr_thunk"], p["bwd"], p["out_trees"]
    in_avals = [v.aval for v in eqn.invars]
    arg_types = [(jnp.shape(x), dtype_of(x)) for x in c.args]

    def fn_fwd(*args: Any) -> tuple[list[Any], list[Any]]:
        fwd_jaxpr, fwd_consts = fwd_jaxpr_thunk.call_wrapped(*[True] * len(args))
        outs = eval_jaxpr(ctx, fwd_jaxpr, fwd_consts, args)
        _, res_tree, input_fwds = out_trees()
        n_res = res_tree.num_leaves - sum(f is not None for f in input_fwds)
        res_out, primals_out = iter(outs[:n_res]), outs[n_res:]
        inputs = [*consts, *args]
        res_avals = iter(v.aval for v in fwd_jaxpr.outvars[:n_res])
        # The user's bwd rule gets its residuals at the types it was written for.
        res = [convert(next(res_out), next(res_avals).dtype) if f is None
               else convert(inputs[f], in_avals[f].dtype) for f in input_fwds]
        return [convert(o, a.dtype) for o, a in zip(primals_out, out_avals)], res

    def fn_bwd(res: Sequence[Any], cts: Sequence[Any]) -> tuple[Any, ...]:
        cts = [convert(c, a.dtype) for c, a in zip(cts, orig_call.out_avals)]
        in_cts = bwd.call_wrapped(*res, *cts)
        if len(in_cts) == 2 and isinstance(in_cts[0], (list, tuple)):
            in_cts = in_cts[0]  # jax >= 0.11 returns (cotangents, logs); a cotangent is never a list
        if len(in_cts) != len(arg_types):  # never zip a changed structure into wrong gradients
            raise NotImplementedError(
                f"autocast: the backward rule of {_func_name(orig_call)!r} returned "
                f"{len(in_cts)} cotangents for {len(arg_types)} arguments under jax "
                f"{jax.__version__}, whose custom_vjp internals autocast does not know. "
                "Please report this with your JAX version.")
        return tuple(_cotangent(ct, shape, dtype) for ct, (shape, dtype) in zip(in_cts, arg_types))

    custom = jax.custom_vjp(c.primal())
    custom.defvjp(fn_fwd, fn_bwd)
    return custom(*c.args)


def _cotangent(ct: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    """A cotangent for an argument of ``shape`` and ``dtype``, as ``jax.custom_vjp`` wants it."""
    if not is_floating_dtype(dtype):
        return None
    if ct is None or not hasattr(ct, "dtype") or type(ct).__name__ == "Zero":  # symbolic zero
        return jnp.zeros(shape, dtype)
    return convert(ct, dtype)


# --- Loops and branches -----------------------------------------------------------------

def _stable_carry(ctx: Context, body: ClosedJaxpr, before: list[Any], carry: list[Any],
                  after: list[Any], out_slice: slice) -> tuple[list[Any], Optional[ClosedJaxpr]]:
    """Carry dtypes that the autocast body maps to themselves (widening only).

    Returns them with the body rewritten for them when that rewrite already
    returns exactly those dtypes (the common case), else with ``None``.
    """
    for _ in range(4):
        traced = autocast_jaxpr(ctx, body, before + carry + after)
        outs = [a.dtype for a in traced.out_avals[out_slice]]
        if outs == carry:
            return carry, traced
        joined = [join(c, o) if is_floating_dtype(c) and is_floating_dtype(o) else c
                  for c, o in zip(carry, outs)]
        if joined == carry:
            return carry, None
        carry = joined
    return carry, None


@register(P.scan_p)
def _scan(ctx: Context, eqn: JaxprEqn, invals: list[Any]) -> Any:
    if isinstance(ctx.float8_slots, Slots):
        return _scan_with_histories(ctx, eqn, invals)
    return _plain_scan(ctx, eqn, invals)


def _plain_scan(ctx: Context, eqn: JaxprEqn, invals: list[Any]) -> Any:
    p = Params(eqn)
    nc, nk = scan_sizes(p)
    d = _dtypes(invals)
    consts_d, carry_d, xs_d = d[:nc], d[nc:nc + nk], d[nc + nk:]
    carry_d, body = _stable_carry(ctx, p["jaxpr"], consts_d, carry_d, xs_d, slice(0, nk))
    if body is None:
        n_ys = len(p["jaxpr"].out_avals) - nk
        body = autocast_jaxpr(ctx, p["jaxpr"], consts_d + carry_d + xs_d, carry_d + [None] * n_ys)
    consts, xs = invals[:nc], invals[nc + nk:]
    carry = [ctx.cast(x, dt) for x, dt in zip(invals[nc:nc + nk], carry_d)]
    body_fn = jaxpr_as_fun(body)
    if ctx.residuals is not None:
        # Stored as each iteration runs, not once the loop has stacked them all; the
        # carry is stacked by the loop, so it is an activation too.
        body_fn = in_float8(body_fn, ctx.residuals, activations=range(nc, nc + nk))

    # Re-entered through the public API (the primitive's parameters differ between
    # JAX versions); the body is already autocast, so this only traces it again.
    def step(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
        outs = body_fn(*consts, *carry, *x)
        return list(outs[:nk]), list(outs[nk:])

    carry, ys = lax.scan(step, carry, list(xs), length=p["length"], reverse=p["reverse"],
                         unroll=p["unroll"])
    return [*carry, *ys]


def _scan_with_histories(ctx: Context, eqn: JaxprEqn, invals: list[Any]) -> Any:
    """A ``scan`` whose body may run delayed-scaling products: each gets a history per
    iteration, stacked, passed in as a scanned operand (a stack of layers gets one per
    layer, and the backward pass returns each layer's observation in its row)."""
    p = Params(eqn)
    nc, nk = scan_sizes(p)
    d = _dtypes(invals)
    consts_d, carry_d, xs_d = d[:nc], d[nc:nc + nk], d[nc + nk:]
    slots = ctx.float8_slots
    probe = Slots(slots.length)  # the body's products, counted on throwaway histories
    carry_d, _ = _stable_carry(dataclasses.replace(ctx, float8_slots=Slots(slots.length)),
                               p["jaxpr"], consts_d, carry_d, xs_d, slice(0, nk))
    n_ys = len(p["jaxpr"].out_avals) - nk
    in_d, out_d = consts_d + carry_d + xs_d, carry_d + [None] * n_ys
    autocast_jaxpr(dataclasses.replace(ctx, float8_slots=probe), p["jaxpr"], in_d, out_d)
    if not probe.requests:
        return _plain_scan(ctx, eqn, invals)
    histories = stacked(slots, probe.requests, p["length"])
    consts, xs = invals[:nc], invals[nc + nk:]
    carry = [ctx.cast(x, dt) for x, dt in zip(invals[nc:nc + nk], carry_d)]

    def step(carry: list[Any], x: tuple[list[Any], list[AmaxHistory]]) -> Any:
        body_slots = Slots(slots.length, x[1], "lax.scan body")
        body = autocast_jaxpr(dataclasses.replace(ctx, float8_slots=body_slots),
                              p["jaxpr"], in_d, out_d)
        body_slots.check_all_taken()
        outs = jaxpr_as_fun(body)(*consts, *carry, *x[0])
        return list(outs[:nk]), list(outs[nk:])

    carry, ys = lax.scan(step, carry, (list(xs), histories), length=p["length"],
                         reverse=p["reverse"], unroll=p["unroll"])
    return [*carry, *ys]


@register(P.while_p)
def _while(ctx: Context, eqn: JaxprEqn, invals: list[Any]) -> Any:
    # Its iterations are not known before it runs: no history per iteration to pass in.
    ctx = _refusing(ctx, "a lax.while_loop (or a fori_loop with a traced trip count)")
    p = Params(eqn)
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    d = _dtypes(invals)
    cond_d, body_d, carry_d = d[:cn], d[cn:cn + bn], d[cn + bn:]
    carry_d, body = _stable_carry(ctx, p["body_jaxpr"], body_d, carry_d, [], slice(None))
    if body is None:
        body = autocast_jaxpr(ctx, p["body_jaxpr"], body_d + carry_d, carry_d)
    cond = autocast_jaxpr(ctx, p["cond_jaxpr"], cond_d + carry_d)
    body, body_hoisted = _hoist(body)
    cond, cond_hoisted = _hoist(cond)
    carry = [ctx.cast(x, dt) for x, dt in zip(invals[cn + bn:], carry_d)]
    params = dict(p, body_jaxpr=body, cond_jaxpr=cond, cond_nconsts=cn + len(cond_hoisted),
                  body_nconsts=bn + len(body_hoisted))
    return bind(eqn, [*cond_hoisted, *invals[:cn], *body_hoisted, *invals[cn:cn + bn], *carry],
                params)


@register(P.cond_p)
def _cond(ctx: Context, eqn: JaxprEqn, invals: list[Any]) -> Any:
    if isinstance(ctx.float8_slots, Slots):
        return _cond_with_histories(ctx, eqn, invals)
    p = Params(eqn)
    index, ops = invals[0], invals[1:]
    d = _dtypes(ops)
    traced = [autocast_jaxpr(ctx, b, d) for b in p["branches"]]
    out_d = _agreed(traced)
    branches = tuple(t if [a.dtype for a in t.out_avals] == out_d
                     else autocast_jaxpr(ctx, b, d, out_d)
                     for t, b in zip(traced, p["branches"]))
    return bind(eqn, [index, *ops], dict(p, branches=branches))


def _agreed(traced: Sequence[ClosedJaxpr]) -> list[Any]:
    """The output types every branch must return: the widest any branch produces."""
    out_d = []
    for avals in zip(*(t.out_avals for t in traced)):
        dts = [a.dtype for a in avals]
        floating = all(is_floating_dtype(x) for x in dts)
        out_d.append(functools.reduce(join, dts) if floating else dts[0])
    return out_d


def _cond_with_histories(ctx: Context, eqn: JaxprEqn, invals: list[Any]) -> Any:
    """A ``cond`` whose branches may run delayed-scaling products: each branch's products
    take their own histories (an untaken branch observes nothing, which
    ``Float8State.record`` leaves alone), which the branches close over, so the
    ``cond`` is made again through ``lax.switch``, which passes them in."""
    p = Params(eqn)
    index, ops = invals[0], invals[1:]
    d = _dtypes(ops)
    probe = Slots(ctx.float8_slots.length)
    out_d = _agreed([autocast_jaxpr(dataclasses.replace(ctx, float8_slots=probe), b, d)
                     for b in p["branches"]])
    if not probe.requests:
        return _cond(dataclasses.replace(ctx, float8_slots=None), eqn, invals)
    branches = [jaxpr_as_fun(autocast_jaxpr(ctx, b, d, out_d)) for b in p["branches"]]
    return lax.switch(index, branches, *ops)


def _hoist(closed: ClosedJaxpr) -> tuple[ClosedJaxpr, list[Any]]:
    """Moves a closed jaxpr's consts to leading inputs (loops take consts as operands)."""
    if not closed.consts:
        return closed, []
    consts = list(closed.consts)
    n = len(consts)
    const_structs = [struct(np.shape(c), dtype_of(c)) for c in consts]
    in_structs = [struct(a.shape, a.dtype, a.weak_type) for a in closed.in_avals]
    hoisted: ClosedJaxpr = jax.make_jaxpr(
        lambda *a: core.eval_jaxpr(closed.jaxpr, a[:n], *a[n:])
    )(*const_structs, *in_structs)
    return hoisted, consts

"""Runs a function as XLA's GPU backend compiles it: narrow float roundings removed.

XLA:CPU rounds every float conversion; XLA:GPU under ``jit`` often does not,
so a CPU run cannot show an algorithm that relies on a rounding failing on a
GPU. `with_excess_precision(fn)` evaluates ``fn``'s jaxpr with the rewrites
below, inside loops, branches, nested calls, custom derivatives and remat too,
so that the tests see what a GPU computes.

What XLA:GPU does (jax and jaxlib 0.10.2, deviceless compiles for an H100,
``xla_allow_excess_precision`` at its default, true; read off the optimized HLO):

1. **Chains of float conversions collapse.** ``convert(convert(x, T1), T2)`` is
   ``convert(x, T2)``, whatever ``T1`` is, and longer chains alike: a round trip
   ``f32 -> f8 -> f32`` is ``x``, and ``f32 -> f8 -> bf16`` rounds to bfloat16
   only. Per use: other uses of the ``T1`` value keep it.
2. **Conversions move across reshapes, transposes and broadcasts.** A broadcast
   always moves after the conversion that reads it; a reshape, transpose,
   squeeze or expand_dims does as soon as the widened value feeds any
   elementwise operation (``x.astype(f8).reshape(s).astype(f32) * 3`` is
   ``x.reshape(s) * 3``; alone as a program's output the rounding stayed, a case
   not worth relying on). The rounding then goes by rule 1.
   Slices, dynamic slices, gathers, pads, concatenations and reversals keep
   the narrow value in every program tried.
3. **Narrow arithmetic is computed wider.** XLA:GPU has no float8 or float4
   arithmetic: every elementwise operation and reduction of a float8 or
   float4_e2m1fn value is computed in float16, from float16 conversions of its
   operands and converted back; by rule 1 the operands then hold their float16
   rounding (``(-x.astype(f8)).astype(f32)`` is ``-x.astype(f16)``, no float8
   rounding at all). bfloat16's ``div``, ``pow``, ``atan2``, ``rem``, ``sqrt``,
   ``rsqrt``, ``cbrt``, ``tanh``, ``sin``, ``cos``, ``log1p``, ``expm1``, ``erf``,
   ``sign``, ``floor``, ``ceil``, ``round`` and ``clamp`` are computed in float32
   (so ``jnp.sqrt(x.astype(bf16)).astype(f32)`` is ``jnp.sqrt(x)``); its other
   operations, and all of float16's, are native.

XLA:CPU, which runs the emulation, has excess precision of its own: it computes
bfloat16 arithmetic and products in float32 and drops the result's rounding
where the result is widened (float16 it rounds). XLA:GPU computes those natively,
rounded: the emulation puts an optimization barrier after them, so that XLA:CPU
keeps the rounding too.

Kept as written, as XLA keeps them: float32 operations (``lax.reduce_precision``
and ``lax.round`` among them), bitcasts, integer operations, comparisons and
selects of narrow values, and the narrow operands of products (``dot_general``:
native float8 and bfloat16 GEMMs).
"""

from __future__ import annotations

import types
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

# Calls XLA inlines: a chain of conversions runs across their boundaries.
_INLINED = ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
            "custom_vjp_call_jaxpr", "remat", "remat2", "checkpoint")

# Rule 2: layout operations a conversion moves across (one operand, values unchanged).
_LAYOUT = frozenset({"reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims",
                     "copy", "copy_p"})

# Rule 3: what XLA:GPU computes narrow operations in.
_ARITHMETIC = frozenset({
    "neg", "abs", "sign", "floor", "ceil", "round", "exp", "exp2", "log", "log1p", "expm1",
    "tanh", "logistic", "sin", "cos", "tan", "sqrt", "rsqrt", "cbrt", "erf", "integer_pow",
    "square", "add", "add_any", "sub", "mul", "div", "max", "min", "pow", "atan2", "rem",
    "clamp", "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "cumsum", "cummax",
    "cummin", "cumprod", "cumlogsumexp"})
_BF16_IN_F32 = frozenset({
    "div", "pow", "atan2", "rem", "sqrt", "rsqrt", "cbrt", "tanh", "sin", "cos", "tan",
    "log1p", "expm1", "erf", "sign", "floor", "ceil", "round", "clamp"})
# What XLA:GPU computes in bfloat16, rounding the result, where XLA:CPU computes in float32
# and drops the result's rounding when it is widened: the emulation keeps it.
_NATIVE_ON_GPU = _ARITHMETIC | {"dot_general", "conv_general_dilated", "ragged_dot",
                                "ragged_dot_general"}
_NO_NARROW_ARITHMETIC = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3", "float8_e4m3fnuz",
                         "float8_e5m2fnuz", "float8_e4m3b11fnuz", "float8_e3m4",
                         "float4_e2m1fn")


def with_excess_precision(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` evaluated with XLA:GPU's excess precision (see the module docstring)."""
    def wrapped(*args: Any) -> Any:
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        outs, _ = _eval(closed.jaxpr, closed.consts, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shape), outs)
    return wrapped


def _is_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def computed_in(name: str, dtype: Any) -> Optional[np.dtype]:
    """The dtype XLA:GPU computes primitive ``name`` on ``dtype`` values in, where wider
    (rule 3); None where native."""
    try:
        dtype_name = np.dtype(dtype).name
    except TypeError:  # a PRNG key's dtype
        return None
    if name in _ARITHMETIC and dtype_name in _NO_NARROW_ARITHMETIC:
        return np.dtype(np.float16)
    if name in _BF16_IN_F32 and dtype_name == "bfloat16":
        return np.dtype(np.float32)
    return None


def _dtype(x: Any) -> Any:
    return getattr(x, "dtype", None) or jnp.result_type(x)


def _eval(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any],
          arg_sources: Optional[Sequence[Any]] = None) -> tuple[list[Any], list[Any]]:
    """Evaluates ``jaxpr``; returns its outputs and their sources.

    A value's *source* is what XLA:GPU may read in its place when it is converted
    again: for the result of a float conversion, the input of its chain of
    conversions (rule 1), carried across layout operations (rule 2); for the
    result of narrow arithmetic computed wider, the wide result (rule 3). None
    for other values. Sources cross into and out of inlined calls, as XLA
    inlines them, but not into loop and branch bodies (computations of their own).
    """
    env: dict[Any, Any] = {}
    sources: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    def source(v: Any) -> Any:
        return None if isinstance(v, Literal) else sources.get(v)

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for i, (v, x) in enumerate(zip(jaxpr.invars, args)):
        env[v] = x
        if arg_sources is not None and arg_sources[i] is not None:
            sources[v] = arg_sources[i]
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        insources = [source(v) for v in eqn.invars]
        outs, outsources = _eval_eqn(eqn, invals, insources)
        for v, x, s in zip(eqn.outvars, outs, outsources):
            env[v] = x
            if s is not None:
                sources[v] = s
    return [read(v) for v in jaxpr.outvars], [source(v) for v in jaxpr.outvars]


def _eval_eqn(eqn: Any, invals: list[Any], insources: list[Any]) -> tuple[list[Any], list[Any]]:
    """One equation's outputs and their sources (see `_eval`)."""
    name, params = eqn.primitive.name, eqn.params
    if name == "convert_element_type":
        return _convert(invals[0], insources[0], params)
    if insources and insources[0] is not None and \
            (name in _LAYOUT or (name == "stack" and len(invals) == 1)):  # a reshape
        out = eqn.primitive.bind(*invals, **params)
        return [out], [eqn.primitive.bind(insources[0], *invals[1:], **params)]
    if name in _INLINED:
        sub = params.get("jaxpr", params.get("call_jaxpr", params.get("fun_jaxpr")))
        sub_consts = sub.consts if isinstance(sub, ClosedJaxpr) else ()
        sub = sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub
        return _eval(sub, sub_consts, invals, insources)
    narrow = eqn.outvars[0].aval.dtype if len(eqn.outvars) == 1 else None
    wide = computed_in(name, narrow)
    if wide is not None:
        to_wide = {"new_dtype": wide, "weak_type": False, "sharding": None}
        operands = [_convert(x, s, to_wide)[0][0] if _dtype(x) == narrow else x
                    for x, s in zip(invals, insources)]
        result = eqn.primitive.bind(*operands, **params)
        return [jax.lax.convert_element_type(result, narrow)], [result]
    outs = eqn.primitive.bind(*invals, **_rewritten(params))
    outs = outs if eqn.primitive.multiple_results else [outs]
    if name in _NATIVE_ON_GPU and computed_in(name, narrow) is None and \
            getattr(narrow, "name", None) == "bfloat16":
        outs = [jax.lax.optimization_barrier(outs[0])]  # keeps XLA:CPU from widening it
    return list(outs), [None] * len(outs)


def _convert(x: Any, source: Any, params: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """A ``convert_element_type`` of ``x`` with ``params``, whose source is ``source``
    (rule 1): a float conversion converts the start of its chain instead of ``x``."""
    new = np.dtype(params["new_dtype"])
    if not _is_float(new):
        return [jax.lax.convert_element_type_p.bind(x, **params)], [None]
    if _dtype(x) == new:  # no conversion in XLA: the chain goes on
        return [jax.lax.convert_element_type_p.bind(x, **params)], [source]
    start = x if source is None else source
    return [jax.lax.convert_element_type_p.bind(start, **params)], [start]


def _rewritten(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with each jaxpr (a loop's body, a branch) evaluated with excess precision."""
    def rewrite(value: Any) -> Any:
        if isinstance(value, ClosedJaxpr):
            shapes = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in value.jaxpr.invars]
            return jax.make_jaxpr(lambda *a: _eval(value.jaxpr, value.consts, a)[0])(*shapes)
        if type(value) is tuple:  # branches; not a NamedTuple parameter (a PRNG impl)
            return tuple(rewrite(v) for v in value)
        return value
    return {k: rewrite(v) for k, v in params.items()}


# The same for the tests' compilers: XLA:CPU's, and XLA:GPU's as emulated here.
COMPILERS = {"jit": jax.jit,
             "jit, excess precision as on a GPU": lambda f: jax.jit(with_excess_precision(f))}


class _JaxCompilingAsOnAGpu(types.ModuleType):
    """The ``jax`` module, its ``jit`` compiling with the emulation."""

    def __init__(self) -> None:
        super().__init__("jax")

    def __getattr__(self, name: str) -> Any:
        return COMPILERS["jit, excess precision as on a GPU"] if name == "jit" \
            else getattr(jax, name)


def inspect_as_on_a_gpu(monkeypatch: Any) -> None:
    """Makes `jmp_policy.inspect_numerics` compile its programs with the emulation (until
    ``monkeypatch`` undoes it), so that its statistics are those of the program XLA:GPU
    runs: the inspector jits its program itself (jmp_policy/inspector/_report.py), and
    the ``jax`` it reads ``jit`` from is replaced."""
    from jmp_policy.inspector import _report
    monkeypatch.setattr(_report, "jax", _JaxCompilingAsOnAGpu())

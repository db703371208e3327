"""Per-operation mixed precision for any JAX function, in the spirit of ``torch.autocast``.

`autocast(fn, policy)` traces ``fn`` to a jaxpr (once per call signature) and
evaluates that jaxpr primitive by primitive, choosing each primitive's
precision from three classes:

``"matmul"``
    ``dot_general``, ``conv_general_dilated``, ``ragged_dot_general``. Floating
    inputs are cast to the policy's compute dtype and the product accumulates
    in float32 (``preferred_element_type``), so the result is float32. The
    products of the backward pass take half-precision operands too.
``"float32"``
    Numerically sensitive primitives (see `FLOAT32_PRIMITIVES`). Floating
    inputs are widened to at least float32 (float64 stays float64).
``"follow"``
    Everything else: the widest floating input wins (JAX promotion; weakly
    typed Python scalars do not widen), so nothing is ever silently narrowed.

A float32 value, once produced, stays float32 for the operations that follow;
it is narrowed only where it feeds matrix work or becomes a floating output
of ``fn`` (cast to the policy's output dtype). Integer, boolean and PRNG
values are never touched. Floating casts inside ``fn`` are kept only where they
widen (see `_convert` for why).

Higher-order primitives are rewritten, not inlined, so they keep their own
semantics: a nested ``jit`` keeps its shardings and name, ``custom_jvp`` /
``custom_vjp`` functions keep their derivative rules, ``scan`` /
``while_loop`` carries are given a stable dtype, ``cond`` branches agree on
output dtypes, ``checkpoint`` keeps its policy, ``shard_map`` bodies are
autocast with their collectives.

A primitive that autocast does not know, and that has floating inputs, is
evaluated at the dtypes it was traced with, with one `AutocastWarning` per
trace naming it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import threading
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Primitive, jaxpr_as_fun

from jmp_policy._dtypes import is_floating_dtype
from jmp_policy.policy import Policy, as_policy

__all__ = [
    "AutocastWarning",
    "FLOAT32_PRIMITIVES",
    "FOLLOW_PRIMITIVES",
    "MATMUL_PRIMITIVES",
    "autocast",
]

_F32 = np.dtype(np.float32)


class AutocastWarning(UserWarning):
    """Emitted once per trace for each primitive autocast does not know."""


# --- The default rules ------------------------------------------------------

MATMUL_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated", "ragged_dot_general"})

FLOAT32_PRIMITIVES = frozenset({
    # Transcendentals whose half-precision results lose most of their digits or overflow.
    "exp", "exp2", "log", "log1p", "expm1", "pow", "logistic", "erf", "erfc", "erf_inv",
    "rsqrt", "sqrt", "cbrt", "tan", "sinh", "cosh", "asin", "acos", "asinh", "acosh", "atanh",
    "lgamma", "digamma", "polygamma", "igamma", "igammac", "igamma_grad_a", "zeta",
    "bessel_i0e", "bessel_i1e", "regularized_incomplete_beta", "random_gamma",
    # Squares overflow float16 above 256: norms and variances start here.
    "square", "integer_pow",
    # Division overflows for small divisors; mean, softmax and normalisation end here.
    "div",
    # Accumulations.
    "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp", "reduce_window_sum",
    # The first primitive of softmax / log_softmax / logsumexp: widening here makes the
    # whole `x - max(x)`, `exp`, `sum`, `log` chain float32 (max itself is exact).
    "reduce_max",
    # Linear algebra and FFTs (often unsupported in half precision, and ill-conditioned).
    "cholesky", "cholesky_update", "eig", "eigh", "lu", "qr", "svd", "schur", "hessenberg",
    "triangular_solve", "tridiagonal", "tridiagonal_solve", "geqrf", "geqp3",
    "householder_product", "ormqr", "symmetric_product", "fft",
})

FOLLOW_PRIMITIVES = frozenset({
    # Elementwise.
    "abs", "add", "add_any", "sub", "mul", "neg", "max", "min", "sign", "floor", "ceil",
    "round", "nextafter", "rem", "clamp", "select_n", "tanh", "sin", "cos", "atan", "atan2",
    "is_finite", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor",
    "shift_left", "shift_right_arithmetic", "shift_right_logical", "population_count", "clz",
    "real", "imag", "conj", "complex", "reduce_precision", "stop_gradient", "copy", "copy_p",
    # Structural.
    "broadcast_in_dim", "reshape", "transpose", "squeeze", "slice", "dynamic_slice",
    "dynamic_update_slice", "gather", "concatenate", "pad", "rev", "tile", "split",
    "iota", "select_and_gather_add", "select_and_scatter_add",
    # Order statistics (exact in any precision).
    "reduce_min", "reduce_and", "reduce_or", "reduce_xor", "argmax", "argmin",
    "cummax", "cummin", "sort", "top_k", "approx_top_k", "reduce_window_max", "reduce_window_min",
    # Sharding, placement and collectives.
    "device_put", "optimization_barrier", "sharding_constraint", "reshard",
    "layout_constraint", "pvary", "psum", "pmax", "pmin", "all_gather", "all_to_all",
    "ppermute", "axis_index", "reduce_scatter", "psum_invariant", "all_gather_invariant",
    "pbroadcast",
    # PRNG (no floating inputs).
    "random_bits", "random_seed", "random_wrap", "random_unwrap", "random_fold_in",
    "random_split", "random_clone", "threefry2x32", "iota_2x32_shape", "rng_bit_generator",
})

# Variadic primitives whose operands are independent: no dtype unification.
_INDEPENDENT = frozenset({
    "sort", "device_put", "optimization_barrier", "psum", "pmax", "pmin", "all_gather",
    "all_to_all", "ppermute", "reduce_scatter", "select_and_gather_add", "psum_invariant",
    "all_gather_invariant", "pvary",
})

# Known primitives whose parameters pin their dtypes (an embedded reduction jaxpr, a
# callback's result types, a bit layout): they run at their traced dtypes, silently.
_TRACED_DTYPES = frozenset({
    "bitcast_convert_type", "reduce", "reduce_window", "select_and_scatter",
    "scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max",
    "pure_callback", "io_callback", "debug_callback", "debug_print", "ffi_call",
    "rng_uniform", "convert_element_type",
})

_HIGHER_ORDER = frozenset({
    "jit", "closed_call", "call", "remat2", "checkpoint", "custom_jvp_call",
    "custom_vjp_call", "scan", "while", "cond", "shard_map",
})

_CLASSES = ("matmul", "float32", "follow")
_RULE_KEYS = _CLASSES + ("float32_scopes",)
_DEFAULTS = {
    "matmul": MATMUL_PRIMITIVES, "float32": FLOAT32_PRIMITIVES, "follow": FOLLOW_PRIMITIVES,
}
_KNOWN = MATMUL_PRIMITIVES | FLOAT32_PRIMITIVES | FOLLOW_PRIMITIVES | _TRACED_DTYPES


# --- Rules --------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Rules:
    classes: Mapping[str, str]              # primitive name -> "matmul" | "float32" | "follow"
    float32_scopes: tuple                   # tuples of name-scope components

    def pinned(self, name_stack: str) -> bool:
        if not self.float32_scopes or not name_stack:
            return False
        parts = tuple(name_stack.split("/"))
        return any(_contains(parts, scope) for scope in self.float32_scopes)


def _contains(parts: tuple, scope: tuple) -> bool:
    n = len(scope)
    return any(parts[i:i + n] == scope for i in range(len(parts) - n + 1))


def _parse_rules(rules: Optional[Mapping[str, Any]]) -> _Rules:
    classes = {name: cls for cls, names in _DEFAULTS.items() for name in names}
    if rules is None:
        return _Rules(classes, ())
    if not isinstance(rules, Mapping):
        raise TypeError(
            f"autocast rules must be a mapping with keys among {', '.join(_RULE_KEYS)}, "
            "e.g. {'float32': ['tanh'], 'float32_scopes': ['attention']}; "
            f"got {type(rules).__name__}."
        )
    unknown = [k for k in rules if k not in _RULE_KEYS]
    if unknown:
        raise ValueError(
            f"Unknown autocast rules key(s) {unknown!r}: valid keys are {', '.join(_RULE_KEYS)}."
        )
    seen: dict = {}
    for cls in _CLASSES:
        for prim in _as_list(rules.get(cls, ()), f"rules[{cls!r}]"):
            name = _primitive_name(prim)
            if name in seen and seen[name] != cls:
                raise ValueError(
                    f"Primitive {name!r} is listed under both rules[{seen[name]!r}] and "
                    f"rules[{cls!r}]: list it under one class only."
                )
            seen[name] = cls
            classes[name] = cls
    scopes = []
    for scope in _as_list(rules.get("float32_scopes", ()), "rules['float32_scopes']"):
        parts = tuple(scope.split("/")) if isinstance(scope, str) else ()
        if not parts or any(not p for p in parts):
            raise ValueError(
                f"rules['float32_scopes'] entries must be jax.named_scope names such as "
                f"'attention' or 'block/attention' (no empty parts); got {scope!r}."
            )
        scopes.append(parts)
    return _Rules(classes, tuple(scopes))


def _as_list(value: Any, what: str) -> list:
    if isinstance(value, (str, Primitive)):
        return [value]
    try:
        return list(value)
    except TypeError:
        raise TypeError(f"{what} must be a name or a list of names, got {value!r}.") from None


def _primitive_name(prim: Any) -> str:
    if isinstance(prim, Primitive):
        name = prim.name
    elif isinstance(prim, str):
        name = prim
        if name not in _KNOWN:
            close = difflib.get_close_matches(name, sorted(_KNOWN), n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ValueError(
                f"Unknown primitive name {name!r} in autocast rules.{hint} Pass primitives "
                "autocast does not list by their jax.extend.core.Primitive object instead."
            )
    else:
        raise TypeError(
            f"autocast rules list primitives by name ('exp') or Primitive object; got {prim!r}."
        )
    if name in _TRACED_DTYPES:
        raise ValueError(
            f"{name!r} always runs at the dtypes it was traced with (its parameters fix its "
            "types), so it cannot be moved to another class."
        )
    if name in _HIGHER_ORDER:
        raise ValueError(
            f"{name!r} is a higher-order primitive: autocast applies its rules inside it, so it "
            "cannot be moved to a class; move the primitives it contains instead."
        )
    return name


# --- dtype helpers --------------------------------------------------------------

def _dtype(x: Any) -> Optional[np.dtype]:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        # Python scalars are weakly typed: JAX sees 2.0 as float32, not numpy's float64.
        dtype = jnp.result_type(x) if isinstance(x, (int, float, complex, bool)) else None
    return None if dtype is None else np.dtype(dtype) if not _is_extended(dtype) else dtype


def _is_extended(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jax.dtypes.extended)


def _floating(x: Any) -> bool:
    dtype = _dtype(x)
    return dtype is not None and is_floating_dtype(dtype)


def _represents(wide: np.dtype, narrow: np.dtype) -> bool:
    """True when every value of ``narrow`` is exactly a value of ``wide``."""
    a, b = jnp.finfo(wide), jnp.finfo(narrow)
    return a.nexp >= b.nexp and a.nmant >= b.nmant


def _join(a: np.dtype, b: np.dtype) -> np.dtype:
    """The narrowest floating dtype representing both (float16 + bfloat16 -> float32)."""
    if a == b:
        return a
    if _represents(a, b):
        return a
    if _represents(b, a):
        return b
    try:
        return np.dtype(jnp.promote_types(a, b))
    except TypeError:  # float8 types refuse implicit promotion
        return _F32 if max(a.itemsize, b.itemsize) <= 4 else np.dtype(np.float64)


# Casts already emitted in the jaxpr being evaluated, keyed by (id(value), dtype), so a
# value feeding several matmuls is converted once (the entry keeps the value alive).
class _Memo(threading.local):
    stack: list

    def __init__(self):
        self.stack = [{}]


_cast_memo = _Memo()


def _cast(x: Any, dtype: np.dtype) -> Any:
    if _dtype(x) == dtype:
        return x
    if isinstance(x, (np.ndarray, np.generic)):
        return np.asarray(x, dtype)  # a literal stays a literal
    memo = _cast_memo.stack[-1]
    hit = memo.get((id(x), dtype))
    if hit is not None and hit[0] is x:
        return hit[1]
    y = lax.convert_element_type(x, dtype)
    memo[(id(x), dtype)] = (x, y)
    return y


def _float_dtypes(values: Sequence[Any], weak: Sequence[bool]) -> list:
    strong = [_dtype(x) for x, w in zip(values, weak) if _floating(x) and not w]
    return strong or [_dtype(x) for x in values if _floating(x)]


# --- The interpreter --------------------------------------------------------------

@dataclasses.dataclass
class _Context:
    compute: np.dtype
    rules: _Rules
    warned: set = dataclasses.field(default_factory=set)
    # Sub-jaxprs already autocast in this trace: JAX's own helpers (`_where`, `clip`,
    # `take_along_axis`...) are nested jits called many times with the same jaxpr.
    traced: dict = dataclasses.field(default_factory=dict)


def _join_stack(prefix: str, stack: Any) -> str:
    stack = str(stack)
    return f"{prefix}/{stack}" if prefix and stack else prefix or stack


def _eval_jaxpr(ctx: _Context, jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any],
                prefix: str = "", pinned: bool = False) -> list:
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    _cast_memo.stack.append({})
    try:
        _eval_eqns(ctx, jaxpr, env, read, prefix, pinned)
        return [read(v) for v in jaxpr.outvars]
    finally:
        _cast_memo.stack.pop()


def _eval_eqns(ctx: _Context, jaxpr: Jaxpr, env: dict, read: Callable, prefix: str,
               pinned: bool) -> None:
    for eqn in jaxpr.eqns:
        stack = _join_stack(prefix, eqn.source_info.name_stack)
        pin = pinned or ctx.rules.pinned(stack)
        invals = [read(v) for v in eqn.invars]
        # Re-emit with the original call site and name scope, as jax.core.eval_jaxpr does,
        # so profiles, error messages and a nested autocast still see them.
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), \
                eqn.ctx.manager:
            outs = _eval_eqn(ctx, eqn, invals, stack, pin)
        if not eqn.primitive.multiple_results:
            outs = [outs]
        for v, out in zip(eqn.outvars, outs):
            env[v] = out


def _eval_eqn(ctx: _Context, eqn: Any, invals: list, stack: str, pin: bool) -> Any:
    name = eqn.primitive.name
    handler = _HANDLERS.get(name)
    if handler is not None:
        return handler(ctx, eqn, invals, stack, pin)
    if not any(_floating(x) for x in invals):
        return _bind(eqn, invals)
    if name == "convert_element_type":
        return _convert(eqn, invals[0])
    if eqn.params.get("out_dtype") is not None or name in _TRACED_DTYPES:
        return _bind(eqn, _at_traced_dtypes(eqn, invals))
    cls = "float32" if pin else ctx.rules.classes.get(name)
    if cls is None:
        if name not in ctx.warned:
            ctx.warned.add(name)
            warnings.warn(
                f"autocast does not know the primitive {name!r}; it is evaluated at the dtypes "
                "it was traced with. Classify it with autocast(..., rules={'follow': [prim]}) "
                "(or 'float32' / 'matmul') to silence this warning.",
                AutocastWarning,
                stacklevel=4,
            )
        return _bind(eqn, _at_traced_dtypes(eqn, invals))
    weak = [getattr(v.aval, "weak_type", False) for v in eqn.invars]
    params = dict(eqn.params)
    if cls == "matmul" and not pin:
        invals = [_cast(x, ctx.compute) if _floating(x) else x for x in invals]
        if "preferred_element_type" not in params or len(invals) != 2:
            return _bind(eqn, invals, params)
        return _matmul(eqn, ctx.compute, params, *invals)
    if name in _INDEPENDENT:
        if cls == "float32":
            invals = [_cast(x, _join(_dtype(x), _F32)) if _floating(x) else x for x in invals]
        return _bind(eqn, invals, params)
    target = functools.reduce(_join, _float_dtypes(invals, weak))
    if cls in ("float32", "matmul"):  # matmul here only when pinned to float32
        target = _join(target, _F32)
        if params.get("preferred_element_type") is not None:
            params["preferred_element_type"] = target
    invals = [_cast(x, target) if _floating(x) else x for x in invals]
    return _bind(eqn, invals, params)


def _convert(eqn: Any, x: Any) -> Any:
    """A float->float cast in fn only ever widens.

    The traced jaxpr cannot tell a user's ``x.astype(jnp.float16)`` from the casts JAX
    itself inserts when fn is traced with half-precision inputs (``jnp.mean`` and
    ``logsumexp`` compute in float32 and cast back). Applying those would narrow
    float32 results mid-function, so narrowing happens only where autocast decides:
    at matrix work and at fn's outputs.
    """
    new = np.dtype(eqn.params["new_dtype"]) if not _is_extended(eqn.params["new_dtype"]) else None
    if new is None or not is_floating_dtype(new) or not _floating(x):
        return _bind(eqn, [x])
    return _cast(x, new) if _represents(new, _dtype(x)) else x


def _matmul(eqn: Any, compute: np.dtype, params: dict, lhs: Any, rhs: Any) -> Any:
    """Matrix work in ``compute`` dtype with float32 results, in both directions.

    The forward product accumulates in float32 (``preferred_element_type``). Left to
    itself, JAX would differentiate that into backward products between a float32
    cotangent and a half-precision operand, i.e. float32 matrix work. The JVP below
    keeps tangents in the compute dtype, so the transposed products of the backward
    pass run in half precision too, as in a hand-written mixed-precision model.
    """
    acc = _join(compute, _F32)
    fwd_params = dict(params, preferred_element_type=acc)
    if acc == compute:  # float32 (or wider) compute: JAX's own derivative is already right
        return _bind(eqn, (lhs, rhs), fwd_params)
    tan_params = dict(params, preferred_element_type=compute)

    def product(a, b):
        return _bind(eqn, (a, b), fwd_params)

    product.__name__ = eqn.primitive.name
    product = jax.custom_jvp(product)

    def product_jvp(primals, tangents):
        a, b = primals
        ta, tb = tangents
        terms = []
        if not isinstance(ta, SymbolicZero):
            terms.append(_bind(eqn, (_cast(ta, compute), b), tan_params))
        if not isinstance(tb, SymbolicZero):
            terms.append(_bind(eqn, (a, _cast(tb, compute)), tan_params))
        tangent = functools.reduce(lax.add, terms)
        return product(a, b), _cast(tangent, acc)

    product.defjvp(product_jvp, symbolic_zeros=True)
    return product(lhs, rhs)


def _bind(eqn: Any, invals: Sequence[Any], params: Optional[dict] = None) -> Any:
    params = eqn.params if params is None else params
    bind_params = eqn.primitive.get_bind_params(params)
    if isinstance(bind_params, tuple):  # jax < 0.8 returns (subfuns, params)
        subfuns, bind_params = bind_params
        return eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return eqn.primitive.bind(*invals, **bind_params)


def _at_traced_dtypes(eqn: Any, invals: Sequence[Any]) -> list:
    return [_cast(x, v.aval.dtype) if _floating(x) else x for x, v in zip(invals, eqn.invars)]


# --- Higher-order primitives ----------------------------------------------------------

class _Params(dict):
    """An equation's parameters; a missing one means JAX changed the primitive."""

    def __init__(self, eqn: Any):
        super().__init__(eqn.params)
        self.primitive = eqn.primitive.name

    def __missing__(self, key: str) -> Any:
        # Handlers read JAX-internal parameters of higher-order primitives; say so
        # clearly rather than fail with a bare KeyError (or, worse, compute wrongly).
        raise NotImplementedError(
            f"autocast: the {self.primitive!r} primitive of jax {jax.__version__} has no "
            f"parameter {key!r} (it has {sorted(self)}), so this JAX version changed its "
            "internals and autocast cannot rewrite it. Please report this with your JAX version."
        )


def _trace(ctx: _Context, closed: ClosedJaxpr, in_dtypes: Sequence[Any], stack: str,
           pin: bool, out_dtypes: Optional[Sequence[Any]] = None) -> ClosedJaxpr:
    """``closed`` autocast for inputs of ``in_dtypes``, as a new closed jaxpr."""
    key = (id(closed), tuple(in_dtypes), None if out_dtypes is None else tuple(out_dtypes), pin,
           stack if ctx.rules.float32_scopes else None)
    hit = ctx.traced.get(key)
    if hit is not None and hit[0] is closed:
        return hit[1]
    structs = [
        jax.ShapeDtypeStruct(a.shape, d, weak_type=getattr(a, "weak_type", False))
        for a, d in zip(closed.in_avals, in_dtypes)
    ]

    def body(*args):
        outs = _eval_jaxpr(ctx, closed.jaxpr, closed.consts, args, stack, pin)
        if out_dtypes is not None:
            outs = [_cast(o, d) if d is not None and _floating(o) else o
                    for o, d in zip(outs, out_dtypes)]
        return outs

    result = jax.make_jaxpr(body)(*structs)
    ctx.traced[key] = (closed, result)  # holding `closed` keeps its id unique
    return result


def _dtypes(values: Sequence[Any]) -> list:
    return [_dtype(x) for x in values]


def _jit(ctx, eqn, invals, stack, pin):
    # Rebinding the primitive (rather than inlining) keeps in/out shardings, donation,
    # layouts, the name and compiler options exactly as the user wrote them.
    jaxpr = _trace(ctx, _Params(eqn)["jaxpr"], _dtypes(invals), stack, pin)
    return eqn.primitive.bind(*invals, **dict(eqn.params, jaxpr=jaxpr))


def _closed_call(ctx, eqn, invals, stack, pin):
    closed = _Params(eqn)["call_jaxpr"]
    if isinstance(closed, ClosedJaxpr):
        return _eval_jaxpr(ctx, closed.jaxpr, closed.consts, invals, stack, pin)
    return _eval_jaxpr(ctx, closed, (), invals, stack, pin)


def _remat(ctx, eqn, invals, stack, pin):
    p = _Params(eqn)
    fn = functools.partial(_eval_jaxpr, ctx, p["jaxpr"], (), prefix=stack, pinned=pin)
    remat = jax.checkpoint(lambda *a: fn(a), prevent_cse=p["prevent_cse"], policy=p["policy"])
    return remat(*invals)


def _custom_jvp(ctx, eqn, invals, stack, pin):
    p = _Params(eqn)
    n_consts = p["num_consts"]
    consts, args = invals[:n_consts], invals[n_consts:]
    call = _trace(ctx, p["call_jaxpr"], _dtypes(invals), stack, pin)
    out_avals = call.out_avals
    call_fn = jaxpr_as_fun(call)

    def fn(*args):
        return call_fn(*consts, *args)

    fn.__name__ = _func_name(p["call_jaxpr"])
    fn = jax.custom_jvp(fn)

    @fn.defjvp
    def fn_jvp(primals, tangents):
        # The user's rule, traced by JAX at the original input types, autocast like the
        # primal; its outputs are then made to agree with the primal's types.
        jvp_jaxpr, jvp_consts, out_zeros = p["jvp_jaxpr_fun"].call_wrapped(*[False] * len(args))
        outs = _eval_jaxpr(ctx, jvp_jaxpr, jvp_consts, [*primals, *tangents], stack, pin)
        n_out = len(out_zeros)
        primals_out = [_cast(o, a.dtype) if _floating(o) else o
                       for o, a in zip(outs[:n_out], out_avals)]
        nonzero = iter(outs[n_out:])
        tangents_out = [_zero_tangent(a) if zero else _cast_tangent(next(nonzero), a)
                        for zero, a in zip(out_zeros, out_avals)]
        return primals_out, tangents_out

    return fn(*args)


def _func_name(closed: ClosedJaxpr) -> str:
    info = getattr(closed.jaxpr, "debug_info", None)
    return getattr(info, "func_name", None) or "autocast_custom"


def _zero_tangent(aval: Any) -> Any:
    if is_floating_dtype(aval.dtype):
        return jnp.zeros(aval.shape, aval.dtype)
    return np.zeros(aval.shape, jax.dtypes.float0)


def _cast_tangent(t: Any, aval: Any) -> Any:
    return _cast_float(t, aval.dtype)


def _cast_float(x: Any, dtype: Any) -> Any:
    """Casts ``x`` to ``dtype`` when both are floating; anything else passes through."""
    return _cast(x, np.dtype(dtype)) if is_floating_dtype(dtype) and _floating(x) else x


def _custom_vjp(ctx, eqn, invals, stack, pin):
    p = _Params(eqn)
    n_consts = p["num_consts"]
    consts, args = invals[:n_consts], invals[n_consts:]
    orig_call: ClosedJaxpr = p["call_jaxpr"]
    call = _trace(ctx, orig_call, _dtypes(invals), stack, pin)
    call_fn = jaxpr_as_fun(call)
    arg_avals = [v.aval for v in eqn.invars]

    def fn(*args):
        return call_fn(*consts, *args)

    fn.__name__ = _func_name(orig_call)
    fn = jax.custom_vjp(fn)

    def fn_fwd(*args):
        fwd_jaxpr, fwd_consts = p["fwd_jaxpr_thunk"].call_wrapped(*[True] * len(args))
        outs = _eval_jaxpr(ctx, fwd_jaxpr, fwd_consts, args, stack, pin)
        _, res_tree, input_fwds = p["out_trees"]()
        n_res = res_tree.num_leaves - sum(f is not None for f in input_fwds)
        res_out, primals_out = outs[:n_res], outs[n_res:]
        res_avals = iter(v.aval for v in fwd_jaxpr.outvars[:n_res])
        res_out_ = iter(res_out)
        everything = [*consts, *args]
        # The user's bwd rule gets its residuals at the types it was written for.
        res = [_cast_tangent(next(res_out_), next(res_avals)) if f is None
               else _cast_tangent(everything[f], arg_avals[f]) for f in input_fwds]
        primals_out = [_cast(o, a.dtype) if _floating(o) else o
                       for o, a in zip(primals_out, call.out_avals)]
        return primals_out, res

    def fn_bwd(res, cts):
        cts = [_cast_tangent(c, a) for c, a in zip(cts, orig_call.out_avals)]
        in_cts = p["bwd"].call_wrapped(*res, *cts)
        if len(in_cts) == 2 and isinstance(in_cts[0], (list, tuple)):
            in_cts = in_cts[0]  # jax >= 0.11 returns (cotangents, logs); a cotangent is never a list
        if len(in_cts) != len(args):  # never zip a changed structure into wrong gradients
            raise NotImplementedError(
                f"autocast: the backward rule of {_func_name(orig_call)!r} returned "
                f"{len(in_cts)} cotangents for {len(args)} arguments under jax "
                f"{jax.__version__}, whose custom_vjp internals autocast does not know. "
                "Please report this with your JAX version.")
        out = []
        for ct, x in zip(in_cts, args):
            if not _floating(x):
                out.append(None)
            elif ct is None or not hasattr(ct, "dtype") or type(ct).__name__ == "Zero":
                out.append(jnp.zeros(jnp.shape(x), _dtype(x)))
            else:
                out.append(_cast(ct, _dtype(x)))
        return tuple(out)

    fn.defvjp(fn_fwd, fn_bwd)
    return fn(*args)


def _stable_carry(ctx, body: ClosedJaxpr, before: list, carry: list, after: list,
                  out_slice: slice, stack: str, pin: bool) -> tuple:
    """Carry dtypes that the autocast body maps to themselves (widening only).

    Returns them with the body traced for them, when that trace already returns
    exactly those dtypes (the common case), else with None.
    """
    for _ in range(4):
        traced = _trace(ctx, body, before + carry + after, stack, pin)
        outs = [a.dtype for a in traced.out_avals[out_slice]]
        if outs == carry:
            return carry, traced
        joined = [_join(c, o) if is_floating_dtype(c) and is_floating_dtype(o) else c
                  for c, o in zip(carry, outs)]
        if joined == carry:
            return carry, None
        carry = joined
    return carry, None


def _scan_sizes(params: dict) -> tuple:
    """(number of consts, number of carries) of a ``scan`` equation."""
    if "num_consts" in params:  # jax < 0.11
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()  # jax >= 0.11: a flat tree (consts, carry, xs)
    return len(consts), len(carry)


def _scan(ctx, eqn, invals, stack, pin):
    p = _Params(eqn)
    nc, nk = _scan_sizes(p)
    d = _dtypes(invals)
    consts_d, carry_d, xs_d = d[:nc], d[nc:nc + nk], d[nc + nk:]
    carry_d, body = _stable_carry(ctx, p["jaxpr"], consts_d, carry_d, xs_d, slice(0, nk),
                                  stack, pin)
    if body is None:
        n_ys = len(p["jaxpr"].out_avals) - nk
        body = _trace(ctx, p["jaxpr"], consts_d + carry_d + xs_d, stack, pin,
                      out_dtypes=carry_d + [None] * n_ys)
    consts, xs = invals[:nc], invals[nc + nk:]
    carry = [_cast_float(x, dt) for x, dt in zip(invals[nc:nc + nk], carry_d)]
    body_fn = jaxpr_as_fun(body)

    # Re-entered through the public API (the primitive's parameters differ
    # between JAX versions); the body is already autocast, so this only
    # re-traces it.
    def step(carry, x):
        outs = body_fn(*consts, *carry, *x)
        return list(outs[:nk]), list(outs[nk:])

    carry, ys = lax.scan(step, carry, list(xs), length=p["length"], reverse=p["reverse"],
                         unroll=p["unroll"])
    return [*carry, *ys]


def _while(ctx, eqn, invals, stack, pin):
    p = _Params(eqn)
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    d = _dtypes(invals)
    cond_d, body_d, carry_d = d[:cn], d[cn:cn + bn], d[cn + bn:]
    carry_d, body = _stable_carry(ctx, p["body_jaxpr"], body_d, carry_d, [], slice(None),
                                  stack, pin)
    if body is None:
        body = _trace(ctx, p["body_jaxpr"], body_d + carry_d, stack, pin, out_dtypes=carry_d)
    cond = _trace(ctx, p["cond_jaxpr"], cond_d + carry_d, stack, pin)
    body, body_hoisted = _hoist(body)
    cond, cond_hoisted = _hoist(cond)
    carry = [_cast_float(x, dt) for x, dt in zip(invals[cn + bn:], carry_d)]
    params = dict(p, body_jaxpr=body, cond_jaxpr=cond, cond_nconsts=cn + len(cond_hoisted),
                  body_nconsts=bn + len(body_hoisted))
    return eqn.primitive.bind(*cond_hoisted, *invals[:cn], *body_hoisted, *invals[cn:cn + bn],
                              *carry, **params)


def _cond(ctx, eqn, invals, stack, pin):
    p = _Params(eqn)
    index, ops = invals[0], invals[1:]
    d = _dtypes(ops)
    traced = [_trace(ctx, b, d, stack, pin) for b in p["branches"]]
    # Every branch must return the same types: the widest any branch produces.
    out_d = []
    for avals in zip(*(t.out_avals for t in traced)):
        dts = [a.dtype for a in avals]
        out_d.append(functools.reduce(_join, dts) if all(is_floating_dtype(x) for x in dts)
                     else dts[0])
    branches = tuple(
        t if [a.dtype for a in t.out_avals] == out_d else _trace(ctx, b, d, stack, pin, out_d)
        for t, b in zip(traced, p["branches"]))
    return eqn.primitive.bind(index, *ops, **dict(p, branches=branches))


def _hoist(closed: ClosedJaxpr) -> tuple:
    """Moves a closed jaxpr's consts to leading inputs (loops take consts as operands)."""
    if not closed.consts:
        return closed, []
    consts = list(closed.consts)
    n = len(consts)
    const_structs = [jax.ShapeDtypeStruct(np.shape(c), _dtype(c)) for c in consts]
    in_structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type)
                  for a in closed.in_avals]
    hoisted = jax.make_jaxpr(
        lambda *a: jax.core.eval_jaxpr(closed.jaxpr, a[:n], *a[n:])
    )(*const_structs, *in_structs)
    return hoisted, consts


def _shard_map(ctx, eqn, invals, stack, pin):
    # Re-entered through the public API, which sets up the manual-axes context the
    # body's collectives and varying-manual-axes types need.
    p = _Params(eqn)
    body = functools.partial(_eval_jaxpr, ctx, p["jaxpr"], (), prefix=stack, pinned=pin)
    mapped = jax.shard_map(
        lambda *args: tuple(body(args)), mesh=p["mesh"], in_specs=p["in_specs"],
        out_specs=p["out_specs"], check_vma=p["check_vma"],
        axis_names=set(p["newly_manual_axes"]))
    return mapped(*invals)


_HANDLERS: dict = {
    "jit": _jit,
    "closed_call": _closed_call,
    "call": _closed_call,
    "remat2": _remat,
    "checkpoint": _remat,
    "custom_jvp_call": _custom_jvp,
    "custom_vjp_call": _custom_vjp,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
    "shard_map": _shard_map,
}


# --- The public entry point ---------------------------------------------------------------

def _is_dynamic(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex, bool))


def autocast(
    fn: Callable[..., Any],
    policy: Any = None,
    *,
    rules: Optional[Mapping[str, Any]] = None,
) -> Callable[..., Any]:
    """Returns ``fn`` evaluated with per-operation mixed precision.

    Matrix work runs in the policy's compute dtype with float32 accumulation,
    numerically sensitive primitives in float32, everything else at the widest
    dtype of its inputs; floating outputs come back in the policy's output
    dtype. See the module docstring and the README table for the full rules.

    Args:
      fn: any function of pytrees of arrays (a ``flax.linen`` ``apply``, an NNX
        module call, a loss function...). Non-array leaves (strings, ``None``,
        static configuration) are treated as static, like ``jax.jit`` would
        with ``static_argnums``.
      policy: a policy name or `Policy`; ``None`` means the global policy in
        force now (at construction, not at call time).
      rules: optional mapping changing the defaults:
        ``{"matmul": [...], "float32": [...], "follow": [...]}`` move
        primitives (by name, or ``jax.extend.core.Primitive`` object) into that
        class; ``{"float32_scopes": ["attention", "block/softmax"]}`` runs every
        primitive under a matching ``jax.named_scope`` (a contiguous run of
        scope names, at any depth) in float32, matrix work included.

    >>> import jax, jax.numpy as jnp, jmp_policy
    >>> def layer(w, x):
    ...     return jax.nn.softmax(x @ w)
    >>> f = jmp_policy.autocast(layer, "mixed_float16")
    >>> f(jnp.ones((4, 4)), jnp.ones((2, 4))).dtype   # outputs in the policy's output dtype
    dtype('float16')
    """
    if not callable(fn):
        raise TypeError(f"autocast expects a callable, got {fn!r}.")
    policy = as_policy(policy)
    parsed = _parse_rules(rules)
    cache: dict = {}

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        dynamic = [i for i, leaf in enumerate(leaves) if _is_dynamic(leaf)]
        dyn_values = [leaves[i] for i in dynamic]
        static = tuple(None if _is_dynamic(leaf) else leaf for leaf in leaves)
        try:
            key = (treedef, static, tuple(jax.typeof(x) for x in dyn_values))
            hash(key)
        except TypeError:
            key = None
        entry = cache.get(key) if key is not None else None
        if entry is None:
            closed, out_tree = _trace_fn(fn, leaves, treedef, dynamic, dyn_values)
            run = functools.partial(_run, closed, policy, parsed)
            entry = (closed, out_tree, run, jax.jit(run))
            if key is not None and not any(isinstance(c, jax.core.Tracer) for c in closed.consts):
                cache[key] = entry
            else:
                entry = (closed, out_tree, run, run)  # one-off trace: no point compiling it
        _, out_tree, run, jitted = entry
        # Called eagerly, the jaxpr runs as one compiled computation: the same values as
        # op by op (fn's Python already ran when it was traced), without a compile per op.
        eager = not any(isinstance(x, jax.core.Tracer) for x in dyn_values)
        outs = jitted(*dyn_values) if eager else run(*dyn_values)
        return jax.tree_util.tree_unflatten(out_tree, outs)

    return wrapped


def _run(closed: ClosedJaxpr, policy: Policy, rules: _Rules, *values: Any) -> list:
    compute, output = _call_dtypes(policy, values)
    ctx = _Context(compute=compute, rules=rules)
    outs = _eval_jaxpr(ctx, closed.jaxpr, closed.consts, values)
    return [_cast(o, output) if _floating(o) else o for o in outs]


def _trace_fn(fn, leaves, treedef, dynamic, dyn_values):
    out_tree = []

    def flat_fn(*values):
        full = list(leaves)
        for i, v in zip(dynamic, values):
            full[i] = v
        args, kwargs = jax.tree_util.tree_unflatten(treedef, full)
        out_leaves, tree = jax.tree_util.tree_flatten(fn(*args, **kwargs))
        out_tree.append(tree)
        return out_leaves

    closed = jax.make_jaxpr(flat_fn)(*dyn_values)
    return closed, out_tree[0]


def _call_dtypes(policy: Policy, values: Sequence[Any]) -> tuple:
    compute, output = policy.compute_dtype, policy.output_dtype
    if compute is None:  # deprecated infer policies: compute follows the first floating input
        compute = next((_dtype(x) for x in values if _floating(x)), _F32)
    if output is None:
        output = compute
    return np.dtype(compute), np.dtype(output)

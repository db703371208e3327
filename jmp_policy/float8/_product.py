"""Autocast's quantized products: every float8 and block-scaled recipe, dense and ragged,
forward and backward, from one ``custom_vjp``.

A product of ``lhs`` and ``rhs`` (a ``dot_general``, or a ``ragged_dot_general`` in
``lax.ragged_dot``'s layout) is three contractions: the forward one, and in the
backward pass the incoming gradient ``g`` with ``rhs`` (lhs's gradient) and with
``lhs`` (rhs's gradient). A `Layout` holds the three `Contraction` s of a product:
which named operands each takes, which of their axes it contracts, how its result
is laid out. Dense and ragged products differ only there. A `Scheme` says how an
operand is quantized for a contraction (`Scheme.prepare`) and how quantized
operands are multiplied (`Scheme.contract`): current-scaled float8, one scale per
tensor or row (``_fp8_matmul.Float8``), or block-scaled MXFP8 and NVFP4
(``_block_matmul.Blocks``). `quantized_product` puts the two together; it is
the only place that defines a product's derivative.

Every operand of every contraction is quantized along the axes that contraction
sums over: a forward operand is quantized again for its backward contraction
(a scheme keeps what it can: a tensorwise operand serves every contraction).
The incoming gradient takes ``recipe.bwd_dtype``, rounded stochastically if the
recipe says so: each value with random bits salted with its own bits
(``formats.salted_bits``) and a fixed seed per backward contraction, so that the
draws change as the values do, no state is carried, and a sharded gradient rounds
shard by shard, with no reduction over it.

Sharded products (``_sharding``): under explicit mesh axes, each contraction's result
takes the sharding the plain product gives it (the forward one) or that of the operand
it is the gradient of, as JAX's own transposition of a ``dot_general`` does.

Under ``jax.checkpoint``, what the forward rule keeps of each operand for the
backward contractions (float8 values and their scales for `Float8` schemes) is
named `QUANTIZED_LHS` and `QUANTIZED_RHS` (``jax.ad_checkpoint.checkpoint_name``):
``jax.checkpoint_policies.save_only_these_names(QUANTIZED_LHS, QUANTIZED_RHS)``
saves them instead of quantizing the operands again in the backward pass. The
forward contraction itself is a ``dot_general`` that the dot policies
(``dots_saveable`` and the like) see.

Derivatives: reverse mode, first order. A ``custom_vjp`` has no forward-mode rule,
and this one could have no consistent one: its backward pass quantizes the incoming
gradient, which is the transpose of no linear map. So ``jax.jvp``, ``jax.jacfwd``
and ``jax.linearize``'s linear function fail: `ForwardModeError` says so in
autocast's terms when the product is traced with a forward-mode tangent (eager, under
``vmap`` as in ``jacfwd``, and under an outer ``jit``). Where the tangent comes later
(``jax.linearize``'s linear function, ``jax.jvp`` of a ``jit``-ed autocast function,
whose body is traced before it is differentiated), JAX raises its own ``TypeError``
("can't apply forward-mode autodiff (jvp) to a custom_vjp function").
Differentiating the forward and backward rules themselves (``jax.hessian``,
``jax.jvp`` or ``jax.grad`` of a gradient, ``jacrev(jacrev(f))``) would
differentiate the quantization (tangents rounded to float8 without scales: NaN, or
wrong by tens of percent), so their operands pass through `_first_order_only`,
which raises `ForwardModeError` when traced with a tangent, under ``jit`` too.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional, Protocol, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import JaxprEqn
from jax.interpreters import ad, partial_eval as pe

import numpy as np
from jax.sharding import NamedSharding

from jmp_policy import formats
from jmp_policy import sharding as _sharding
from jmp_policy.float8._delayed import AmaxHistory, observation
from jmp_policy.float8._recipe import RAGGED, Float8Recipe
from jmp_policy.float8._quantize import WEIGHT_GRADIENT, in_groups, ragged_dims
from jmp_policy.jaxprs import bind
from jmp_policy.dtypes import (
    F32, DType, convert, dtype_of, has_float32_range, represents)

Name = Literal["lhs", "rhs", "g"]

QUANTIZED_LHS = "autocast_quantized_lhs"
"""The ``checkpoint_name`` of what a quantized product keeps of its left operand."""
QUANTIZED_RHS = "autocast_quantized_rhs"
"""The ``checkpoint_name`` of what a quantized product keeps of its right operand."""


@dataclasses.dataclass(frozen=True)
class Contraction:
    """One contraction of a product.

    Attributes:
      operands: the names of its (left, right) operands.
      axes: the axes of (left, right) that it sums over: each operand is quantized
        along them (rowwise: one scale per row of the others; blocks: blocks along them).
      dims: its dimension numbers (``dot_general``'s, or a ``RaggedDotDimensionNumbers``).
      ragged: whether it is a ``ragged_dot_general``, whose third operand is the group sizes.
      grouped: whether it sums over each group's rows (a ragged product's weight
        gradient): its operands take one scale per group (and column).
      perm: the transpose taking its result to the layout of the operand it is the
        gradient of, if any.
      eqn: the equation it rewrites (the forward contraction), whose parameters it keeps.
    """

    operands: tuple[Name, Name]
    axes: tuple[tuple[int, ...], tuple[int, ...]]
    dims: Any
    ragged: bool = False
    grouped: bool = False
    perm: Optional[tuple[int, ...]] = None
    eqn: Optional[JaxprEqn] = None

    def dot(self, left: Any, right: Any, rest: Sequence[Any],
            out_sharding: Optional[NamedSharding] = None, **params: Any) -> jax.Array:
        """The contraction of ``left`` and ``right`` as JAX computes it, with ``params``
        (``preferred_element_type``, ``precision``), its result sharded as
        ``out_sharding`` if given (see `result_sharding`)."""
        if self.eqn is not None:  # bound as traced: the parameters hold canonical values
            precision = params.pop("precision", None)
            if precision is not None:
                precision = (precision, precision)
            out: jax.Array = bind(self.eqn, (left, right, *rest),
                                  {**self.eqn.params, "precision": precision, **params})
            return out
        if self.ragged:
            return lax.ragged_dot_general(left, right, rest[0], self.dims, **params)
        return lax.dot_general(left, right, self.dims, out_sharding=out_sharding, **params)

    def result_sharding(self, operand: Any) -> Optional[NamedSharding]:
        """Under explicit mesh axes, the sharding this contraction's result takes: the
        forward one's that of the traced product's result, a gradient's that of
        ``operand`` (the operand it is the gradient of, or a value of its type) before
        `arranged`'s transpose. ``None`` elsewhere, and for ragged products, which keep
        JAX's rule."""
        if self.ragged:
            return None
        if self.eqn is not None:
            return _sharding.explicit(self.eqn.outvars[0].aval)
        return _sharding.permuted(_sharding.explicit(operand), self.perm)

    def arranged(self, out: jax.Array) -> jax.Array:
        """The contraction's result in the layout of the operand it is the gradient of."""
        return out if self.perm is None else lax.transpose(out, self.perm)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A product's three contractions, and what its operands must be before them."""

    forward: Contraction
    lhs_gradient: Contraction
    rhs_gradient: Contraction
    ragged: bool = False

    def masked(self, x: Any, rest: Sequence[Any]) -> Any:
        """``x`` as the contractions take it: a ragged product's rows past the groups zeroed
        (they take no part in it, so they must not count in its scales either)."""
        return in_groups(x, rest[0]) if self.ragged else x


def layout_of(eqn: JaxprEqn, lhs_ndim: int, rhs_ndim: int) -> Layout:
    """The `Layout` of ``eqn``, a ``dot_general`` or a plain ``ragged_dot_general``."""
    if eqn.primitive.name == RAGGED:
        return _ragged_layout(eqn)
    dims = eqn.params["dimension_numbers"]
    axes = DenseAxes.of(dims, lhs_ndim, rhs_ndim)
    lhs_dims, lhs_perm = axes.lhs_gradient()
    rhs_dims, rhs_perm = axes.rhs_gradient()
    return Layout(
        Contraction(("lhs", "rhs"), (axes.lhs_contract, axes.rhs_contract), dims, eqn=eqn),
        Contraction(("g", "rhs"), (axes.out_rhs_free, axes.rhs_free), lhs_dims, perm=lhs_perm),
        Contraction(("g", "lhs"), (axes.out_lhs_free, axes.lhs_free), rhs_dims, perm=rhs_perm))


def _ragged_layout(eqn: JaxprEqn) -> Layout:
    """``[m, k] x [groups, k, n] -> [m, n]`` (or rhs ``[groups, n, k]``): lhs's gradient is
    ragged like the forward product; rhs's sums each group's rows, ``[m, k] x [m, n] ->
    [groups, k, n]``."""
    rhs_k = eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers[0][1][0]
    rhs_n = 3 - rhs_k
    return Layout(
        Contraction(("lhs", "rhs"), ((1,), (rhs_k,)), eqn.params["ragged_dot_dimension_numbers"],
                    ragged=True, eqn=eqn),
        Contraction(("g", "rhs"), ((1,), (rhs_n,)), ragged_dims((1, rhs_n), True, True),
                    ragged=True),
        Contraction(("lhs", "g"), ((0,), (0,)), WEIGHT_GRADIENT, ragged=True, grouped=True,
                    perm=(0, 2, 1) if rhs_k == 2 else None),
        ragged=True)


class Scheme(Protocol):
    """How a recipe quantizes operands and multiplies them (see the module docstring)."""

    def prepare(self, x: Any, dtype: DType, c: Contraction, position: int,
                seed: Optional[jax.Array], rest: Sequence[Any],
                history: Optional[jax.Array] = None) -> Any:
        """``x``, the operand at ``position`` (0 left, 1 right) of ``c``, quantized to
        ``dtype`` for it (rounded stochastically with ``seed`` if given, scaled from its
        amax ``history`` if given); an operand this scheme already prepared for ``c`` as
        it is."""

    def keep(self, x: Any, prepared: Any, dtype: DType, c: Contraction, position: int,
             rest: Sequence[Any]) -> Any:
        """What the forward pass saves of operand ``x`` (``prepared`` for the forward
        contraction) for backward contraction ``c``."""

    def reuses(self, prepared: Any, c: Contraction) -> bool:
        """Whether an operand prepared for one contraction serves ``c`` as it is."""

    def contract(self, c: Contraction, left: Any, right: Any, rest: Sequence[Any],
                 out_sharding: Optional[NamedSharding], gemm_dtype: DType) -> jax.Array:
        """``c`` of prepared operands, in float32 and rescaled, sharded as ``out_sharding``
        if given (`Contraction.result_sharding`). The GEMM may give its unscaled result in
        ``gemm_dtype`` (see `_gemm_dtype`), which the rescaling then widens."""


def quantized_product(eqn: JaxprEqn, recipe: Float8Recipe, scheme: Scheme,
                      operand_formats: tuple[DType, DType], compute: DType,
                      lhs: Any, rhs: Any, *rest: Any,
                      history: Optional[AmaxHistory] = None) -> Any:
    """``eqn`` (a ``dot_general``, or a ``ragged_dot_general`` with its group sizes in
    ``rest``) of ``lhs`` and ``rhs`` on quantized operands, differentiable.

    ``operand_formats`` are the forward formats of (lhs, rhs). The result is in
    ``compute``, as the matmul class returns it. Differentiated, each
    operand's gradient is a quantized contraction of the incoming gradient (in
    ``recipe.bwd_dtype``) and the other operand, returned in the operand's dtype;
    with ``recipe.float8_weight_gradient`` off, rhs's gradient is a product in
    ``compute``, as the matmul class computes it. Group sizes have no gradient.

    With an amax ``history`` (delayed scaling), operands are scaled from it, and its
    cotangent is what the product observed: each operand's absolute maximum, the
    incoming gradient's from the backward pass (``_delayed.observation``).
    """
    # This rule runs whenever the product is differentiated, possibly after this trace:
    # it keeps the equation, recipe and dtypes, never a traced value.
    layout = layout_of(eqn, jnp.ndim(lhs), jnp.ndim(rhs))
    lhs_dtype, rhs_dtype, gemm = dtype_of(lhs), dtype_of(rhs), _gemm_dtype(compute)
    fmt = {"lhs": operand_formats[0], "rhs": operand_formats[1], "g": recipe.bwd_dtype}
    fwd, d_lhs, d_rhs = layout.forward, layout.lhs_gradient, layout.rhs_gradient

    def seed(c: Contraction) -> Optional[jax.Array]:
        # Fixed, the values salting the bits; a stream per backward contraction's g.
        streams = formats.SEED_STREAMS
        stream = streams.lhs_gradient if c is d_lhs else streams.rhs_gradient
        return formats.fixed_seed(stream) if recipe.stochastic_rounding else None

    def forward(a: Any, b: Any, h: Optional[AmaxHistory], rest: Sequence[Any],
                saved: bool = False) -> tuple[Any, Any]:
        """The product, and with ``saved`` what its backward pass keeps of the operands."""
        a = layout.masked(a, rest)
        qa = scheme.prepare(a, fmt["lhs"], fwd, 0, None, rest, *_of(h, "lhs"))
        qb = scheme.prepare(b, fmt["rhs"], fwd, 1, None, rest, *_of(h, "rhs"))
        kept = None
        if saved:
            a_res = (scheme.keep(a, qa, fmt["lhs"], d_rhs, d_rhs.operands.index("lhs"), rest)
                     if recipe.float8_weight_gradient else a)
            b_res = scheme.keep(b, qb, fmt["rhs"], d_lhs, 1, rest)
            if b_res is not qb:
                # Quantized again for the backward contraction (rowwise, block scalings):
                # made with the forward operand, or it waits for the backward pass and
                # keeps the float32 weight alive past its update (XLA then copies a donated
                # weight). Tying the left operand's too costs more than it saves (roofline).
                qb, b_res = _made_together((qb, b_res))
            kept = (a_res, b_res)
        out = scheme.contract(fwd, qa, qb, rest, fwd.result_sharding(a), gemm)
        return _narrowed(out, compute), (kept, qa, qb)

    def product(a: Any, b: Any, h: Optional[AmaxHistory], *rest: Any) -> Any:
        return forward(a, b, h, rest)[0]

    def product_fwd(a: Any, b: Any, h: Optional[AmaxHistory],
                    *rest: Any) -> tuple[Any, tuple[Any, ...]]:
        out, ((a_res, b_res), qa, qb) = forward(a, b, h, rest, saved=True)
        named = (checkpoint_name(a_res, QUANTIZED_LHS),  # type: ignore[no-untyped-call]
                 checkpoint_name(b_res, QUANTIZED_RHS))  # type: ignore[no-untyped-call]
        # Delayed scaling: the history (for the gradient's scale) and the maxima observed.
        seen = None if h is None else (h.grad, qa[2], qb[2])
        return out, (*named, seen, rest)

    def product_bwd(res: tuple[Any, ...], g: Any) -> tuple[Any, ...]:
        a_res, b_res, seen, rest = res
        # Each gradient is sharded as its operand (the residuals have the operands' types).
        lhs_sharding = d_lhs.result_sharding(_array_of(a_res))
        rhs_sharding = d_rhs.result_sharding(_array_of(b_res))
        g = layout.masked(g, rest)
        g_lhs = scheme.prepare(g, fmt["g"], d_lhs, 0, seed(d_lhs), rest,
                               *(() if seen is None else (seen[0],)))
        grad_lhs = scheme.contract(
            d_lhs, g_lhs, scheme.prepare(b_res, fmt["rhs"], d_lhs, 1, None, rest), rest,
            lhs_sharding, gemm)
        if recipe.float8_weight_gradient:
            at = d_rhs.operands.index("g")
            g_rhs = g_lhs if scheme.reuses(g_lhs, d_rhs) else \
                scheme.prepare(g, fmt["g"], d_rhs, at, seed(d_rhs), rest)
            a_rhs = scheme.prepare(a_res, fmt["lhs"], d_rhs, 1 - at, None, rest)
            grad_rhs = scheme.contract(d_rhs, *((g_rhs, a_rhs) if at == 0 else (a_rhs, g_rhs)),
                                       rest, rhs_sharding, gemm)
        else:  # as the matmul class's backward products: compute-dtype operands and result
            named = {"g": convert(g, compute), "lhs": convert(a_res, compute)}
            left, right = (named[n] for n in d_rhs.operands)
            grad_rhs = d_rhs.dot(left, right, rest, rhs_sharding,
                                 preferred_element_type=compute)
        observed = None if seen is None else AmaxHistory(
            *(observation(m, seen[0]) for m in (seen[1], seen[2], g_lhs[2])))
        return (convert(d_lhs.arranged(grad_lhs), lhs_dtype),
                convert(d_rhs.arranged(grad_rhs), rhs_dtype), observed, *(None for _ in rest))

    name = recipe.scaling if recipe.blocks else "float8"
    product.__name__ = f"{name}_{eqn.primitive.name}"
    kind = "block-scaled" if recipe.blocks else "float8"  # NVFP4's values are not float8
    what = (f"autocast's {recipe.scaling} {kind} product ({eqn.primitive.name} of "
            f"{_shape(lhs)} and {_shape(rhs)}{_scope(eqn)})")
    first_order = _first_order_only(what)

    def guarded_fwd(a: Any, b: Any, h: Optional[AmaxHistory],
                    *rest: Any) -> tuple[Any, tuple[Any, ...]]:
        return product_fwd(first_order(a), first_order(b), h, *rest)

    def guarded_bwd(res: tuple[Any, ...], g: Any) -> tuple[Any, ...]:
        return product_bwd(res, first_order(g))

    custom = jax.custom_vjp(product)
    custom.defvjp(guarded_fwd, guarded_bwd)
    if _forward_mode(lhs, rhs):  # said here: under jit, JAX would say it when compiling
        raise ForwardModeError(_forward_mode_message(what))
    try:
        return custom(lhs, rhs, history, *rest)
    except TypeError as e:  # JAX's, from evaluating (or batching) the product's JVP
        if _JAX_NO_JVP not in str(e):
            raise
        raise ForwardModeError(_forward_mode_message(what)) from e


class ForwardModeError(TypeError):
    """Autocast's float8 or block-scaled product reached by forward-mode or second-order
    differentiation, which it does not support (see the module docstring)."""


_JAX_NO_JVP = "can't apply forward-mode autodiff (jvp) to a custom_vjp function"
"""JAX's message when a ``custom_vjp`` function's JVP is evaluated."""

_INSTEAD = (
    "Take first derivatives in reverse mode (jax.grad, jax.value_and_grad, jax.vjp, "
    "jax.jacrev); for forward-mode or second derivatives, run the function with fp8=None, "
    "or keep this product out of float8 (Float8Recipe(exclude=...) matching its scope, or "
    "a min_size above its smallest dimension).")


def _forward_mode_message(what: str) -> str:
    return (f"{what} supports reverse-mode differentiation only: it is a jax.custom_vjp "
            "whose backward pass quantizes the incoming gradient, with no forward-mode "
            "(JVP) rule, so jax.jvp, jax.jacfwd and jax.linearize cannot differentiate it. "
            + _INSTEAD)


def _second_order_message(what: str) -> str:
    return (f"{what} has first derivatives only: differentiating its gradient "
            "(jax.hessian, jax.jvp or jax.grad of a gradient, jax.jacrev(jax.jacrev(f))) "
            "would differentiate the float8 quantization in its backward pass, which gives "
            "NaN or wrong values. " + _INSTEAD)


def _forward_mode(*operands: Any) -> bool:
    """Whether an operand carries a forward-mode tangent (``jax.jvp``, ``jax.jacfwd``).

    Reverse mode linearizes: its tracers are ``LinearizeTracer``s or, with
    ``jax_use_direct_linearize`` off, JVP tracers whose tangents are partial-evaluation
    tracers; forward mode's tangents are values (arrays, jit's or vmap's tracers).
    Operands that do not depend on the differentiated inputs carry no tangent."""
    return any(isinstance(x, ad.JVPTracer) and not isinstance(x.tangent, pe.JaxprTracer)
               for x in operands)


def _first_order_only(what: str) -> Any:
    """The identity, raising `ForwardModeError` when differentiated: a ``custom_jvp``
    rule runs when traced, in forward and reverse mode alike, under ``jit`` too."""
    @jax.custom_jvp
    def first_order(x: Any) -> Any:
        return x

    @first_order.defjvp
    def _(primals: Any, tangents: Any) -> Any:
        raise ForwardModeError(_second_order_message(what))

    return first_order


def _gemm_dtype(compute: DType) -> DType:
    """The dtype a float8 GEMM gives its unscaled result in: the compute dtype where it
    has float32's range (bfloat16: the GEMM writes half the bytes of float32, and a
    ``jax.checkpoint`` dot policy saves that), else float32 (float8 operands scaled to
    their format's maximum multiply to far beyond float16's)."""
    return compute if has_float32_range(compute) else F32


def _narrowed(out: jax.Array, compute: DType) -> Any:
    """The float32 product in the compute dtype, rounded by `formats.encode`: a float32-class
    operation after the product widens it again, and XLA:GPU removes a plain conversion's
    round trip (float32 -> bfloat16 -> float32), which would leave the product unrounded
    there and rounded on a CPU."""
    if represents(compute, dtype_of(out)):
        return convert(out, compute)
    return formats.encode(out, compute)


def _shape(x: Any) -> str:
    return f"{np.dtype(dtype_of(x)).name}{list(jnp.shape(x))}"


def _scope(eqn: JaxprEqn) -> str:
    scope = str(eqn.source_info.name_stack)
    return f" under {scope!r}" if scope else ""


def _made_together(tree: Any) -> Any:
    """``tree`` with its arrays behind one ``optimization_barrier``: XLA computes them all
    before any is used (a scheme's prepared operand may hold dtypes too)."""
    leaves, treedef = jax.tree.flatten(tree)
    at = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    tied = lax.optimization_barrier([leaves[i] for i in at])  # type: ignore[no-untyped-call]
    for i, x in zip(at, tied):
        leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


def _of(history: Optional[AmaxHistory], name: str) -> tuple[Any, ...]:
    """``(history.<name>,)`` as the extra argument of `Scheme.prepare`, or nothing."""
    return () if history is None else (getattr(history, name),)


def _array_of(residual: Any) -> Any:
    """The array of an operand's type in what a scheme kept of it: the operand, or the
    values of a quantized (or deferred) one."""
    return residual[0] if isinstance(residual, tuple) else residual


# --- Where each axis of a dense product goes -----------------------------------------------

@dataclasses.dataclass(frozen=True)
class DenseAxes:
    """The axes of ``dot_general(lhs, rhs)``; its output is (batch, lhs free, rhs free)."""

    lhs_contract: tuple[int, ...]
    rhs_contract: tuple[int, ...]
    lhs_batch: tuple[int, ...]
    rhs_batch: tuple[int, ...]
    lhs_free: tuple[int, ...]
    rhs_free: tuple[int, ...]

    @classmethod
    def of(cls, dims: Any, lhs_ndim: int, rhs_ndim: int) -> DenseAxes:
        (lc, rc), (lb, rb) = dims
        return cls(tuple(lc), tuple(rc), tuple(lb), tuple(rb),
                   _free(lhs_ndim, lc, lb), _free(rhs_ndim, rc, rb))

    @property
    def out_batch(self) -> tuple[int, ...]:
        return tuple(range(len(self.lhs_batch)))

    @property
    def out_lhs_free(self) -> tuple[int, ...]:
        start = len(self.lhs_batch)
        return tuple(range(start, start + len(self.lhs_free)))

    @property
    def out_rhs_free(self) -> tuple[int, ...]:
        start = len(self.lhs_batch) + len(self.lhs_free)
        return tuple(range(start, start + len(self.rhs_free)))

    def lhs_gradient(self) -> tuple[Any, tuple[int, ...]]:
        """``dot_general(g, rhs)`` dimension numbers giving lhs's gradient, and its transpose.

        The product's axes are (batch, lhs free, rhs's contracting axes in
        increasing order); the permutation puts them in lhs's order.
        """
        dims = ((self.out_rhs_free, self.rhs_free), (self.out_batch, self.rhs_batch))
        return dims, _gradient_axes(self.lhs_batch, self.lhs_free, self.lhs_contract,
                                    self.rhs_contract)

    def rhs_gradient(self) -> tuple[Any, tuple[int, ...]]:
        """``dot_general(g, lhs)`` dimension numbers giving rhs's gradient, and its transpose."""
        dims = ((self.out_lhs_free, self.lhs_free), (self.out_batch, self.lhs_batch))
        return dims, _gradient_axes(self.rhs_batch, self.rhs_free, self.rhs_contract,
                                    self.lhs_contract)


def _free(ndim: int, contract: Sequence[int], batch: Sequence[int]) -> tuple[int, ...]:
    return tuple(i for i in range(ndim) if i not in contract and i not in batch)


def _gradient_axes(batch: Sequence[int], free: Sequence[int], contract: Sequence[int],
                   other_contract: Sequence[int]) -> tuple[int, ...]:
    """For each operand axis, its axis in a gradient product laid out as
    (batch, free, the other operand's contracting axes in increasing order)."""
    ndim = len(batch) + len(free) + len(contract)
    rest = sorted(other_contract)
    position = {}
    for i, a in enumerate(batch):
        position[a] = i
    for i, a in enumerate(free):
        position[a] = len(batch) + i
    for a, b in zip(contract, other_contract):
        position[a] = len(batch) + len(free) + rest.index(b)
    return tuple(position[a] for a in range(ndim))

"""The quantized product: every float8 and block-scaled recipe, dense and ragged,
forward and backward, from one ``custom_vjp``, the only place that defines a
product's derivative.

`quantized_product` runs the three contractions of a product (``_layout``: the
forward one, and the two of the backward pass) with the recipe's `Scheme`, which
says how an operand is quantized for a contraction (`Scheme.prepare`) and how
quantized operands are multiplied (`Scheme.contract`): current- or delayed-scaled
float8, one scale per tensor or row (``_scaled.Float8``), or block-scaled MXFP8 and
NVFP4 (``_block_product.BlockScaled``). `_Rules` holds the rules, in the order they
run: the forward operands quantized, what the forward pass keeps of them, the
forward contraction, then the backward contractions.

A forward operand is quantized again for its backward contraction, along the axes
that one sums over (a scheme keeps what it can: a tensorwise operand serves every
contraction). The incoming gradient takes ``recipe.bwd_dtype``, rounded
stochastically if the recipe says so: each value with random bits salted with its
own bits (``formats.salted_bits``) and a fixed seed per backward contraction, so that
the draws change as the values do, no state is carried, and a sharded gradient
rounds shard by shard, with no reduction over it.

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
wrong by far), so their operands pass through `_first_order_only`, which raises
`ForwardModeError` when traced with a tangent, under ``jit`` too.

>>> import jax, jax.numpy as jnp, jmp_policy
>>> f = jmp_policy.autocast(lambda x, w: jnp.sum(x @ w), "mixed_bfloat16", fp8="rowwise")
>>> x, w = jnp.ones((16, 32)), jnp.ones((32, 16))
>>> jax.grad(f, argnums=1)(x, w).shape
(32, 16)
>>> try:
...     jax.jvp(lambda w: f(x, w), (w,), (w,))
... except jmp_policy.float8.ForwardModeError as e:
...     print(str(e)[:60])
autocast's rowwise float8 product (dot_general of float32[16
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import JaxprEqn
from jax.interpreters import ad
from jax.interpreters import partial_eval as pe
from jax.sharding import NamedSharding

from jmp_policy import formats
from jmp_policy.dtypes import (
    F32,
    DType,
    convert,
    dtype_of,
    has_float32_range,
    represents,
)
from jmp_policy.float8._block_product import BlockScaled
from jmp_policy.float8._delayed import AmaxHistory, observation
from jmp_policy.float8._layout import Contraction, Layout, layout_of
from jmp_policy.float8._recipe import RAGGED, Float8Recipe, native_block_products
from jmp_policy.float8._scaled import Float8

QUANTIZED_LHS = "autocast_quantized_lhs"
"""The ``checkpoint_name`` of what a quantized product keeps of its left operand."""
QUANTIZED_RHS = "autocast_quantized_rhs"
"""The ``checkpoint_name`` of what a quantized product keeps of its right operand."""


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


def quantized_product(eqn: JaxprEqn, recipe: Float8Recipe,
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
    rules = _Rules(layout_of(eqn, jnp.ndim(lhs), jnp.ndim(rhs)), recipe, _scheme(recipe, eqn),
                   {"lhs": operand_formats[0], "rhs": operand_formats[1], "g": recipe.bwd_dtype},
                   compute, (dtype_of(lhs), dtype_of(rhs)))
    what = _description(eqn, recipe, lhs, rhs)
    name = recipe.scaling if recipe.blocks else "float8"
    custom = _custom_vjp(rules, f"{name}_{eqn.primitive.name}", what)
    if _forward_mode(lhs, rhs):  # said here: under jit, JAX would say it when compiling
        raise ForwardModeError(_forward_mode_message(what))
    try:
        return custom(lhs, rhs, history, *rest)
    except TypeError as e:  # JAX's, from evaluating (or batching) the product's JVP
        if _JAX_NO_JVP not in str(e):
            raise
        raise ForwardModeError(_forward_mode_message(what)) from e


def _scheme(recipe: Float8Recipe, eqn: JaxprEqn) -> Scheme:
    """The scheme of ``recipe``'s products. Block products run native or emulated, as
    `native_block_products` decides when tracing, from the backend; ragged ones have no
    native product in JAX."""
    if recipe.blocks:
        return BlockScaled(recipe, native_block_products(recipe) and eqn.primitive.name != RAGGED)
    return Float8(recipe)


def _custom_vjp(rules: _Rules, name: str, what: str) -> Any:
    """The product of ``rules`` as a ``custom_vjp`` function named ``name``, whose rules
    raise `ForwardModeError` (naming the product as ``what``) when differentiated."""
    first_order = _first_order_only(what)

    def product(a: Any, b: Any, h: Optional[AmaxHistory], *rest: Any) -> Any:
        return rules.product(a, b, h, rest)

    def guarded_fwd(a: Any, b: Any, h: Optional[AmaxHistory],
                    *rest: Any) -> tuple[Any, tuple[Any, ...]]:
        return rules.product_fwd(first_order(a), first_order(b), h, rest)

    def guarded_bwd(res: tuple[Any, ...], g: Any) -> tuple[Any, ...]:
        return rules.product_bwd(res, first_order(g))

    product.__name__ = name
    custom = jax.custom_vjp(product)
    custom.defvjp(guarded_fwd, guarded_bwd)
    return custom


@dataclasses.dataclass(frozen=True, eq=False)
class _Rules:
    """The forward and backward rules of one quantized product.

    They run whenever the product is differentiated, possibly after the trace that
    made them: they keep the equation's layout, the recipe, its scheme and the
    dtypes, never a traced value.

    Attributes:
      layout: the product's three contractions.
      recipe: the recipe it runs.
      scheme: how the recipe quantizes and multiplies operands.
      formats: the format of each named operand (``"lhs"``, ``"rhs"``, ``"g"``).
      compute: the dtype of the product's result.
      dtypes: the dtypes of (lhs, rhs), which their gradients take.
    """

    layout: Layout
    recipe: Float8Recipe
    scheme: Scheme
    formats: dict[str, DType]
    compute: DType
    dtypes: tuple[DType, DType]

    @property
    def gemm(self) -> DType:
        return _gemm_dtype(self.compute)

    def product(self, a: Any, b: Any, h: Optional[AmaxHistory], rest: Sequence[Any]) -> Any:
        """The product, undifferentiated."""
        a, qa, qb = self._quantized(a, b, h, rest)
        return self._forward(a, qa, qb, rest)

    def product_fwd(self, a: Any, b: Any, h: Optional[AmaxHistory],
                    rest: Sequence[Any]) -> tuple[Any, tuple[Any, ...]]:
        """The product, and what the backward rule takes: each operand's residual (named
        for ``jax.checkpoint``), the maxima seen (delayed scaling) and ``rest``."""
        a, qa, qb = self._quantized(a, b, h, rest)
        qb, a_res, b_res = self._residuals(a, b, qa, qb, rest)
        out = self._forward(a, qa, qb, rest)
        named = (checkpoint_name(a_res, QUANTIZED_LHS),  # type: ignore[no-untyped-call]
                 checkpoint_name(b_res, QUANTIZED_RHS))  # type: ignore[no-untyped-call]
        # Delayed scaling: the history (for the gradient's scale) and the maxima observed.
        seen = None if h is None else (h.grad, qa[2], qb[2])
        return out, (*named, seen, rest)

    def product_bwd(self, res: tuple[Any, ...], g: Any) -> tuple[Any, ...]:
        """The gradients of (lhs, rhs, history, *rest) for incoming gradient ``g``."""
        a_res, b_res, seen, rest = res
        d_lhs, d_rhs = self.layout.lhs_gradient, self.layout.rhs_gradient
        # Each gradient is sharded as its operand (the residuals have the operands' types).
        lhs_sharding = d_lhs.result_sharding(_array_of(a_res))
        rhs_sharding = d_rhs.result_sharding(_array_of(b_res))
        g = self.layout.masked(g, rest)
        g_lhs = self.scheme.prepare(g, self.formats["g"], d_lhs, 0, self._seed(d_lhs), rest,
                                    *(() if seen is None else (seen[0],)))
        b_lhs = self.scheme.prepare(b_res, self.formats["rhs"], d_lhs, 1, None, rest)
        grad_lhs = self.scheme.contract(d_lhs, g_lhs, b_lhs, rest, lhs_sharding, self.gemm)
        grad_rhs = self._rhs_gradient(g, g_lhs, a_res, rest, rhs_sharding)
        observed = None if seen is None else AmaxHistory(
            *(observation(m, seen[0]) for m in (seen[1], seen[2], g_lhs[2])))
        return (convert(d_lhs.arranged(grad_lhs), self.dtypes[0]),
                convert(d_rhs.arranged(grad_rhs), self.dtypes[1]), observed,
                *(None for _ in rest))

    def _quantized(self, a: Any, b: Any, h: Optional[AmaxHistory],
                   rest: Sequence[Any]) -> tuple[Any, Any, Any]:
        """``a`` as the contractions take it, and both operands prepared for the forward
        contraction (scaled from ``h`` if given)."""
        fwd = self.layout.forward
        a = self.layout.masked(a, rest)
        qa = self.scheme.prepare(a, self.formats["lhs"], fwd, 0, None, rest, *_of(h, "lhs"))
        qb = self.scheme.prepare(b, self.formats["rhs"], fwd, 1, None, rest, *_of(h, "rhs"))
        return a, qa, qb

    def _residuals(self, a: Any, b: Any, qa: Any, qb: Any,
                   rest: Sequence[Any]) -> tuple[Any, Any, Any]:
        """``(qb, a_res, b_res)``: what the forward pass keeps of each operand for the
        backward contraction that takes it, and ``qb`` made together with ``b_res``
        where that is a new quantization."""
        d_lhs, d_rhs = self.layout.lhs_gradient, self.layout.rhs_gradient
        a_res = (self.scheme.keep(a, qa, self.formats["lhs"], d_rhs,
                                  d_rhs.operands.index("lhs"), rest)
                 if self.recipe.float8_weight_gradient else a)
        b_res = self.scheme.keep(b, qb, self.formats["rhs"], d_lhs, 1, rest)
        if b_res is not qb:
            # Quantized again for the backward contraction (rowwise, block scalings):
            # made with the forward operand, or it waits for the backward pass and
            # keeps the float32 weight alive past its update (XLA then copies a donated
            # weight). Tying the left operand's too costs more than it saves.
            qb, b_res = _made_together((qb, b_res))
        return qb, a_res, b_res

    def _forward(self, a: Any, qa: Any, qb: Any, rest: Sequence[Any]) -> Any:
        """The forward contraction of prepared ``qa`` and ``qb``, in the compute dtype."""
        fwd = self.layout.forward
        out = self.scheme.contract(fwd, qa, qb, rest, fwd.result_sharding(a), self.gemm)
        return _narrowed(out, self.compute)

    def _rhs_gradient(self, g: Any, g_lhs: Any, a_res: Any, rest: Sequence[Any],
                      sharding: Optional[NamedSharding]) -> jax.Array:
        """rhs's gradient, before its transpose: quantized as lhs's (``g`` prepared once
        for both where the scheme allows), or with ``recipe.float8_weight_gradient`` off as
        the matmul class's backward products: compute-dtype operands and result."""
        d_rhs = self.layout.rhs_gradient
        if not self.recipe.float8_weight_gradient:
            named = {"g": convert(g, self.compute), "lhs": convert(a_res, self.compute)}
            left, right = (named[n] for n in d_rhs.operands)
            return d_rhs.dot(left, right, rest, sharding, preferred_element_type=self.compute)
        at = d_rhs.operands.index("g")
        g_rhs = g_lhs if self.scheme.reuses(g_lhs, d_rhs) else \
            self.scheme.prepare(g, self.formats["g"], d_rhs, at, self._seed(d_rhs), rest)
        a_rhs = self.scheme.prepare(a_res, self.formats["lhs"], d_rhs, 1 - at, None, rest)
        operands = (g_rhs, a_rhs) if at == 0 else (a_rhs, g_rhs)
        return self.scheme.contract(d_rhs, *operands, rest, sharding, self.gemm)

    def _seed(self, c: Contraction) -> Optional[jax.Array]:
        """The seed of ``g``'s stochastic rounding for backward contraction ``c``, if the
        recipe rounds so. Fixed, the values salting the bits; a stream of its own for each
        backward contraction's rounding of ``g``."""
        if not self.recipe.stochastic_rounding:
            return None
        streams = formats.SEED_STREAMS
        return formats.fixed_seed(streams.lhs_gradient if c is self.layout.lhs_gradient
                                  else streams.rhs_gradient)


def _description(eqn: JaxprEqn, recipe: Float8Recipe, lhs: Any, rhs: Any) -> str:
    """The product as errors name it: recipe, primitive, operands and scope."""
    kind = "block-scaled" if recipe.blocks else "float8"  # NVFP4's values are not float8
    return (f"autocast's {recipe.scaling} {kind} product ({eqn.primitive.name} of "
            f"{_shape(lhs)} and {_shape(rhs)}{_scope(eqn)})")


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


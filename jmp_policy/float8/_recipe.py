"""The float8 recipe, and which matrix products it runs in which format.

Everything that decides whether and how a product runs in float8 lives here,
so that autocast's float8 rule and tools that report on it (the numerics
inspector) agree:

* `Float8Recipe` holds the settings and `as_recipe` reads autocast's ``fp8=``
  argument into one;
* `eligible` says whether a ``dot_general`` (or mixture-of-experts
  ``ragged_dot_general``) equation runs in float8 (`why_not_float8` says why
  not), `operand_dtypes` which format each of its operands takes, and
  `native_block_products` whether a block scaling's products run as the
  backend's native GEMM.

>>> import jax, jax.numpy as jnp, jmp_policy
>>> recipe = jmp_policy.Float8Recipe("rowwise", min_size=64)
>>> eqn = jax.make_jaxpr(jnp.matmul)(jnp.ones((128, 32)), jnp.ones((32, 128))).eqns[0]
>>> eligible(recipe, eqn, "mlp"), why_not_float8(recipe, eqn, "mlp")
(False, "its sizes (M=128, K=32, N=128) are below the recipe's min_size=64")
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Literal, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import JaxprEqn

from jmp_policy import formats
from jmp_policy.dtypes import is_floating_dtype
from jmp_policy.float8 import _blocks
from jmp_policy.float8._axes import free_axes
from jmp_policy.float8._layers import KeptLayers
from jmp_policy.paths import is_backward, scope_patterns, search_scopes

Scaling = Literal["tensorwise", "rowwise", "delayed", "mxfp8", "nvfp4"]
SCALINGS: tuple[Scaling, ...] = ("tensorwise", "rowwise", "delayed", "mxfp8", "nvfp4")
AmaxReduction = Literal["max", "most_recent"]
AMAX_REDUCTIONS: tuple[AmaxReduction, ...] = ("max", "most_recent")

# The operand formats each scaling takes by default: (forward, gradients).
_DEFAULT_DTYPES = {
    "tensorwise": (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)),
    "rowwise": (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)),
    "delayed": (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)),
    # Block scales give each block its own range: gradients keep e4m3's precision, as
    # Transformer Engine's MXFP8 recipe and jax.nn.get_scaled_dot_general_config do.
    "mxfp8": (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e4m3fn)),
    "nvfp4": (_blocks.E2M1, _blocks.E2M1),
}

@dataclasses.dataclass(frozen=True)
class Float8Recipe:
    """How autocast runs matrix products in float8 (immutable and hashable).

    Attributes:
      scaling: ``"tensorwise"`` (one scale per operand), ``"rowwise"`` (one
        scale per row along each operand's non-contracting dimensions, so an
        outlier row does not crush the precision of the others), ``"delayed"``
        (one scale per operand, as tensorwise, computed from a history of the
        operand's absolute maxima in earlier steps rather than from its values
        now: the operand is read once, and its cast to float8 can run in the
        kernel that produces it; see `jmp_policy.float8_state`), or a block
        scaling, one scale per block of consecutive values along the
        contracting dimension: ``"mxfp8"`` (blocks of 32, power-of-two
        ``float8_e8m0fnu`` scales, ``float8_e4m3fn`` values) or ``"nvfp4"``
        (blocks of 16, ``float8_e4m3fn`` scales, ``float4_e2m1fn`` values, and
        one float32 scale per tensor). Except for ``"delayed"``, scales come
        from each operand's current absolute maximum: no state to carry.
      fwd_dtype: format of the forward operands (activations, weights); by
        default ``float8_e4m3fn``, ``float4_e2m1fn`` for ``"nvfp4"``.
      bwd_dtype: format of the incoming gradients (cotangents) in the
        backward products: by default ``float8_e5m2`` (range) for tensorwise
        and rowwise scaling, ``float8_e4m3fn`` for ``"mxfp8"`` (its block
        scales give the range) and ``float4_e2m1fn`` for ``"nvfp4"``.
      min_size: a product whose contracting size or either non-contracting
        size (each the product of those dimensions' sizes, batch dimensions
        aside) is below this stays in the policy's compute dtype: small
        matrices gain nothing from float8 and lose accuracy.
      exclude: regular expressions searched (``re.search``) in the
        ``jax.named_scope`` path of each product, ``/``-joined and without
        JAX's transformation names (``"TransformerLM/logits"``, also in the
        backward pass); a product that matches stays in the compute dtype.
        The default, `DEFAULT_EXCLUDE`, keeps the output layer of a model out
        of float8: a scope named ``logits...``, ``lm_head...``, ``head`` or
        ``<task>_head`` (``classifier_head``, ``cls_head``; an attention head,
        ``attention_head``, ``attn_head`` or ``multi_head``, is not an output
        layer), and a head tied to its embedding, any ``.attend`` method
        (``nn.Embed``'s in linen, ``nnx.Embed``'s: ``Decoder/embedder.attend``).
      batched: whether products with batch dimensions (attention's scores and
        weighted values, per-example weights under ``vmap``) run in float8
        too. ``False`` keeps them in the compute dtype and float8s only the
        layers' products, as float8 training libraries for PyTorch do. ``None``
        (the default) is ``True``, except for ``"nvfp4"``: attention's products
        in 4-bit values cost more accuracy in training than all the layers'
        products together (docs/fp8.md), and Transformer Engine's NVFP4 recipe
        keeps them in bfloat16 too.
      power_of_two_scales: round every scale down to a power of two (exact
        scaling and rescaling, bit patterns that do not depend on rounding
        of the scale). Off by default: a scale mapping the absolute maximum
        exactly onto the format's largest value uses up to one more binade
        of the format and keeps that largest value exact, which makes
        heavy-tailed operands and the other rows of a tensorwise product
        with an outlier row more accurate, and costs no accuracy elsewhere.
      float8_weight_gradient: whether the backward product giving the
        gradient of a product's right operand (the weight in ``x @ w`` and in
        Flax's ``Dense``), a sum over all tokens, runs in float8 too; if not,
        it runs in the compute dtype. On by default: all three products of a
        layer in float8 is where the speed is (docs/fp8.md compares training
        with it on and off). Applies to
        products that autocast differentiates (``jax.grad`` of an autocast
        function).
      stochastic_rounding: round the incoming gradients of the backward
        products to their format stochastically (unbiased: the expected
        rounded value is the value), with random bits drawn from the
        gradient's own values, so that no state is carried. On by default for
        ``"nvfp4"``, whose two-bit grid biases gradients otherwise; off by
        default for the float8 scalings.
      hadamard: for ``"nvfp4"``, whether the backward product giving a product's
        right-operand (weight) gradient, a sum over tokens, rotates both its operands
        first, in blocks of 16 along the tokens, by the same random Hadamard matrix
        (``R = diag(signs) H / 4``, orthogonal, exact in float32, its signs drawn once
        from ``jmp_policy.formats.SEED_STREAMS.hadamard_signs``): the same product,
        with a token whose gradient is an outlier spread over its block rather than
        setting the block's scale. Off by default: in training it bought nothing
        measurable on the models measured (docs/fp8.md), and it costs a 16 x 16
        product per 16 values of both operands. Dense products only: a mixture of
        experts' weight gradient is not rotated.
      tiled_weights: for ``"nvfp4"``, whether the right operand of each product
        without batch dimensions (a layer's weight; the experts' matrices of a
        mixture of experts) takes one block scale per 16 x 16 tile rather than per
        16 values along the summed axis, so that the forward product and the
        backward one giving the left operand's gradient take the same quantized
        weight. Off by default: a scale per 256 values rather than 16 cost
        accuracy in training on the models measured (docs/fp8.md).
      four_over_six: for ``"nvfp4"``, whether each block of an operand rounded to
        nearest (forward operands, and the saved operands of the backward products)
        takes the better of two scales, its maximum mapped onto 6 or onto 4, by
        squared error (Four Over Six, arXiv 2512.02010): e2m1 has no value between
        4 and 6, so values in the top third of a block scaled to 6 round coarsely.
        Gradients rounded stochastically keep the scale to 6 (choosing between two
        random roundings by their error would bias them), and so do a weight's
        16 x 16 tiles and a mixture of experts' weight-gradient operands. Off by
        default: it trained the example LM closer to bfloat16, by less than the
        seeds vary (docs/fp8.md).
      native: for a block scaling, whether its products run as the block-scaled
        GEMM that the backend runs natively (``jax.nn.scaled_matmul``, cuDNN
        on Blackwell GPUs) or as its emulation (dequantize, multiply in
        float32), which gives the same products on every backend. ``None``
        (the default) chooses when tracing, from the backend; ``True`` on a
        backend without it fails when compiled. Only for block scalings.
      amax_history_length: for ``"delayed"``, how many steps of absolute maxima
        each operand's history keeps (1024 by default, as Transformer Engine's
        and Flax's delayed scaling).
      amax_reduction: for ``"delayed"``, how a history gives the maximum a scale
        maps onto the format's largest value: ``"max"`` (the largest in the
        history, the default) or ``"most_recent"`` (the last step's). Values
        above it saturate to the format's largest value; an empty history
        (the first step) gives a scale of 1.
      high_precision_layers: ``(first, last)``: in each stack of numbered
        layers of the function (sibling scopes whose names differ only by a
        trailing number: linen's ``Block_0``, ``Block_1``, ...; NNX's
        ``layers/0``, ``layers/1``, ...; ``jax.named_scope(f"layer_{i}")``), the
        products of the first ``first`` and the last ``last`` layers stay in the
        compute dtype, forward and backward, as an excluded scope does (NVFP4
        training keeps a few layers, mostly the last ones, in bfloat16). A
        stack has two or more layers; a block's own numbered parts (each
        block's ``Dense_0``, ``Dense_1``) are not one, and other numbered
        siblings are (linen's automatic names included: name a model's other
        layers to keep them out; see `jmp_policy.float8.find_stacks`). A
        scanned stack (``nn.scan``, ``nnx.scan``, ``lax.scan`` over layers)
        has one body and no layer numbers: split the scan, or unroll the
        layers to keep. A rule that finds no stack warns
        (``UnmatchedRuleWarning``). Applies to `jmp_policy.autocast`, which
        sees the whole stack; ``(0, 0)`` (the default) keeps no layer.

    >>> import jmp_policy
    >>> recipe = jmp_policy.Float8Recipe("rowwise", min_size=64)
    >>> recipe.fwd_dtype, recipe.bwd_dtype
    (dtype(float8_e4m3fn), dtype(float8_e5m2))
    >>> recipe.excludes("transpose(jvp(TransformerLM))/logits")
    True
    >>> recipe.excludes("Gemma/embedder.attend"), recipe.excludes("Gemma/blocks/0/attn")
    (True, False)
    >>> Float8Recipe("rowwise", exclude=(*recipe.exclude, "router")).excludes("moe/router")
    True
    """

    # Anchored on whole scope names: a ``heads``, ``ahead`` or ``head_proj`` scope is not
    # matched, nor an attention head (the lookbehinds on the name before ``_head``).
    DEFAULT_EXCLUDE: ClassVar[tuple[str, ...]] = (
        r"(?i)(^|/)(logits?\w*|lm_head\w*|head|\w+(?<!attention)(?<!attn)(?<!multi)_head)"
        r"(\.\w+)?(/|$)",
        r"(^|/)\w+\.attend(/|$)")

    scaling: Scaling = "tensorwise"
    fwd_dtype: Any = None  # None: the scaling's default (_DEFAULT_DTYPES)
    bwd_dtype: Any = None
    # The smallest size float8 tensor-core GEMMs take (multiples of 16).
    min_size: int = 16
    exclude: Union[str, Sequence[str]] = DEFAULT_EXCLUDE
    batched: Optional[bool] = None  # None: True except for "nvfp4"
    power_of_two_scales: bool = False
    float8_weight_gradient: bool = True
    stochastic_rounding: Optional[bool] = None  # None: on for "nvfp4" only
    hadamard: bool = False
    tiled_weights: bool = False
    four_over_six: bool = False
    native: Optional[bool] = None
    amax_history_length: int = 1024
    amax_reduction: AmaxReduction = "max"
    high_precision_layers: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        if self.scaling not in SCALINGS:
            raise ValueError(
                f"Float8Recipe scaling must be one of {', '.join(map(repr, SCALINGS))}, "
                f"got {self.scaling!r}.")
        for field, default in zip(("fwd_dtype", "bwd_dtype"), _DEFAULT_DTYPES[self.scaling]):
            value = getattr(self, field)
            object.__setattr__(self, field, default if value is None
                               else _operand_dtype(value, field, self.scaling))
        if self.stochastic_rounding is None:
            object.__setattr__(self, "stochastic_rounding", self.scaling == "nvfp4")
        if self.batched is None:
            object.__setattr__(self, "batched", self.scaling != "nvfp4")
        if isinstance(self.min_size, bool) or not isinstance(self.min_size, int):
            raise TypeError(f"Float8Recipe min_size must be an int, got {self.min_size!r}.")
        if self.min_size < 0:
            raise ValueError(
                f"Float8Recipe min_size must be a non-negative int (products with a "
                f"dimension below it stay in the compute dtype), got {self.min_size!r}.")
        object.__setattr__(self, "exclude", scope_patterns(self.exclude, "Float8Recipe exclude"))
        for field in ("batched", "power_of_two_scales", "float8_weight_gradient",
                      "stochastic_rounding", "hadamard", "tiled_weights", "four_over_six"):
            if not isinstance(getattr(self, field), bool):
                raise TypeError(
                    f"Float8Recipe {field} must be True or False, got {getattr(self, field)!r}.")
        if self.native is not None and not isinstance(self.native, bool):
            raise TypeError(
                f"Float8Recipe native must be None, True or False, got {self.native!r}.")
        self._check_delayed_fields()
        for field in ("hadamard", "tiled_weights", "four_over_six"):
            if getattr(self, field) and self.scaling != "nvfp4":
                raise ValueError(
                    f"Float8Recipe {field} applies to scaling='nvfp4' (16-value blocks of "
                    f"4-bit values), not to scaling={self.scaling!r}; leave it False.")
        object.__setattr__(self, "high_precision_layers",
                           _layer_counts(self.high_precision_layers))
        if self.blocks:
            if self.power_of_two_scales:
                raise ValueError(
                    f"Float8Recipe power_of_two_scales cannot apply to scaling={self.scaling!r}, "
                    "whose block scales have a fixed format (mxfp8: powers of two, nvfp4: "
                    "float8_e4m3fn); leave it False.")
        elif self.native is not None:
            raise ValueError(
                f"Float8Recipe native applies to the block scalings ('mxfp8', 'nvfp4'), not "
                f"to scaling={self.scaling!r}, whose products are float8 dot_generals on "
                "every backend; leave it None.")

    def _check_delayed_fields(self) -> None:
        length, reduction = self.amax_history_length, self.amax_reduction
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(
                f"Float8Recipe amax_history_length must be a positive int, got {length!r}.")
        if reduction not in AMAX_REDUCTIONS:
            raise ValueError(
                f"Float8Recipe amax_reduction must be one of "
                f"{', '.join(map(repr, AMAX_REDUCTIONS))}, got {reduction!r}.")
        if not self.delayed and (length, reduction) != (1024, "max"):
            raise ValueError(
                f"Float8Recipe amax_history_length and amax_reduction apply to "
                f"scaling='delayed', whose scales come from a history of maxima; "
                f"scaling={self.scaling!r} scales by current maxima. Leave them at their "
                "defaults, or use scaling='delayed'.")

    @property
    def delayed(self) -> bool:
        """Whether scales come from a history of maxima (``"delayed"``), a state the
        autocast function takes (see `jmp_policy.float8_state`)."""
        return self.scaling == "delayed"

    @property
    def blocks(self) -> bool:
        """Whether the scaling is a block scaling (``"mxfp8"``, ``"nvfp4"``)."""
        return self.scaling in _blocks.BLOCK_SCALINGS

    @property
    def block_size(self) -> Optional[int]:
        """Values per scale along the contracting dimension: 32 for ``"mxfp8"``, 16 for
        ``"nvfp4"``, ``None`` for tensorwise and rowwise scaling."""
        return _blocks.BLOCK_SIZES.get(self.scaling)

    def excludes(self, scope: str) -> bool:
        """True when an `exclude` pattern is found in the name-scope path ``scope``."""
        return search_scopes(self.exclude, scope)


def _operand_dtype(value: Any, field: str, scaling: str) -> np.dtype[Any]:
    dtype: Optional[np.dtype[Any]]
    try:
        dtype = np.dtype(value)
    except TypeError:
        dtype = None
    if scaling == "nvfp4":
        if dtype != _blocks.E2M1:
            raise ValueError(
                f"Float8Recipe {field} must be jnp.float4_e2m1fn with scaling='nvfp4' (its "
                f"values are e2m1); got {value if dtype is None else dtype}. For float8 "
                "values in blocks, use scaling='mxfp8'.")
        return dtype
    if dtype is None or not dtype.name.startswith("float8_") or not is_floating_dtype(dtype) \
            or formats.facts_of(dtype).mantissa == 0:
        raise ValueError(
            f"Float8Recipe {field} must be a float8 dtype with a mantissa, such as "
            f"jnp.float8_e4m3fn or jnp.float8_e5m2; got {value if dtype is None else dtype}.")
    if scaling == "mxfp8" and dtype.name not in ("float8_e4m3fn", "float8_e5m2"):
        raise ValueError(
            f"Float8Recipe {field} must be jnp.float8_e4m3fn or jnp.float8_e5m2 with "
            f"scaling='mxfp8' (the MXFP8 value formats); got {dtype}.")
    return dtype


def _layer_counts(value: Any) -> tuple[int, int]:
    try:
        counts = tuple(value)
    except TypeError:
        counts = ()
    if len(counts) != 2 or not all(isinstance(n, int) and not isinstance(n, bool)
                                   for n in counts):
        raise TypeError(
            "Float8Recipe high_precision_layers must be a pair of ints (first, last): how "
            "many of the first and of the last layers of each stack stay in the compute "
            f"dtype, such as (0, 2); got {value!r}.")
    if min(counts) < 0:
        raise ValueError(
            "Float8Recipe high_precision_layers must be two non-negative ints (first, last), "
            f"such as (0, 2) or (0, 0) for none; got {value!r}.")
    return counts[0], counts[1]


Float8Like = Union[None, str, Float8Recipe]


def as_recipe(fp8: Float8Like) -> Optional[Float8Recipe]:
    """Reads autocast's ``fp8=`` argument: ``None``, a scaling name or a `Float8Recipe`.

    >>> as_recipe("rowwise").scaling
    'rowwise'
    >>> as_recipe(None) is None
    True
    """
    if fp8 is None or isinstance(fp8, Float8Recipe):
        return fp8
    if isinstance(fp8, str):
        if fp8 not in SCALINGS:
            raise ValueError(
                f"autocast fp8 must be None, {', '.join(map(repr, SCALINGS))}, or a "
                f"jmp_policy.Float8Recipe; got {fp8!r}.")
        return Float8Recipe(fp8)
    raise TypeError(
        f"autocast fp8 must be None, {', '.join(map(repr, SCALINGS))} or a "
        f"jmp_policy.Float8Recipe; got {type(fp8).__name__} {fp8!r}.")


# --- Which products, in which formats ----------------------------------------------------

RAGGED = "ragged_dot_general"
"""The mixture-of-experts product (``lax.ragged_dot``): rows of lhs ``[m, k]``, sorted
by group, times their group's matrix of rhs ``[g, k, n]``."""


def eligible(recipe: Float8Recipe, eqn: JaxprEqn, scope: str,
             layers: Optional[KeptLayers] = None) -> bool:
    """True when ``recipe`` runs ``eqn``, found under the name-scope path ``scope``, in float8.

    That is a ``dot_general``, or a ``ragged_dot_general`` of the
    mixture-of-experts layout (see `is_plain_ragged`), with floating operands,
    no size below ``recipe.min_size`` (empty products never qualify), batch
    dimensions only if ``recipe.batched``, a scope that no ``recipe.exclude``
    pattern matches and, given the function's ``layers`` (the layers that
    ``recipe.high_precision_layers`` keeps, found from all its products), a
    scope in none of them. (A product in an autocast float32 scope runs in
    float32 before this is asked.)
    """
    return why_not_float8(recipe, eqn, scope, layers) is None


def why_not_float8(recipe: Float8Recipe, eqn: JaxprEqn, scope: str,
                   layers: Optional[KeptLayers] = None) -> Optional[str]:
    """Why ``recipe`` keeps ``eqn`` out of float8 (see `eligible`), or ``None`` if it
    does not."""
    if eqn.primitive.name == RAGGED:
        if not is_plain_ragged(eqn):
            return "its ragged layout is not lax.ragged_dot's"
    elif eqn.primitive.name != "dot_general" or len(eqn.invars) != 2:
        return "it is not a dot_general"
    if not all(is_floating_dtype(_aval(v).dtype) for v in eqn.invars[:2]):
        return "it is not a floating product"
    m, k, n = product_sizes(eqn)
    if min(m, k, n) < max(recipe.min_size, 1):
        return (f"its sizes (M={m}, K={k}, N={n}) are below the recipe's "
                f"min_size={recipe.min_size}")
    if not recipe.batched and _dimension_numbers(eqn)[1][0]:
        return "it has batch dimensions and the recipe has batched=False"
    if recipe.excludes(scope):
        return (f"its scope {scope!r} matches the recipe's exclude (an output layer); "
                "Float8Recipe(exclude=()) puts it in float8")
    return None if layers is None else layers.why(scope)


def _dimension_numbers(eqn: JaxprEqn) -> Any:
    """``((lhs contracting, rhs contracting), (lhs batch, rhs batch))`` of a product."""
    if eqn.primitive.name == RAGGED:
        return eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers
    return eqn.params["dimension_numbers"]


def product_sizes(eqn: JaxprEqn) -> tuple[int, int, int]:
    """``(m, k, n)`` of a ``dot_general``: non-contracting, contracting, non-contracting sizes.

    Each is the product of those dimensions' sizes, batch dimensions (and the
    group dimension of a ragged product's rhs) aside.
    """
    lhs, rhs = (_aval(v).shape for v in eqn.invars[:2])
    (lc, rc), (lb, rb) = _dimension_numbers(eqn)
    groups = eqn.params["ragged_dot_dimension_numbers"].rhs_group_dimensions \
        if eqn.primitive.name == RAGGED else ()
    m = math.prod(lhs[i] for i in free_axes(len(lhs), lc, lb))
    n = math.prod(rhs[i] for i in free_axes(len(rhs), rc, (*rb, *groups)))
    return m, math.prod(lhs[i] for i in lc), n


def _aval(var: Any) -> Any:
    return var.aval


def is_plain_ragged(eqn: JaxprEqn) -> bool:
    """Whether a ``ragged_dot_general`` has the layout of ``lax.ragged_dot``, the one
    autocast's float8 rule runs: lhs ``[m, k]`` ragged along ``m``, rhs ``[g, k, n]``
    (or ``[g, n, k]``), group sizes ``[g]``, no batch dimensions, no group offset.

    The other modes (ragged contracting or batch dimensions, which JAX writes for a
    ragged product's weight gradient) stay in the compute dtype.
    """
    dims = eqn.params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = dims.dot_dimension_numbers
    lhs, rhs, sizes = (_aval(v).ndim for v in eqn.invars)
    return (lhs, rhs, sizes) == (2, 3, 1) and tuple(lc) == (1,) and tuple(rc) in ((1,), (2,)) \
        and not lb and not rb and tuple(dims.lhs_ragged_dimensions) == (0,) \
        and tuple(dims.rhs_group_dimensions) == (0,) and eqn.params["group_offset"] is None


def operand_dtypes(recipe: Float8Recipe, scope: str) -> tuple[np.dtype[Any], np.dtype[Any]]:
    """The float8 formats of a product's (lhs, rhs) found under ``scope``.

    Forward products take ``fwd_dtype`` on both sides. A backward product that
    JAX wrote by transposing a forward one (when the function autocast
    evaluates computes its own gradients) has the incoming gradient as its
    left operand, so that side takes ``bwd_dtype``; the forward products a
    ``jax.checkpoint`` recomputes there are forward products (see
    `jmp_policy.paths.is_backward`). (The backward products
    that autocast itself differentiates are formatted by its float8 rule.)
    """
    if is_backward(scope):
        return recipe.bwd_dtype, recipe.fwd_dtype
    return recipe.fwd_dtype, recipe.fwd_dtype


def native_block_products(recipe: Float8Recipe) -> bool:
    """Whether ``recipe``'s block-scaled products run as the backend's native block-scaled
    GEMM (``jax.nn.scaled_matmul``) rather than its emulation; asked when tracing.

    ``recipe.native`` decides if set; else the answer is whether every local
    device is a CUDA GPU of compute capability 10 or above (Blackwell), where
    cuDNN runs MXFP8 and NVFP4 products. Elsewhere JAX has no lowering for them.
    """
    if not recipe.blocks:
        return False
    if recipe.native is not None:
        return recipe.native
    return jax.default_backend() == "gpu" and all(
        _compute_capability(d) >= (10, 0) for d in jax.local_devices())


def _compute_capability(device: Any) -> tuple[int, ...]:
    """A CUDA device's compute capability (``(10, 0)``); ``(0,)`` for other devices."""
    try:
        return tuple(int(p) for p in str(device.compute_capability).split("."))
    except (AttributeError, ValueError):
        return (0,)

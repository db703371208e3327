"""Which precision each primitive runs in: the rule registry and the ``rules=`` argument.

Every primitive autocast knows has one `PrimitiveRule` in `PRIMITIVES`, which
says all autocast (and the numerics inspector) does with it: its class, how
its operands are cast, what kind of output of ``fn`` it makes, whether its
results are values of its inputs. Every primitive with floating inputs
belongs to one of three classes:

``"matmul"``
    Matrix work (`MATMUL_PRIMITIVES`): operands and result in the policy's
    compute dtype, accumulated in float32.
``"float32"``
    Numerically sensitive primitives (`FLOAT32_PRIMITIVES`): floating inputs
    widened to at least float32.
``"follow"``
    Everything else autocast knows (`FOLLOW_PRIMITIVES`): the widest floating
    input wins, as in JAX's own promotion.

A few primitives have no class: their parameters fix their dtypes, so they run
at the dtypes they were traced with. Higher-order primitives (``jit``,
``scan``...) are not classified but rewritten, each by its handler
(``interpreter.register``).

>>> PRIMITIVES["exp"]
PrimitiveRule(cls='float32', operands='promoted', output='class', preserves_values=False, range_only=False)
>>> PRIMITIVES["sort"].operands, PRIMITIVES["sort"].preserves_values
('independent', True)

``rules`` moves primitives between classes and pins ``jax.named_scope`` scopes
to float32:

>>> rules = parse_rules({"float32": ["tanh"], "float32_scopes": ["block/attention"]})
>>> rules.classes["tanh"], rules.classes["exp"]
('float32', 'float32')
>>> rules.scopes_in("model/block/attention")
('block/attention',)
>>> rules.scopes_in("transpose(jvp(model))/block/attention")  # a backward pass
('block/attention',)
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Collection, Literal, Mapping, Optional

from jax.extend.core import Primitive

from jmp_policy.dtypes import has_float32_range
from jmp_policy.paths import scope_names

__all__ = ["AutocastWarning", "Class", "FLOAT32_PRIMITIVES", "FOLLOW_PRIMITIVES",
           "MATMUL_PRIMITIVES", "Operands", "Output", "PRIMITIVES", "PrimitiveRule",
           "RANGE_PRIMITIVES", "Rules", "parse_rules", "rule_of"]

Class = Literal["matmul", "float32", "follow"]

Operands = Literal["promoted", "independent", "traced", "cast"]
"""How a primitive's floating operands are cast.

``"promoted"``: to one dtype, which its class picks (the compute dtype for
matmul, the widest operand's widened to float32 for float32, the widest
operand's for follow). ``"independent"``: each operand is a value of its own
(a collective's, a variadic sort's) and keeps its dtype, widened to float32 in
the float32 class. ``"traced"``: the dtypes it was traced with, which its
parameters fix (an embedded reduction jaxpr, a callback's result types, a bit
layout). ``"cast"``: a cast written in ``fn``, made as written
(``interpreter._convert``)."""

Output = Literal["class", "choice", "cast"]
"""What kind of output of ``fn`` a primitive's result is (``_outputs``).

``"class"``: by its class, a product for matmul, a value kept as computed
for float32, the strongest kind of its inputs for follow. ``"choice"``: each
element is one of its inputs (``select_n``). ``"cast"``: a value ``fn`` cast,
kept as cast."""


class AutocastWarning(UserWarning):
    """Autocast met a primitive it has no rule for (reported once per trace, naming it), or
    was given ``fp8=`` for a function none of whose products can run in float8.

    >>> import warnings, jax.numpy as jnp, jmp_policy
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("error", AutocastWarning)
    ...     jmp_policy.autocast(jnp.sin, "mixed_bfloat16")(jnp.ones(2)).dtype
    dtype('float32')
    """


@dataclasses.dataclass(frozen=True)
class PrimitiveRule:
    """Everything autocast does with one primitive, by default (``rules=`` moves its class).

    Attributes:
      cls: its class; ``None`` for a primitive that runs at its traced dtypes
        (``operands`` ``"traced"`` or ``"cast"``), which no rule can move.
      operands: how its floating operands are cast (see `Operands`).
      output: what kind of output of ``fn`` its result is (see `Output`).
      preserves_values: its results are values of its inputs, moved or selected:
        it can neither overflow nor round (the inspector gives it no row).
      range_only: a float32-class primitive that is there for float32's range
        alone (see `RANGE_PRIMITIVES`).
    """

    cls: Optional[Class]
    operands: Operands = "promoted"
    output: Output = "class"
    preserves_values: bool = False
    range_only: bool = False


_MATMUL = PrimitiveRule("matmul")
_FLOAT32 = PrimitiveRule("float32")
_FOLLOW = PrimitiveRule("follow")
_MOVES = PrimitiveRule("follow", preserves_values=True)
_INDEPENDENT = PrimitiveRule("follow", operands="independent")
_MOVES_INDEPENDENT = PrimitiveRule("follow", operands="independent", preserves_values=True)
_TRACED = PrimitiveRule(None, operands="traced")


def _registry(*groups: tuple[PrimitiveRule, str]) -> dict[str, PrimitiveRule]:
    """The registry of ``groups`` (a rule and the names it is for); a name once only."""
    registry: dict[str, PrimitiveRule] = {}
    for rule, names in groups:
        for name in names.split():
            if name in registry:
                raise ValueError(f"autocast's registry lists {name!r} twice.")
            registry[name] = rule
    return registry


PRIMITIVES: Mapping[str, PrimitiveRule] = _registry(
    # --- matmul ---
    (_MATMUL, "dot_general conv_general_dilated ragged_dot_general"),
    # --- float32 ---
    # Transcendentals whose half-precision results lose most of their digits or overflow.
    (_FLOAT32, "exp exp2 log log1p expm1 pow logistic erf erfc erf_inv rsqrt sqrt cbrt tan "
               "sinh cosh asin acos asinh acosh atanh lgamma digamma polygamma igamma "
               "igammac igamma_grad_a zeta bessel_i0e bessel_i1e "
               "regularized_incomplete_beta random_gamma"),
    # Squares overflow float16 above 256: norms and variances start here (float16 only).
    (PrimitiveRule("float32", range_only=True), "square integer_pow"),
    # Division overflows for small divisors; mean, softmax and normalisation end here.
    (_FLOAT32, "div"),
    # Accumulations.
    (_FLOAT32, "reduce_sum reduce_prod cumsum cumprod cumlogsumexp reduce_window_sum"),
    # The first primitive of softmax / log_softmax / logsumexp: widening here makes the
    # whole `x - max(x)`, `exp`, `sum`, `log` chain float32 (max itself is exact).
    (PrimitiveRule("float32", preserves_values=True), "reduce_max"),
    # Linear algebra and FFTs (often unsupported in half precision, and ill-conditioned).
    (_FLOAT32, "cholesky cholesky_update eig eigh lu qr svd schur hessenberg "
               "triangular_solve tridiagonal tridiagonal_solve geqrf geqp3 "
               "householder_product ormqr symmetric_product fft"),
    # --- follow ---
    # Elementwise. one_minus_square is tanh's derivative (JAX 0.11+); eq_to, le_to and
    # lt_to are total-order comparisons (searchsorted, histograms); name is
    # jax.ad_checkpoint.checkpoint_name, an identity that names a value.
    (_FOLLOW, "add add_any sub mul sign floor ceil round nextafter rem clamp tanh sin cos "
              "atan atan2 one_minus_square eq_to le_to lt_to name is_finite eq ne lt le gt "
              "ge and or not xor shift_left shift_right_arithmetic shift_right_logical "
              "population_count clz complex reduce_precision"),
    (_MOVES, "abs neg max min real imag conj stop_gradient copy copy_p"),
    # A choice between values: each element is one of the alternatives, unchanged.
    (PrimitiveRule("follow", output="choice", preserves_values=True), "select_n"),
    # Structural.
    (_MOVES, "broadcast_in_dim reshape transpose squeeze slice dynamic_slice "
             "dynamic_update_slice gather concatenate pad rev split"),
    (_FOLLOW, "stack unstack tile iota select_and_scatter_add"),
    (_INDEPENDENT, "select_and_gather_add"),
    # Order statistics (exact in any precision).
    (_MOVES, "reduce_min cummax cummin"),
    (_MOVES_INDEPENDENT, "sort"),
    (_FOLLOW, "reduce_and reduce_or reduce_xor argmax argmin top_k approx_top_k "
              "reduce_window_max reduce_window_min"),
    # Sharding, placement and collectives: a collective's operands are values of their own.
    (_MOVES, "sharding_constraint"),
    (_MOVES_INDEPENDENT, "device_put optimization_barrier"),
    (_FOLLOW, "reshard layout_constraint axis_index pbroadcast"),
    (_INDEPENDENT, "pvary psum pmax pmin all_gather all_to_all ppermute reduce_scatter "
                   "psum_invariant all_gather_invariant"),
    # PRNG (no floating inputs).
    (_FOLLOW, "random_bits random_seed random_wrap random_unwrap random_fold_in "
              "random_split random_clone threefry2x32 iota_2x32_shape rng_bit_generator"),
    # --- no class: dtypes fixed by the parameters ---
    (_TRACED, "bitcast_convert_type reduce reduce_window select_and_scatter scatter "
              "scatter-add scatter-sub scatter-mul scatter-min scatter-max pure_callback "
              "io_callback debug_callback debug_print ffi_call rng_uniform"),
    # jmp_policy.formats' rounding to a format: float32 in and out, the format a parameter.
    (_TRACED, "round_to_format"),
    # Library-level primitives (jnp.searchsorted in JAX 0.12): run as JAX wrote them.
    (_TRACED, "call_hi_primitive"),
    # cuDNN's fused attention (jax.nn.dot_product_attention's choice on a GPU): half
    # precision operands only, its softmax float32 inside; run at the traced dtypes.
    (_TRACED, "dot_product_attention_fwd_wrapper dot_product_attention_bwd_wrapper "
              "dot_product_attention_fp8_fwd_wrapper dot_product_attention_fp8_bwd_wrapper"),
    # A cast written in fn: made as written.
    (PrimitiveRule(None, operands="cast", output="cast"), "convert_element_type"),
)
"""Autocast's rule for each primitive it knows, by name."""


def rule_of(name: str) -> Optional[PrimitiveRule]:
    """The registry's rule for the primitive named ``name``; ``None`` if autocast does not
    know it.

    >>> rule_of("dot_general").cls, rule_of("my_kernel") is None
    ('matmul', True)
    """
    return PRIMITIVES.get(name)


def _classed(cls: Class) -> frozenset[str]:
    return frozenset(n for n, r in PRIMITIVES.items() if r.cls == cls)


MATMUL_PRIMITIVES = _classed("matmul")
"""The primitives of the matmul class, by default."""

FLOAT32_PRIMITIVES = _classed("float32")
"""The primitives of the float32 class, by default."""

FOLLOW_PRIMITIVES = _classed("follow")
"""The primitives of the follow class, by default."""

RANGE_PRIMITIVES = frozenset(n for n, r in PRIMITIVES.items() if r.range_only)
"""The float32-class primitives that are there for float32's range alone: under a compute
dtype with float32's exponent range (bfloat16) they follow their inputs instead, as in
plain bfloat16 JAX (``jax.nn.gelu``'s ``x ** 3`` keeps a bfloat16 activation bfloat16)."""

_DEFAULTS: Mapping[Class, frozenset[str]] = {
    "matmul": MATMUL_PRIMITIVES, "float32": FLOAT32_PRIMITIVES, "follow": FOLLOW_PRIMITIVES,
}
_KEYS = (*_DEFAULTS, "float32_scopes")


@dataclasses.dataclass(frozen=True)
class Rules:
    """The parsed ``rules=`` argument, defaults included.

    Attributes:
      classes: primitive name -> its class.
      float32_scopes: the scopes pinned to float32, as the user wrote them
        (``"block/attention"``).
      listed: the primitives ``rules=`` put in a class: they keep it under every
        policy (see `under`).
    """

    classes: Mapping[str, Class]
    float32_scopes: tuple[str, ...] = ()
    listed: frozenset[str] = frozenset()

    def class_of(self, primitive: Primitive) -> Optional[Class]:
        """The class of ``primitive``; ``None`` for a primitive autocast does not know."""
        return self.classes.get(primitive.name)

    def under(self, compute: Any) -> Rules:
        """These rules for a policy computing in ``compute``: `RANGE_PRIMITIVES` follow
        their inputs where ``compute`` has float32's exponent range, unless ``rules=``
        listed them.

        >>> import jax.numpy as jnp
        >>> parse_rules(None).under(jnp.bfloat16).classes["integer_pow"]
        'follow'
        >>> parse_rules(None).under(jnp.float16).classes["integer_pow"]
        'float32'
        """
        if not has_float32_range(compute):
            return self
        moved: dict[str, Class] = {n: "follow" for n in RANGE_PRIMITIVES - self.listed if n in self.classes}
        return dataclasses.replace(self, classes={**self.classes, **moved})

    def scopes_in(self, path: str) -> tuple[str, ...]:
        """The float32 scopes found in a name-scope path such as ``"model/block/attention"``.

        A scope matches a contiguous run of the path's scope names, at any depth:
        ``"attention"`` and ``"block/attention"`` both match that path,
        ``"lock"`` and ``"model/attention"`` do not.
        """
        if not self.float32_scopes or not path:
            return ()
        names = scope_names(path)
        return tuple(s for s in self.float32_scopes if _contains(names, s.split("/")))

    def unmatched(self, paths: Collection[str]) -> list[tuple[str, list[str]]]:
        """The float32 scopes that no path of ``paths`` is in, each with near misses."""
        matched = {s for path in paths for s in self.scopes_in(path)}
        names = {name for path in paths for name in scope_names(path)}
        return [(s, _near(s, names)) for s in self.float32_scopes if s not in matched]


def _near(scope: str, names: set[str]) -> list[str]:
    return [m for part in scope.split("/") for m in difflib.get_close_matches(part, names, n=2)]


def _contains(parts: list[str], run: list[str]) -> bool:
    n = len(run)
    return any(parts[i:i + n] == run for i in range(len(parts) - n + 1))


def parse_rules(rules: Optional[Mapping[str, Any]],
                higher_order: Collection[str] = ()) -> Rules:
    """Validates ``rules`` and merges it into the default classes.

    Args:
      rules: ``None``, or a mapping with keys among ``"matmul"``, ``"float32"``,
        ``"follow"`` (primitive names or ``jax.extend.core.Primitive`` objects
        to move into that class) and ``"float32_scopes"`` (``jax.named_scope``
        names, ``/``-joined for nested scopes).
      higher_order: names of the primitives autocast rewrites rather than
        classifies; listing one in a class is an error.
    """
    classes: dict[str, Class] = {n: c for c, names in _DEFAULTS.items() for n in names}
    if rules is None:
        return Rules(classes)
    if not isinstance(rules, Mapping):
        raise TypeError(
            f"autocast rules must be a mapping with keys among {', '.join(_KEYS)}, "
            "e.g. {'float32': ['tanh'], 'float32_scopes': ['attention']}; "
            f"got {type(rules).__name__}.")
    unknown = [k for k in rules if k not in _KEYS]
    if unknown:
        raise ValueError(
            f"Unknown autocast rules key(s) {unknown!r}: valid keys are {', '.join(_KEYS)}.")
    listed: dict[str, Class] = {}
    for cls in _DEFAULTS:
        for prim in _as_list(rules.get(cls, ()), f"rules[{cls!r}]"):
            name = _primitive_name(prim, higher_order)
            if listed.setdefault(name, cls) != cls:
                raise ValueError(
                    f"Primitive {name!r} is listed under both rules[{listed[name]!r}] and "
                    f"rules[{cls!r}]: list it under one class only.")
    classes.update(listed)
    scopes = _as_list(rules.get("float32_scopes", ()), "rules['float32_scopes']")
    return Rules(classes, tuple(_scope(s) for s in scopes), frozenset(listed))


def _as_list(value: Any, what: str) -> list[Any]:
    if isinstance(value, (str, Primitive)):
        return [value]
    try:
        return list(value)
    except TypeError:
        raise TypeError(f"{what} must be a name or a list of names, got {value!r}.") from None


def _primitive_name(prim: Any, higher_order: Collection[str]) -> str:
    if not isinstance(prim, (str, Primitive)):
        raise TypeError(
            f"autocast rules list primitives by name ('exp') or Primitive object; got {prim!r}.")
    name = prim.name if isinstance(prim, Primitive) else prim
    if name in higher_order:
        raise ValueError(
            f"{name!r} is a higher-order primitive: autocast applies its rules inside it, so it "
            "cannot be moved to a class; move the primitives it contains instead.")
    rule = rule_of(name)
    if rule is not None and rule.cls is None:
        raise ValueError(
            f"{name!r} always runs at the dtypes it was traced with (its parameters fix its "
            "types), so it cannot be moved to another class.")
    if isinstance(prim, str) and rule is None:
        close = difflib.get_close_matches(name, sorted(PRIMITIVES), n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(
            f"Unknown primitive name {name!r} in autocast rules.{hint} Pass primitives "
            "autocast does not list by their jax.extend.core.Primitive object instead.")
    return name


def _scope(scope: Any) -> str:
    if not isinstance(scope, str) or not all(scope.split("/")):
        raise ValueError(
            "rules['float32_scopes'] entries must be jax.named_scope names such as "
            f"'attention' or 'block/attention' (no empty parts); got {scope!r}.")
    return scope

"""The numerics inspector: which operations overflow, underflow or lose precision, and where.

``inspect_numerics(fn, policy)`` evaluates ``fn`` once in float32 and once as
``autocast(fn, policy)`` runs it, equation by equation, and reports for every
operation with floating results how its low-precision result compares with
float32: a `NumericsReport` of `NumericsRow` records, one per operation (and
call site), named by their ``jax.named_scope`` path, so Flax module paths
(``Block_0/Dense_1``) appear. With ``argnums``, the backward pass is reported
too, and the report suggests a loss scale.

Each operation that autocast does not run in float32 (matrix products, and
operations on half-precision values) is evaluated as autocast runs it on the
float32 evaluation's inputs and compared with the float32 result: a row shows
what its own operation loses. An overflow or a flush to zero upstream neither
hides one downstream nor is counted again at every operation that passes an
inf or a zero on, so one round of `NumericsReport.suggest_rules` fixes a
model. The float32 evaluation also gives the value ranges
(`NumericsReport.plot`) and the gradient magnitudes that a loss scale must
bring into range (`NumericsReport.suggest_loss_scale`).

All statistics are computed inside one compiled program per call signature
and come to the host together, so an inspection costs a few train steps.

>>> import jax, jax.numpy as jnp, jmp_policy
>>> def layer(x, w):
...     with jax.named_scope("boom"):       # inputs beyond float16's 65504
...         return jnp.tanh((x * 1000.0) @ w)
>>> report = jmp_policy.inspect_numerics(layer, "mixed_float16")(
...     jnp.full((2, 3), 100.0), jnp.ones((3, 4)))
>>> row = report.worst(1)[0]
>>> row.scope, row.primitive, row.phase, row.dtype, row.overflow
('boom', 'dot_general', 'forward', 'float16', 8)
>>> report.suggest_rules()
{'float32_scopes': ['boom']}
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import warnings
from collections.abc import Sequence as SequenceABC
from typing import (
    Any, Callable, Iterator, Literal, Mapping, Optional, Sequence, Union, overload)

import jax
import numpy as np
from jax.core import Tracer
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

from jmp_policy._dtypes import is_floating_dtype
from jmp_policy._rules import UnmatchedRuleWarning
from jmp_policy.autocast._fp8 import Float8Like, Float8Recipe, as_recipe
from jmp_policy.autocast._fp8_matmul import float8_matmul
from jmp_policy.autocast._inspect import (
    HISTOGRAM, Packing, Registry, VALUE_PRESERVING, display_scope, evaluate, pack, phase_of,
    unpack)
from jmp_policy.autocast._interpreter import Context, higher_order_names
from jmp_policy.autocast._lattice import F32, is_floating, join
from jmp_policy.autocast._matmul import matmul
from jmp_policy.autocast._rules import Rules, parse_rules
from jmp_policy.policy import Policy, PolicyLike, as_policy

Phase = Literal["forward", "backward"]
Argnums = Union[None, int, Sequence[int]]

# Loss scales are sized for float16, the format whose range gradients fall out of.
_F16 = np.finfo(np.float16)
_NORMAL_SHARE = 0.999


# --- Rows and reports ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class NumericsRow:
    """One operation of the inspected function: its low-precision result against float32.

    The low-precision result is the operation evaluated as autocast runs it on
    the float32 evaluation's inputs (so it shows what the operation itself
    loses); for an operation that autocast runs in float32 it is the float32
    result. Inside a loop body (``scan``, ``while_loop``), one row holds all the
    iterations of its operation.

    Attributes:
      scope: the ``jax.named_scope`` path, ``/``-joined, without JAX's
        transformation names (``"Block_0/Dense_1"``; ``""`` outside any scope).
      primitive: the primitive's name (``"dot_general"``).
      phase: ``"forward"``, or ``"backward"`` for the operations of the
        backward pass (inspected with ``argnums``).
      dtype: the dtype it ran in: for matrix products, the dtype of their
        operands (``"float16"``, ``"float8_e4m3fn"``; ``"float8_e5m2 x
        float8_e4m3fn"`` for two formats); else that of its result.
      max_abs: the largest finite magnitude of the low-precision result.
      overflow: how many result elements are inf or NaN in low precision while
        finite in float32.
      underflow: the fraction of the float32 result's nonzero elements that
        are zero in low precision.
      subnormal: the fraction of result elements that are subnormal in
        ``dtype`` (for a float8 product, in the policy's compute dtype, which
        its rescaled result continues in).
      rel_error: the relative RMS error of the low-precision result against
        float32, over the elements finite in both.
      size: the number of result elements (over all iterations of a loop).
      float32_min: the smallest nonzero magnitude of the result in the float32
        evaluation of the function (``None`` if all zero).
      float32_max: the largest finite magnitude there.
      fp8_saturated: for a float8 product, how many operand values saturate
        (are beyond the float8 format after scaling, inf and NaN included);
        ``None`` for other operations.
      fp8_flushed: for a float8 product, how many nonzero operand values
        become zero in float8; ``None`` for other operations.
    """

    scope: str
    primitive: str
    phase: Phase
    dtype: str
    max_abs: float
    overflow: int
    underflow: float
    subnormal: float
    rel_error: float
    size: int
    float32_min: Optional[float]
    float32_max: float
    fp8_saturated: Optional[int] = None
    fp8_flushed: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class _Meta:
    """What a report says about how it was made."""

    name: str
    policy: str
    fp8: Optional[str]
    rules: Optional[Mapping[str, Any]]
    backward: bool
    # Counts of the float32 backward pass's nonzero magnitudes by float32 exponent, and
    # its largest magnitude: what a loss scale is chosen from.
    gradient_histogram: Optional[np.ndarray[Any, Any]] = None
    gradient_max: float = 0.0


class NumericsReport(SequenceABC[NumericsRow]):
    """The rows of an inspection (see `inspect_numerics`), with what to do about them.

    A report is a sequence of `NumericsRow` in program order (``report[0]``,
    ``len(report)``, ``for row in report``); `worst` and slicing give reports
    of fewer rows. ``str(report)`` is a table of its rows.
    """

    def __init__(self, rows: Sequence[NumericsRow], meta: _Meta):
        self._rows = tuple(rows)
        self._meta = meta

    @property
    def rows(self) -> list[NumericsRow]:
        """The rows, one per operation with floating results, in program order."""
        return list(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, index: int) -> NumericsRow: ...

    @overload
    def __getitem__(self, index: slice) -> NumericsReport: ...

    def __getitem__(self, index: Union[int, slice]) -> Union[NumericsRow, NumericsReport]:
        if isinstance(index, slice):
            return NumericsReport(self._rows[index], self._meta)
        return self._rows[index]

    def __iter__(self) -> Iterator[NumericsRow]:
        return iter(self._rows)

    def worst(self, n: int = 10) -> NumericsReport:
        """The ``n`` riskiest rows: most overflow first, then most underflow, then
        largest ``rel_error`` (program order among equals)."""
        ranked = sorted(self._rows, key=lambda r: (-r.overflow, -r.underflow, -r.rel_error))
        return NumericsReport(ranked[:n], self._meta)

    def __str__(self) -> str:
        return _table(self._rows, self._meta)

    def __repr__(self) -> str:
        return (f"<NumericsReport of {self._meta.name} under {self._meta.policy}: "
                f"{len(self._rows)} rows>")

    def to_json(self) -> str:
        """The report as a JSON object: settings and ``rows`` (non-finite numbers as null)."""
        meta = self._meta
        document = {
            "function": meta.name, "policy": meta.policy, "fp8": meta.fp8,
            "backward": meta.backward, "rows": [dataclasses.asdict(r) for r in self._rows],
        }
        return json.dumps(_finite_or_null(document), indent=1)

    def plot(self, path: str) -> None:
        """Writes a picture of each scope's dynamic range to ``path`` (a PNG, PDF, SVG...).

        For each scope (and phase), a bar from the smallest nonzero to the
        largest magnitude of its results in the float32 evaluation, drawn
        against the ranges of float16, bfloat16, float8_e4m3fn and float8_e5m2
        (normal range solid, subnormals lighter): a bar that leaves a format's
        range shows a scope that overflows or underflows in it. Scopes with
        overflowing operations are drawn in red. Needs matplotlib.
        """
        from jmp_policy._numerics_plot import plot_ranges

        plot_ranges(_scope_ranges(self._rows), path, title=_title(self._meta))

    def suggest_rules(self) -> dict[str, Any]:
        """Autocast ``rules`` that keep the scopes of overflowing operations in float32.

        The inspection's own ``rules`` are kept; their ``"float32_scopes"`` gain
        the scope of every row with ``overflow`` (a scope inside another listed
        scope is left out). Pass the result as ``autocast(fn, policy,
        rules=...)``. An overflow outside any ``jax.named_scope`` cannot be
        pinned by scope: a warning names it.
        """
        rules = dict(self._meta.rules or {})
        listed = list(rules.get("float32_scopes", ()))
        if isinstance(listed, str):
            listed = [listed]
        for row in self._rows:
            if row.overflow and not row.scope:
                warnings.warn(
                    f"{row.primitive!r} ({row.phase}) overflows outside any jax.named_scope, "
                    "so no float32 scope can pin it: wrap that code in "
                    "jax.named_scope('name') and inspect again.", UserWarning, stacklevel=2)
            elif row.overflow and row.scope not in listed:
                listed.append(row.scope)
        rules["float32_scopes"] = _outermost(listed)
        return rules

    def suggest_loss_scale(self) -> float:
        """A power of two to scale the loss by for float16 gradients.

        It brings at least 99.9% of the nonzero float32 values of the backward
        pass into float16's normal range (at least ``2**-14``) without taking
        any beyond its largest value (65504). Of the powers of two that do,
        the one in the middle (in exponent) is returned, leaving room on both
        sides as gradients change during training. Where none does, the
        largest that overflows nothing is returned, with a warning. Needs an
        inspection with ``argnums`` (the backward pass); 1.0 if every gradient
        value is zero.
        """
        meta = self._meta
        if not meta.backward or meta.gradient_histogram is None:
            raise ValueError(
                "suggest_loss_scale needs the backward pass, which this report does not have: "
                "inspect with argnums=... (the positions of the arguments you differentiate, "
                "as in jax.grad), e.g. jmp_policy.inspect_numerics(loss_fn, policy, argnums=0).")
        return _loss_scale(meta.gradient_histogram, meta.gradient_max)


# --- inspect_numerics ----------------------------------------------------------------------

def inspect_numerics(
    fn: Callable[..., Any],
    policy: PolicyLike = None,
    *,
    rules: Optional[Mapping[str, Any]] = None,
    fp8: Float8Like = None,
    argnums: Argnums = None,
) -> Callable[..., NumericsReport]:
    """Returns a function that inspects ``fn``'s numerics under ``autocast(fn, policy, ...)``.

    Calling it with ``fn``'s arguments evaluates ``fn`` once in float32 (floating
    arguments widened to float32) and once as ``autocast(fn, policy,
    rules=rules, fp8=fp8)`` would, equation by equation, and returns a
    `NumericsReport` with one row per operation with floating results. Loops
    (``scan``, ``while_loop``) give one row per operation of their body, over
    all iterations. Each call signature is traced and compiled once; the
    statistics come to the host at the end of one compiled program.

    Args:
      fn: the function, as given to `jmp_policy.autocast` (``jit``-ed functions,
        Flax ``apply`` and NNX modules included).
      policy, rules, fp8: as for `jmp_policy.autocast`.
      argnums: ``None`` (the forward pass only), or an int or tuple of ints as
        in ``jax.grad``: the backward pass of ``fn``'s output, which must then
        be a scalar, with respect to the floating leaves of those positional
        arguments is inspected too.
    """
    if not callable(fn):
        raise TypeError(f"inspect_numerics expects a callable, got {fn!r}.")
    resolved = as_policy(policy)
    parsed = parse_rules(rules, higher_order_names())
    recipe = as_recipe(fp8)
    positions = _argnums(argnums)
    name = _function_name(fn)
    meta = _Meta(name, resolved.name, None if recipe is None else _recipe_name(recipe),
                 rules, positions is not None)
    cache: dict[Any, tuple[Registry, Packing, Callable[..., tuple[jax.Array, ...]]]] = {}

    @functools.wraps(fn)
    def inspect(*args: Any, **kwargs: Any) -> NumericsReport:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        dynamic = [i for i, leaf in enumerate(leaves) if _is_dynamic(leaf)]
        values = [leaves[i] for i in dynamic]
        if any(isinstance(x, Tracer) for x in values):
            raise TypeError(
                f"inspect_numerics({name}) was called with traced values: it builds its "
                "report on the host, so call it outside jax.jit, grad and vmap.")
        key = _signature(treedef, leaves, values)
        entry = cache.get(key) if key is not None else None
        if entry is None:
            wrt = _differentiated(positions, args, dynamic, values, name)
            closed = _trace(fn, leaves, treedef, dynamic, values, wrt, name)
            registry, packing = Registry(), Packing()
            program: Callable[..., tuple[jax.Array, ...]] = jax.jit(functools.partial(
                _program, closed, registry, packing, resolved, parsed, recipe, name))
            entry = (registry, packing, program)
            if key is not None:
                cache[key] = entry
        registry, packing, program = entry
        stats = unpack(jax.device_get(program(np.float32(1), *values)), packing)
        return _report(registry, stats, meta)

    return inspect


def _is_dynamic(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def _signature(treedef: Any, leaves: list[Any], values: list[Any]) -> Optional[tuple[Any, ...]]:
    """What a trace of ``fn`` depends on, or ``None`` when a static leaf is unhashable."""
    static = tuple(None if _is_dynamic(leaf) else leaf for leaf in leaves)
    key = (treedef, static, tuple(jax.typeof(x) for x in values))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _call_dtypes(policy: Policy, values: Sequence[Any]) -> tuple[Any, Any]:
    compute, output = policy.compute_dtype, policy.output_dtype
    if compute is None:  # deprecated infer policies: compute follows the first floating input
        compute = next((np.dtype(x.dtype) for x in values if is_floating(x)), F32)
    return np.dtype(compute), np.dtype(compute if output is None else output)


def _function_name(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__name__", None)
    return name if isinstance(name, str) else repr(fn)


def _argnums(argnums: Argnums) -> Optional[tuple[int, ...]]:
    if argnums is None:
        return None
    try:
        numbers = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    except TypeError:
        numbers = ()
    if not numbers or not all(isinstance(a, int) and not isinstance(a, bool) for a in numbers):
        raise TypeError(
            "inspect_numerics argnums must be None, an int or a non-empty tuple of ints (the "
            f"positions of the arguments to differentiate, as in jax.grad); got {argnums!r}.")
    return numbers


def _differentiated(positions: Optional[tuple[int, ...]], args: tuple[Any, ...],
                    dynamic: list[int], values: list[Any], name: str) -> Optional[list[int]]:
    """The indices in ``values`` of the floating leaves of the arguments at ``positions``."""
    if positions is None:
        return None
    n = len(args)
    bad = [a for a in positions if not -n <= a < n]
    if bad:
        raise ValueError(
            f"inspect_numerics argnums={positions!r}, but {name} was called with {n} positional "
            f"argument(s): argnums counts positional arguments from 0 (keyword arguments "
            "cannot be differentiated).")
    starts = np.cumsum([0] + [len(jax.tree_util.tree_leaves(a)) for a in args])
    wanted = {i for a in sorted({a % n for a in positions})
              for i in range(int(starts[a]), int(starts[a + 1]))}
    where = {leaf: k for k, leaf in enumerate(dynamic)}
    wrt = [where[i] for i in sorted(wanted) if i in where and is_floating(values[where[i]])]
    for a in sorted({a % n for a in positions}):
        if not any(int(starts[a]) <= dynamic[k] < int(starts[a + 1]) for k in wrt):
            raise ValueError(
                f"inspect_numerics argnums includes {a}, but argument {a} of {name} has no "
                "floating-point arrays to differentiate.")
    return wrt


def _trace(fn: Callable[..., Any], leaves: list[Any], treedef: Any, dynamic: list[int],
           values: list[Any], wrt: Optional[list[int]], name: str) -> ClosedJaxpr:
    """The jaxpr to inspect: ``fn`` of its dynamic leaves, or ``fn`` and its gradient."""
    def call(*values: Any) -> Any:
        full = list(leaves)
        for i, v in zip(dynamic, values):
            full[i] = v
        args, kwargs = jax.tree_util.tree_unflatten(treedef, full)
        return fn(*args, **kwargs)

    closed: ClosedJaxpr = jax.make_jaxpr(
        lambda *v: jax.tree_util.tree_leaves(call(*v)))(*values)
    if wrt is None:
        return closed
    _check_scalar(closed.out_avals, name)
    # The gradient is taken of the jaxpr, so that fn is traced once.
    forward = jaxpr_as_fun(closed)

    def value_and_grad(*values: Any) -> list[Any]:
        def of_wrt(*diff: Any) -> Any:
            full = list(values)
            for k, v in zip(wrt, diff):
                full[k] = v
            (out,) = forward(*full)
            return out

        out, grads = jax.value_and_grad(of_wrt, argnums=tuple(range(len(wrt))))(
            *[values[k] for k in wrt])
        return [out, *grads]

    gradient: ClosedJaxpr = jax.make_jaxpr(value_and_grad)(*values)
    return gradient


def _check_scalar(leaves: Sequence[Any], name: str) -> None:
    if len(leaves) == 1 and leaves[0].shape == () and is_floating_dtype(leaves[0].dtype):
        return
    got = (f"{len(leaves)} values" if len(leaves) != 1
           else f"{leaves[0].dtype}{list(leaves[0].shape)}")
    raise ValueError(
        f"inspect_numerics(..., argnums=...) inspects the backward pass of {name}'s output, "
        f"which must be one floating-point scalar (a loss); {name} returned {got}. Inspect "
        "the loss function, or leave argnums out to inspect the forward pass only.")


def _program(closed: ClosedJaxpr, registry: Registry, packing: Packing, policy: Policy,
             rules: Rules, recipe: Optional[Float8Recipe], name: str, one: jax.Array,
             *values: Any) -> tuple[jax.Array, ...]:
    """The inspection: ``closed`` evaluated under autocast and in float32, in lockstep,
    returning the statistics only (packed into a few arrays, see ``packing``)."""
    compute, _ = _call_dtypes(policy, values)
    low = Context(compute, rules, matmul if recipe is None else float8_matmul(recipe))
    ref = Context(join(compute, F32), rules, matmul)
    sink = evaluate(registry, recipe, low, ref, closed, values, one)
    for scope, near in low.unmatched_scopes():
        hint = f" Did you mean {' or '.join(map(repr, near))}?" if near else ""
        warnings.warn(
            f"rules['float32_scopes'] entry {scope!r} matched no operation of {name}.{hint}",
            UnmatchedRuleWarning, stacklevel=2)
    return pack(sink, packing)


def _recipe_name(recipe: Float8Recipe) -> str:
    return recipe.scaling if recipe == Float8Recipe(recipe.scaling) else repr(recipe)


# --- Building the report -------------------------------------------------------------------

def _report(registry: Registry, stats: dict[int, dict[str, Any]], meta: _Meta) -> NumericsReport:
    rows = []
    for number, info in enumerate(registry.rows):
        lo = stats.get(number)
        if lo is None or int(lo["size"]) == 0:  # not run: an untaken branch, an empty loop
            continue
        f32_min = float(lo["f32_min"])
        rows.append(NumericsRow(
            scope=display_scope(info.path), primitive=info.primitive,
            phase=phase_of(info.path), dtype=info.dtype,
            max_abs=float(lo["max_abs"]), overflow=int(lo["overflow"]),
            underflow=_fraction(lo["underflow"], lo["nonzero"]),
            subnormal=_fraction(lo["subnormal"], lo["size"]),
            rel_error=_relative(float(lo["err_sq"]), float(lo["ref_sq"])),
            size=int(lo["size"]),
            float32_min=f32_min if math.isfinite(f32_min) else None,
            float32_max=float(lo["f32_max"]),
            fp8_saturated=int(lo["fp8_saturated"]) if info.fp8 else None,
            fp8_flushed=int(lo["fp8_flushed"]) if info.fp8 else None))
    if meta.backward:
        hist = stats.get(HISTOGRAM, {}).get("hist")
        top = max((r.float32_max for r in rows if r.phase == "backward"
                   and r.primitive not in VALUE_PRESERVING), default=0.0)
        meta = dataclasses.replace(
            meta, gradient_histogram=np.zeros(256, np.int64) if hist is None else np.asarray(hist),
            gradient_max=top)
    return NumericsReport(rows, meta)


def _fraction(part: Any, whole: Any) -> float:
    return float(part) / float(whole) if float(whole) else 0.0


def _relative(err_sq: float, ref_sq: float) -> float:
    if ref_sq > 0:
        return math.sqrt(err_sq / ref_sq)
    return 0.0 if err_sq == 0 else math.inf


def _finite_or_null(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite_or_null(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite_or_null(v) for v in x]
    return x


def _outermost(scopes: list[str]) -> list[str]:
    """``scopes`` without those that a shorter one already pins (``a/b`` pins ``a/b/c``)."""
    def inside(scope: str, other: str) -> bool:
        parts, run = scope.split("/"), other.split("/")
        return len(run) < len(parts) and any(
            parts[i:i + len(run)] == run for i in range(len(parts) - len(run) + 1))

    return [s for s in scopes if not any(inside(s, o) for o in scopes if o != s)]


def _loss_scale(histogram: np.ndarray[Any, Any], top: float) -> float:
    """The loss scale of `NumericsReport.suggest_loss_scale` from a gradient histogram.

    Bin ``e`` counts magnitudes in ``[2**(e - 127), 2**(e - 126))``; scaled by
    ``2**k`` they are float16 normals when ``e - 127 + k >= -14``.

    >>> hist = np.zeros(256, np.int64); hist[127 - 30] = 1000   # values near 2**-30
    >>> _loss_scale(hist, 2.0**-29) == 2.0**((16 + 44) // 2)
    True
    """
    counts = np.asarray(histogram, np.int64)
    total = int(counts.sum())
    if total == 0 or top <= 0:
        return 1.0
    at_or_above = np.cumsum(counts[::-1])[::-1]  # at_or_above[e]: values in bins >= e
    lowest = max(e for e in range(counts.size) if at_or_above[e] >= _NORMAL_SHARE * total)
    smallest = math.ceil(math.log2(float(_F16.tiny))) + 127 - lowest  # k_min
    largest = math.floor(math.log2(float(_F16.max) / top))
    if smallest > largest:
        share = at_or_above[max(0, min(counts.size - 1, 113 - largest))] / total
        warnings.warn(
            f"No power of two brings {_NORMAL_SHARE:.1%} of the gradient values into float16's "
            f"normal range without overflowing the largest ({top:.3g}): 2**{largest} brings "
            f"{share:.2%}. Consider bfloat16, or float32 scopes for the widest layers.",
            UserWarning, stacklevel=3)
        return 2.0 ** max(-126, largest)
    return 2.0 ** min(126, max(-126, (smallest + largest) // 2))


# --- The table -----------------------------------------------------------------------------

_COLUMNS = ("scope", "primitive", "phase", "dtype", "max_abs", "overflow", "underflow",
            "subnormal", "rel_error")
_FP8_COLUMNS = ("fp8_saturated", "fp8_flushed")


def _title(meta: _Meta) -> str:
    fp8 = f", fp8={meta.fp8}" if meta.fp8 else ""
    return f"{meta.name} under {meta.policy}{fp8}"


def _table(rows: Sequence[NumericsRow], meta: _Meta) -> str:
    columns = _COLUMNS + (_FP8_COLUMNS if any(r.fp8_saturated is not None for r in rows) else ())
    cells = [[_cell(getattr(r, c)) if c != "scope" else (r.scope or "-") for c in columns]
             for r in rows]
    widths = [max([len(c)] + [len(line[i]) for line in cells]) for i, c in enumerate(columns)]
    text = [" | ".join(c.ljust(w) if i < 4 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(line, widths)))
            for line in [list(columns)] + cells]
    overflow = sum(1 for r in rows if r.overflow)
    underflow = sum(1 for r in rows if r.underflow)
    head = (f"Numerics of {_title(meta)}: {len(rows)} rows, {overflow} overflowing, "
            f"{underflow} underflowing")
    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([head, text[0], rule, *text[1:]])


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return str(value)
    if value == 0:
        return "0"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.3g}"


# --- Ranges for the plot -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ScopeRange:
    """The float32 dynamic range of one scope in one phase, for `NumericsReport.plot`."""

    label: str
    smallest: float
    largest: float
    phase: Phase
    overflow: bool


def _scope_ranges(rows: Sequence[NumericsRow]) -> list[ScopeRange]:
    ranges: dict[tuple[str, Phase], ScopeRange] = {}
    for r in rows:
        if r.float32_min is None:
            continue
        key = (r.scope or "(no scope)", r.phase)
        old = ranges.get(key)
        if old is None:
            ranges[key] = ScopeRange(key[0], r.float32_min, r.float32_max, r.phase,
                                     r.overflow > 0)
        else:
            ranges[key] = ScopeRange(key[0], min(old.smallest, r.float32_min),
                                     max(old.largest, r.float32_max), r.phase,
                                     old.overflow or r.overflow > 0)
    return list(ranges.values())

"""`inspect_numerics` and its `NumericsReport`: which operations overflow, underflow or lose
precision, and where.

``inspect_numerics(fn, policy)`` runs ``autocast(fn, policy)`` (with
``argnums``, its backward pass too) and observes every operation it computes
below float32 precision: each result is compared with the same operation
evaluated in float32 on the same inputs. The `NumericsReport` holds one
`NumericsRow` per such operation (and call site), named by its
``jax.named_scope`` or module path, so Flax and Equinox module paths
(``Block_0/Dense_1``) appear. With ``argnums``, the report also suggests a
loss scale from the values the backward pass holds in float16.

An overflow shows at the operation that makes it (a cast to float16, a
half-precision product), where `NumericsReport.suggest_rules` pins it to
float32; the operations downstream receive its inf and are not counted again.

>>> import jax, jax.numpy as jnp, jmp_policy
>>> def layer(x, w):
...     with jax.named_scope("boom"):       # inputs beyond float16's 65504
...         return jnp.tanh((x * 1000.0) @ w)
>>> report = jmp_policy.inspect_numerics(layer, "mixed_float16")(
...     jnp.full((2, 3), 100.0), jnp.ones((3, 4)))
>>> row = report.worst(1)[0]
>>> row.scope, row.primitive, row.phase, row.dtype, row.overflow
('boom', 'convert_element_type', 'forward', 'float16', 6)
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
    Any, Callable, Iterator, Literal, Mapping, Optional, Self, Sequence, TypeVar, Union,
    overload)

import jax
import numpy as np
from jax.core import Tracer
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn

from jmp_policy import formats
from jmp_policy.autocast import modules as _modules
from jmp_policy.autocast import autocast
from jmp_policy.autocast.modules import Call
from jmp_policy.float8 import (
    NO_LAYERS, SCALINGS, Float8Like, Float8Recipe, KeptLayers, as_recipe, eligible,
    products, why_not_float8)
from jmp_policy.inspector._observer import (
    HostSink, Observer, Registry, dead_equations, observe, rel_error)
from jmp_policy.autocast.interpreter import compute_dtype, higher_order_names
from jmp_policy.dtypes import is_floating
from jmp_policy.jaxprs import Kept
from jmp_policy.autocast.rules import MATMUL_PRIMITIVES, parse_rules
from jmp_policy.paths import display_scope, is_backward
from jmp_policy.policy import Policy, PolicyLike, as_policy

Phase = Literal["forward", "backward"]
Argnums = Union[None, int, Sequence[int]]

# Loss scales are sized for float16, the format whose range gradients fall out of.
_F16 = formats.facts_of(np.float16)
_NORMAL_SHARE = 0.999


# --- Rows and reports ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class NumericsRow:
    """One operation of autocast's program below float32: its result against float32.

    The operation's result in autocast's program is compared with the same
    operation evaluated in float32 on the same inputs, so a row shows what the
    operation itself loses. Inside a loop body (``scan``, ``while_loop``), one
    row holds all the iterations of its operation.

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
      float32_min: the smallest nonzero magnitude of the float32 result
        (``None`` if all zero).
      float32_max: the largest finite magnitude of the float32 result.
      fp8_saturated: for a float8 product, how many operand values saturate
        (are beyond the float8 format after scaling, inf and NaN included): the
        overflows of the casts to float8 that made its operands; ``None`` for
        other operations. A block-scaled product (``fp8="mxfp8"``, ``"nvfp4"``)
        is one too, its ``dtype`` the format of its values
        (``"float4_e2m1fn"`` for NVFP4): NVFP4 saturates the values that its
        block scale, rounded to a ``float8_e4m3fn`` value, takes to 7 or
        beyond, where rounding would no longer give e2m1's largest value, 6
        (blocks whose scales fall among e4m3's subnormals); MXFP8's scales
        round up, and saturate nothing. The ranges of its operands' scales
        are rows of their own, scopes ``.../block_scales`` and (NVFP4's
        per-tensor scales) ``.../tensor_scales``: ``max_abs`` the largest,
        ``float32_min`` the smallest nonzero.
      fp8_flushed: for a float8 product, how many nonzero operand values
        become zero in float8 (those casts' underflows); ``None`` for other
        operations.
      shapes: the shapes of its floating operands (``"16x64, 64x64"``), which
        tell apart operations of one primitive in one scope.
      index: how many rows of the same scope, primitive, phase and shapes come
        before it in program order (the query's and the key's products of an
        attention layer: 0 and 1); the table shows it as ``dot_general#1``.
      why_not_fp8: for a matrix product that an inspection with ``fp8`` ran in
        the compute dtype, why the recipe kept it out of float8, as
        ``jmp_policy.float8.why_not_float8`` says (a scope it excludes, a size
        below its ``min_size``, a layer its ``high_precision_layers`` keeps);
        ``None`` for other rows.
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
    shapes: str = ""
    index: int = 0
    why_not_fp8: Optional[str] = None


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


RowT = TypeVar("RowT")


class Rows(SequenceABC[RowT]):
    """A report's rows as a sequence (``len``, iteration, indexing); a slice is a report
    of the same kind and ``meta``, what the report keeps besides its rows."""

    def __init__(self, rows: Sequence[RowT], meta: Any):
        self._rows = tuple(rows)
        self._meta = meta

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, index: int) -> RowT: ...

    @overload
    def __getitem__(self, index: slice) -> Self: ...

    def __getitem__(self, index: Union[int, slice]) -> Union[RowT, Self]:
        if isinstance(index, slice):
            return type(self)(self._rows[index], self._meta)
        return self._rows[index]

    def __iter__(self) -> Iterator[RowT]:
        return iter(self._rows)


class NumericsReport(Rows[NumericsRow]):
    """The rows of an inspection (see `inspect_numerics`), with what to do about them.

    A report is a sequence of `NumericsRow` in program order (``report[0]``,
    ``len(report)``, ``for row in report``); `worst` and slicing give reports
    of fewer rows. ``str(report)`` is a table of its rows that ends with the
    next step: the ``autocast`` call with `suggest_rules` and, where the
    backward pass holds values in float16, `suggest_loss_scale`.

    >>> import jax, jax.numpy as jnp, jmp_policy
    >>> def layer(x, w):
    ...     with jax.named_scope("boom"):
    ...         return (x * 1000.0) @ w
    >>> report = jmp_policy.inspect_numerics(layer, "mixed_float16")(
    ...     jnp.full((2, 3), 100.0), jnp.ones((3, 4)))
    >>> str(report).splitlines()[-1]
    "Next: autocast(layer, 'mixed_float16', rules={'float32_scopes': ['boom']})"
    """

    _meta: _Meta

    @property
    def rows(self) -> list[NumericsRow]:
        """The rows, one per operation with floating results, in program order."""
        return list(self._rows)

    def worst(self, n: int = 10) -> NumericsReport:
        """The ``n`` riskiest rows: most overflow first, then most underflow, then
        largest ``rel_error`` (program order among equals)."""
        ranked = sorted(self._rows, key=lambda r: (-r.overflow, -r.underflow, -r.rel_error))
        return NumericsReport(ranked[:n], self._meta)

    def __str__(self) -> str:
        """The rows as a table, then the next step: the ``autocast`` call with the
        suggested rules and, with a backward pass in float16, the loss scale."""
        return "\n".join([_table(self._rows, self._meta), *_next_step(self._rows, self._meta)])

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
        against the ranges of float16, bfloat16, float8_e4m3fn, float8_e5m2 and
        float4_e2m1fn (NVFP4's values; normal range solid, subnormals lighter): a bar that leaves a format's
        range shows a scope that overflows or underflows in it. Scopes with
        overflowing operations are drawn in red. Needs matplotlib.
        """
        from jmp_policy.inspector._plot import plot_ranges, scope_ranges

        plot_ranges(scope_ranges(self._rows), path, title=_title(self._meta))

    def suggest_rules(self) -> dict[str, Any]:
        """Autocast ``rules`` that keep the scopes of overflowing operations in float32.

        The inspection's own ``rules`` are kept; their ``"float32_scopes"`` gain
        the scope of every row with ``overflow`` (a scope inside another listed
        scope is left out). Pass the result as ``autocast(fn, policy,
        rules=...)``. An overflow outside any ``jax.named_scope`` cannot be
        pinned by scope: a warning names it.
        """
        rules, unscoped = _suggested_rules(self._rows, self._meta)
        for row in unscoped:
            warnings.warn(
                f"{row.primitive!r} ({row.phase}) overflows outside any jax.named_scope, "
                "so no float32 scope can pin it: wrap that code in "
                "jax.named_scope('name') and inspect again.", UserWarning, stacklevel=2)
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

    Calling it with ``fn``'s arguments runs ``autocast(fn, policy, rules=rules,
    fp8=fp8)`` on them, as training traces it, and returns a `NumericsReport`
    with one row per operation that it computes below float32 precision (casts,
    half-precision and float8 products, operations on half-precision values),
    each compared with the same operation in float32 on the same inputs. Loops
    (``scan``, ``while_loop``) give one row per operation of their body, over all
    iterations. Each call traces and compiles one program, whose statistics
    reach the host by callbacks.

    Args:
      fn: the function, as given to `jmp_policy.autocast` (``jit``-ed functions,
        Flax ``apply`` and NNX modules included).
      policy, rules, fp8: as for `jmp_policy.autocast`.
      argnums: ``None`` (the forward pass only), or an int or tuple of ints as in
        ``jax.grad``: the backward pass of ``fn``'s output (then a scalar) with
        respect to the floating leaves of those positional arguments too.

    >>> import jax.numpy as jnp, jmp_policy
    >>> loss = lambda w, x: jnp.sum(x @ w)
    >>> report = jmp_policy.inspect_numerics(loss, "mixed_float16", argnums=0)(
    ...     jnp.ones((3, 4)), jnp.ones((2, 3)))
    >>> sorted({row.phase for row in report})
    ['backward', 'forward']
    """
    if not callable(fn):
        raise TypeError(f"inspect_numerics expects a callable, got {fn!r}.")
    resolved = as_policy(policy)
    parse_rules(rules, higher_order_names())  # bad rules are an error now, not at the call
    recipe = _current_recipe(fp8)
    positions = _argnums(argnums)
    name = _function_name(fn)
    meta = _Meta(name, resolved.name, None if recipe is None else _recipe_name(recipe),
                 rules, positions is not None)
    programs = Kept[_Program](_PROGRAMS)

    @functools.wraps(fn)
    def inspect(*args: Any, **kwargs: Any) -> NumericsReport:
        call = _untraced(Call.of(fn, args, kwargs), name)
        wrt = _differentiated(positions, args, call, name)
        closed = _program_jaxpr(call, wrt, resolved, rules, recipe, name)
        compute = compute_dtype(resolved, call.values)
        program = programs.get(closed.jaxpr, compute, lambda: _Program.of(closed.jaxpr, compute))

        def run(scale: float) -> HostSink:
            return program.run(closed.consts, call.values, scale)

        first = run(1.0)
        gradients = _gradients(program.registry, first, run) if wrt is not None else None
        return _report(program.registry, first, meta, gradients, _reasons(recipe, call, rules))

    return inspect


def _untraced(call: Call, name: str) -> Call:
    """``call``, whose values must be arrays, not tracers: the report is made on the host."""
    if any(isinstance(x, Tracer) for x in call.values):
        raise TypeError(
            f"inspect_numerics({name}) was called with traced values: it builds its "
            "report on the host, so call it outside jax.jit, grad and vmap.")
    return call


def _current_recipe(fp8: Float8Like) -> Optional[Float8Recipe]:
    """``fp8`` as a recipe, which must scale currently: one inspected call has no history."""
    recipe = as_recipe(fp8)
    if recipe is not None and recipe.delayed:
        raise ValueError(
            "inspect_numerics cannot take a delayed-scaling Float8Recipe: its scales depend "
            "on amax histories of earlier steps, which one inspected call does not have. "
            "Inspect with fp8='tensorwise' (the same formats, scaled by the values' own "
            "maxima, which a settled history approaches).")
    return recipe


_PROGRAMS = 4  # compiled inspections kept per inspect_numerics function, the oldest dropped


@dataclasses.dataclass
class _Program:
    """The compiled inspection of one traced jaxpr, and the rows its trace numbered."""

    registry: Registry
    sinks: list[HostSink]  # where the run in progress delivers its statistics
    program: Callable[..., Any]

    @classmethod
    def of(cls, jaxpr: Jaxpr, compute: Any) -> _Program:
        registry, sinks = Registry(), list[HostSink]()
        observer = Observer(registry, compute, lambda: sinks[-1], dead_equations(jaxpr))

        def program(consts: Sequence[Any], *values: Any) -> None:
            # The statistics leave by callbacks; the function's outputs are not returned.
            # Returned, a product could be the program's root, which XLA:GPU's Triton GEMM
            # fusion pass fails to compile when the product also feeds a callback (an
            # XLA bug: tests/test_xla_gpu.py::test_the_inspector_compiles_with_its_callbacks).
            observe(observer, jaxpr, consts, values)

        return cls(registry, sinks, jax.jit(program))

    def run(self, consts: Sequence[Any], values: Sequence[Any], scale: float) -> HostSink:
        """Runs the program with the loss scale ``scale``; returns its statistics."""
        self.sinks.append(HostSink(scale))
        try:
            self.program(list(consts), np.float32(scale), *values)
            jax.effects_barrier()  # type: ignore[no-untyped-call]  # every callback delivered
            return self.sinks[-1]
        finally:
            self.sinks.pop()


# Runs of the inspection at other loss scales, to measure gradients that the unscaled run
# flushes to zero (or takes beyond float16) before the values downstream of them.
_SCALE_RUNS = 4


def _gradients(registry: Registry, first: HostSink,
               run: Callable[[float], HostSink]) -> tuple[np.ndarray[Any, Any], float]:
    """The histogram and largest magnitude of the backward pass's float16-held values.

    The backward pass is linear in the loss's cotangent, which the program takes as its
    loss scale: a run at a scale that brings the values one run measured into range
    measures those downstream of them too. Runs go on until the suggested scale is the
    one they ran at.
    """
    sink = first
    for _ in range(_SCALE_RUNS):
        hist, top = sink.histogram, _gradient_max(registry, sink)
        scale = _loss_scale(hist, top, warn=False)
        if scale == sink.scale or not hist.any():
            break
        sink = run(scale)
    return sink.histogram, _gradient_max(registry, sink)


def _gradient_max(registry: Registry, sink: HostSink) -> float:
    top: float = max((s["f32_max"] if "f32_max" in s else s["max_abs"]
                      for n, s in sink.stats.items() if registry.rows[n].gradient), default=0.0)
    return top / sink.scale


def _function_name(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__name__", None)
    return name if isinstance(name, str) else repr(fn)


def _argnums(argnums: Argnums, caller: str = "inspect_numerics",
             optional: bool = True) -> Optional[tuple[int, ...]]:
    """``argnums`` as a tuple; ``None`` stays ``None`` where ``optional`` (the forward
    pass only)."""
    if argnums is None and optional:
        return None
    try:
        numbers = (argnums,) if isinstance(argnums, int) else tuple(argnums)  # type: ignore[arg-type]
    except TypeError:
        numbers = ()
    if not numbers or not all(isinstance(a, int) and not isinstance(a, bool) for a in numbers):
        raise TypeError(
            f"{caller} argnums must be {'None, ' if optional else ''}an int or a non-empty "
            "tuple of ints (the positions of the arguments to differentiate, as in "
            f"jax.grad); got {argnums!r}.")
    return numbers


def _differentiated(positions: Optional[tuple[int, ...]], args: Sequence[Any], call: Call,
                    name: str, caller: str = "inspect_numerics") -> Optional[list[int]]:
    """The indices in ``call.values`` of the floating arrays of the arguments at ``positions``."""
    if positions is None:
        return None
    n = len(args)
    bad = [a for a in positions if not -n <= a < n]
    if bad:
        raise ValueError(
            f"{caller} argnums={positions!r}, but {name} was called with {n} positional "
            f"argument(s): argnums counts positional arguments from 0 (keyword arguments "
            "cannot be differentiated).")
    wrt = []
    for a in sorted({a % n for a in positions}):
        found = [k for k in call.dynamic_in(a) if is_floating(call.values[k])]
        if not found:
            raise ValueError(
                f"{caller} argnums includes {a}, but argument {a} of {name} has no "
                "floating-point arrays to differentiate.")
        wrt.extend(found)
    return sorted(wrt)


def _program_jaxpr(call: Call, wrt: Optional[list[int]], policy: Policy,
                   rules: Optional[Mapping[str, Any]], recipe: Optional[Float8Recipe],
                   name: str) -> ClosedJaxpr:
    """The program to inspect: ``autocast(fn)``, or its value and gradients, as a jaxpr of a
    loss scale and the call's traced values, exactly as training traces it.

    The gradients are a vector-Jacobian product with the loss scale as the cotangent: the
    backward pass of ``jax.grad`` scaled, without an operation of its own.
    """
    def forward(*values: Any) -> Any:
        callee, args, kwargs, _ = call.rebuild(values)  # NNX objects: copies
        return autocast(_modules.as_callable(callee), policy, rules=rules, fp8=recipe)(
            *args, **kwargs)

    if wrt is None:
        return jax.make_jaxpr(lambda _, *v: jax.tree_util.tree_leaves(forward(*v)))(
            np.float32(1), *call.values)

    def value_and_grad(scale: Any, *values: Any) -> list[Any]:
        def of_wrt(*diff: Any) -> Any:
            full = list(values)
            for k, v in zip(wrt, diff):
                full[k] = v
            return _scalar(forward(*full), name)

        out, vjp = jax.vjp(of_wrt, *[values[k] for k in wrt])
        return [out, *vjp(scale.astype(out.dtype))]

    closed: ClosedJaxpr = jax.make_jaxpr(value_and_grad)(np.float32(1), *call.values)
    return closed


def _scalar(out: Any, name: str) -> Any:
    leaves = jax.tree_util.tree_leaves(out)
    if len(leaves) == 1 and np.shape(leaves[0]) == () and is_floating(leaves[0]):
        return leaves[0]
    got = (f"{len(leaves)} values" if len(leaves) != 1
           else f"{leaves[0].dtype}{list(np.shape(leaves[0]))}")
    raise ValueError(
        f"inspect_numerics(..., argnums=...) inspects the backward pass of {name}'s output, "
        f"which must be one floating-point scalar (a loss); {name} returned {got}. Inspect "
        "the loss function, or leave argnums out to inspect the forward pass only.")


Reasons = Callable[[JaxprEqn, str], Optional[str]]
"""Why a product (equation, scope path) of the inspected program is not in float8."""


def _reasons(recipe: Optional[Float8Recipe], call: Call,
             rules: Optional[Mapping[str, Any]]) -> Optional[Reasons]:
    """Why the recipe keeps a product out of float8, as autocast decided it for ``call``:
    the layers ``high_precision_layers`` keeps are those of ``fn``'s own products."""
    if recipe is None:
        return None
    layers = NO_LAYERS
    if any(recipe.high_precision_layers):
        pinned = parse_rules(rules, higher_order_names()).scopes_in
        layers = KeptLayers.of(recipe.high_precision_layers, [
            p.unrolled for p in products(call.trace())
            if not pinned(p.scope) and eligible(recipe, p.eqn, p.scope)])

    def reason(eqn: JaxprEqn, path: str) -> Optional[str]:
        return why_not_float8(recipe, eqn, path, layers)

    return reason


def _recipe_name(recipe: Float8Recipe) -> str:
    return recipe.scaling if recipe == Float8Recipe(recipe.scaling) else repr(recipe)


# --- Building the report -------------------------------------------------------------------

def _report(registry: Registry, sink: HostSink, meta: _Meta,
            gradients: Optional[tuple[np.ndarray[Any, Any], float]],
            reasons: Optional[Reasons] = None) -> NumericsReport:
    rows: list[NumericsRow] = []
    seen: dict[tuple[str, str, str, str], int] = {}
    for number, info in enumerate(registry.rows):
        lo = sink.stats.get(number)
        if lo is None or lo["size"] == 0:  # not run: an untaken branch, an empty loop
            continue
        casts = [sink.stats.get(n, {}) for n in registry.fp8_casts.get(number, ())]
        lo = {**_EXACT, "f32_max": lo["max_abs"], **lo}
        rows.append(NumericsRow(
            scope=display_scope(info.path), primitive=info.primitive,
            phase="backward" if is_backward(info.path) else "forward", dtype=info.dtype,
            max_abs=lo["max_abs"], overflow=int(lo["overflow"]),
            underflow=_fraction(lo["underflow"], lo["nonzero"]),
            subnormal=_fraction(lo["subnormal"], lo["size"]),
            rel_error=rel_error(lo),
            size=int(lo["size"]),
            float32_min=lo["f32_min"] if math.isfinite(lo["f32_min"]) else None,
            float32_max=lo["f32_max"],
            fp8_saturated=sum(int(c.get("overflow", 0)) + int(c.get("saturated", 0))
                              for c in casts) if info.fp8 else None,
            fp8_flushed=sum(int(c.get("underflow", 0)) for c in casts) if info.fp8 else None,
            shapes=info.shapes,
            why_not_fp8=reasons(registry.eqn(number), info.path)
            if reasons is not None and not info.fp8 and info.primitive in MATMUL_PRIMITIVES
            else None))
        same = (rows[-1].scope, rows[-1].primitive, rows[-1].phase, rows[-1].shapes)
        rows[-1] = dataclasses.replace(rows[-1], index=seen.get(same, 0))
        seen[same] = seen.get(same, 0) + 1
    if gradients is not None:
        meta = dataclasses.replace(meta, gradient_histogram=gradients[0],
                                   gradient_max=gradients[1])
    return NumericsReport(rows, meta)


# The statistics of a result that is its own float32 evaluation (see `Result`).
_EXACT = {"overflow": 0, "underflow": 0, "nonzero": 0}


def _fraction(part: Any, whole: Any) -> float:
    return float(part) / float(whole) if float(whole) else 0.0


def _finite_or_null(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite_or_null(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite_or_null(v) for v in x]
    return x


def _suggested_rules(rows: Sequence[NumericsRow],
                     meta: _Meta) -> tuple[dict[str, Any], list[NumericsRow]]:
    """`NumericsReport.suggest_rules` of ``rows``, and the overflowing rows outside any
    scope, which no rule can pin."""
    rules = dict(meta.rules or {})
    listed = list(rules.get("float32_scopes", ()))
    if isinstance(listed, str):
        listed = [listed]
    unscoped = []
    for row in rows:
        if row.overflow and not row.scope:
            unscoped.append(row)
        elif row.overflow and row.scope not in listed:
            listed.append(row.scope)
    rules["float32_scopes"] = _outermost(listed)
    return rules, unscoped


def _next_step(rows: Sequence[NumericsRow], meta: _Meta) -> list[str]:
    """The lines that end a printed report: the ``autocast`` call to make next, with the
    suggested rules and, where the backward pass holds values in float16, the loss scale
    to train with."""
    rules, unscoped = _suggested_rules(rows, meta)
    args = [meta.name, repr(meta.policy)]
    if rules["float32_scopes"] or len(rules) > 1:
        args.append(f"rules={rules!r}")
    if meta.fp8 is not None:
        args.append(f"fp8={meta.fp8!r}" if meta.fp8 in SCALINGS else f"fp8={meta.fp8}")
    lines = [f"Next: autocast({', '.join(args)})"]
    lines += [f"      {row.primitive} ({row.phase}) overflows outside any jax.named_scope: "
              "wrap it in one to pin it" for row in unscoped]
    histogram = meta.gradient_histogram
    if meta.backward and histogram is not None and histogram.any():
        scale = _loss_scale(histogram, meta.gradient_max, warn=False)
        lines.append(f"      with the loss scaled by 2**{int(math.log2(scale))} = {scale:g} "
                     "(NumericsReport.suggest_loss_scale)")
    return lines


def _outermost(scopes: list[str]) -> list[str]:
    """``scopes`` without those that a shorter one already pins (``a/b`` pins ``a/b/c``)."""
    def inside(scope: str, other: str) -> bool:
        parts, run = scope.split("/"), other.split("/")
        return len(run) < len(parts) and any(
            parts[i:i + len(run)] == run for i in range(len(parts) - len(run) + 1))

    return [s for s in scopes if not any(inside(s, o) for o in scopes if o != s)]


def _loss_scale(histogram: np.ndarray[Any, Any], top: float, warn: bool = True) -> float:
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
    smallest = _F16.min_exponent + 127 - lowest  # k_min
    largest = math.floor(math.log2(float(_F16.max) / top))
    if smallest > largest and not warn:
        return 2.0 ** max(-126, largest)
    if smallest > largest:
        # Bin e holds 2**(e - 127): scaled by 2**largest, float16 normals from bin
        # 127 + min_exponent - largest.
        normal = 127 + _F16.min_exponent - largest
        share = at_or_above[max(0, min(counts.size - 1, normal))] / total
        warnings.warn(
            f"No power of two brings {_NORMAL_SHARE:.1%} of the gradient values into float16's "
            f"normal range without overflowing the largest ({top:.3g}): 2**{largest} brings "
            f"{share:.2%}. Consider bfloat16, or float32 scopes for the widest layers.",
            UserWarning, stacklevel=3)
        return 2.0 ** max(-126, largest)
    return 2.0 ** min(126, max(-126, (smallest + largest) // 2))


# --- The table -----------------------------------------------------------------------------

_COLUMNS = ("scope", "primitive", "phase", "dtype", "shapes", "max_abs", "overflow",
            "underflow", "subnormal", "rel_error")
_LEFT = 5  # the columns that name a row are aligned left, the figures right
_FP8_COLUMNS = ("fp8_saturated", "fp8_flushed")


def _title(meta: _Meta) -> str:
    fp8 = f", fp8={meta.fp8}" if meta.fp8 else ""
    return f"{meta.name} under {meta.policy}{fp8}"


def _table(rows: Sequence[NumericsRow], meta: _Meta) -> str:
    columns = _COLUMNS + (_FP8_COLUMNS if any(r.fp8_saturated is not None for r in rows) else ())
    cells = [[_cell(getattr(r, c)) if c not in ("scope", "shapes") else (getattr(r, c) or "-")
              for c in columns] for r in rows]
    for line, r in zip(cells, rows):
        if r.index:
            line[1] += f"#{r.index}"
    widths = [max([len(c)] + [len(line[i]) for line in cells]) for i, c in enumerate(columns)]
    text = [" | ".join(c.ljust(w) if i < _LEFT else c.rjust(w)
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

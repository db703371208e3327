"""Statistics of every equation of a jaxpr under autocast against float32, in one program.

The numerics inspector (``jmp_policy.inspect_numerics``) needs, for each
equation of a function, how its low-precision result compares with float32.
`Walk` evaluates a jaxpr in lockstep: every variable holds a *pair*, its value
as autocast computes it and its value in a float32 evaluation, and every
first-order equation is evaluated on both sides through autocast's own
`eval_equation` (with the autocast context on one side, a float32 one on the
other), so it runs exactly as autocast runs it.

Each equation that autocast does not run in float32 (matrix products, and
operations on half-precision values) is then *probed*: evaluated as autocast
runs it on the float32 evaluation's inputs, at the dtypes autocast gives them,
and compared with the float32 result. So every row shows what its equation
itself loses: an overflow or a flush to zero upstream neither hides one here
(as comparing autocast's own values would: inf in, inf out) nor repeats here.
Autocast's side gives the dtypes (XLA drops its values, which nothing uses);
the float32 side gives each result's range and, in the backward pass, the
gradient magnitudes that a loss scale must bring into range.

Statistics stay traced values: one variadic reduction for the results of the
same shape of a body computes them all, and they leave the program as its
outputs (`pack`), so nothing goes to the host per equation. Higher-order
primitives keep their rows: calls, ``checkpoint`` and custom derivatives are
evaluated in place; the rows of a ``scan``, ``while_loop`` or ``cond`` body are
outputs of the loop or branch, reduced over the iterations (one row per
equation of the body, not one per iteration). `Registry` numbers rows by
equation and name-scope path: a row is one equation at one call site.

>>> import jax, jax.numpy as jnp, numpy as np
>>> from jmp_policy.autocast._matmul import matmul
>>> from jmp_policy.autocast._rules import parse_rules
>>> closed = jax.make_jaxpr(lambda x: jnp.tanh(x @ x))(jnp.ones((2, 2)))
>>> low = Context(np.dtype(jnp.float16), parse_rules(None), matmul)
>>> ref = Context(np.dtype(jnp.float32), parse_rules(None), matmul)
>>> registry = Registry()
>>> sink = evaluate(registry, None, low, ref, closed, [jnp.full((2, 2), 7e4)])
>>> [(row.primitive, row.dtype) for row in registry.rows]
[('dot_general', 'float16'), ('tanh', 'float32')]
>>> int(sink[0]["overflow"])    # 70000 is beyond float16's largest value, 65504
4
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable, Literal, Optional, Sequence

import jax
import jax.extend.core.primitives as P
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal as JaxprLiteral, Primitive, Var

from jmp_policy._dtypes import is_floating_dtype
from jmp_policy.autocast._bits import (
    I32, INF_BITS, as_float, below, finite_mask, magnitude_bits, positive, where_bits)
from jmp_policy.autocast._fp8 import (
    RAGGED, Float8Recipe, contracting_axes, eligible, operand_dtypes, quantization_counts, quantize)
from jmp_policy.autocast._fp8_matmul import Quantized, float8_dot, float8_ragged_dot
from jmp_policy.autocast._higher_order import _scan_sizes, _stable_carry
from jmp_policy.autocast._interpreter import (
    Context, Params, _Casts, eval_equation, eval_jaxpr, higher_order_names)
from jmp_policy.autocast._lattice import (
    F32, DType, convert, dtype_of, is_floating, join, represents)
from jmp_policy.autocast._matmul import matmul
from jmp_policy.autocast._rules import AutocastWarning, scope_names

Pair = tuple[Any, Any]
"""A value in the low-precision evaluation and the same value in the float32 one."""

Stats = dict[str, jax.Array]
"""One row's statistics: named scalars (the gradient histogram aside), all traced."""

Sink = dict[int, Stats]
"""Statistics by row number; `HISTOGRAM` holds the gradient histogram."""

HISTOGRAM = -1
"""The sink entry holding the histogram of the backward pass's float32 magnitudes."""

HISTOGRAM_BINS = 256
"""Bins of the gradient histogram: a float32's biased exponent (bin ``e`` holds
magnitudes in ``[2**(e - 127), 2**(e - 126))``; bin 0 the float32 subnormals)."""

# How each statistic combines across iterations, branches and repeated call sites.
# "scaled" sums are sums of squares relative to the "err_scale" of the same row.
_REDUCTION: dict[str, str] = {
    "size": "sum", "max_abs": "max", "subnormal": "sum", "overflow": "sum",
    "nonzero": "sum", "underflow": "sum", "err_scale": "max", "err_sq": "scaled",
    "ref_sq": "scaled", "fp8_saturated": "sum", "fp8_flushed": "sum",
    "f32_min": "min", "f32_max": "max", "hist": "sum",
}
# Primitives whose results are values of their inputs, moved or selected: they can
# neither overflow nor round, and add no new values to the gradient histogram.
VALUE_PRESERVING = frozenset({
    "reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "slice",
    "dynamic_slice", "dynamic_update_slice", "gather", "concatenate", "pad", "rev", "copy",
    "copy_p", "select_n", "split", "neg", "abs", "max", "min", "reduce_max", "reduce_min",
    "cummax", "cummin", "sort", "stop_gradient", "optimization_barrier",
    "sharding_constraint", "device_put", "real", "imag", "conj",
})

# JAX names the recomputation of a `checkpoint` in the backward pass with this scope:
# forward values computed again, not gradients.
_REMAT_SCOPE = "rematted_computation"


@functools.lru_cache(maxsize=4096)
def display_scope(path: str) -> str:
    """A name-stack path as users wrote it: ``/``-joined scope names, JAX's wrappers removed.

    A transformation repeats the name of the scope it traced
    (``transpose(jvp(block))/jvp(block)``): a name repeated next to a wrapped
    one is shown once. JAX's own recomputation scope is dropped.

    >>> display_scope("transpose(jvp(model))/jvp(model)/rematted_computation/mlp")
    'model/mlp'
    """
    names: list[str] = []
    wrapped_before = False
    for part in path.split("/"):
        name = "/".join(scope_names(part))
        wrapped = name != part
        if name and name != _REMAT_SCOPE and not (
                names and names[-1] == name and (wrapped or wrapped_before)):
            names.append(name)
        wrapped_before = wrapped
    return "/".join(names)


@functools.lru_cache(maxsize=4096)
def phase_of(path: str) -> Literal["forward", "backward"]:
    """``"backward"`` for equations JAX's transposition wrote, recomputations aside."""
    backward = "transpose(" in path and _REMAT_SCOPE not in path.split("/")
    return "backward" if backward else "forward"


# --- Rows ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RowInfo:
    """What is known of a row when its equation is traced.

    Attributes:
      path: the name-stack path, with JAX's transformation names.
      primitive: the primitive's name.
      dtype: the dtype it ran in: a product's operand dtype, else its result's.
      fp8: whether the product ran on float8 operands.
    """

    path: str
    primitive: str
    dtype: str
    fp8: bool = False


class Registry:
    """Row numbers of (equation, name-scope path) pairs, in the order first met."""

    def __init__(self) -> None:
        self.rows: list[RowInfo] = []
        self._numbers: dict[tuple[int, str], int] = {}
        self._eqns: list[JaxprEqn] = []  # kept alive, so that their ids are not reused

    def number(self, eqn: JaxprEqn, info: RowInfo) -> int:
        key = (id(eqn), info.path)
        found = self._numbers.get(key)
        if found is not None:
            return found
        self._numbers[key] = len(self.rows)
        self.rows.append(info)
        self._eqns.append(eqn)
        return len(self.rows) - 1


# --- Combining statistics ------------------------------------------------------------------

def _identity(name: str, shape: Any, dtype: Any) -> jax.Array:
    # The only minimum is a bit pattern: inf's is above every finite magnitude's.
    return jnp.full(shape, 0x7F800000 if _REDUCTION[name] == "min" else 0, dtype)


def _rescale(scale: jax.Array, common: jax.Array) -> jax.Array:
    """The factor taking sums of squares relative to ``scale`` to ``common`` (both bit
    patterns of float32 magnitudes)."""
    s, c = (lax.bitcast_convert_type(x, np.float32) for x in (scale, common))
    ratio = jnp.where(c > 0, s / jnp.where(c > 0, c, 1), 0)
    return ratio * ratio


def combine(a: Stats, b: Stats) -> Stats:
    """The statistics of two evaluations of one row, as if of one."""
    common = jnp.maximum(a["err_scale"], b["err_scale"]) \
        if "err_scale" in a and "err_scale" in b else None
    out: Stats = {**a, **b}  # a statistic only one of them has is kept as it is
    for name in a.keys() & b.keys():
        how, x, y = _REDUCTION[name], a[name], b[name]
        if how == "sum":
            out[name] = x + y
        elif how == "max":
            out[name] = jnp.maximum(x, y)
        elif how == "min":
            out[name] = jnp.minimum(x, y)
        else:
            assert common is not None
            out[name] = (x * _rescale(a["err_scale"], common)
                         + y * _rescale(b["err_scale"], common))
    return out


def reduce_stacked(stats: Stats) -> Stats:
    """The statistics of a loop body stacked over iterations (leading axis), as one."""
    common = jnp.max(stats["err_scale"], axis=0, initial=0) if "err_scale" in stats else None
    out: Stats = {}
    for name, x in stats.items():
        how = _REDUCTION[name]
        if how == "sum":
            out[name] = jnp.sum(x, axis=0, dtype=x.dtype)
        elif how == "max":
            out[name] = jnp.max(x, axis=0, initial=0)
        elif how == "min":
            out[name] = jnp.min(x, axis=0, initial=0x7F800000)
        else:
            assert common is not None
            out[name] = jnp.sum(x * _rescale(stats["err_scale"], common), axis=0)
    return out


def merge(sink: Sink, more: Sink) -> None:
    """Adds the statistics of ``more`` to ``sink``."""
    for number, stats in more.items():
        sink[number] = combine(sink[number], stats) if number in sink else stats


def _completed(sink: Sink, shapes: dict[int, dict[str, Any]]) -> Sink:
    """``sink`` with an identity for every statistic of ``shapes`` it lacks."""
    completed: Sink = {}
    for number, fields in shapes.items():
        have = sink.get(number, {})
        completed[number] = {name: have[name] if name in have
                             else _identity(name, s.shape, s.dtype)
                             for name, s in fields.items()}
    return completed


@dataclasses.dataclass(frozen=True)
class Result:
    """A floating result of an equation, waiting for its statistics (see `result_stats`).

    Attributes:
      number: its row.
      ref: its value in the float32 evaluation.
      low: the equation evaluated as autocast runs it on the float32 evaluation's
        inputs; ``None`` where that is ``ref`` itself (nothing to compare).
      tiny: the smallest normal magnitude of the dtype the equation ran in.
    """

    number: int
    ref: Any
    low: Optional[Any]
    tiny: float


@dataclasses.dataclass
class Level:
    """What the equations of one evaluated body record: statistics, the results whose
    statistics are computed when the body ends (together, see `grouped_stats`), and
    the float32 values of the backward pass (binned together then too).

    Attributes:
      one: a float32 one known only at run time (see `_bits.magnitude_bits`).
      origin: the source location given to every operation that computes
        statistics, so that XLA sees copies of one kernel as one.
    """

    one: Any
    origin: Any
    sink: Sink = dataclasses.field(default_factory=dict)
    results: list[Result] = dataclasses.field(default_factory=list)
    gradients: list[jax.Array] = dataclasses.field(default_factory=list)

    def inner(self) -> Level:
        """The level of a body evaluated from this one (a loop's, a branch's)."""
        return Level(self.one, self.origin)

    def record(self, number: int, stats: Callable[[], Stats]) -> None:
        """Adds the statistics that ``stats`` computes to row ``number``."""
        with source_info_util.user_context(self.origin):
            merge(self.sink, {number: stats()})

    def finish(self) -> Sink:
        """The statistics of the body, all computed (call it where the body is traced)."""
        with source_info_util.user_context(self.origin):
            merge(self.sink, grouped_stats(self.results, self.one))
            if self.gradients:
                merge(self.sink, {HISTOGRAM: {"hist": histogram(self.gradients, self.one)}})
        self.results, self.gradients = [], []
        return self.sink


# --- Getting statistics out of the program ------------------------------------------------

@dataclasses.dataclass
class Packing:
    """Where `pack` put each statistic, set while the program is traced.

    Attributes:
      scalars: for each statistic's name, the rows that have it, which of the
        stacked arrays holds it (by dtype) and at which offsets.
      others: ``(row, name, array)`` for the statistics that are not scalars.
    """

    scalars: dict[str, tuple[list[int], int, list[int]]] = dataclasses.field(
        default_factory=dict)
    others: list[tuple[int, str, int]] = dataclasses.field(default_factory=list)


_SCALAR_DTYPES = (np.dtype(np.int32), np.dtype(np.float32))


def pack(sink: Sink, packing: Packing) -> tuple[jax.Array, ...]:
    """The statistics of ``sink`` in a few arrays: the scalars stacked by dtype.

    A program returning thousands of scalars would pay for each output.
    """
    stacks: list[list[jax.Array]] = [[] for _ in _SCALAR_DTYPES]
    others: list[jax.Array] = []
    packing.scalars, packing.others = {}, []
    for number, stats in sink.items():
        for name, x in stats.items():
            if x.shape == () and x.dtype in _SCALAR_DTYPES:
                kind = _SCALAR_DTYPES.index(x.dtype)
                numbers, _, offsets = packing.scalars.setdefault(name, ([], kind, []))
                numbers.append(number)
                offsets.append(len(stacks[kind]))
                stacks[kind].append(x)
            else:
                packing.others.append((number, name, len(stacks) + len(others)))
                others.append(x)
    stacked = [jnp.stack(xs) if xs else jnp.zeros(0, d) for xs, d in zip(stacks, _SCALAR_DTYPES)]
    return (*stacked, *others)


def unpack(arrays: Sequence[Any], packing: Packing) -> dict[int, dict[str, Any]]:
    """The statistics `pack` packed, from the program's outputs on the host (Python
    numbers and numpy arrays), bit patterns turned into the float32 magnitudes they are."""
    sink: dict[int, dict[str, Any]] = {}
    for name, (numbers, kind, offsets) in packing.scalars.items():
        values = np.asarray(arrays[kind])[offsets]
        if name in BIT_PATTERNS:
            values = values.view(np.float32)
        for number, value in zip(numbers, values.tolist()):
            sink.setdefault(number, {})[name] = value
    for number, name, array in packing.others:
        sink.setdefault(number, {})[name] = np.asarray(arrays[array])
    return sink


# --- Statistics of one result --------------------------------------------------------------

# The statistics are computed on the bits of float32 values, with integer arithmetic
# only (see `_bits`).


def _reduced(fields: Sequence[dict[str, jax.Array]]) -> list[Stats]:
    """Each array of each of ``fields`` (all of one shape) reduced as `_REDUCTION` says.

    One variadic reduction over every axis: XLA emits a single loop nest over
    the elements for all of them, one kernel to compile where a reduction per
    statistic, or per result, would be a kernel each. The arrays keep their
    shape: XLA fuses the operations that produced the values into the loop,
    and a broadcast or transpose fused into a loop over a flattened array
    would recover every element's position by division, a loop over the
    shape indexes it directly.
    """
    names = [(k, n) for k, f in enumerate(fields) for n in f]
    hows = ["sum" if _REDUCTION[n] == "scaled" else _REDUCTION[n] for _, n in names]
    operands = [fields[k][n] for k, n in names]
    inits = [np.array(INF_BITS if h == "min" else 0, x.dtype) for h, x in zip(hows, operands)]
    ops = {"sum": lax.add, "max": lax.max, "min": lax.min}

    def computation(a: Sequence[jax.Array], b: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
        return tuple(ops[h](x, y) for h, x, y in zip(hows, a, b))

    outs = lax.reduce(operands, inits, computation, tuple(range(operands[0].ndim)))
    reduced: list[Stats] = [{} for _ in fields]
    for (k, n), x in zip(names, outs):
        reduced[k][n] = x
    return reduced


# Statistics kept as the bit patterns of float32 magnitudes (int32, ordered like the
# values), turned into floats on the host: a conversion per statistic in the program
# would be one more kernel to compile each.
BIT_PATTERNS = frozenset({"max_abs", "f32_min", "f32_max", "err_scale"})

# Results reduced by one kernel at most. Fewer kernels compile faster; a kernel that
# reads many arrays at once runs slower (more streams than the caches prefetch well).
_GROUP = 4


def grouped_stats(results: Sequence[Result], one: Any) -> Sink:
    """The statistics of ``results``, those of the same shape reduced together."""
    groups: dict[tuple[tuple[int, ...], bool], list[Result]] = {}
    for r in results:
        groups.setdefault((np.shape(r.ref), r.low is None), []).append(r)
    sink: Sink = {}
    for group in groups.values():
        for start in range(0, len(group), _GROUP):
            for r, stats in zip(group[start:start + _GROUP],
                                _group_stats(group[start:start + _GROUP], one)):
                merge(sink, {r.number: stats})
    return sink


def _group_stats(group: Sequence[Result], one: Any) -> list[Stats]:
    values = [(r.ref, r.low) for r in group]
    bits = [_value_bits(ref, low, one) for ref, low in values]
    stats = _reduced([_result_fields(b, r.tiny) for b, r in zip(bits, group)])
    if group[0].low is not None:
        squares = _reduced([_square_fields(pair, b, s["err_scale"], one)
                            for pair, b, s in zip(values, bits, stats)])
        stats = [{**s, **q} for s, q in zip(stats, squares)]
    else:
        zero_i, zero_f = jnp.zeros((), I32), jnp.zeros((), np.float32)
        stats = [{**s, "overflow": zero_i, "nonzero": zero_i, "underflow": zero_i,
                  "err_scale": zero_i, "err_sq": zero_f, "ref_sq": zero_f} for s in stats]
    size = jnp.asarray(np.size(group[0].ref), I32)
    return [{**s, "size": size} for s in stats]


def _value_bits(ref: Any, low: Optional[Any], one: Any) -> dict[str, jax.Array]:
    """The magnitude bits of a result's values, and which are finite (-1) or not (0)."""
    bits = {"ref": magnitude_bits(ref, one)}
    if low is not None:
        bits["low"] = magnitude_bits(low, one)
    finite = {f"{k}_finite": finite_mask(b) for k, b in bits.items()}
    return {**bits, **finite}


def _result_fields(b: dict[str, jax.Array], tiny: float) -> dict[str, jax.Array]:
    """The arrays reduced into one result's statistics (see `result_stats`)."""
    w = b["ref"] & b["ref_finite"]  # finite magnitudes; 0 for inf and NaN
    v = b["low"] & b["low_finite"] if "low" in b else w
    fields = {
        "max_abs": v,
        "subnormal": positive(v) & below(v, np.float32(tiny).view(I32)),
        "f32_max": w,
        "f32_min": w | (lax.shift_right_arithmetic(w - I32(1), I32(31)) & INF_BITS),
    }
    if "low" not in b:
        return fields
    return {**fields,
            "overflow": (b["low_finite"] + 1) & b["ref_finite"],  # low inf/NaN, float32 finite
            "nonzero": positive(w),
            "underflow": positive(w) & below(b["low"], 1),  # float32 nonzero, low zero
            "err_scale": lax.max(v, w) & b["low_finite"] & b["ref_finite"]}


def _square_fields(values: tuple[Any, Any], b: dict[str, jax.Array], scale_bits: jax.Array,
                   one: Any) -> dict[str, jax.Array]:
    """The squared error and float32 values, relative to the largest magnitude so that
    values beyond 1e19 do not overflow the sums (a second pass, for the few equations
    that compare)."""
    scale = as_float(scale_bits)
    inv = jnp.where(scale > 0, 1 / jnp.where(scale > 0, scale, 1), np.float32(0))
    r, x = (lax.mul(lax.convert_element_type(y, np.float32), one) for y in values)
    both = b["low_finite"] & b["ref_finite"]
    d = where_bits(both, lax.mul(lax.sub(x, r), inv))
    rr = where_bits(both, lax.mul(r, inv))
    return {"err_sq": lax.mul(d, d), "ref_sq": lax.mul(rr, rr)}


def result_stats(ref: Any, low: Optional[Any], tiny: float, one: Any) -> Stats:
    """Statistics of one result: ``ref`` (the float32 evaluation's) and ``low`` (the
    equation as autocast runs it on the float32 evaluation's inputs, ``None`` where
    that is ``ref``).

    ``tiny`` is the smallest normal magnitude of the dtype the equation ran in; ``one``
    is a float32 one known only at run time (see `_bits.magnitude_bits`). Magnitudes
    (``max_abs``, ``f32_min``...) are float32 bit patterns (see `BIT_PATTERNS`).
    """
    return grouped_stats([Result(0, ref, low, tiny)], one)[0]


HISTOGRAM_SAMPLE = 4096
"""At most this many values of each result enter the gradient histogram."""


def _sample_stride(size: int) -> int:
    """Every how many values a result of ``size`` values is sampled: an odd stride, so
    that a sample of an array with power-of-two dimensions goes through all its columns."""
    stride = -(-size // HISTOGRAM_SAMPLE)
    return stride if stride == 1 or stride % 2 else stride + 1


def histogram(values: Sequence[Any], one: Any) -> jax.Array:
    """Counts of the finite nonzero magnitudes of ``values`` by float32 exponent.

    A large result is represented by an evenly spread sample of its values,
    each counting for the values it stands for: binning every value of a
    backward pass would cost more than the rest of the inspection. The samples
    are binned together, in one kernel.
    """
    samples, weights = [], []
    for x in values:
        flat = jnp.ravel(x)
        stride = _sample_stride(flat.size)
        samples.append(lax.convert_element_type(flat[::stride], np.float32))
        weights.append(jnp.full(samples[-1].shape, stride, I32))
    bits = magnitude_bits(jnp.concatenate(samples), one)
    v = bits & finite_mask(bits)
    # Zeros and non-finite values go to bin 255 (that of inf and NaN), dropped below.
    bins = lax.shift_right_logical(v, I32(23)) \
        | (lax.shift_right_arithmetic(v - I32(1), I32(31)) & I32(255))
    counts = jnp.zeros(HISTOGRAM_BINS, I32).at[bins].add(jnp.concatenate(weights))
    return counts.at[255].set(0)


def _quantized(recipe: Float8Recipe, eqn: JaxprEqn, scope: str,
               inputs: Sequence[Any]) -> list[Quantized]:
    """The float8 operands of a product, as autocast's float8 rule quantizes them."""
    return [quantize(x, fmt, recipe.scaling, axes, power_of_two=recipe.power_of_two_scales)
            for x, fmt, axes in zip(inputs, operand_dtypes(recipe, scope), contracting_axes(eqn))]


def _fp8_stats(inputs: Sequence[Any], quantized: Sequence[Quantized]) -> Stats:
    """How many operand values of a float8 product saturate or flush to zero."""
    counts = [quantization_counts(x, q) for x, q in zip(inputs, quantized)]
    return {"fp8_saturated": sum((c.saturated for c in counts[1:]), counts[0].saturated),
            "fp8_flushed": sum((c.flushed_to_zero for c in counts[1:]),
                               counts[0].flushed_to_zero)}


# --- The walk ------------------------------------------------------------------------------

Handler = Callable[["Walk", Context, Context, JaxprEqn, list[Pair], Level], list[Pair]]
_HANDLERS: dict[Primitive, Handler] = {}


def _handles(*primitives: Primitive) -> Callable[[Handler], Handler]:
    def decorator(handler: Handler) -> Handler:
        for primitive in primitives:
            _HANDLERS[primitive] = handler
        return handler
    return decorator


def _widened(x: Any) -> Any:
    """``x`` at float32 at least, if floating (float64 stays float64)."""
    return convert(x, join(dtype_of(x), F32)) if is_floating(x) else x


def pairs(values: Sequence[Any]) -> list[Pair]:
    """Values entering both evaluations: as they are, and widened to float32."""
    return [(x, _widened(x)) for x in values]


def evaluate(registry: Registry, recipe: Optional[Float8Recipe], low: Context, ref: Context,
             closed: ClosedJaxpr, values: Sequence[Any], one: Any = np.float32(1)) -> Sink:
    """Evaluates ``closed`` on ``values`` under ``low`` and ``ref``; returns the statistics.

    ``one`` is a float32 one; pass a traced one (an argument of the program) so that
    the statistics of constants are not computed when the program is compiled.
    """
    level = Level(one, source_info_util.current().traceback)
    Walk(registry, recipe).jaxpr(low, ref, closed.jaxpr, pairs(closed.consts), pairs(values),
                                 level)
    return level.finish()


class Walk:
    """Evaluates jaxprs in lockstep under two contexts, recording statistics per equation.

    Args:
      registry: numbers the rows.
      recipe: the float8 recipe of the low-precision side, for its products' counts.
    """

    def __init__(self, registry: Registry, recipe: Optional[Float8Recipe]):
        self.registry = registry
        self.recipe = recipe
        self._unvisited: set[str] = set()

    def jaxpr(self, low: Context, ref: Context, jaxpr: Jaxpr, consts: Sequence[Pair],
              args: Sequence[Pair], level: Level) -> list[Pair]:
        """Evaluates ``jaxpr`` like autocast's ``eval_jaxpr``, on both sides."""
        # Casts are memoized per evaluated jaxpr, as in autocast's own eval_jaxpr.
        low = dataclasses.replace(low, _casts=_Casts())
        ref = dataclasses.replace(ref, _casts=_Casts())
        env: dict[Var, Pair] = {**dict(zip(jaxpr.constvars, consts)),
                                **dict(zip(jaxpr.invars, args))}

        def read(v: Any) -> Pair:
            return (v.val, v.val) if isinstance(v, JaxprLiteral) else env[v]

        try:
            for eqn in jaxpr.eqns:
                invals = [read(v) for v in eqn.invars]
                # Values computed from constants alone are constants of the program.
                with eqn.ctx.manager:
                    outs = self.equation(low.at(eqn), ref.at(eqn), eqn, invals, level)
                env.update(zip(eqn.outvars, outs))
            return [read(v) for v in jaxpr.outvars]
        finally:
            low._casts.close()
            ref._casts.close()

    def equation(self, low: Context, ref: Context, eqn: JaxprEqn, invals: list[Pair],
                 level: Level) -> list[Pair]:
        handler = _HANDLERS.get(eqn.primitive)
        if handler is not None:
            return handler(self, low, ref, eqn, invals, level)
        lows = eval_equation(low, eqn, [x for x, _ in invals])
        refs = eval_equation(ref, eqn, [x for _, x in invals])
        if eqn.primitive.name in higher_order_names():
            self._warn_unvisited(eqn.primitive.name)
        elif any(is_floating(o) for o in lows):
            self._record(low, eqn, invals, lows, refs, level)
        return list(zip(lows, refs))

    def _warn_unvisited(self, name: str) -> None:
        if name in self._unvisited:
            return
        self._unvisited.add(name)
        warnings.warn(
            f"inspect_numerics evaluates {name!r} as autocast does but does not look inside "
            "it: its equations have no rows in the report.", AutocastWarning, stacklevel=4)

    def _record(self, ctx: Context, eqn: JaxprEqn, invals: list[Pair], lows: list[Any],
                refs: list[Any], level: Level) -> None:
        floats = [i for i, o in enumerate(lows) if is_floating(o)]
        product = _is_product(ctx, eqn)
        fp8 = product and self.recipe is not None and eligible(self.recipe, eqn, ctx.scope)
        ran_in = _ran_in(ctx, lows, floats, product, self.recipe if fp8 else None)
        number = self.registry.number(
            eqn, RowInfo(ctx.scope, eqn.primitive.name, " x ".join(d.name for d in ran_in), fp8))
        inputs = _as_autocast_sees_them(ctx, invals)
        quantized = _quantized(self.recipe, eqn, ctx.scope, inputs) \
            if fp8 and self.recipe is not None else None
        probe = _probe(ctx, eqn, inputs, lows, product, quantized)
        # A float8 product's result is rescaled float32 that continues in the compute
        # dtype: its subnormals are the compute dtype's.
        info = jnp.finfo(ctx.compute if fp8 else ran_in[0])  # type: ignore[no-untyped-call]
        tiny = float(info.tiny)
        level.results.extend(Result(number, refs[i], None if probe is None else probe[i], tiny)
                             for i in floats)
        if quantized is not None:
            level.record(number, lambda: _fp8_stats(inputs, quantized))
        if phase_of(ctx.scope) == "backward" and eqn.primitive.name not in VALUE_PRESERVING:
            level.gradients.extend(refs[i] for i in floats)


def _is_product(ctx: Context, eqn: JaxprEqn) -> bool:
    """Whether autocast runs ``eqn`` as matrix work on operands narrowed to ``ctx.compute``."""
    cls = ctx.rules.class_of(eqn.primitive)
    return cls == "matmul" and not ctx.pinned and not represents(ctx.compute, F32)


def _ran_in(ctx: Context, outs: list[Any], floats: list[int], product: bool,
            fp8: Optional[Float8Recipe]) -> tuple[DType, ...]:
    """The dtypes an equation ran in: its float8 operand formats, its compute dtype, or the
    narrowest floating dtype of its results."""
    if fp8 is not None:
        lhs, rhs = operand_dtypes(fp8, ctx.scope)
        return (lhs,) if lhs == rhs else (lhs, rhs)
    if product:
        return (ctx.compute,)
    dtypes = [dtype_of(outs[i]) for i in floats]
    return (min(dtypes, key=lambda d: (d.itemsize, d.name)),)


def _as_autocast_sees_them(ctx: Context, invals: Sequence[Pair]) -> list[Any]:
    """The float32 evaluation's inputs of an equation, at the dtypes they have under
    autocast (where autocast holds a value in half precision, so does the probe)."""
    return [ctx.cast(ref, dtype_of(low)) if is_floating(low) and is_floating(ref) else ref
            for low, ref in invals]


def _probe(ctx: Context, eqn: JaxprEqn, inputs: list[Any], lows: list[Any], product: bool,
           quantized: Optional[list[Quantized]]) -> Optional[list[Any]]:
    """``eqn`` evaluated as autocast runs it on ``inputs``, or ``None`` where that is
    the float32 evaluation's result itself (float32 or wider results of float32
    inputs, values only moved or selected).

    Comparing this with the float32 result shows what the equation itself loses: an
    overflow or an underflow before it, which the float32 inputs do not have, does
    not hide (or repeat) one here. A float8 product is computed as autocast's float8
    rule computes it, from the operands ``quantized`` once for it and its counts.
    """
    if quantized is not None and eqn.primitive.name == RAGGED:
        return [float8_ragged_dot(quantized[0], quantized[1], inputs[2],
                                  Params(eqn)["ragged_dot_dimension_numbers"])]
    if quantized is not None:
        return [float8_dot(quantized[0], quantized[1], Params(eqn)["dimension_numbers"])]
    if product:
        # A product of half-precision operands accumulated in float32 is the float32
        # product of the operands rounded to half precision: each product of two halves
        # is exact in float32. Computed so, as XLA's CPU backend lacks some half-
        # precision products (bfloat16 batched products accumulated in float32).
        wide = dataclasses.replace(ctx, compute=join(ctx.compute, F32), matmul=matmul)
        rounded = [convert(convert(x, ctx.compute), wide.compute) if is_floating(x) else x
                   for x in inputs]
        return eval_equation(wide, eqn, rounded)
    if eqn.primitive.name in VALUE_PRESERVING:
        return None
    if all(represents(dtype_of(o), F32) for o in lows if is_floating(o)):
        return None
    return eval_equation(ctx, eqn, inputs)


# --- Higher-order primitives ---------------------------------------------------------------

def _inline(walk: Walk, low: Context, ref: Context, jaxpr: Any, invals: Sequence[Pair],
            level: Level) -> list[Pair]:
    """Evaluates a called jaxpr (closed or open) in place: calls change no precision."""
    if isinstance(jaxpr, ClosedJaxpr):
        return walk.jaxpr(low, ref, jaxpr.jaxpr, pairs(jaxpr.consts), invals, level)
    return walk.jaxpr(low, ref, jaxpr, (), invals, level)


@_handles(P.jit_p)
def _jit(walk: Walk, low: Context, ref: Context, eqn: JaxprEqn, invals: list[Pair],
         level: Level) -> list[Pair]:
    return _inline(walk, low, ref, Params(eqn)["jaxpr"], invals, level)


@_handles(P.closed_call_p, P.call_p, P.custom_jvp_call_p, P.custom_vjp_call_p)
def _call(walk: Walk, low: Context, ref: Context, eqn: JaxprEqn, invals: list[Pair],
          level: Level) -> list[Pair]:
    # A custom derivative changes no value of the primal: its function is evaluated in
    # place (the derivatives of a backward pass are already equations of the jaxpr).
    return _inline(walk, low, ref, Params(eqn)["call_jaxpr"], invals, level)


@_handles(P.remat_p)
def _remat(walk: Walk, low: Context, ref: Context, eqn: JaxprEqn, invals: list[Pair],
           level: Level) -> list[Pair]:
    return _inline(walk, low, ref, Params(eqn)["jaxpr"], invals, level)


def _carry_dtypes(ctx: Context, body: ClosedJaxpr, values: Sequence[Any], n_before: int,
                  n_carry: int) -> list[Any]:
    """The carry dtypes autocast gives a loop body under ``ctx`` (see ``_higher_order``)."""
    d = [dtype_of(x) for x in values]
    carry, _ = _stable_carry(ctx, body, d[:n_before], d[n_before:n_before + n_carry],
                             d[n_before + n_carry:], slice(0, n_carry))
    return carry


def _cast_pairs(low: Context, ref: Context, values: Sequence[Pair], low_d: Sequence[Any],
                ref_d: Sequence[Any]) -> list[Pair]:
    return [(low.cast(x, a), ref.cast(y, b)) for (x, y), a, b in zip(values, low_d, ref_d)]


def _converted(values: Sequence[Pair], low_d: Sequence[Any], ref_d: Sequence[Any]) -> list[Pair]:
    return [(convert(x, a), convert(y, b)) for (x, y), a, b in zip(values, low_d, ref_d)]


@_handles(P.scan_p)
def _scan(walk: Walk, low: Context, ref: Context, eqn: JaxprEqn, invals: list[Pair],
          level: Level) -> list[Pair]:
    p = Params(eqn)
    nc, nk = _scan_sizes(p)
    body: ClosedJaxpr = p["jaxpr"]
    low_d = _carry_dtypes(low, body, [x for x, _ in invals], nc, nk)
    ref_d = _carry_dtypes(ref, body, [x for _, x in invals], nc, nk)
    consts, xs = invals[:nc], invals[nc + nk:]
    carry = _cast_pairs(low, ref, invals[nc:nc + nk], low_d, ref_d)

    def step(carry: list[Pair], x: list[Pair]) -> tuple[list[Pair], tuple[list[Pair], Sink]]:
        inner = level.inner()
        outs = walk.jaxpr(low, ref, body.jaxpr, pairs(body.consts), [*consts, *carry, *x], inner)
        return _converted(outs[:nk], low_d, ref_d), (outs[nk:], inner.finish())

    carry, (ys, stacked) = lax.scan(step, carry, xs, length=p["length"], reverse=p["reverse"],
                                    unroll=p["unroll"])
    merge(level.sink, {number: reduce_stacked(stats) for number, stats in stacked.items()})
    return [*carry, *ys]


# Loops and branches follow the float32 evaluation: the statistics come from its values
# (and the probes of them), autocast's side only gives dtypes, and its values, unused,
# are dropped by XLA. So a loop runs while the float32 evaluation's condition holds,
# and a branch is the one the float32 evaluation takes.

@_handles(P.while_p)
def _while(walk: Walk, low: Context, ref: Context, eqn: JaxprEqn, invals: list[Pair],
           level: Level) -> list[Pair]:
    p = Params(eqn)
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cond: ClosedJaxpr = p["cond_jaxpr"]
    body: ClosedJaxpr = p["body_jaxpr"]
    low_d = _carry_dtypes(low, body, [x for x, _ in invals[cn:]], bn, len(invals) - cn - bn)
    ref_d = _carry_dtypes(ref, body, [x for _, x in invals[cn:]], bn, len(invals) - cn - bn)
    cond_consts, body_consts = invals[:cn], invals[cn:cn + bn]

    def step(carry: list[Pair]) -> tuple[list[Pair], Sink]:
        inner = level.inner()
        outs = walk.jaxpr(low, ref, body.jaxpr, pairs(body.consts), [*body_consts, *carry], inner)
        return _converted(outs, low_d, ref_d), inner.finish()

    carry = _cast_pairs(low, ref, invals[cn + bn:], low_d, ref_d)
    shapes = jax.eval_shape(lambda c: step(c)[1], carry)

    def running(state: tuple[list[Pair], Sink]) -> Any:
        # The condition's equations have no rows: a loop's condition returns a boolean.
        args = [x for _, x in cond_consts + state[0]]
        (holds,) = eval_jaxpr(ref, cond.jaxpr, cond.consts, args)
        return holds

    def loop(state: tuple[list[Pair], Sink]) -> tuple[list[Pair], Sink]:
        new, inner = step(state[0])
        return new, {n: combine(state[1][n], s) for n, s in _completed(inner, shapes).items()}

    carry, totals = lax.while_loop(running, loop, (carry, _completed({}, shapes)))
    merge(level.sink, totals)
    return carry


@_handles(P.cond_p)
def _cond(walk: Walk, low: Context, ref: Context, eqn: JaxprEqn, invals: list[Pair],
          level: Level) -> list[Pair]:
    (_, index), ops = invals[0], invals[1:]
    branches: Sequence[ClosedJaxpr] = Params(eqn)["branches"]

    def branch(closed: ClosedJaxpr) -> Callable[..., tuple[list[Pair], Sink]]:
        def run(*ops: Pair) -> tuple[list[Pair], Sink]:
            inner = level.inner()
            outs = walk.jaxpr(low, ref, closed.jaxpr, pairs(closed.consts), ops, inner)
            return outs, inner.finish()
        return run

    runs = [branch(b) for b in branches]
    traced = [jax.eval_shape(r, *ops) for r in runs]
    # Every branch returns the same types (per side, the join of what the branches
    # produce) and the statistics of every branch's rows, identities where it has none.
    n_out = len(traced[0][0])
    low_d = [_join_all([t[0][i][0].dtype for t in traced]) for i in range(n_out)]
    ref_d = [_join_all([t[0][i][1].dtype for t in traced]) for i in range(n_out)]
    shapes: dict[int, dict[str, Any]] = {}
    for _, sink in traced:
        for number, fields in sink.items():
            shapes.setdefault(number, {}).update(fields)

    def agreed(run: Callable[..., tuple[list[Pair], Sink]]) -> Callable[..., Any]:
        def run_agreed(*ops: Pair) -> tuple[list[Pair], Sink]:
            outs, sink = run(*ops)
            return _converted(outs, low_d, ref_d), _completed(sink, shapes)
        return run_agreed

    outs, sink = lax.switch(index, [agreed(r) for r in runs], *ops)
    merge(level.sink, sink)
    return list(outs)


def _join_all(dtypes: list[Any]) -> Any:
    if not all(is_floating_dtype(d) for d in dtypes):
        return dtypes[0]
    result = np.dtype(dtypes[0])
    for d in dtypes[1:]:
        result = join(result, np.dtype(d))
    return result

"""Statistics of every operation of autocast's program against float32, observed as it runs.

The numerics inspector (``jmp_policy.inspect_numerics``) needs, for each
operation that a function runs under autocast, forward and backward, how its
low-precision result compares with float32. It observes the program itself:
the jaxpr of ``autocast(fn)``, or of ``jax.value_and_grad`` of it, exactly as
training traces it, replayed through autocast's own interpreter
(``Context(as_traced=True)``) with an `Observer`. For each equation with
floating results, the observer evaluates the same equation in float32 on the
same inputs (widened) and compares: a row shows what that operation loses on
the values it receives in autocast's program, in the dtype it runs in there.
An overflow shows at the operation that makes it, which is where a float32
scope fixes it; the operations downstream receive its inf.

Statistics are reduced on the device, where the values are (the results of
one shape reduced together, see `grouped_stats`), and reach the host through
one ``jax.debug.callback`` per evaluated jaxpr: operations inside
``jit``, ``scan``, ``while_loop``, ``cond``, ``checkpoint`` and custom-derivative
bodies are observed where the interpreter's handlers evaluate them, and a
loop body's row adds up its iterations on the host (`HostSink`). `Registry`
numbers rows by equation and name-scope path: a row is one equation at one
call site.

>>> import jax, jax.numpy as jnp, numpy as np
>>> def f(x):
...     h = x.astype(jnp.float16)
...     return jnp.tanh(h @ h)
>>> closed = jax.make_jaxpr(f)(jnp.ones((2, 2)))
>>> registry, sink = Registry(), HostSink()
>>> observer = Observer(registry, np.dtype(jnp.float16), lambda: sink)
>>> _ = jax.jit(lambda x: observe(observer, closed.jaxpr, closed.consts, [x]))(
...     jnp.full((2, 2), 7e4))
>>> jax.effects_barrier()
>>> [(row.primitive, row.dtype) for row in registry.rows]
[('convert_element_type', 'float16'), ('dot_general', 'float16'), ('tanh', 'float16')]
>>> sink.stats[0]["overflow"]   # 70000 is beyond float16's largest value, 65504
4
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from typing import Any, Callable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Jaxpr, JaxprEqn, Var

from jmp_policy import formats
from jmp_policy.dtypes import is_floating_dtype
from jmp_policy.formats import (
    I32, INF_BITS, below, finite_mask, magnitude_bits, positive, where_bits)
from jmp_policy.autocast.interpreter import Context, eval_jaxpr, higher_order_names
from jmp_policy.jaxprs import bind
from jmp_policy.float8 import BLOCK_SCALES, TENSOR_SCALES
from jmp_policy.dtypes import F32, DType, convert, dtype_of, is_floating, join, represents
from jmp_policy.autocast.interpreter import matmul
from jmp_policy.autocast.rules import MATMUL_PRIMITIVES, AutocastWarning, parse_rules, rule_of
from jmp_policy.jaxprs import sub_jaxprs
from jmp_policy.paths import is_backward, scope_names

Stats = dict[str, Any]
"""One row's statistics: named scalars."""

HISTOGRAM_BINS = 256
"""Bins of the gradient histogram: a float32's biased exponent (bin ``e`` holds
magnitudes in ``[2**(e - 127), 2**(e - 126))``; bin 0 the float32 subnormals)."""

# Sums of squares are kept at several scales (``err_sq@64`` is the sum of the squares of
# the errors times 2**64): one of them is within float32's range (see `rel_error`).
SQUARE_SCALES = (64, 0, -64)

# How each statistic combines across iterations, branches and repeated call sites.
_REDUCTION: dict[str, str] = {
    "size": "sum", "max_abs": "max", "subnormal": "sum", "overflow": "sum", "saturated": "sum",
    "nonzero": "sum", "underflow": "sum", "f32_min": "min", "f32_max": "max",
    **{f"{name}@{k}": "sum" for name in ("err_sq", "ref_sq") for k in SQUARE_SCALES},
}
# --- Rows ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RowInfo:
    """What is known of a row when its equation is traced.

    Attributes:
      path: the name-stack path, with JAX's transformation names.
      primitive: the primitive's name.
      dtype: the dtype it ran in: a product's operand dtype, else its result's.
      shapes: the shapes of its floating operands (``"16x64, 64x64"``), which tell
        apart operations of one primitive in one scope.
      fp8: whether the product ran on float8 operands.
      gradient: whether its results are backward-pass values held in float16, which
        a loss scale must bring into range.
    """

    path: str
    primitive: str
    dtype: str
    shapes: str
    fp8: bool = False
    gradient: bool = False


class Registry:
    """Row numbers of (equation, name-scope path) pairs, in the order first met, and the
    casts that made each float8 product's operands."""

    def __init__(self) -> None:
        self.rows: list[RowInfo] = []
        self.fp8_casts: dict[int, list[int]] = {}  # a float8 product's row: its casts' rows
        self.cast_dtypes: dict[int, DType] = {}  # a cast to float8 (float4): its format
        self._numbers: dict[tuple[int, str], int] = {}
        self._eqns: list[JaxprEqn] = []  # kept alive, so that their ids are not reused

    def eqn(self, number: int) -> JaxprEqn:
        """The equation of row ``number``."""
        return self._eqns[number]

    def number(self, eqn: JaxprEqn, info: RowInfo) -> int:
        key = (id(eqn), info.path)
        found = self._numbers.get(key)
        if found is not None:
            return found
        self._numbers[key] = len(self.rows)
        self.rows.append(info)
        self._eqns.append(eqn)
        return len(self.rows) - 1


# --- Statistics of one equation, on the device ------------------------------------------------

# The statistics are computed on the bits of float32 values, with integer arithmetic
# only (see `_bits`); magnitudes leave the program as bit patterns.
BIT_PATTERNS = frozenset({"max_abs", "f32_min", "f32_max"})

def _reduced(fields: Sequence[dict[str, jax.Array]], first: int = 0) -> list[Stats]:
    """Each array of each of ``fields`` (all of one shape) reduced as `_REDUCTION` says,
    over every axis from ``first`` on.

    One variadic reduction: XLA emits a single loop nest over the elements for
    all of them, one kernel to compile where a reduction per statistic would be
    a kernel each. The arrays keep their shape: XLA fuses the operations that
    produced the values into the loop, and a broadcast or transpose fused into
    a loop over a flattened array would recover every element's position by
    division, a loop over the shape indexes it directly.
    """
    names = [(k, n) for k, f in enumerate(fields) for n in f]
    hows = [_REDUCTION[n] for _, n in names]
    operands = [fields[k][n] for k, n in names]
    inits = [np.array(INF_BITS if h == "min" else 0, x.dtype) for h, x in zip(hows, operands)]
    ops = {"sum": lax.add, "max": lax.max, "min": lax.min}

    def computation(a: Sequence[jax.Array], b: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
        return tuple(ops[h](x, y) for h, x, y in zip(hows, a, b))

    outs = lax.reduce(operands, inits, computation, tuple(range(first, operands[0].ndim)))
    reduced: list[Stats] = [{} for _ in fields]
    for (k, n), x in zip(names, outs):
        reduced[k][n] = x
    return reduced


def _value_bits(ref: Any, low: Any) -> dict[str, jax.Array]:
    """The magnitude bits of a result's values, and which are finite (-1) or not (0)."""
    bits = {"ref": magnitude_bits(ref), "low": magnitude_bits(low)}
    return {**bits, **{f"{k}_finite": finite_mask(b) for k, b in bits.items()}}


def _result_fields(b: dict[str, jax.Array], tiny: float,
                   top: Optional[float] = None) -> dict[str, jax.Array]:
    """The arrays reduced into one result's statistics (see `grouped_stats`). ``top``:
    for a low-precision dtype that has neither inf nor NaN (``float4_e2m1fn``), to whose
    largest value a conversion saturates what lies beyond it, where the values that
    rounding would not take to that largest value begin."""
    w = b["ref"] & b["ref_finite"]  # finite magnitudes; 0 for inf and NaN
    v = b["low"] & b["low_finite"]
    beyond = 0 if top is None else (1 - below(w, np.float32(top).view(I32)))
    return {"max_abs": v,
            "subnormal": _subnormal(v, tiny),
            "f32_min": _nonzero_or_inf(w),
            "f32_max": w,
            "overflow": (b["low_finite"] + 1) & b["ref_finite"],  # low inf/NaN, float32 finite
            "saturated": beyond & b["ref_finite"],  # finite, made the dtype's largest value
            "nonzero": positive(w),
            "underflow": positive(w) & below(b["low"], 1)}  # float32 nonzero, low zero


def _subnormal(v: jax.Array, tiny: float) -> jax.Array:
    """1 where the magnitude bits ``v`` are nonzero and below ``tiny``."""
    return positive(v) & below(v, np.float32(tiny).view(I32))


def _nonzero_or_inf(w: jax.Array) -> jax.Array:
    """The magnitude bits ``w`` with zeros made inf's: their minimum is the smallest nonzero."""
    return w | (lax.shift_right_arithmetic(w - I32(1), I32(31)) & INF_BITS)


def _square_fields(values: tuple[Any, Any], b: dict[str, jax.Array],
                   scales: Sequence[int]) -> dict[str, jax.Array]:
    """The squared errors and float32 values, over the elements finite in both, times
    ``2**(2 * k)`` for each ``k`` of ``scales``: values beyond 1e19 overflow the
    unscaled squares, values below 1e-19 underflow them."""
    # The narrow values rounded on every backend (XLA:GPU removes a plain round trip).
    r, x = (lax.convert_element_type(formats.widen(y), np.float32) for y in values)
    both = b["low_finite"] & b["ref_finite"]
    d, rr = where_bits(both, lax.sub(x, r)), where_bits(both, r)
    fields = {}
    for k in scales:
        f = np.float32(2.0 ** k)
        dk, rk = (lax.mul(d, f), lax.mul(rr, f)) if k else (d, rr)
        fields[f"err_sq@{k}"], fields[f"ref_sq@{k}"] = lax.mul(dk, dk), lax.mul(rk, rk)
    return fields


def rel_error(stats: Stats) -> float:
    """The relative RMS error of a row's host statistics: from the sums of squares at the
    largest scale whose sums are finite (the most resolution for small values)."""
    for k in SQUARE_SCALES:
        err, ref = stats.get(f"err_sq@{k}"), stats.get(f"ref_sq@{k}")
        if err is None or ref is None or not (np.isfinite(err) and np.isfinite(ref)):
            continue
        if ref > 0:
            return float(np.sqrt(err / ref))
        return 0.0 if err == 0 else float("inf")
    return 0.0



@dataclasses.dataclass(frozen=True)
class Result:
    """A floating result of an observed equation, waiting for its statistics.

    Attributes:
      number: its row.
      ref: the equation evaluated in float32 on the same inputs.
      low: the result as the program computed it; ``None`` where that is ``ref``
        (results in float32: the equation rounds nothing to low precision).
      tiny: the smallest normal magnitude of the dtype the equation ran in.
    """

    number: int
    ref: Any
    low: Optional[Any]
    tiny: float


def grouped_stats(results: Sequence[Result]) -> list[tuple[list[int], Stats]]:
    """The statistics of ``results``: for each group of results of one shape and dtypes,
    their rows and statistics (arrays with one entry per result, magnitudes as float32
    bit patterns).

    A group's results are stacked and reduced by one kernel: the kernels to compile
    are few (the results of a transformer block share a few shapes). A group holds at
    most `GROUP` results, which bounds the memory a stack may take. The sums of squares are kept at the scales `SQUARE_SCALES` unless the
    dtype bounds them: the values finite in float16 or float8 have squares and sums far
    within float32's range.
    """
    groups: dict[tuple[Any, ...], list[Result]] = {}
    for r in results:
        key = (np.shape(r.ref), dtype_of(r.ref), None if r.low is None else dtype_of(r.low),
               r.tiny)
        groups.setdefault(key, []).append(r)
    chunks = [group[i:i + GROUP] for group in groups.values() for i in range(0, len(group), GROUP)]
    return [([r.number for r in chunk], _group_stats(chunk)) for chunk in chunks]


GROUP = 8
"""At most this many results are reduced together (see `grouped_stats`)."""


def _group_stats(group: Sequence[Result]) -> Stats:
    ref = jnp.stack([r.ref for r in group])
    size = jnp.full(len(group), np.size(group[0].ref), I32)
    low, tiny = group[0].low, group[0].tiny
    if low is None:  # float32 results themselves: their magnitudes only
        v = magnitude_bits(ref)
        v = v & finite_mask(v)
        (stats,) = _reduced([{"max_abs": v, "subnormal": _subnormal(v, tiny),
                              "f32_min": _nonzero_or_inf(v)}], first=1)
        return {**stats, "size": size}
    low = jnp.stack([r.low for r in group if r.low is not None])
    b = _value_bits(ref, low)
    bounded = formats.facts_of(dtype_of(low)).max <= _BOUNDED
    scales = (0,) if bounded else SQUARE_SCALES
    top = _saturates_at(dtype_of(low))
    (stats,) = _reduced([{**_result_fields(b, tiny, top), **_square_fields((ref, low), b, scales)}],
                        first=1)
    return {**stats, "size": size}


_BOUNDED = formats.facts_of(np.float16).max


@functools.lru_cache(maxsize=None)
def _saturates_at(dtype: Any) -> Optional[float]:
    """For a floating ``dtype`` that has neither inf nor NaN (a conversion to it saturates:
    ``float4_e2m1fn``), the magnitude from which a value saturates: halfway from its
    largest value to the next one a wider exponent would give (below it, rounding to
    nearest gives the largest value anyway; 7 for e2m1). ``None`` for other dtypes."""
    fmt = formats.facts_of(dtype)
    if fmt.overflow != "saturate":
        return None
    return fmt.max + fmt.spacing_at_max / 2


HISTOGRAM_SAMPLE = 4096
"""At most this many values of each result enter the gradient histogram."""


def _sample(x: Any) -> tuple[jax.Array, int]:
    """An evenly spread sample of ``x``'s values (float32, at most `HISTOGRAM_SAMPLE`)
    and the number of values each stands for: binning every value of a backward pass
    would cost more than the rest. The stride is odd, so that a sample of an array with
    power-of-two dimensions goes through all its columns."""
    flat = jnp.ravel(x)
    stride = -(-flat.size // HISTOGRAM_SAMPLE)
    stride = stride if stride == 1 or stride % 2 else stride + 1
    return lax.convert_element_type(flat[::stride], np.float32), stride


# --- On the host ------------------------------------------------------------------------------

class HostSink:
    """The statistics the program's callbacks deliver, combined per row on the host.

    Attributes:
      stats: by row number, Python numbers (magnitudes as floats).
      histogram: counts of the backward pass's float16-held values by float32
        exponent, as they would be without the loss scale the program ran with.
    """

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale
        self.stats: dict[int, Stats] = {}
        self.histogram = np.zeros(HISTOGRAM_BINS, np.int64)

    def add(self, groups: Sequence[Sequence[int]], stats: Sequence[Stats],
            samples: Sequence[Any], strides: Sequence[int]) -> None:
        """Adds the statistics of groups of rows (see `grouped_stats`) and samples of
        gradient values, each standing for ``strides`` values (what one evaluation of a
        jaxpr delivers)."""
        for numbers, group in zip(groups, stats):
            arrays = {k: np.asarray(v).view(np.float32) if k in BIT_PATTERNS else np.asarray(v)
                      for k, v in group.items()}
            for j, number in enumerate(numbers):
                new = {k: v[j].item() for k, v in arrays.items()}
                old = self.stats.get(number)
                self.stats[number] = new if old is None else combine(old, new)
        for values, stride in zip(samples, strides):
            self.histogram += stride * _bin_counts(np.asarray(values) / self.scale)


def _bin_counts(values: Any) -> Any:
    """Counts of the finite nonzero magnitudes of ``values`` by float32 exponent."""
    bits = np.abs(values.astype(np.float32)).view(np.int32)
    exponents = bits[(bits > 0) & (bits < 0x7F800000)] >> 23
    return np.bincount(exponents, minlength=HISTOGRAM_BINS)


def combine(a: Stats, b: Stats) -> Stats:
    """The statistics of two evaluations of one row (host numbers), as if of one."""
    out: Stats = {**a, **b}  # a statistic only one of them has is kept as it is
    for name in a.keys() & b.keys():
        how, x, y = _REDUCTION[name], a[name], b[name]
        out[name] = x + y if how == "sum" else max(x, y) if how == "max" else min(x, y)
    return out


# --- The observer -----------------------------------------------------------------------------

@dataclasses.dataclass
class _Level:
    """What the equations of one evaluated jaxpr left to compute at its end."""

    results: list[Result] = dataclasses.field(default_factory=list)
    samples: list[tuple[jax.Array, int]] = dataclasses.field(default_factory=list)


class Observer:
    """Observes each equation of a program replayed by autocast's interpreter.

    Args:
      registry: numbers the rows.
      compute: the policy's compute dtype (a float8 product's result continues in it).
      sink: returns the `HostSink` that the statistics of the current run go to (the
        program is compiled once and may run several times).
      dead: ids of equations whose results the program's outputs do not need.
    """

    def __init__(self, registry: Registry, compute: DType, sink: Callable[[], HostSink],
                 dead: frozenset[int] = frozenset()):
        self.registry = registry
        self.compute = compute
        self.sink = sink
        self.dead = dead
        self._fp8_casts: dict[int, tuple[Any, int]] = {}  # id of a float8 value: its cast
        # id of a value dequantized from float8 (float4) casts: (the value, their rows)
        self._dequantized: dict[int, tuple[Any, list[int]]] = {}
        # id of a value that formats.round_nearest rounded: (the value, what it rounded, the
        # format)
        self._rounded: dict[int, tuple[Any, Any, DType]] = {}
        self._levels: list[_Level] = []
        self._higher_order = higher_order_names()
        self._unvisited: set[str] = set()

    def __call__(self, ctx: Context, eqn: JaxprEqn, invals: Sequence[Any],
                 outs: Sequence[Any]) -> None:
        if id(eqn) in self.dead or eqn.primitive.name in self._higher_order:
            return  # a higher-order primitive's equations were observed one by one
        block = self._track_dequantized(eqn, invals, outs)
        invals = self._unrounded(eqn, invals, outs)
        scales = eqn.primitive.name == "mul" and _SCALE_SCOPES.intersection(
            scope_names(ctx.scope)[-1:])
        if sub_jaxprs(eqn) and not _traced(eqn):  # a scatter's combiner
            self._warn_unvisited(eqn.primitive.name)                  # is not a body
            return
        floats = [i for i, v in enumerate(eqn.outvars) if _floating_aval(v)]
        if not floats or not (_runs_narrow(eqn) or block or scales) or _preserves_values(eqn) \
                or not any(
                _floating_aval(v) for v in eqn.invars):
            return  # it loses nothing against float32 (or makes its values: empty, iota)
        # Results in float32 from narrow operands (a product accumulated in float32) are
        # what the equation computes in float32: nothing to evaluate again.
        exact = all(represents(_dtype(eqn.outvars[i]), F32) for i in floats)
        refs = list(outs) if exact else _float32_bind(eqn, list(invals))
        info = self._info(eqn, ctx.scope, block)
        number = self.registry.number(eqn, info)
        # A float8 product's result is rescaled and continues in the compute dtype: its
        # subnormals are the compute dtype's.
        tiny = formats.facts_of(self.compute if info.fp8 else _ran_in(eqn)[0]).tiny
        level = self._levels[-1]
        level.results.extend(Result(number, refs[i], None if exact else outs[i], tiny)
                             for i in floats)
        if info.gradient:
            level.samples.extend(_sample(refs[i]) for i in floats)
        self._link_fp8(eqn, invals, outs, number, info, block)

    def _track_dequantized(self, eqn: JaxprEqn, invals: Sequence[Any],
                           outs: Sequence[Any]) -> Optional[list[int]]:
        """Follows values dequantized from float8 (float4) casts, as block-scaled products
        emulate them: a product of such values runs on block-scaled operands. Returns,
        for a product whose floating operands all are, their casts' rows."""
        name = eqn.primitive.name
        found = [self._dequantized.get(id(x)) for x in invals]
        sources = [rows for x, f in zip(invals, found) if f is not None and f[0] is x
                   for rows in (f[1],)]
        if name in MATMUL_PRIMITIVES:
            operands = [x for x, v in zip(invals, eqn.invars) if _floating_aval(v)]
            if operands and len(sources) == len(operands):
                return [n for rows in sources for n in rows]
            return None
        cast = self._fp8_casts.get(id(invals[0])) if invals else None
        if cast is not None and cast[0] is invals[0] and _moves_values(eqn):
            self._fp8_casts[id(outs[0])] = (outs[0], cast[1])  # a float8 value, laid out
        if name == "convert_element_type" and _floating_aval(eqn.invars[0]) \
                and _is_float8(_dtype(eqn.invars[0])):
            cast = self._fp8_casts.get(id(invals[0]))
            if cast is not None and cast[0] is invals[0]:
                self._dequantized[id(outs[0])] = (outs[0], [cast[1]])
        elif sources and name in _DEQUANTIZING:
            self._dequantized[id(outs[0])] = (outs[0], [n for rows in sources for n in rows])
        return None

    def _unrounded(self, eqn: JaxprEqn, invals: Sequence[Any], outs: Sequence[Any]) -> list[Any]:
        """``invals``, except that a cast of a value the program rounded to the cast's format
        first (``formats.round_nearest``, which makes the cast exact) takes the value before
        that rounding: the cast's row is then the rounding's."""
        if eqn.primitive is formats.rounding_p:
            self._rounded[id(outs[0])] = (outs[0], invals[0], eqn.params["format"].dtype)
        elif eqn.primitive.name == "convert_element_type":
            found = self._rounded.get(id(invals[0]))
            if found is not None and found[0] is invals[0] and \
                    np.dtype(eqn.params["new_dtype"]) == found[2]:
                return [found[1]]
        return list(invals)

    @contextlib.contextmanager
    def jaxpr(self) -> Iterator[None]:
        """Around the evaluation of one jaxpr: its statistics are computed together at the
        end, and delivered to the host by one callback."""
        self._levels.append(_Level())
        try:
            yield
            level = self._levels[-1]
            if not level.results:
                return
            grouped = grouped_stats(level.results)
            groups = [numbers for numbers, _ in grouped]
            strides = [stride for _, stride in level.samples]
            sink = self.sink

            def deliver(stats: list[Stats], samples: list[Any]) -> None:
                sink().add(groups, stats, samples, strides)

            jax.debug.callback(deliver, [stats for _, stats in grouped],
                               [v for v, _ in level.samples])
        finally:
            self._levels.pop()

    def _info(self, eqn: JaxprEqn, path: str, block: Optional[list[int]] = None) -> RowInfo:
        ran_in = _ran_in(eqn)
        if block:  # a block-scaled product: the formats its operands were quantized to
            ran_in = tuple(dict.fromkeys(self.registry.cast_dtypes[n] for n in block))
        shapes = ", ".join("x".join(map(str, getattr(v.aval, "shape", ()))) or "scalar"
                           for v in eqn.invars if _floating_aval(v))
        fp8 = eqn.primitive.name in MATMUL_PRIMITIVES and any(_is_float8(d) for d in ran_in)
        gradient = is_backward(path) and any(
            _dtype(v) == _F16 for v in eqn.outvars if _floating_aval(v))
        return RowInfo(path, eqn.primitive.name, " x ".join(d.name for d in ran_in), shapes,
                       fp8, gradient)

    def _link_fp8(self, eqn: JaxprEqn, invals: Sequence[Any], outs: Sequence[Any],
                  number: int, info: RowInfo, block: Optional[list[int]] = None) -> None:
        """Remembers the casts to float8 and which product each feeds: a product's
        saturated and flushed operand values are its operand casts' overflows and
        underflows."""
        if eqn.primitive.name == "convert_element_type" and _is_float8(_dtype(eqn.outvars[0])):
            self._fp8_casts[id(outs[0])] = (outs[0], number)  # the value kept: its id stays
            self.registry.cast_dtypes[number] = _dtype(eqn.outvars[0])
        elif info.fp8:
            casts = [self._fp8_casts.get(id(x)) for x in invals]
            found = block or [n for x, c in zip(invals, casts) if c is not None and c[0] is x
                              for n in (c[1],)]
            known = self.registry.fp8_casts.setdefault(number, [])
            known.extend(n for n in found if n not in known)

    def _warn_unvisited(self, name: str) -> None:
        if name in self._unvisited:
            return
        self._unvisited.add(name)
        warnings.warn(
            f"inspect_numerics runs {name!r} as autocast's program does but does not look "
            "inside it: its equations have no rows in the report.", AutocastWarning,
            stacklevel=4)


def observe(observer: Observer, jaxpr: Jaxpr, consts: Sequence[Any],
            values: Sequence[Any]) -> list[Any]:
    """Evaluates ``jaxpr`` (a program autocast already rewrote) on ``consts`` and ``values``
    as traced, with ``observer`` watching every equation; returns its outputs."""
    ctx = Context(observer.compute, parse_rules(None), matmul, observe=observer, as_traced=True,
                  observe_jaxpr=observer.jaxpr)
    return eval_jaxpr(ctx, jaxpr, consts, values)


def dead_equations(jaxpr: Jaxpr) -> frozenset[int]:
    """The ids of the equations of ``jaxpr`` that neither its outputs nor an effect need:
    the program computes them (the gradient of an operand not differentiated) but XLA
    removes them, so training never runs them."""
    live = {v for v in jaxpr.outvars if isinstance(v, Var)}
    dead = set()
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in live for v in eqn.outvars):
            live.update(v for v in eqn.invars if isinstance(v, Var))
        else:
            dead.add(id(eqn))
    return frozenset(dead)


_F16 = np.dtype(np.float16)


def widened(x: Any) -> Any:
    """``x`` at float32 at least, if floating (float64 stays float64); a narrow ``x`` with
    its rounding in place (``formats.widen``), which no compiler rewrite removes."""
    return convert(formats.widen(x), join(dtype_of(x), F32)) if is_floating(x) else x


def _preserves_values(eqn: JaxprEqn) -> bool:
    """Whether ``eqn`` only moves, selects or widens values: it can lose nothing, so it has
    no row (a widening cast's input is the result of the operation that rounded it)."""
    if eqn.primitive.name == "convert_element_type":
        (x,), (y,) = eqn.invars, eqn.outvars
        return not _floating_aval(x) or not _floating_aval(y) or represents(_dtype(y), _dtype(x))
    return _moves_values(eqn)


def _moves_values(eqn: JaxprEqn) -> bool:
    """Whether ``eqn``'s results are values of its inputs, moved or selected (its rule
    says so): they can neither overflow nor round, and add no new values to the gradient
    histogram."""
    rule = rule_of(eqn.primitive.name)
    return rule is not None and rule.preserves_values


def _dtype(v: Any) -> DType:
    dtype: DType = np.dtype(v.aval.dtype)
    return dtype


def _floating_aval(v: Any) -> bool:
    dtype = getattr(v.aval, "dtype", None)
    return dtype is not None and is_floating_dtype(dtype)


# The block-scaled quantization makes its scales under these scopes (``_blocks._marked``):
# the float32 values there have rows, whose ranges are the scales'.
_SCALE_SCOPES = frozenset({BLOCK_SCALES, TENSOR_SCALES})

# What a block-scaled product's emulation does to an operand between its cast back from
# float8 (float4) and the product: the rounding made again (``formats.widen``), a scale,
# a layout.
_DEQUANTIZING = frozenset({formats.rounding_p.name, "mul", "reshape", "transpose", "slice",
                           "squeeze", "expand_dims", "broadcast_in_dim", "pad", "copy", "copy_p"})


def _is_float8(dtype: Any) -> bool:
    return np.dtype(dtype).itemsize == 1 and is_floating_dtype(dtype)


def _ran_in(eqn: JaxprEqn) -> tuple[DType, ...]:
    """The dtypes an equation ran in: a product's floating operand dtypes (each once);
    else the narrowest floating dtype of its results."""
    if eqn.primitive.name in MATMUL_PRIMITIVES:
        operands = [_dtype(v) for v in eqn.invars if _floating_aval(v)]
        if operands:
            return tuple(dict.fromkeys(operands))
    dtypes = [_dtype(v) for v in eqn.outvars if _floating_aval(v)]
    return (min(dtypes, key=lambda d: (d.itemsize, d.name)),)


def _runs_narrow(eqn: JaxprEqn) -> bool:
    """Whether a floating input or result of ``eqn`` is narrower than float32."""
    return any(_floating_aval(v) and not represents(_dtype(v), F32)
               for v in (*eqn.invars, *eqn.outvars))


def _as_list(eqn: JaxprEqn, outs: Any) -> list[Any]:
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _at_traced_dtypes(eqn: JaxprEqn, refs: list[Any]) -> list[Any]:
    """``eqn`` bound at the dtypes it was traced with, its results widened again."""
    ins = [convert(r, _dtype(v)) if _floating_aval(v) else r for r, v in zip(refs, eqn.invars)]
    return [widened(o) for o in _as_list(eqn, bind(eqn, ins))]


def _traced(eqn: JaxprEqn) -> bool:
    """Whether ``eqn``'s parameters fix its dtypes (an embedded jaxpr, a bit layout): it
    is evaluated at the traced dtypes, in float32 as in the program."""
    rule = rule_of(eqn.primitive.name)
    return rule is not None and rule.operands == "traced"


def _float32_bind(eqn: JaxprEqn, refs: list[Any]) -> list[Any]:
    """``eqn`` in the float32 evaluation: on float32 inputs, nothing narrowed."""
    name = eqn.primitive.name
    if _traced(eqn):
        return _at_traced_dtypes(eqn, refs)
    # On the inputs the program gave it, widened: the operation itself in float32.
    refs = [widened(r) for r in refs]
    if name == "reduce_precision":
        return [refs[0]]
    params = dict(eqn.params)
    if name == "convert_element_type" and is_floating_dtype(params["new_dtype"]):
        return [convert(refs[0], join(np.dtype(params["new_dtype"]), F32))]
    preferred = params.get("preferred_element_type")
    if preferred is not None and is_floating_dtype(preferred):
        params["preferred_element_type"] = join(np.dtype(preferred), F32)
    # Widened again: a primitive may make a narrow value from its parameters alone
    # (empty, full), as JAX's zeros of a branch not taken.
    return [widened(o) for o in _as_list(eqn, bind(eqn, refs, params))]

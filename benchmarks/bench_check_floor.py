"""How fast can a finiteness check be, next to the Adam step it guards?

A skip that updates donated buffers in place must know whether the gradients
are finite before it writes anything, so the check's own time is added to the
step's. This measures that floor on the optimizer-only workload of
``bench_loss_scaling.py`` (same shapes), in one process, interleaved:

* ``adam``: a donated plain ``optax.adam`` step (update + apply_updates);
* ``check``: jmp_policy's finiteness check alone (``all_finite`` of the grads;
  on XLA:CPU, one matrix-vector product ``x @ zeros`` per large float32 leaf);
* ``grouped``: the form of the check on other backends (and on XLA:CPU for
  small or non-float32 leaves): one fused ``sum(x * 0)`` per shape group;
* ``variadic``: the check variant of the ``--lm-layout`` experiment below;
* ``column``: another exact form that XLA:CPU compiles with LLVM instead of
  YNNPACK: per large leaf, a column reduction of ``x.reshape(-1, 256)`` with
  the absorbing reducer ``a + b * 0`` (see `_column_nonfinite_sum`). It runs
  as fast as the matrix-vector products; ``--lm-layout`` shows its compile
  time and LM bytes;
* ``contiguous``: the grouped check over ONE contiguous array holding as many
  float32 elements as all the gradients together -- the best case for that
  reduction (gradients live in separate buffers; concatenating them would copy
  them, so no real check gets this);
* ``plain sum``: one bare ``sum(x)`` per gradient leaf, with no elementwise op
  in front of the reduction. It is NOT an exact finiteness check: a finite leaf
  whose sum overflows (e.g. ``full(n, 3e38)``) reads as non-finite, and an
  exact fallback for that case would be a second ``cond`` whose branch XLA
  counts in the bytes accessed. It shows what the elementwise ``x * 0``
  costs on XLA:CPU.

``check / adam`` is roughly what the check adds to the wall time of a donated
step; ``contiguous / adam`` is the lower bound for the fused ``sum(x * 0)``;
``plain sum / adam`` for any reduction of the gradients. Run it once normally
and once pinned to one core (``taskset -c 0``) to see whether the reductions
use several threads.

``--lm-layout`` also prints XLA's bytes accessed for the full LM train step of
``bench_loss_scaling.py`` with the shipped check, the grouped one, and a
variant of the grouped one that feeds each per-shape sum to a 2-operand
(variadic) reduction, which makes XLA:CPU give the gradients the default
layout (the trade-off is discussed in ``RESULTS.md``).

Example::

    python benchmarks/bench_check_floor.py --rounds 20
    taskset -c 0 python benchmarks/bench_check_floor.py --rounds 20
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp

import jmp_policy
from jmp_policy import loss_scale
from bench_loss_scaling import (
    _compile_once, _cost, build_variants, hlo_instruction_count, lm_workload, optimizer_only_workload)


def _median_ms(samples) -> float:
    return statistics.median(samples) * 1e3


def wall_floor(params_count: float, leaves: int, rounds: int, iters: int) -> None:
    params, grads, desc, _ = optimizer_only_workload(params_count, leaves)
    n = sum(x.size for x in jax.tree.leaves(grads))
    contiguous = jnp.ones((n // 1024, 1024), jnp.float32)
    adam = build_variants("opt", None, [], True)[0]  # plain optax.adam, as in bench_loss_scaling
    step = jax.jit(adam.step, donate_argnums=(0, 1)).lower(params, adam.init_state(params), grads)
    step = step.compile()
    check = jax.jit(jmp_policy.all_finite).lower(grads).compile()
    grouped = jax.jit(lambda g: jnp.isfinite(loss_scale._grouped_nonfinite_sum(jax.tree.leaves(g))))
    grouped = grouped.lower(grads).compile()
    whole = jax.jit(lambda a: jnp.isfinite(loss_scale._grouped_nonfinite_sum([a])))
    whole = whole.lower(contiguous).compile()
    variadic = jax.jit(lambda g: jnp.isfinite(_variadic_nonfinite_sum(jax.tree.leaves(g))))
    variadic = variadic.lower(grads).compile()
    plain = jax.jit(_plain_sum).lower(grads).compile()
    column = jax.jit(lambda g: jnp.isfinite(_column_nonfinite_sum(jax.tree.leaves(g))))
    column = column.lower(grads).compile()
    overflowing = {"w": jnp.full((4,), 3e38, jnp.float32)}
    assert bool(jmp_policy.all_finite(overflowing)) and not bool(_plain_sum(overflowing))
    big = jnp.full((512, 256), 3e38, jnp.float32)
    assert bool(jnp.isfinite(_column_nonfinite_sum([big, -big])))
    assert not any(bool(jnp.isfinite(_column_nonfinite_sum([big, big.at[300, 7].set(bad)])))
                   for bad in (jnp.nan, jnp.inf, -jnp.inf))
    p = jax.tree.map(jnp.array, params)
    s = adam.init_state(p)

    def timed(fn, *args):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / iters

    times = {"adam": [], "check": [], "grouped": [], "contiguous": [], "variadic": [], "column": [],
             "plain": []}
    for _ in range(rounds):  # interleaved, so that load from elsewhere hits all alike
        t0 = time.perf_counter()
        for _ in range(iters):
            p, s = step(p, s, grads)
        jax.block_until_ready(p)
        times["adam"].append((time.perf_counter() - t0) / iters)
        times["check"].append(timed(check, grads))
        times["grouped"].append(timed(grouped, grads))
        times["contiguous"].append(timed(whole, contiguous))
        times["variadic"].append(timed(variadic, grads))
        times["column"].append(timed(column, grads))
        times["plain"].append(timed(plain, grads))
    ms = {k: _median_ms(v) for k, v in times.items()}
    print(f"{desc}; {os.cpu_count()} CPUs visible, affinity {len(os.sched_getaffinity(0))}")
    print(f"  donated adam step  {ms['adam']:.3f} ms")
    print(f"  check (all_finite) {ms['check']:.3f} ms = {ms['check'] / ms['adam']:.3f}x of the step")
    print(f"  grouped sum(x * 0) {ms['grouped']:.3f} ms = {ms['grouped'] / ms['adam']:.3f}x of the step")
    print(f"  contiguous check   {ms['contiguous']:.3f} ms = {ms['contiguous'] / ms['adam']:.3f}x of the step")
    print(f"  variadic check     {ms['variadic']:.3f} ms = {ms['variadic'] / ms['adam']:.3f}x of the step "
          "(the --lm-layout variant)")
    print(f"  column reductions  {ms['column']:.3f} ms = {ms['column'] / ms['adam']:.3f}x of the step "
          "(a + b * 0, compiled by LLVM)")
    print(f"  plain sum per leaf {ms['plain']:.3f} ms = {ms['plain'] / ms['adam']:.3f}x of the step "
          "(not exact: overflow reads as non-finite)")


def _plain_sum(grads) -> jax.Array:
    """``isfinite`` of the sum of bare per-leaf sums: fast, but overflow reads as non-finite."""
    sums = [jnp.sum(x) for x in jax.tree.leaves(grads) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.isfinite(functools.reduce(jnp.add, sums))


def _variadic_nonfinite_sum(leaves, multiplier=None):
    """The grouped check, but each per-shape sum goes through a 2-operand reduce."""
    if multiplier is not None:
        return loss_scale._nonfinite_sum(leaves, multiplier)
    groups: dict = {}
    for x in leaves:
        if jnp.issubdtype(x.dtype, jnp.floating) and x.size:
            key = (None if loss_scale._concatenable(x) else x.shape, x.dtype)
            groups.setdefault(key, []).append(x)
    total = jnp.zeros((), jnp.float32)
    for (shape, dtype), xs in groups.items():
        if shape is None:
            xs = [jnp.concatenate([jnp.ravel(x) for x in xs])]
        zero = jnp.zeros((), dtype)
        zeros = functools.reduce(jnp.add, [x * zero for x in xs])
        a, b = jax.lax.reduce((zeros, zeros), (zero, zero),
                              lambda u, v: (u[0] + v[0], u[1] + v[1]), tuple(range(zeros.ndim)))
        total = total + a.astype(jnp.float32) + b.astype(jnp.float32)
    return total


def _column_nonfinite_sum(leaves, multiplier=None):
    """The check with each large leaf as a column reduction under ``a + b * 0``.

    The reducer keeps ``a`` (0, one of the leaf's values, or non-finite) and
    turns ``b`` into 0 or NaN, so no partial result ever grows: it cannot
    overflow, a non-finite value always reaches the result, and that holds
    in whatever order XLA combines elements and partials. Not a YNNPACK
    pattern, so XLA:CPU compiles each leaf shape with LLVM (the cost this
    variant shows); smaller leaves take the grouped form.
    """
    if multiplier is not None:
        return loss_scale._nonfinite_sum(leaves, multiplier)
    columns, rest = [], []
    for x in leaves:
        if (jnp.issubdtype(x.dtype, jnp.floating) and x.size >= loss_scale._MATVEC_LEAF
                and x.size % 256 == 0):
            columns.append(jax.lax.reduce(x.reshape(-1, 256), jnp.zeros((), x.dtype),
                                          lambda a, b: a + b * 0, (0,)))
        elif jnp.issubdtype(x.dtype, jnp.floating) and x.size:
            rest.append(x)
    total = loss_scale._grouped_nonfinite_sum(rest)
    if columns:  # 256 values each: 0, leaf values or non-finite; * 0 before adding keeps it exact
        total = total + jnp.sum(functools.reduce(jnp.add, [c * 0 for c in columns])).astype(jnp.float32)
    return total


@contextlib.contextmanager
def _checked_by(check):
    """Makes `loss_scaling` trace with ``check`` as its finiteness check."""
    from jmp_policy import transform

    shipped = transform._nonfinite_sum
    transform._nonfinite_sum = check or shipped
    try:
        yield
    finally:
        transform._nonfinite_sum = shipped


_CHECKS = (("shipped", None), ("grouped", loss_scale._grouped_nonfinite_sum),
           ("variadic", _variadic_nonfinite_sum), ("column", _column_nonfinite_sum))


def _fused_variant(workload: str, loss_fn, donate: bool):
    return next(v for v in build_variants(workload, loss_fn, [], donate) if "update_and_apply" in v.name)


def lm_layout(params_count: float, leaves: int, compile_reps: int) -> None:
    # Compile time of each check on the optimizer-only step: the checks that
    # are not YNNPACK kernels on XLA:CPU are compiled by LLVM.
    params, grads, desc, _ = optimizer_only_workload(params_count, leaves)
    print(desc + ", donated, update_and_apply:")
    adam = build_variants("opt", None, [], True)[0]
    jitted = {"plain adam": (jax.jit(adam.step, donate_argnums=(0, 1)), adam.init_state(params))}
    _, compiled = _compile_once(jitted["plain adam"][0], params, jitted["plain adam"][1], grads)
    figures = {"plain adam": (_cost(compiled)["bytes accessed"], hlo_instruction_count(compiled.as_text()))}
    kernels, seconds = {}, {"plain adam": []}
    for name, check in _CHECKS:
        with _checked_by(check):
            v = _fused_variant("opt", None, True)
            state = v.init_state(params)
            # A fresh jit per check: the check is read at trace time.
            jitted[name] = (jax.jit(v.step, donate_argnums=(0, 1)), state)
            _, compiled = _compile_once(jitted[name][0], params, state, grads)
            hlo = compiled.as_text()
            kernels[name] = (hlo.count("__ynn_fusion"), hlo.count(" dot("))
            figures[name] = (_cost(compiled)["bytes accessed"], hlo_instruction_count(hlo))
        seconds[name] = []
    checks = (("plain adam", None),) + _CHECKS
    for _ in range(compile_reps):  # interleaved: compile time drifts on a shared machine
        for name, check in checks:
            with _checked_by(check):
                seconds[name].append(_compile_once(jitted[name][0], params, jitted[name][1], grads)[0])
    base = _median_ms(seconds["plain adam"])
    print(f"  plain adam: compile {base:.0f} ms (median of {compile_reps})")
    for name, _ in _CHECKS:
        ratios = [a / b for a, b in zip(figures[name], figures["plain adam"])]
        print(f"  {name} check: {kernels[name][0]} YNNPACK kernels, {kernels[name][1]} dots, compile "
              f"{_median_ms(seconds[name]):.0f} ms = {_median_ms(seconds[name]) / base:.2f}x, "
              f"bytes {ratios[0]:.3f}x, HLO instructions {ratios[1]:.2f}x")

    params, tokens, desc, loss_fn = lm_workload(1024, 128, 2, 4, 64, 8)
    print(desc)
    for donate in (True, False):
        mode = "donated" if donate else "not donated"
        baseline = build_variants("lm", loss_fn, [], donate)[0]
        _, compiled = _compile_once(jax.jit(baseline.step, donate_argnums=(0, 1) if donate else ()),
                                    params, baseline.init_state(params), tokens)
        base = _cost(compiled)["bytes accessed"]
        for name, check in _CHECKS:
            with _checked_by(check):
                v = _fused_variant("lm", loss_fn, donate)
                _, compiled = _compile_once(jax.jit(v.step, donate_argnums=(0, 1) if donate else ()),
                                            params, v.init_state(params), tokens)
            b = _cost(compiled)["bytes accessed"]
            print(f"  {mode}, {name} check: {b / base:.4f}x plain adam's bytes ({b / 2**20:.1f} MiB)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=8e6)
    ap.add_argument("--leaves", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--lm-layout", action="store_true", help="also the layout experiment")
    ap.add_argument("--compile-reps", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"jax {jax.__version__} on {jax.default_backend()}")
    wall_floor(args.params, args.leaves, args.rounds, args.iters)
    if args.lm_layout:
        lm_layout(args.params, args.leaves, args.compile_reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())

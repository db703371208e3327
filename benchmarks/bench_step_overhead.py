"""Where a donated optimizer-only step spends its time: host dispatch or the device?

Written for GPUs, where the optimizer-only step of ``bench_loss_scaling.py``
(about 100 leaves) is bound by the host: launching ~100-300 kernels and
passing ~400 buffers takes longer than the device work. For each recipe this
prints, per step (median of interleaved rounds):

* ``total``: wall time of ``--iters`` donated steps, until the results are ready;
* ``enqueue``: time until the Python loop has *dispatched* them. When it is
  close to ``total``, the host is the bottleneck and the ratios measure
  launches, not memory traffic;

plus XLA's bytes accessed, fusions and ``conditional`` ops of the compiled
step (XLA:GPU sometimes turns a ``lax.cond`` into per-leaf selects).

Besides the recipes of ``bench_loss_scaling.py`` it times four diagnostic
forms built on plain Adam: ``check+select`` (jmp_policy's finiteness check,
then ``select_tree``), ``check+cond`` (the check, then a ``lax.cond`` around
Adam), ``check+cond+unscale`` (the same, with Adam fed ``g * (1 / scale)``,
``1 / scale`` computed before the ``cond``; ``... 1/scale in the branch``
computes it inside the taken branch instead) and ``cond only`` (a ``lax.cond`` on one gradient element: the cost of
the conditional itself); and ``loss_scaling, check per leaf``, jmp_policy with
one reduction per leaf instead of one per shape group.

    python benchmarks/bench_step_overhead.py            # 7.96M params
    python benchmarks/bench_step_overhead.py --tiny     # 1-element leaves: host cost alone
    python benchmarks/bench_step_overhead.py --params 6.4e7
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp

import jmp_policy
from bench_check_floor import _checked_by, _fused_variant
from bench_loss_scaling import _cost, build_variants, optimizer_only_workload
from jmp_policy._dtypes import is_floating_dtype
from jmp_policy.loss_scale import _nonfinite_sum

PEERS = ("jmp_policy.loss_scaling(adam)", "jmp_policy ... .update_and_apply",
         "optax.apply_if_finite(adam)", "Keras LossScaleOptimizer(Adam)", "jmp recipe (select_tree)")


def per_leaf_check(leaves, multiplier=None):
    """jmp_policy's check with one ``sum(x * 0)`` reduction per leaf (no grouping)."""
    if multiplier is not None:
        return _nonfinite_sum(leaves, multiplier)
    total = jnp.zeros((), jnp.float32)
    for x in leaves:
        if is_floating_dtype(x.dtype) and x.size:
            zero = jnp.zeros((), x.dtype)
            total = total + jax.lax.reduce(x * zero, zero, jax.lax.add,
                                           tuple(range(x.ndim))).astype(jnp.float32)
    return total


def diagnostic_steps(baseline):
    """The diagnostic forms, around ``baseline`` (bench_loss_scaling's plain Adam step)."""
    plain, init = baseline.step, baseline.init_state

    def finite(g):
        return jnp.isfinite(_nonfinite_sum(jax.tree.leaves(g)))

    def check_select(p, s, g):
        return jmp_policy.select_tree(finite(g), plain(p, s, g), (p, s))

    def check_cond(p, s, g):
        return jax.lax.cond(finite(g), plain, lambda p, s, g: (p, s), p, s, g)

    def cond_only(p, s, g):
        pred = jnp.isfinite(jax.tree.leaves(g)[0].ravel()[0])
        return jax.lax.cond(pred, plain, lambda p, s, g: (p, s), p, s, g)

    def init_with_scale(p):
        return init(p), jnp.float32(2.0**15)

    def check_cond_unscale(p, state, g):
        # check+cond, plus the `1 / scale` multiply of a loss-scaled step (the
        # scale is state, so XLA cannot fold it into a constant), with
        # `1 / scale` computed before the cond, as jmp_policy does.
        s, scale = state

        def update(p, s, g, inverse):
            return plain(p, s, jax.tree.map(lambda x: x * inverse, g))

        p, s = jax.lax.cond(finite(g), update, lambda p, s, g, inverse: (p, s), p, s, g, 1 / scale)
        return p, (s, scale)

    def check_cond_unscale_inside(p, state, g):
        # The same, with `1 / scale` computed inside the taken branch.
        s, scale = state

        def update(p, s, g):
            return plain(p, s, jax.tree.map(lambda x: x * (1 / scale), g))

        p, s = jax.lax.cond(finite(g), update, lambda p, s, g: (p, s), p, s, g)
        return p, (s, scale)

    return [(baseline.name, plain, init), ("check+select", check_select, init),
            ("check+cond", check_cond, init), ("check+cond+unscale", check_cond_unscale, init_with_scale),
            ("... 1/scale in the branch", check_cond_unscale_inside, init_with_scale),
            ("cond only", cond_only, init)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=8e6)
    ap.add_argument("--leaves", type=int, default=100)
    ap.add_argument("--tiny", action="store_true", help="1-element leaves: host cost alone")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args(argv)

    params, grads, desc, _ = optimizer_only_workload(args.params, args.leaves)
    if args.tiny:
        params, grads = (jax.tree.map(lambda x: jnp.zeros((1,) * x.ndim, x.dtype), t)
                         for t in (params, grads))
        desc += ", every leaf cut to one element"
    print(f"jax {jax.__version__} on {jax.devices()}; {desc}; donated")

    variants = {v.name: v for v in build_variants("opt", None, [], True)}
    recipes = [(*r, None) for r in diagnostic_steps(variants["optax.adam (baseline)"])]
    recipes += [(name, variants[name].step, variants[name].init_state, None) for name in PEERS]
    v = _fused_variant("opt", None, True)
    recipes.append(("loss_scaling, check per leaf", v.step, v.init_state, per_leaf_check))

    runs = {}
    for name, step, init, check in recipes:
        p = jax.tree.map(jnp.array, params)
        s = init(p)
        with _checked_by(check):  # the check is read when the step is traced
            compiled = jax.jit(step, donate_argnums=(0, 1)).lower(p, s, grads).compile()
        hlo = compiled.as_text()
        runs[name] = [compiled, p, s, _cost(compiled).get("bytes accessed", float("nan")),
                      hlo.count(" fusion("), hlo.count(" conditional(")]
    enqueue = {k: [] for k in runs}
    total = {k: [] for k in runs}
    for _ in range(args.rounds):  # interleaved
        for name, run in runs.items():
            compiled, p, s = run[:3]
            jax.block_until_ready(p)
            t0 = time.perf_counter()
            for _ in range(args.iters):
                p, s = compiled(p, s, grads)
            t1 = time.perf_counter()
            jax.block_until_ready(p)
            t2 = time.perf_counter()
            enqueue[name].append((t1 - t0) / args.iters)
            total[name].append((t2 - t0) / args.iters)
            run[1], run[2] = p, s
    base_t = statistics.median(total["optax.adam (baseline)"])
    base_b = runs["optax.adam (baseline)"][3]
    print(f"{'recipe':34s} {'total':>18s} {'enqueue':>10s} {'bytes':>7s} {'fusions':>7s} {'cond':>4s}")
    for name, run in runs.items():
        t, e = statistics.median(total[name]), statistics.median(enqueue[name])
        print(f"{name:34s} {t * 1e3:7.3f} ms {t / base_t:5.2f}x {e * 1e3:7.3f} ms "
              f"{run[3] / base_b:6.3f}x {run[4]:7d} {run[5]:4d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

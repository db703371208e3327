"""Autocast overhead: compile time and compiled size of a mixed-precision train step.

Three versions of the same train step (a pre-LayerNorm transformer block with a
classification head, Adam, dynamic loss scaling) are compiled and compared:

* ``float32``: no mixed precision (reference);
* ``hand-cast``: a careful hand-written mixed-precision model: every matmul casts
  its operands to float16 and widens its float16 product back to float32;
  LayerNorm, softmax and the loss stay float32, params stay float32;
* ``autocast``: the float32 model under ``jmp_policy.autocast(..., "mixed_float16")``.

For each: time to trace + lower + compile (fresh function objects every repeat,
so nothing is cached; best and median of ``--repeats``, compiled round-robin so
that load on a shared machine hits every version alike), ops in the lowered StableHLO,
ops of the optimized HLO's entry computation (the fusions, dots and copies a
step launches), all instructions of the optimized module (fusion bodies
included), and the run time of one step (CPU: indicative only, half precision
is emulated there).

Run: ``python benchmarks/bench_autocast.py [--repeats 5] [--width 128]``.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import jmp_policy

F16 = jnp.float16


def layer_norm(x, g, b):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * lax.rsqrt(var + 1e-5) * g + b


def make_model(mm):
    """The model with its matrix products done by ``mm(a, b, spec)``."""

    def block(p, x, heads):
        b, t, d = x.shape
        h = layer_norm(x, p["g1"], p["c1"])
        q, k, v = [mm(h, p[w], "btd,de->bte").reshape(b, t, heads, d // heads)
                   for w in ("wq", "wk", "wv")]
        s = mm(q, k, "bthd,bshd->bhts") / np.sqrt(d // heads)
        a = jax.nn.softmax(s, axis=-1)
        o = mm(a, v, "bhts,bshd->bthd").reshape(b, t, d)
        x = x + mm(o, p["wo"], "btd,de->bte")
        h = layer_norm(x, p["g2"], p["c2"])
        h = jax.nn.gelu(mm(h, p["w1"], "btd,de->bte") + p["b1"])
        return x + mm(h, p["w2"], "btd,de->bte") + p["b2"]

    def loss_fn(p, tokens, y, heads=4):
        x = p["emb"][tokens] + p["pos"]
        x = layer_norm(block(p, x, heads), p["g3"], p["c3"])
        logits = mm(x.mean(1), p["head"], "bd,dc->bc")
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return loss_fn


float32_loss = make_model(lambda a, b, spec: jnp.einsum(spec, a, b))
# Careful hand-written mixed precision: half-precision products, widened right away so
# that everything around them (residuals, LayerNorm, softmax, loss) stays float32.
hand_loss = make_model(
    lambda a, b, spec: jnp.einsum(spec, a.astype(F16), b.astype(F16)).astype(jnp.float32))


def init(key, vocab, seq, width, classes):
    ks = jax.random.split(key, 9)
    n = lambda k, shape: jax.random.normal(k, shape) * shape[0] ** -0.5
    return dict(
        emb=n(ks[0], (vocab, width)), pos=n(ks[1], (seq, width)),
        wq=n(ks[2], (width, width)), wk=n(ks[3], (width, width)), wv=n(ks[4], (width, width)),
        wo=n(ks[5], (width, width)), w1=n(ks[6], (width, 4 * width)), b1=jnp.zeros(4 * width),
        w2=n(ks[7], (4 * width, width)), b2=jnp.zeros(width), head=n(ks[8], (width, classes)),
        g1=jnp.ones(width), c1=jnp.zeros(width), g2=jnp.ones(width), c2=jnp.zeros(width),
        g3=jnp.ones(width), c3=jnp.zeros(width))


def make_step(kind):
    """A fresh train step (fresh function objects: no tracing or compile cache hits)."""
    if kind == "float32":
        loss_fn = lambda p, t, y: float32_loss(p, t, y)
    elif kind == "hand-cast":
        loss_fn = lambda p, t, y: hand_loss(p, t, y)
    else:
        loss_fn = jmp_policy.autocast(lambda p, t, y: float32_loss(p, t, y), "mixed_float16")
    tx = jmp_policy.loss_scaling(optax.adam(1e-3), "dynamic")

    def step(params, opt_state, tokens, y):
        scale = jmp_policy.get_loss_scale(opt_state)
        loss, grads = jmp_policy.scaled_value_and_grad(loss_fn)(scale, params, tokens, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step), tx


def count_stablehlo_ops(text: str) -> int:
    """Ops in the lowered module: ``%x = stablehlo.op`` plus result-less ones (return...)."""
    return (len(re.findall(r"=\s*\"?stablehlo\.", text))
            + len(re.findall(r"^\s*stablehlo\.", text, re.M)))


def count_hlo_instructions(text: str) -> int:
    # One instruction per line of the form "name = type op(...)" in any computation.
    return sum(1 for line in text.splitlines() if re.match(r"\s*(ROOT\s+)?%?[\w.\-]+ = ", line))


def count_entry_instructions(text: str) -> int:
    """Instructions of the ENTRY computation: the kernels (fusions, dots, ...) a step runs."""
    entry = text[text.index("ENTRY"):]
    return count_hlo_instructions(entry[:entry.index("\n}")])


def compile_once(kind, args):
    step, _ = make_step(kind)
    t0 = time.perf_counter()
    lowered = step.trace(*args).lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t0, lowered, compiled


def measure(kinds, args, repeats):
    """Compiles every kind ``repeats`` times, round-robin, so machine load hits all alike."""
    for kind in kinds:
        compile_once(kind, args)  # warm-up: JAX's own caches, imports
    times = {kind: [] for kind in kinds}
    last = {}
    for _ in range(repeats):
        for kind in kinds:
            trace, total, lowered, compiled = compile_once(kind, args)
            times[kind].append((trace, total))
            last[kind] = (lowered, compiled)
    rows = {}
    for kind in kinds:
        lowered, compiled = last[kind]
        out = compiled(*args)
        jax.block_until_ready(out)
        t0 = time.perf_counter()
        for _ in range(10):
            out = compiled(*args)
        jax.block_until_ready(out)
        traces, totals = zip(*times[kind])
        rows[kind] = dict(
            trace_lower=min(traces), total=min(totals), total_median=statistics.median(totals),
            stablehlo=count_stablehlo_ops(lowered.as_text()),
            hlo=count_hlo_instructions(compiled.as_text()),
            entry=count_entry_instructions(compiled.as_text()),
            run=(time.perf_counter() - t0) / 10,
            loss=float(out[2]),
        )
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    a = parser.parse_args()
    vocab, classes = 256, 10
    params = init(jax.random.key(0), vocab, a.seq, a.width, classes)
    tokens = jax.random.randint(jax.random.key(1), (a.batch, a.seq), 0, vocab)
    y = jax.random.randint(jax.random.key(2), (a.batch,), 0, classes)
    _, tx = make_step("float32")
    args = (params, tx.init(params), tokens, y)

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; width {a.width}, seq {a.seq}, "
          f"batch {a.batch}; times: best of {a.repeats} fresh compiles (median in brackets)")
    rows = measure(("float32", "hand-cast", "autocast"), args, a.repeats)
    print(f"{'train step':<10} | {'trace+lower s':>13} | {'+compile s (median)':>19} | "
          f"{'StableHLO ops':>13} | {'HLO entry ops':>13} | {'HLO all instrs':>14} | "
          f"{'step ms':>8} | {'loss':>8}")
    print("-" * 117)
    for kind, r in rows.items():
        total = f"{r['total']:.3f} ({r['total_median']:.3f})"
        print(f"{kind:<10} | {r['trace_lower']:13.3f} | {total:>19} | {r['stablehlo']:13d} | "
              f"{r['entry']:13d} | {r['hlo']:14d} | {1e3 * r['run']:8.2f} | {r['loss']:8.4f}")
    auto, hand = rows["autocast"], rows["hand-cast"]
    print(f"\nautocast / hand-cast compile time: {auto['total'] / hand['total']:.2f}x best, "
          f"{auto['total_median'] / hand['total_median']:.2f}x median "
          f"(trace+lower alone {auto['trace_lower'] / hand['trace_lower']:.2f}x); "
          f"StableHLO ops {auto['stablehlo']} vs {hand['stablehlo']}; optimized HLO entry ops "
          f"{auto['entry']} vs {hand['entry']} (all instructions {auto['hlo']} vs {hand['hlo']})")


if __name__ == "__main__":
    main()

"""Autocast overhead: compile time and compiled size of a mixed-precision train step.

Three versions of the same train step (a pre-LayerNorm transformer block with a
classification head, Adam, dynamic loss scaling) are compiled and compared:

* ``float32``: no mixed precision (reference);
* ``hand-cast`` (the baseline): a careful hand-written mixed-precision model:
  every matmul casts its operands to float16 and widens its float16 product
  back to float32; LayerNorm, softmax and the loss stay float32, params stay
  float32;
* ``autocast``: the float32 model under ``jmp_policy.autocast(..., "mixed_float16")``.

Figures (`harness.measure`): trace + lower time and XLA compile time (a fresh
autocast wrapper and JAX's caches cleared for every compile; medians of
``--compile-rounds`` interleaved rounds), ops in the lowered StableHLO, every
instruction of the optimized HLO (fusion bodies included), its top-level ops
(the fusions, dots and copies a step launches), bytes accessed, and the wall
time of a step (on a CPU indicative only: half precision is emulated there).

Commands (from the repository root; JSON to ``benchmarks/results/bench_autocast.json``)::

    python -m benchmarks.bench_autocast                      # ~1-2 min on 2 CPU cores
    python -m benchmarks.bench_autocast --quick              # smoke run, ~20 s
    python -m benchmarks.bench_autocast --width 256 --compile-rounds 7
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from benchmarks import harness
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


KINDS = ("float32", "hand-cast", "autocast")
COLUMNS = [
    harness.Column("lower_s", "trace + lower", "s"),
    harness.Column("compile_s", "XLA compile", "s"),
    harness.Column("stablehlo_ops", "StableHLO ops", "count"),
    harness.Column("hlo_instructions", "HLO instructions", "count"),
    harness.Column("top_level_ops", "top-level ops", "count"),
    harness.Column("bytes_accessed", "bytes accessed", "bytes"),
    harness.Column("wall_s", "step time (CPU: indicative)", "s"),
]


def make_step(kind: str):
    """A fresh train step ``(params, opt_state, tokens, y) -> (params, opt_state, loss)``."""
    if kind == "float32":
        loss_fn = lambda p, t, y: float32_loss(p, t, y)  # noqa: E731
    elif kind == "hand-cast":
        loss_fn = lambda p, t, y: hand_loss(p, t, y)  # noqa: E731
    else:
        loss_fn = jmp_policy.autocast(lambda p, t, y: float32_loss(p, t, y), "mixed_float16")
    tx = jmp_policy.loss_scaling(optax.adam(1e-3), "dynamic")

    def step(params, opt_state, tokens, y):
        scale = jmp_policy.get_loss_scale(opt_state)
        loss, grads = jmp_policy.scaled_value_and_grad(loss_fn)(scale, params, tokens, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, tx


def stablehlo_ops(build: harness.Build) -> dict:
    return {"stablehlo_ops": harness.count_stablehlo_ops(build.lowered.as_text())}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    harness.add_common_arguments(parser, rounds=10, iters=5, compile_rounds=5)
    a = parser.parse_args(argv)
    if a.quick:
        a.width, a.seq, a.batch, a.compile_rounds, a.rounds, a.iters = 32, 16, 4, 1, 3, 2
    vocab, classes = 256, 10
    params = init(jax.random.key(0), vocab, a.seq, a.width, classes)
    tokens = jax.random.randint(jax.random.key(1), (a.batch, a.seq), 0, vocab)
    y = jax.random.randint(jax.random.key(2), (a.batch,), 0, classes)
    _, tx = make_step("float32")
    args = (params, tx.init(params), tokens, y)
    cases = [harness.Case(kind, make_step(kind)[0], args, carry=2, extra=stablehlo_ops,
                          make_fn=lambda kind=kind: make_step(kind)[0]) for kind in KINDS]

    report = harness.Report("bench_autocast", __doc__.splitlines()[0], vars(a), argv)
    desc = (f"transformer block + classifier, width {a.width}, seq {a.seq}, batch {a.batch}, "
            "Adam with dynamic loss scaling")
    print(f"jax {jax.__version__} on {jax.default_backend()}; {desc}", flush=True)
    rows, failed = harness.measure(cases, compile_rounds=a.compile_rounds, rounds=a.rounds,
                                   iters=a.iters, wall=not a.no_wall)
    table = report.table("train-step", "autocast against a hand-cast train step",
                         baseline="hand-cast", columns=COLUMNS, description=desc)
    table.add_rows(rows)
    report.failed(failed)
    print(harness.render_table(table.to_json()))
    path = a.json or harness.default_json_path("bench_autocast", a.quick)
    report.write(path)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Float8 autocast on CPU: product accuracy per recipe, compile cost, and training accuracy.

Tables of the report (``benchmarks/results/bench_fp8.json``):

``accuracy``
    Relative error (norm of the error over the norm of the float32 result) of
    one product ``x @ w`` (256 x 512 x 256) and of its two backward products
    (the gradients of x and of w), under ``autocast(jnp.matmul, "float32",
    fp8=recipe)``: tensorwise and rowwise scaling with exact (the default) and
    power-of-two scales, the block scalings MXFP8 and NVFP4 (the latter also
    with its gradients rounded to nearest instead of stochastically), and
    plain bfloat16 autocast for reference. Operands:
    standard normal; scaled to 1e-4 and to 1e4 (outside float8_e4m3fn's range
    unscaled); one outlier row of order 1e4 among rows of order 1 (the error
    is measured on the other rows); heavy-tailed (log-normal magnitudes,
    sigma 2). Deterministic: the same figures on every machine.
``compile``
    A transformer LM train step (2 blocks, d_model 128, AdamW) under
    ``autocast(..., "mixed_bfloat16")``, with and without ``fp8=``:
    trace + lower and XLA compile time (medians of ``--compile-rounds``
    interleaved fresh compiles), StableHLO ops, float8 ``dot_general`` ops,
    optimized HLO instructions and top-level ops, and the step's wall time
    on this CPU; ratios to the bfloat16 step. A CPU emulates float8 and the
    block scalings, so the wall times say what emulation costs, not what a GPU
    gains (``gpu_fp8.py`` measures speed).
``training`` (with ``--training``, written to ``bench_fp8_training.json``)
    ``examples/transformer_lm.py``'s model trained for ``--steps`` steps per
    seed, under its ``mixed_bfloat16`` module policy and with its ``apply``
    under ``autocast(..., "mixed_bfloat16", fp8=recipe)`` for each recipe
    variant behind the defaults: held-out bits per byte (the example's
    metric: every window of the held-out text, the same for every seed) and the
    mean training loss of the last
    ``--tail`` steps, both in bits per byte, means over the seeds (per-seed
    values under ``samples``); ratios to ``mixed_bfloat16``. ``--runs``
    picks runs by name; ``--experts E`` trains the example's
    mixture-of-experts variant (E experts, top-2) instead.

Commands (from the repository root)::

    python -m benchmarks.bench_fp8                          # accuracy + compile, ~2 min
    python -m benchmarks.bench_fp8 --training               # ~45 min on 2 busy CPU cores
    python -m benchmarks.bench_fp8 --quick                  # smoke run, ~30 s
    # the block-scaled recipes' training tables (docs/fp8.md), ~15 min each:
    python -m benchmarks.bench_fp8 --training --steps 300 --tail 100 --seeds 0 1 \
        --runs mixed_bfloat16 tensorwise rowwise mxfp8 nvfp4 "nvfp4, round to nearest" \
        --json benchmarks/results/bench_fp8_training_blocks.json
    python -m benchmarks.bench_fp8 --training --steps 300 --tail 100 --seeds 0 1 --experts 4 \
        --runs mixed_bfloat16 tensorwise rowwise mxfp8 nvfp4 \
        --json benchmarks/results/bench_fp8_training_moe.json
    python -m benchmarks.bench_fp8 --training --steps 300 --tail 100 --seeds 0 1 \
        --runs mixed_bfloat16 "nvfp4, batched=False" \
        --json benchmarks/results/bench_fp8_training_nvfp4_batched.json
    # delayed scaling against the current scalings (five seeds), and its variants:
    python -m benchmarks.bench_fp8 --training --seeds 0 1 2 3 4 \
        --runs mixed_bfloat16 tensorwise rowwise delayed \
        --json benchmarks/results/bench_fp8_training_delayed.json
    python -m benchmarks.bench_fp8 --training --seeds 0 1 2 3 4 \
        --runs "delayed, history 16" "delayed, most recent" \
        --json benchmarks/results/bench_fp8_training_delayed_variants.json
    # float8 residuals (autocast's residuals="float8") with each recipe, ~60 min:
    python -m benchmarks.bench_fp8 --training --seeds 0 1 2 3 4 --workers 2 \
        --runs mixed_bfloat16 "float8 residuals" "tensorwise, float8 residuals" \
               "rowwise, float8 residuals" "mxfp8, float8 residuals" \
        --json benchmarks/results/bench_fp8_training_residuals.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import math
import multiprocessing
import sys
from typing import Any, Callable, List, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import harness
import jmp_policy

R = jmp_policy.Float8Recipe
ACCURACY_RECIPES: dict[str, Optional[R]] = {
    "bfloat16 (no fp8)": None,
    "tensorwise": R("tensorwise"),
    "tensorwise, 2^k scales": R("tensorwise", power_of_two_scales=True),
    "rowwise": R("rowwise"),
    "rowwise, 2^k scales": R("rowwise", power_of_two_scales=True),
    "mxfp8": R("mxfp8"),
    "nvfp4": R("nvfp4"),
    "nvfp4, round to nearest": R("nvfp4", stochastic_rounding=False),
}
DISTRIBUTIONS = ("normal", "1e-4", "1e4", "outlier row", "heavy-tailed")

# The runs behind the defaults; "autocast, no fp8" wraps apply like the others but
# leaves every product out of float8 (to tell autocast's own effect from float8's).
TRAINING_RUNS: dict[str, Any] = {
    "mixed_bfloat16": None,
    "autocast, no fp8": R(min_size=2**31),
    "tensorwise": "tensorwise",
    "rowwise": "rowwise",
    "delayed": "delayed",
    "delayed, history 16": R("delayed", amax_history_length=16),
    "delayed, most recent": R("delayed", amax_reduction="most_recent"),
    "tensorwise, head fp8": R("tensorwise", exclude=()),
    "rowwise, head fp8": R("rowwise", exclude=()),
    "tensorwise, 2^k scales": R("tensorwise", power_of_two_scales=True),
    "rowwise, 2^k scales": R("rowwise", power_of_two_scales=True),
    "tensorwise, bf16 weight grad": R("tensorwise", float8_weight_gradient=False),
    "rowwise, bf16 weight grad": R("rowwise", float8_weight_gradient=False),
    "tensorwise, batched=False": R("tensorwise", batched=False),
    "rowwise, batched=False": R("rowwise", batched=False),
    "mxfp8": "mxfp8",
    "nvfp4": "nvfp4",
    "nvfp4, round to nearest": R("nvfp4", stochastic_rounding=False),
    # The parts of NVIDIA's NVFP4 training recipe, on and off. "last block bf16" keeps the
    # second of the two blocks in bfloat16; "bf16 last 10%" trains the last 10% of the steps
    # without float8 (the same params and optimizer state).
    "nvfp4, batched=True": R("nvfp4", batched=True),
    "nvfp4, Hadamard": R("nvfp4", hadamard=True),
    "nvfp4, 16x16 weight tiles": R("nvfp4", tiled_weights=True),
    "nvfp4, Hadamard, 16x16 weight tiles": R("nvfp4", hadamard=True, tiled_weights=True),
    "nvfp4, Hadamard, 16x16 weight tiles, batched=True":
        R("nvfp4", hadamard=True, tiled_weights=True, batched=True),
    "nvfp4, Hadamard, 16x16 weight tiles, round to nearest":
        R("nvfp4", hadamard=True, tiled_weights=True, stochastic_rounding=False),
    "nvfp4, Hadamard, 16x16 weight tiles, last block bf16":
        R("nvfp4", hadamard=True, tiled_weights=True, high_precision_layers=(0, 1)),
    "nvfp4, Hadamard, 16x16 weight tiles, bf16 last 10%":
        (R("nvfp4", hadamard=True, tiled_weights=True), 0.1),
    "nvfp4, last block bf16": R("nvfp4", high_precision_layers=(0, 1)),
    "nvfp4, bf16 last 10%": ("nvfp4", 0.1),
    "mxfp8, batched=False": R("mxfp8", batched=False),
    "nvfp4, Four Over Six": R("nvfp4", four_over_six=True),
    "nvfp4, Four Over Six, last block bf16":
        R("nvfp4", four_over_six=True, high_precision_layers=(0, 1)),
    "nvfp4, Hadamard, 16x16 weight tiles, Four Over Six, last block bf16":
        R("nvfp4", hadamard=True, tiled_weights=True, four_over_six=True,
          high_precision_layers=(0, 1)),
    # Float8 residuals (autocast's residuals="float8"), with and without float8 products.
    "float8 residuals": {"residuals": "float8"},
    "tensorwise, float8 residuals": {"fp8": "tensorwise", "residuals": "float8"},
    "rowwise, float8 residuals": {"fp8": "rowwise", "residuals": "float8"},
    "mxfp8, float8 residuals": {"fp8": "mxfp8", "residuals": "float8"},
    "nvfp4, float8 residuals": {"fp8": "nvfp4", "residuals": "float8"},
    "delayed, float8 residuals": {"fp8": "delayed", "residuals": "float8"},
    "nvfp4, bf16 last 10%, float8 residuals": ({"fp8": "nvfp4", "residuals": "float8"}, 0.1),
    "tensorwise, float8 residuals, softmax excluded":
        {"fp8": "tensorwise", "residuals": jmp_policy.Float8Residuals(exclude=("Softmax",))},
}


# --- accuracy ----------------------------------------------------------------------------

def operands(kind: str, m: int = 256, k: int = 512, n: int = 256):
    """``(x, w, cotangent, rows)``: a product's operands, the gradient reaching it, and the
    output rows the error is measured on."""
    keys = jax.random.split(jax.random.key(0), 3)
    x, w, ct = (jax.random.normal(key, shape) for key, shape in zip(keys, [(m, k), (k, n), (m, n)]))
    rows = slice(None)
    if kind in ("1e-4", "1e4"):
        x, w, ct = (a * float(kind) for a in (x, w, ct))
    elif kind == "outlier row":
        x, rows = x.at[0].multiply(1e4), slice(1, None)
    elif kind == "heavy-tailed":
        keys = jax.random.split(jax.random.key(1), 3)
        x, w, ct = (a * jnp.exp(2 * jax.random.normal(key, a.shape))
                    for a, key in zip((x, w, ct), keys))
    return x, w, ct, rows


def rel_error(got: Any, want: Any) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def accuracy(table: harness.Table, size: tuple[int, int, int]) -> None:
    for kind in DISTRIBUTIONS:
        x, w, ct, sel = operands(kind, *size)
        want, vjp = jax.vjp(jnp.matmul, x, w)
        want_dx, want_dw = vjp(ct)
        for name, recipe in ACCURACY_RECIPES.items():
            policy = "mixed_bfloat16" if recipe is None else "float32"
            f = jmp_policy.autocast(jnp.matmul, policy, fp8=recipe)
            out, dx, dw = jax.jit(lambda x, w, ct: (lambda o, vjp: (o, *vjp(ct.astype(o.dtype))))(
                *jax.vjp(f, x, w)))(x, w, ct)
            table.add_row(f"{kind}: {name}", {
                "forward": rel_error(out[sel], want[sel]),
                "grad_x": rel_error(dx[sel], want_dx[sel]),
                "grad_w": rel_error(dw, want_dw)})


ACCURACY_COLUMNS = [harness.Column("forward", "forward", "", ratio=False),
                    harness.Column("grad_x", "gradient of x", "", ratio=False),
                    harness.Column("grad_w", "gradient of w", "", ratio=False)]


# --- compile cost ------------------------------------------------------------------------

def layer_norm(x, g):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * g


def lm_loss(p, tokens, heads=4):
    """A transformer LM in plain JAX, under the named scopes Flax would give it."""
    b, t = tokens.shape[0], tokens.shape[1] - 1
    x = p["emb"][tokens[:, :-1]]
    d = x.shape[-1]
    for i, blk in enumerate(p["blocks"]):
        with jax.named_scope(f"block_{i}"):
            q, k, v = jnp.split(layer_norm(x, blk["g1"]) @ blk["qkv"], 3, axis=-1)
            q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // heads)
            s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
            a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v).reshape(b, t, d)
            x = x + a @ blk["proj"]
            x = x + jax.nn.gelu(layer_norm(x, blk["g2"]) @ blk["w1"]) @ blk["w2"]
    with jax.named_scope("logits"):
        logits = layer_norm(x, p["g"]) @ p["head"]
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), tokens[:, 1:]).mean()


def lm_params(d: int, vocab: int = 256, layers: int = 2):
    keys = iter(jax.random.split(jax.random.key(0), 4 * layers + 2))
    n = lambda shape: jax.random.normal(next(keys), shape) * shape[0] ** -0.5  # noqa: E731
    blocks = [dict(qkv=n((d, 3 * d)), proj=n((d, d)), w1=n((d, 4 * d)), w2=n((4 * d, d)),
                   g1=jnp.ones(d), g2=jnp.ones(d)) for _ in range(layers)]
    return dict(emb=n((vocab, d)), blocks=blocks, g=jnp.ones(d), head=n((d, vocab)))


def make_step(fp8: Optional[str]) -> Callable[..., Any]:
    """A fresh train step (a fresh autocast wrapper: nothing comes from its trace cache)."""
    loss_fn = jmp_policy.autocast(lambda p, t: lm_loss(p, t), "mixed_bfloat16", fp8=fp8)
    tx = optax.adamw(1e-3)

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def lowered_figures(build: harness.Build) -> dict:
    text = build.lowered.as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    return {"stablehlo_ops": harness.count_stablehlo_ops(text),
            "float8_dots": sum(": (tensor<" in d and "xf8" in d.split(" : ")[-1] for d in dots)}


COMPILE_COLUMNS = [
    harness.Column("lower_s", "trace + lower", "s"),
    harness.Column("compile_s", "XLA compile", "s"),
    harness.Column("stablehlo_ops", "StableHLO ops", "count"),
    harness.Column("float8_dots", "float8 dot_generals", "count", ratio=False),
    harness.Column("hlo_instructions", "HLO instructions", "count"),
    harness.Column("top_level_ops", "top-level ops", "count"),
    harness.Column("wall_s", "step time (CPU)", "s"),
]


def compile_cost(report: harness.Report, a: argparse.Namespace) -> None:
    params = lm_params(a.width)
    tokens = jax.random.randint(jax.random.key(1), (a.batch, a.seq + 1), 0, 256)
    args = (params, optax.adamw(1e-3).init(params), tokens)
    cases = [harness.Case("bfloat16" if k is None else f"fp8 {k}", make_step(k), args, carry=2,
                          extra=lowered_figures, make_fn=lambda k=k: make_step(k))
             for k in (None, "tensorwise", "rowwise", "mxfp8", "nvfp4")]
    rows, failed = harness.measure(cases, compile_rounds=a.compile_rounds, rounds=a.rounds,
                                   iters=a.iters, wall=not a.no_wall)
    desc = (f"transformer LM, 2 blocks, d_model {a.width}, seq {a.seq}, batch {a.batch}, AdamW, "
            "under autocast mixed_bfloat16")
    table = report.table("compile", "float8 train step against the bfloat16 one: compile cost",
                         baseline="bfloat16", columns=COMPILE_COLUMNS, description=desc)
    table.add_rows(rows)
    report.failed(failed)


# --- training ------------------------------------------------------------------------------

TRAINING_COLUMNS = [
    harness.Column("held_out_bpb", "held-out loss", "bits/byte"),
    harness.Column("held_out_plain_bpb", "held-out loss, weights run without fp8", "bits/byte"),
    harness.Column("train_bpb", "training loss, last steps", "bits/byte"),
]


def _train_run(job: tuple[Any, ...]) -> tuple[str, dict[str, float]]:
    """One training run, ``(name, spec, seed, steps, tail, config)``, in this process or a
    worker: a spec is a recipe, ``(recipe, fraction)`` to train the last ``fraction``
    of the steps without float8, or a dict of ``train``'s ``fp8`` and ``residuals``."""
    name, spec, seed, steps, tail, config = job
    lm = harness.load_file("examples/transformer_lm.py")
    fp8, last = spec if isinstance(spec, tuple) else (spec, 0.0)
    options = fp8 if isinstance(fp8, dict) else {"fp8": fp8}
    r = lm.train("mixed_bfloat16", steps=steps, seed=seed, config=lm.Config(**config),
                 text=lm.load_text(), final_steps_without_fp8=int(round(last * steps)),
                 **options)
    return name, {"held_out_bpb": r["test_bits_per_byte"],
                  "held_out_plain_bpb": r["test_bits_per_byte_without_fp8"],
                  "train_bpb": float(np.mean(r["losses"][-tail:])) / math.log(2)}


def training(report: harness.Report, a: argparse.Namespace, path: str) -> None:
    lm = harness.load_file("examples/transformer_lm.py")
    config = lm.Config(experts=a.experts) if not a.quick else lm.Config(
        d_model=16, heads=1, layers=1, seq_len=16, experts=a.experts)
    unknown = set(a.runs or ()) - set(TRAINING_RUNS)
    if unknown:
        raise SystemExit(f"--runs: unknown {sorted(unknown)}; known: {list(TRAINING_RUNS)}")
    runs = {n: r for n, r in TRAINING_RUNS.items() if a.runs is None or n in a.runs}
    runs = runs if not a.quick else dict(list(runs.items())[:3])
    samples: dict[str, dict[str, list[float]]] = {
        n: {c.key: [] for c in TRAINING_COLUMNS} for n in runs}
    pool = concurrent.futures.ProcessPoolExecutor(
        a.workers, mp_context=multiprocessing.get_context("spawn")) if a.workers > 1 else None
    # Every (seed, run) at once, in order: the workers stay busy across seeds.
    jobs = [(name, spec, seed, a.steps, a.tail, dataclasses.asdict(config))
            for seed in a.seeds for name, spec in runs.items()]
    results = pool.map(_train_run, jobs) if pool else map(_train_run, jobs)
    for i, seed in enumerate(a.seeds):
        for _ in runs:
            name, figures = next(results)
            for key, value in figures.items():
                samples[name][key].append(value)
            print(f"  seed {seed} {name}: held-out {figures['held_out_bpb']:.4f}", flush=True)
        # Written after every seed, so that a run cut short keeps the seeds it finished.
        report.tables = []
        table = report.table(
            "training", "byte-level transformer LM: float8 recipes against mixed_bfloat16",
            baseline="mixed_bfloat16", columns=TRAINING_COLUMNS,
            description=(f"examples/transformer_lm.py"
                         f"{f' with {a.experts} experts (top-2)' if a.experts else ''}, "
                         f"{a.steps} steps, seeds "
                         f"{a.seeds[:i + 1]}, means over the seeds; training loss: mean of the "
                         f"last {a.tail} steps; held-out loss: every window of the held-out "
                         f"text"))
        for name, s in samples.items():
            table.add_row(name, {k: float(np.mean(v)) for k, v in s.items()}, samples=s)
        report.write(path)


# --- main ------------------------------------------------------------------------------------

def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--training", action="store_true",
                        help="train the example LM per recipe instead (bench_fp8_training.json)")
    parser.add_argument("--steps", type=int, default=2000, help="training steps per run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tail", type=int, default=300, help="training-loss steps averaged")
    parser.add_argument("--runs", nargs="+", default=None,
                        help=f"training runs to do, by name (default: all of {list(TRAINING_RUNS)})")
    parser.add_argument("--workers", type=int, default=1,
                        help="training runs at once, each in its own process")
    parser.add_argument("--experts", type=int, default=0,
                        help="train the example's mixture-of-experts variant with this many experts")
    harness.add_common_arguments(parser, compile_rounds=5)
    a = parser.parse_args(argv)
    if a.quick:
        a.width, a.seq, a.batch, a.compile_rounds = 32, 16, 4, 1
        a.steps, a.seeds, a.tail = 3, [0], 2
    name = "bench_fp8_training" if a.training else "bench_fp8"
    report = harness.Report(name, __doc__.splitlines()[0], vars(a), argv)
    print(f"jax {jax.__version__} on {jax.default_backend()}", flush=True)
    path = a.json or harness.default_json_path(name, a.quick)
    if a.training:
        training(report, a, path)
    else:
        size = (256, 512, 256) if not a.quick else (32, 64, 32)
        table = report.table(
            "accuracy", "relative error of one product and its two backward products",
            baseline=None, columns=ACCURACY_COLUMNS,
            description=f"{'x'.join(map(str, size))} product; operands: recipe")
        accuracy(table, size)
        compile_cost(report, a)
    for t in report.tables:
        print(f"\n{t.title}\n\n{harness.render_table(t.to_json())}")
    report.write(path)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

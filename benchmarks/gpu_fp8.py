"""Float8 autocast on a GPU (H100 or newer): cuBLASLt float8 GEMMs, step time, where it pays off.

Everything is measured against the same function under
``jmp_policy.autocast(..., "mixed_bfloat16")`` without float8, in one run
(`harness.measure`: interleaved rounds, medians). Tables of the report
(``benchmarks/results/gpu_fp8.json``):

``mlp``
    A transformer MLP block (LayerNorm, d_model -> 4 d_model, GELU ->
    d_model, residual), d_model 4096 and 8192 tokens per step (batch 8 x
    sequence 1024): its train step with AdamW (params and optimizer state
    donated and fed back) and its forward + backward alone, in bfloat16 and
    with ``fp8="tensorwise"`` / ``"rowwise"`` / ``"delayed"`` (scales from amax
    histories, `jmp_policy.float8_state`, recorded every step). ``f8_gemms`` /
    ``gemms``: the GEMMs of the optimized HLO on float8 operands, of all its
    GEMMs (`harness.gemm_counts`: cuBLAS(Lt) calls, Triton GEMM fusions): each of
    the block's six products (two forward, four backward) should be one.
``sweep``
    Forward + backward of one product ``x @ w`` with x of 8192 x s
    ("tokens") or s x s ("square") and w of s x s, for growing s, float8
    (its quantization included) against bfloat16. The report's
    ``suggested_min_size`` is the smallest swept s from which every float8
    case is faster than bfloat16, for ``Float8Recipe.min_size``.

On a CPU (``--smoke``: tiny sizes, to check the script runs) no GEMM is on
float8 operands (XLA:CPU converts them to float32 around its dots) and the
times say nothing about float8.

Commands (from the repository root)::

    python -m benchmarks.gpu_fp8                 # on an H100: ~3-5 min
    python -m benchmarks.gpu_fp8 --smoke         # anywhere, ~1 min on a CPU
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, List, Optional

import jax
import jax.numpy as jnp
import optax

from benchmarks import harness
import jmp_policy

KINDS: tuple[Optional[str], ...] = (None, "tensorwise", "rowwise", "delayed")
SIZES = {
    "full": dict(d_model=4096, batch=8, seq=1024, sweep=(256, 512, 1024, 2048, 4096, 8192),
                 sweep_tokens=8192),
    "smoke": dict(d_model=64, batch=2, seq=32, sweep=(16, 32, 64), sweep_tokens=64),
}


def kind_name(kind: Optional[str]) -> str:
    return "bfloat16" if kind is None else f"fp8 {kind}"


# --- the MLP block ----------------------------------------------------------------------------

def mlp_block(p, x):
    mu = x.mean(-1, keepdims=True)
    h = (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * p["scale"]
    return x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]


def mlp_params(d: int):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"scale": jnp.ones(d), "w1": jax.random.normal(k1, (d, 4 * d)) * d ** -0.5,
            "w2": jax.random.normal(k2, (4 * d, d)) * (4 * d) ** -0.5}


def block_loss(kind: Optional[str]) -> Callable[..., Any]:
    """``loss(fp8_state, p, x, y)``: the state is delayed scaling's amax histories (a
    `jmp_policy.Float8State`), ``None`` for the other kinds, so every kind's step takes
    the same arguments."""
    f = jmp_policy.autocast(mlp_block, "mixed_bfloat16", fp8=kind)
    if kind == "delayed":
        return lambda s, p, x, y: jnp.mean((f(s, p, x).astype(jnp.float32) - y) ** 2)
    return lambda s, p, x, y: jnp.mean((f(p, x).astype(jnp.float32) - y) ** 2)


def fp8_state(kind: Optional[str], p: Any, x: Any) -> Any:
    """The float8 state of ``kind``'s step (``None`` but for delayed scaling); abstract
    for abstract arguments."""
    if kind != "delayed":
        return None
    f = jmp_policy.autocast(mlp_block, "mixed_bfloat16", fp8=kind)
    return jax.eval_shape(lambda p, x: jmp_policy.float8_state(f, p, x), p, x) \
        if isinstance(x, jax.ShapeDtypeStruct) else jmp_policy.float8_state(f, p, x)


def init_state(kind: Optional[str], p: Any, x: Any) -> Any:
    """The train step's state: AdamW's, and the float8 state (see `fp8_state`)."""
    adam = (jax.eval_shape(optax.adamw(1e-4).init, p) if isinstance(x, jax.ShapeDtypeStruct)
            else optax.adamw(1e-4).init(p))
    return adam, fp8_state(kind, p, x)


def train_step(kind: Optional[str]) -> Callable[..., Any]:
    """``step(p, (adam_state, fp8_state), x, y) -> (p, state, loss)``; delayed scaling's
    histories record the step's maxima."""
    loss_fn, tx = block_loss(kind), optax.adamw(1e-4)

    def step(p, state, x, y):
        opt_state, s = state
        loss, (observed, grads) = jax.value_and_grad(
            loss_fn, argnums=(0, 1))(s, p, x, y) if s is not None else \
            (lambda l, g: (l, (None, g)))(*jax.value_and_grad(loss_fn, argnums=1)(s, p, x, y))
        updates, opt_state = tx.update(grads, opt_state, p)
        s = None if s is None else s.record(observed)
        return optax.apply_updates(p, updates), (opt_state, s), loss

    return step


def grad_step(kind: Optional[str]) -> Callable[..., Any]:
    """``grad(p, x, y, fp8_state)``: the parameters' gradients (and, for delayed scaling,
    the observed maxima)."""
    loss_fn = block_loss(kind)
    return lambda p, x, y, s: jax.grad(loss_fn, argnums=(0, 1) if s is not None else 1)(s, p, x, y)


def gemm_figures(build: harness.Build) -> dict:
    """GEMMs of the optimized HLO, and those on float8 operands (`harness.gemm_counts`)."""
    return harness.gemm_counts(build.compiled.as_text())


MLP_COLUMNS = [
    harness.Column("wall_s", "step time", "s"),
    harness.Column("f8_gemms", "float8 GEMMs", "count", ratio=False),
    harness.Column("gemms", "GEMMs", "count", ratio=False),
    harness.Column("compile_s", "XLA compile", "s"),
    harness.Column("temp_bytes", "temp memory", "bytes"),
]


def mlp_table(report: harness.Report, size: dict, a: argparse.Namespace) -> None:
    d, b, t = size["d_model"], size["batch"], size["seq"]
    p = mlp_params(d)
    x = jax.random.normal(jax.random.key(1), (b, t, d)).astype(jnp.bfloat16)
    y = jnp.zeros((b, t, d), jnp.float32)
    for table_id, title, make, args_of, carry, donate in (
            ("mlp", "MLP block train step (AdamW)", train_step,
             lambda k: (p, init_state(k, p, x), x, y), 2, (0, 1)),
            ("mlp-grad", "MLP block forward + backward", grad_step,
             lambda k: (p, x, y, fp8_state(k, p, x)), 0, ())):
        cases = [harness.Case(kind_name(k), make(k), args_of(k), donate_argnums=donate,
                              carry=carry, extra=gemm_figures,
                              make_fn=lambda k=k, make=make: make(k))
                 for k in KINDS]
        rows, failed = harness.measure(cases, compile_rounds=1, rounds=a.rounds, iters=a.iters)
        table = report.table(table_id, title, baseline="bfloat16", columns=MLP_COLUMNS,
                             description=f"d_model {d}, {b * t} tokens per step (batch {b} x "
                                         f"sequence {t}), under autocast mixed_bfloat16")
        table.add_rows(rows)
        report.failed(failed, table_id)
        print(f"\n{title}\n\n{harness.render_table(table.to_json())}", flush=True)


# --- the size sweep ----------------------------------------------------------------------------

SWEEP_COLUMNS = [
    harness.Column("wall_s", "forward + backward", "s", ratio=False),
    harness.Column("speedup", "speedup over bfloat16", "x"),
    harness.Column("f8_gemms", "float8 GEMMs", "count", ratio=False),
]


def product(kind: Optional[str]) -> Callable[..., Any]:
    """``f(fp8_state, x, w)``, ``x @ w`` under autocast (the state ``None`` but for delayed
    scaling)."""
    recipe = None if kind is None else jmp_policy.Float8Recipe(kind, min_size=0)
    f = jmp_policy.autocast(jnp.matmul, "mixed_bfloat16", fp8=recipe)
    return f if kind == "delayed" else lambda s, x, w: f(x, w)


def product_grad(kind: Optional[str]) -> Callable[..., Any]:
    f = product(kind)
    return jax.grad(lambda x, w, s: jnp.sum(f(s, x, w).astype(jnp.float32)),
                    (0, 1, 2) if kind == "delayed" else (0, 1))


def sweep_table(report: harness.Report, size: dict, a: argparse.Namespace) -> Optional[int]:
    table = report.table("sweep", "one product x @ w, forward + backward", baseline=None,
                         columns=SWEEP_COLUMNS,
                         description=f"x: {size['sweep_tokens']} x s (tokens) or s x s (square); "
                                     "w: s x s; speedups against bfloat16 at the same size")
    wins: dict[int, bool] = {}
    for shape in ("tokens", "square"):
        for s in size["sweep"]:
            m = size["sweep_tokens"] if shape == "tokens" else s
            x = jax.random.normal(jax.random.key(0), (m, s)).astype(jnp.bfloat16)
            w = jax.random.normal(jax.random.key(1), (s, s)) * s ** -0.5
            state = {k: jmp_policy.float8_state(product(k), x, w) if k == "delayed" else None
                     for k in KINDS}
            cases = [harness.Case(f"{shape} {m}x{s}x{s}: {kind_name(k)}", product_grad(k),
                                  (x, w, state[k]), extra=gemm_figures,
                                  make_fn=lambda k=k: product_grad(k))
                     for k in KINDS]
            rows, failed = harness.measure(cases, compile_rounds=1, rounds=a.rounds,
                                           iters=a.iters, progress=lambda _: None)
            report.failed(failed, "sweep")
            base = next((r for r in rows if r["name"].endswith("bfloat16")), None)
            for r in rows:
                speedup = base["figures"]["wall_s"] / r["figures"]["wall_s"] if base else None
                r["figures"]["speedup"] = speedup
                if r is not base and speedup is not None:
                    wins[s] = wins.get(s, True) and speedup > 1.0
            table.add_rows(rows)
    print(f"\n{table.title}\n\n{harness.render_table(table.to_json())}", flush=True)
    sizes = sorted(wins)
    return next((s for s in sizes if all(wins[t] for t in sizes if t >= s)), None)


# --- main ----------------------------------------------------------------------------------

def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (same as --quick)")
    parser.add_argument("--skip-sweep", action="store_true")
    harness.add_common_arguments(parser, rounds=10, iters=5, compile_rounds=1)
    a = parser.parse_args(argv)
    a.quick = a.quick or a.smoke
    if a.quick:
        a.rounds, a.iters = 2, 2
    size = SIZES["smoke" if a.quick else "full"]
    device = jax.devices()[0]
    report = harness.Report("gpu_fp8", __doc__.splitlines()[0], {**vars(a), **size}, argv)
    print(f"jax {jax.__version__} on {device.device_kind} ({device.platform})", flush=True)
    if device.platform != "gpu":
        report.note("Not a GPU: no cuBLASLt GEMMs, and float8 is emulated; the times say "
                    "nothing about float8 speed.")
    mlp_table(report, size, a)
    if not a.skip_sweep:
        suggestion = sweep_table(report, size, a)
        report.extra["suggested_min_size"] = suggestion
        report.note(f"suggested Float8Recipe.min_size: {suggestion} (the smallest swept size "
                    "from which every float8 case beats bfloat16)")
        print(f"\nsuggested Float8Recipe.min_size: {suggestion}")
    path = a.json or harness.default_json_path("gpu_fp8", a.quick)
    report.write(path)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

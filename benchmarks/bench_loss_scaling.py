"""Loss scaling: jmp_policy.loss_scaling(adam) against plain adam and its peers.

Two workloads, each compiled with and without donation of params and optimizer
state (``donate_argnums``; outputs are fed back as the next inputs, as a train
loop does):

* ``opt``: the optimizer step alone -- ~8M float32 params in ~100 leaves of
  transformer shapes, Adam, gradients given.
* ``lm``: a full jitted train step (forward, backward, update) of a small Flax
  transformer language model computing in float16 with float32 params.

Rows (each a complete "skip non-finite steps + dynamic loss scale" recipe):
plain ``optax.adam`` (the baseline, 1.00x), ``jmp_policy.loss_scaling(adam)``,
DeepMind jmp's README recipe (``DynamicLossScale`` + ``all_finite`` +
``select_tree``), MPX (``mixed-precision-for-jax``: ``all_finite`` +
``optimizer_update``), Flax's ``DynamicScale`` recipe (``jnp.where`` on every
leaf, as in Flax's examples), ``optax.apply_if_finite`` (skips, no scaling) and
Keras 3's ``LossScaleOptimizer`` (JAX backend; with plain Keras ``Adam`` as a
reference, since Keras' Adam is not optax's). Peers that are not installed are
left out and named in the output.

Figures, as ratios to plain adam measured in the same run: bytes accessed
(``compiled.cost_analysis()``), HLO instructions (optimized HLO text), XLA
compile time (median of ``--compile-reps`` interleaved rounds), temp memory
(``memory_analysis()``), wall time per step (median over ``--rounds``
interleaved rounds of ``--iters`` steps). Wall time is noisy on a shared
machine; the XLA figures are not.

Examples::

    python benchmarks/bench_loss_scaling.py                       # full run
    python benchmarks/bench_loss_scaling.py --quick               # seconds
    python benchmarks/bench_loss_scaling.py --workload opt --params 8e6 --leaves 100
    python benchmarks/bench_loss_scaling.py --markdown RESULTS_part.md --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import statistics
import sys
import time
from typing import Any, Callable

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_policy

SCALE = 2.0**15
LR = 1e-3


# --------------------------------------------------------------------------- #
# What a row is: a step function and the state it carries.
# --------------------------------------------------------------------------- #

@dataclasses.dataclass
class Variant:
    """One recipe: ``step(params, state, batch) -> (params, state)``.

    ``state`` is everything the recipe carries between steps besides params
    (optimizer state, loss scale). Both are donated in donated mode.
    """

    name: str
    step: Callable[..., Any]
    init_state: Callable[[Any], Any]
    note: str = ""
    skips: bool = True  # whether the recipe is meant to skip non-finite steps


def _optional(module: str):
    try:
        return __import__(module)
    except Exception as e:  # noqa: BLE001 - any import failure means "peer unavailable"
        return e


# --------------------------------------------------------------------------- #
# Workload (a): optimizer step only, gradients given.
# --------------------------------------------------------------------------- #

def transformer_shapes(n_params: float, n_leaves: int) -> dict[str, tuple[int, ...]]:
    """Leaf shapes of a pre-LN transformer (12 leaves per block + embedding + final LN).

    The width is chosen so that the total is close to ``n_params``.
    """
    layers = max(1, (n_leaves - 3) // 12)
    vocab_per_width = 25  # embedding rows per model width unit (vocab = 25 * d)
    # 12 d^2 per block + 25 d^2 embedding.
    d = int(math.sqrt(n_params / (12 * layers + vocab_per_width)))
    d = max(8, d // 8 * 8)
    shapes = {"embed": (vocab_per_width * d, d)}
    for i in range(layers):
        p = f"block{i:02d}/"
        shapes.update({
            p + "ln1/scale": (d,), p + "ln1/bias": (d,),
            p + "attn/qkv/kernel": (d, 3 * d), p + "attn/qkv/bias": (3 * d,),
            p + "attn/out/kernel": (d, d), p + "attn/out/bias": (d,),
            p + "ln2/scale": (d,), p + "ln2/bias": (d,),
            p + "mlp/up/kernel": (d, 4 * d), p + "mlp/up/bias": (4 * d,),
            p + "mlp/down/kernel": (4 * d, d), p + "mlp/down/bias": (d,),
        })
    shapes["final_ln/scale"] = (d,)
    shapes["final_ln/bias"] = (d,)
    return shapes


def optimizer_only_workload(n_params: float, n_leaves: int):
    shapes = transformer_shapes(n_params, n_leaves)
    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.normal(0, 0.02, s), jnp.float32) for k, s in shapes.items()}
    # Gradients of the scaled loss (finite): every recipe gets the same arrays.
    grads = {k: jnp.asarray(rng.normal(0, 1.0, s), jnp.float32) for k, s in shapes.items()}
    size = sum(int(np.prod(s)) for s in shapes.values())
    desc = f"{size / 1e6:.2f}M float32 params in {len(shapes)} leaves"

    def given(grads_fn):
        # In this workload the "batch" is the gradient tree itself.
        return lambda params, batch: grads_fn(batch)

    return params, grads, desc, given


# --------------------------------------------------------------------------- #
# Workload (b): full train step of a small Flax transformer LM, float16 compute.
# --------------------------------------------------------------------------- #

def lm_workload(vocab: int, width: int, depth: int, heads: int, seq: int, batch: int):
    import flax.linen as nn

    half = jnp.float16

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.LayerNorm(dtype=half)(x)
            h = nn.MultiHeadDotProductAttention(
                num_heads=heads, dtype=half, deterministic=True)(
                    h, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
            x = x + h
            h = nn.LayerNorm(dtype=half)(x)
            h = nn.Dense(4 * width, dtype=half)(h)
            h = nn.Dense(width, dtype=half)(nn.gelu(h))
            return x + h

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            embed = nn.Embed(vocab, width, dtype=half)
            x = embed(tokens)
            for _ in range(depth):
                x = Block()(x)
            x = nn.LayerNorm(dtype=half)(x)
            return embed.attend(x)

    model = LM()
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, vocab, (batch, seq + 1)), jnp.int32)
    params = model.init(jax.random.key(0), tokens[:, :-1])["params"]

    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    size = sum(x.size for x in jax.tree.leaves(params))
    desc = (f"Flax LM, {size / 1e6:.2f}M float32 params in {len(jax.tree.leaves(params))} "
            f"leaves, float16 compute, batch {batch}x{seq}, width {width}, depth {depth}")
    return params, tokens, desc, loss_fn


# --------------------------------------------------------------------------- #
# The recipes. `grads_of(loss_scale_value_or_None)` abstracts the workload:
# for `opt` it returns the given gradients, for `lm` it differentiates the
# (scaled) loss. Every recipe below is written the way its docs show it.
# --------------------------------------------------------------------------- #

def build_variants(workload: str, loss_fn, skipped: list[str], donate: bool) -> list[Variant]:
    """`loss_fn(params, batch)`; for the `opt` workload it is None (batch = grads)."""

    def grads_and_loss(params, batch, scale=None):
        """Gradients of ``scale * loss`` (or of the loss when ``scale`` is None)."""
        if loss_fn is None:
            return batch, None
        if scale is None:
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        else:
            loss, grads = jax.value_and_grad(lambda p: scale * loss_fn(p, batch))(params)
        return grads, loss

    adam = optax.adam(LR)
    variants = []

    # 1. Baseline: plain adam, no scaling, no skipping.
    def adam_step(params, state, batch):
        grads, _ = grads_and_loss(params, batch)
        updates, state = adam.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    variants.append(Variant("optax.adam (baseline)", adam_step, adam.init, skips=False))

    # 2. jmp_policy: update + optax.apply_updates, as its docs write the train step.
    tx = jmp_policy.loss_scaling(adam, jmp_policy.DynamicLossScale(jnp.float32(SCALE)))

    def ours_step(params, state, batch):
        if loss_fn is None:
            grads = batch
        else:
            scale = jmp_policy.get_loss_scale(state)
            _, grads = jmp_policy.scaled_value_and_grad(loss_fn)(scale, params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    variants.append(Variant("jmp_policy.loss_scaling(adam)", ours_step, tx.init))

    # 3. DeepMind jmp, README recipe.
    jmp = _optional("jmp")
    if isinstance(jmp, Exception):
        skipped.append(f"jmp ({jmp})")
    else:
        # jmp's DynamicLossScale cannot be an argument of `jit(...).lower`: its
        # pytree unflattening runs __init__ checks on JAX's placeholder leaves.
        # So the carried state holds its two leaves and the object is rebuilt
        # inside the step (the same computation).
        def jmp_init(params):
            ls = jmp.DynamicLossScale(jnp.float32(SCALE))
            return adam.init(params), (ls.loss_scale, ls.counter)

        def jmp_step(params, state, batch):
            opt_state, (scale, counter) = state
            loss_scale = jmp.DynamicLossScale(scale, counter)
            if loss_fn is None:
                grads = batch
            else:
                grads = jax.grad(lambda p: loss_scale.scale(loss_fn(p, batch)))(params)
            grads = loss_scale.unscale(grads)
            grads_finite = jmp.all_finite(grads)
            loss_scale = loss_scale.adjust(grads_finite)
            updates, new_opt_state = adam.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            params, opt_state = jmp.select_tree(
                grads_finite, (new_params, new_opt_state), (params, opt_state))
            return params, (opt_state, (loss_scale.loss_scale, loss_scale.counter))

        variants.append(Variant("jmp recipe (select_tree)", jmp_step, jmp_init))

    # 4. MPX (PyPI: mixed-precision-for-jax, imported as `mpx`).
    mpx = _optional("mpx")
    if isinstance(mpx, Exception) or not hasattr(mpx, "DynamicLossScaling"):
        skipped.append("MPX (pip install mixed-precision-for-jax)")
    else:
        def mpx_init(params):
            return adam.init(params), mpx.DynamicLossScaling(
                jnp.float32(SCALE), jnp.float32(1.0), period=2000)

        def mpx_step(params, state, batch):
            opt_state, scaling = state
            if loss_fn is None:
                grads = batch
            else:
                grads = jax.grad(mpx.scaled(lambda p: loss_fn(p, batch), scaling))(params)
            grads_finite = mpx.all_finite(grads)
            # (mpx.filter_value_and_grad unscales with the *adjusted* scale; the
            # old scale, used here, is the correct one and costs the same.)
            grads = scaling.unscale(grads)
            scaling = scaling.adjust(grads_finite)
            params, opt_state = mpx.optimizer_update(params, adam, opt_state, grads, grads_finite)
            return params, (opt_state, scaling)

        variants.append(Variant("MPX (optimizer_update)", mpx_step, mpx_init))

    # 5. Flax DynamicScale recipe (flax/examples: jnp.where on every leaf).
    try:
        from flax.training.dynamic_scale import DynamicScale
    except Exception as e:  # noqa: BLE001
        skipped.append(f"Flax DynamicScale ({e})")
    else:
        def flax_init(params):
            return adam.init(params), DynamicScale(scale=jnp.float32(SCALE))

        def flax_step(params, state, batch):
            opt_state, dyn_scale = state
            if loss_fn is None:
                # DynamicScale only offers value_and_grad: differentiate a linear
                # function whose gradient is the given tree (its forward is dead code).
                fn = lambda p: sum(jnp.vdot(x, jax.lax.stop_gradient(g)) for x, g in
                                   zip(jax.tree.leaves(p), jax.tree.leaves(batch)))
            else:
                fn = lambda p: loss_fn(p, batch)
            dyn_scale, is_fin, _, grads = dyn_scale.value_and_grad(fn)(params)
            updates, new_opt_state = adam.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            select = functools.partial(jnp.where, is_fin)
            params = jax.tree.map(select, new_params, params)
            opt_state = jax.tree.map(select, new_opt_state, opt_state)
            return params, (opt_state, dyn_scale)

        variants.append(Variant("Flax DynamicScale recipe", flax_step, flax_init))

    # 6. optax.apply_if_finite: skips non-finite steps (lax.cond), no loss scale.
    guarded = optax.apply_if_finite(adam, max_consecutive_errors=10**6)

    def guarded_step(params, state, batch):
        grads, _ = grads_and_loss(params, batch)
        updates, state = guarded.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    variants.append(Variant("optax.apply_if_finite(adam)", guarded_step, guarded.init,
                            note="no loss scale"))

    # 7. Keras 3 LossScaleOptimizer, JAX backend, stateless API.
    keras = _optional("keras")
    if isinstance(keras, Exception) or keras.backend.backend() != "jax":
        skipped.append("Keras 3 LossScaleOptimizer (pip install keras; KERAS_BACKEND=jax)")
    else:
        variants.extend(_keras_variants(keras, loss_fn))
    return variants


def _keras_variants(keras, loss_fn) -> list[Variant]:
    """Keras optimizers keep their state in Variables; `stateless_apply` is the jit-able form."""

    def make(with_loss_scale: bool):
        built: dict[str, Any] = {}

        def init(params):
            leaves, treedef = jax.tree.flatten(params)
            variables = [keras.Variable(np.asarray(x)) for x in leaves]
            opt = keras.optimizers.Adam(LR)
            if with_loss_scale:
                opt = keras.optimizers.LossScaleOptimizer(opt, initial_scale=SCALE)
            opt.build(variables)
            built.update(opt=opt, treedef=treedef)
            names = [v.path for v in opt.variables]
            built["scale_index"] = next(
                (i for i, n in enumerate(names) if n.endswith("dynamic_scale")), None)
            return [jnp.asarray(v.value) for v in opt.variables]

        def step(params, opt_vars, batch):
            opt, treedef = built["opt"], built["treedef"]
            if loss_fn is None:
                grads = batch
            elif with_loss_scale:
                scale = opt_vars[built["scale_index"]]
                grads = jax.grad(lambda p: scale * loss_fn(p, batch))(params)
            else:
                grads = jax.grad(loss_fn)(params, batch)
            new_vars, opt_vars = opt.stateless_apply(
                list(opt_vars), jax.tree.leaves(grads), jax.tree.leaves(params))
            return jax.tree.unflatten(treedef, new_vars), list(opt_vars)

        return step, init

    lso_step, lso_init = make(True)
    adam_step, adam_init = make(False)
    return [
        Variant("Keras LossScaleOptimizer(Adam)", lso_step, lso_init),
        Variant("Keras Adam (reference)", adam_step, adam_init,
                note="Keras' own Adam, no loss scale", skips=False),
    ]


# --------------------------------------------------------------------------- #
# Measuring.
# --------------------------------------------------------------------------- #

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*\S")


def hlo_instruction_count(hlo_text: str) -> int:
    """Instructions in every computation of an optimized HLO module (fusions included)."""
    return sum(1 for line in hlo_text.splitlines() if _INSTRUCTION.match(line))


def _cost(compiled) -> dict:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return cost or {}


@dataclasses.dataclass
class Measured:
    name: str
    note: str
    bytes_accessed: float
    hlo_instructions: int
    compile_s: float
    temp_bytes: int
    wall_s: float = float("nan")
    wall_rounds: list = dataclasses.field(default_factory=list)
    compile_times: list = dataclasses.field(default_factory=list)


def _compile_once(jitted, params, state, batch):
    """XLA compile time of one fresh lowering (JAX's caches cleared first)."""
    jax.clear_caches()
    lowered = jitted.lower(params, state, batch)
    t0 = time.perf_counter()
    compiled = lowered.compile()
    return time.perf_counter() - t0, compiled


def compile_variant(v: Variant, params, batch, donate: bool):
    """Compiles once; `Measured.compile_times` gets more samples in `run_workload`."""
    jitted = jax.jit(v.step, donate_argnums=(0, 1) if donate else ())
    state = v.init_state(params)
    seconds, compiled = _compile_once(jitted, params, state, batch)
    mem = compiled.memory_analysis()
    m = Measured(
        name=v.name, note=v.note,
        bytes_accessed=float(_cost(compiled).get("bytes accessed", float("nan"))),
        hlo_instructions=hlo_instruction_count(compiled.as_text()),
        compile_s=seconds,
        temp_bytes=int(getattr(mem, "temp_size_in_bytes", -1)) if mem is not None else -1,
        compile_times=[seconds],
    )
    return m, compiled, state, jitted


def _check_skips(v: Variant, compiled, params, state, grads) -> None:
    """The recipe really is a skip-on-overflow recipe: a NaN step leaves params alone."""
    nan_grads = dict(grads)
    key = sorted(grads)[len(grads) // 2]
    nan_grads[key] = grads[key].at[(0,) * grads[key].ndim].set(jnp.nan)
    before = jax.tree.map(np.asarray, params)
    p, _ = compiled(jax.tree.map(jnp.array, params),
                    jax.tree.map(lambda x: jnp.array(x) if isinstance(x, jax.Array) else x, state),
                    nan_grads)
    if not all(np.array_equal(a, np.asarray(b)) for a, b in
               zip(jax.tree.leaves(before), jax.tree.leaves(p))):
        raise AssertionError(f"{v.name} changed the params on a NaN step")


def run_workload(name, desc, make_variants, params, batch, args, skipped) -> dict:
    results = {}
    for donate in (True, False):
        mode = "donated" if donate else "not donated"
        print(f"\n== {name}: {desc}; {mode} ==", flush=True)
        runs, lowerings = [], []
        for v in make_variants(donate):
            try:
                m, compiled, state, jitted = compile_variant(v, params, batch, donate)
            except Exception as e:  # noqa: BLE001 - a broken peer must not stop the run
                print(f"  {v.name}: FAILED to compile: {type(e).__name__}: {e}", flush=True)
                skipped.append(f"{v.name} [{name}, {mode}]: {type(e).__name__}: {str(e)[:200]}")
                continue
            # Private copies: donation invalidates the buffers it is given.
            p = jax.tree.map(jnp.array, params)
            s = jax.tree.map(lambda x: jnp.array(x) if isinstance(x, jax.Array) else x, state)
            p, s = compiled(p, s, batch)  # warm-up
            jax.block_until_ready((p, s))
            if v.skips and name.startswith("optimizer-only"):
                _check_skips(v, compiled, p, s, batch)
            runs.append([m, compiled, p, s])
            lowerings.append((m, jitted, state))
            print(f"  compiled {v.name}", flush=True)
        # More compile samples, interleaved like the wall-time rounds below:
        # compile time on a shared machine drifts by +-15% over a minute.
        for _ in range(args.compile_reps - 1):
            for m, jitted, state in lowerings:
                m.compile_times.append(_compile_once(jitted, params, state, batch)[0])
        for m, _, _ in lowerings:
            m.compile_s = statistics.median(m.compile_times)
        del lowerings[:]
        # Interleaved rounds: each round times every variant once, so that load
        # from other processes hits all of them alike.
        for _ in range(args.rounds if not args.no_wall else 0):
            for run in runs:
                m, compiled, p, s = run
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    p, s = compiled(p, s, batch)
                jax.block_until_ready((p, s))
                m.wall_rounds.append((time.perf_counter() - t0) / args.iters)
                run[2], run[3] = p, s
        for run in runs:
            m = run[0]
            if m.wall_rounds:
                m.wall_s = statistics.median(m.wall_rounds)
        results[mode] = [r[0] for r in runs]
        for r in runs:
            del r[1:]
        print(format_table(results[mode]), flush=True)
    return results


def format_table(rows: list[Measured]) -> str:
    base = rows[0]
    ratio = lambda a, b: (a / b) if b and not math.isnan(a) and not math.isnan(b) else float("nan")
    out = ["| recipe | bytes accessed | HLO instructions | compile time | wall time | temp memory |",
           "|---|---|---|---|---|---|"]
    for m in rows:
        name = m.name + (f" ({m.note})" if m.note else "")
        wall = (f"{ratio(m.wall_s, base.wall_s):.2f}x ({m.wall_s * 1e3:.2f} ms)"
                if not math.isnan(m.wall_s) else "n/a")
        out.append(
            f"| {name} | {ratio(m.bytes_accessed, base.bytes_accessed):.2f}x "
            f"({m.bytes_accessed / 2**20:.0f} MiB) | "
            f"{ratio(m.hlo_instructions, base.hlo_instructions):.2f}x ({m.hlo_instructions}) | "
            f"{ratio(m.compile_s, base.compile_s):.2f}x ({m.compile_s * 1e3:.0f} ms) | "
            f"{wall} | {m.temp_bytes / 2**20:.1f} MiB |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=["opt", "lm", "all"], default="all")
    ap.add_argument("--params", type=float, default=8e6, help="optimizer-only: total params")
    ap.add_argument("--leaves", type=int, default=100, help="optimizer-only: about this many leaves")
    ap.add_argument("--lm-vocab", type=int, default=1024)
    ap.add_argument("--lm-width", type=int, default=128)
    ap.add_argument("--lm-depth", type=int, default=2)
    ap.add_argument("--lm-heads", type=int, default=4)
    ap.add_argument("--lm-seq", type=int, default=64)
    ap.add_argument("--lm-batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=15, help="interleaved wall-time rounds")
    ap.add_argument("--iters", type=int, default=5, help="steps per variant per round")
    ap.add_argument("--compile-reps", type=int, default=5)
    ap.add_argument("--no-wall", action="store_true", help="XLA figures only")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, few rounds: a smoke run")
    ap.add_argument("--json", help="write all figures here")
    ap.add_argument("--markdown", help="write the tables here")
    args = ap.parse_args(argv)
    if args.quick:
        args.params, args.leaves, args.rounds, args.iters, args.compile_reps = 2e5, 27, 3, 2, 1
        args.lm_vocab, args.lm_width, args.lm_depth, args.lm_seq, args.lm_batch = 256, 64, 2, 32, 2

    skipped: list[str] = []
    header = (f"jax {jax.__version__} on {jax.default_backend()} "
              f"({jax.device_count()} device(s)); optax {optax.__version__}")
    print(header)
    sections = {}
    if args.workload in ("opt", "all"):
        params, grads, desc, _ = optimizer_only_workload(args.params, args.leaves)
        make = functools.partial(build_variants, "opt", None, skipped)
        sections["optimizer-only step"] = (desc, run_workload(
            "optimizer-only step", desc, make, params, grads, args, skipped))
    if args.workload in ("lm", "all"):
        params, tokens, desc, loss_fn = lm_workload(
            args.lm_vocab, args.lm_width, args.lm_depth, args.lm_heads, args.lm_seq,
            args.lm_batch)
        make = functools.partial(build_variants, "lm", loss_fn, skipped)
        sections["full train step"] = (desc, run_workload(
            "full train step", desc, make, params, tokens, args, skipped))

    skipped = sorted(set(skipped))
    if skipped:
        print("\nLeft out: " + "; ".join(skipped))
    command = "python benchmarks/bench_loss_scaling.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.markdown:
        lines = [f"Command: `{command.strip()}`", "", header, ""]
        for title, (desc, modes) in sections.items():
            for mode, rows in modes.items():
                lines += [f"**{title}, {mode}** ({desc})", "", format_table(rows), ""]
        if skipped:
            lines += ["Left out: " + "; ".join(skipped), ""]
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "header": header, "skipped": skipped,
                       "sections": {t: {"desc": d, **{mode: [dataclasses.asdict(m) for m in rows]
                                                      for mode, rows in modes.items()}}
                                    for t, (d, modes) in sections.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Loss scaling: jmp_policy.loss_scaling(adam) against plain adam and its peers.

Two workloads, each compiled with and without donation of params and optimizer
state (``donate_argnums=(0, 1)``; outputs fed back as the next inputs, as a
train loop does):

* ``opt``: the optimizer step alone: ~8M float32 params in ~100 leaves of
  transformer shapes, Adam, gradients given (the batch is the gradients);
* ``lm``: a full jitted train step (forward, backward, update) of a small Flax
  transformer language model computing in float16 with float32 params.

Rows, each a complete "skip non-finite steps + dynamic loss scale" recipe
written as its documentation shows it: plain ``optax.adam`` (the baseline);
``jmp_policy.loss_scaling(adam)`` (``update`` + ``optax.apply_updates``);
DeepMind jmp's README recipe (``DynamicLossScale`` + ``all_finite`` +
``select_tree``); MPX (``all_finite`` + ``DynamicLossScaling.adjust`` +
``optimizer_update``); Flax's ``DynamicScale`` recipe (``jnp.where`` on every
leaf, as in Flax's examples); ``optax.apply_if_finite`` (skips, no loss
scale); Keras 3's ``LossScaleOptimizer(Adam)`` through ``stateless_apply``
(with Keras' own ``Adam`` as a reference: it is not optax's Adam). Peers that
are not installed are listed under "failed". Before timing, every skipping
recipe is run once on a non-finite step and must leave the params (and, where
the recipe has one, the inner optimizer state) bit for bit unchanged.

Figures (`harness.measure`), as ratios to plain adam in the same run and
mode: bytes accessed, HLO instructions, top-level ops, parameter-sized
copies that run on every step (the JSON also counts those inside a
conditional's branch), compile time, wall time per step, temp memory.

Commands (from the repository root; JSON to ``benchmarks/results/bench_loss_scaling.json``)::

    python -m benchmarks.bench_loss_scaling                 # full run, ~6-10 min on 2 CPU cores
    python -m benchmarks.bench_loss_scaling --quick         # smoke run (donated only), ~1 min
    python -m benchmarks.bench_loss_scaling --workload opt --params 8e6 --leaves 100
    python -m benchmarks.bench_loss_scaling --workload lm --lm-vocab 8192 --lm-width 512 \\
        --lm-depth 4 --lm-heads 8 --lm-seq 256 --lm-batch 16   # a 16.8M-parameter LM (GPU size)

``gpu_loss_scaling.py`` imports the workloads and recipes from here.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
from typing import Any, Callable, List, Optional

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import harness
import jmp_policy

SCALE = 2.0**15
LR = 1e-3
BASELINE = "optax.adam"


@dataclasses.dataclass
class Recipe:
    """``step(params, state, batch) -> (params, state)`` and what it carries.

    ``state`` is everything the recipe keeps between steps besides params
    (optimizer state, loss scale). ``kept(state)`` is the part a skipped step
    must leave bit for bit unchanged (None: only the params are checked).
    """

    name: str
    step: Callable[..., Any]
    init_state: Callable[[Any], Any]
    note: str = ""
    skips: bool = True
    kept: Optional[Callable[[Any], Any]] = None


def _optional(module: str) -> Any:
    try:
        return __import__(module)
    except Exception as e:  # noqa: BLE001 - any import failure means "peer unavailable"
        return e


# --------------------------------------------------------------------------- #
# Workloads.
# --------------------------------------------------------------------------- #

def transformer_shapes(n_params: float, n_leaves: int) -> dict:
    """Leaf shapes of a pre-LN transformer (12 leaves per block + embedding + final LN).

    The width is chosen so that the total is close to ``n_params``.
    """
    layers = max(1, (n_leaves - 3) // 12)
    vocab_per_width = 25  # embedding rows per model width unit (vocab = 25 * d)
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
    """``(params, grads, description)``: float32 params and finite gradients of the scaled loss."""
    shapes = transformer_shapes(n_params, n_leaves)
    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.normal(0, 0.02, s), jnp.float32) for k, s in shapes.items()}
    grads = {k: jnp.asarray(rng.normal(0, 1.0, s), jnp.float32) for k, s in shapes.items()}
    size = sum(int(np.prod(s)) for s in shapes.values())
    return params, grads, f"{size / 1e6:.2f}M float32 params in {len(shapes)} leaves"


@dataclasses.dataclass(frozen=True)
class LMConfig:
    vocab: int = 1024
    width: int = 128
    depth: int = 2
    heads: int = 4
    seq: int = 64
    batch: int = 8


def lm_workload(config: LMConfig):
    """``(params, tokens, description, loss_fn)`` of a Flax transformer LM computing in float16."""
    import flax.linen as nn

    half, c = jnp.float16, config

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.LayerNorm(dtype=half)(x)
            h = nn.MultiHeadDotProductAttention(num_heads=c.heads, dtype=half, deterministic=True)(
                h, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
            x = x + h
            h = nn.LayerNorm(dtype=half)(x)
            h = nn.Dense(4 * c.width, dtype=half)(h)
            h = nn.Dense(c.width, dtype=half)(nn.gelu(h))
            return x + h

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            embed = nn.Embed(c.vocab, c.width, dtype=half)
            x = embed(tokens)
            for _ in range(c.depth):
                x = Block()(x)
            return embed.attend(nn.LayerNorm(dtype=half)(x))

    model = LM()
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, c.vocab, (c.batch, c.seq + 1)), jnp.int32)
    params = model.init(jax.random.key(0), tokens[:, :-1])["params"]

    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    leaves = jax.tree.leaves(params)
    size = sum(x.size for x in leaves)
    desc = (f"Flax LM, {size / 1e6:.2f}M float32 params in {len(leaves)} leaves, float16 compute, "
            f"batch {c.batch}x{c.seq}, width {c.width}, depth {c.depth}, {c.heads} heads, "
            f"vocab {c.vocab}")
    return params, tokens, desc, loss_fn


# --------------------------------------------------------------------------- #
# The recipes. ``loss_fn(params, batch)``; None for the optimizer-only
# workload, whose batch is the gradient tree.
# --------------------------------------------------------------------------- #

def build_recipes(loss_fn: Optional[Callable[..., Any]], skipped: List[dict],
                  names: Optional[List[str]] = None) -> List[Recipe]:
    """Every recipe (or those in ``names``); unavailable peers are appended to ``skipped``."""

    def grads_of(params, batch, scale=None):
        if loss_fn is None:
            return batch
        if scale is None:
            return jax.grad(loss_fn)(params, batch)
        return jax.grad(lambda p: scale * loss_fn(p, batch))(params)

    adam = optax.adam(LR)

    def adam_step(params, state, batch):
        updates, state = adam.update(grads_of(params, batch), state, params)
        return optax.apply_updates(params, updates), state

    recipes = [Recipe(BASELINE, adam_step, adam.init, skips=False), ours_recipe(loss_fn)]
    for make in (_jmp_recipe, _mpx_recipe, _flax_recipe):
        try:
            recipes.append(make(adam, loss_fn, grads_of))
        except Exception as e:  # noqa: BLE001 - any import failure means "peer unavailable"
            skipped.append({"name": make.__doc__.split(":")[0], "error": f"{type(e).__name__}: {e}"})

    guarded = optax.apply_if_finite(adam, max_consecutive_errors=10**6)

    def guarded_step(params, state, batch):
        updates, state = guarded.update(grads_of(params, batch), state, params)
        return optax.apply_updates(params, updates), state

    recipes.append(Recipe("optax.apply_if_finite(adam)", guarded_step, guarded.init,
                          note="no loss scale", kept=lambda s: s.inner_state))
    keras = _optional("keras")
    if isinstance(keras, Exception) or keras.backend.backend() != "jax":
        skipped.append({"name": "Keras LossScaleOptimizer",
                        "error": "not installed, or KERAS_BACKEND is not jax"})
    else:
        recipes += _keras_recipes(keras, loss_fn)
    if names is not None:
        recipes = [r for r in recipes if r.name in names]
    return recipes


def ours_recipe(loss_fn: Optional[Callable[..., Any]], inner: Any = None,
                name: str = "jmp_policy.loss_scaling(adam)") -> Recipe:
    """``loss_scaling(inner)`` (default Adam) as its docs write the train step."""
    tx = jmp_policy.loss_scaling(inner if inner is not None else optax.adam(LR),
                                 jmp_policy.DynamicLossScale(jnp.float32(SCALE)))

    def step(params, state, batch):
        if loss_fn is None:
            grads = batch
        else:
            scale = jmp_policy.get_loss_scale(state)
            _, grads = jmp_policy.scaled_value_and_grad(loss_fn)(scale, params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return Recipe(name, step, tx.init, kept=lambda s: s.inner_state)


def _jmp_recipe(adam, loss_fn, grads_of) -> Recipe:
    """jmp recipe (select_tree): DeepMind jmp's README."""
    import jmp

    # jmp's DynamicLossScale cannot be an argument of `jit(...).lower` (its
    # unflattening checks JAX's placeholder leaves), so the state carries its
    # two leaves and the step rebuilds the object (the same computation).
    def init(params):
        ls = jmp.DynamicLossScale(jnp.float32(SCALE))
        return adam.init(params), (ls.loss_scale, ls.counter)

    def step(params, state, batch):
        opt_state, (scale, counter) = state
        loss_scale = jmp.DynamicLossScale(scale, counter)
        grads = loss_scale.unscale(grads_of(params, batch, loss_scale.loss_scale))
        grads_finite = jmp.all_finite(grads)
        loss_scale = loss_scale.adjust(grads_finite)
        updates, new_opt_state = adam.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp.select_tree(
            grads_finite, (new_params, new_opt_state), (params, opt_state))
        return params, (opt_state, (loss_scale.loss_scale, loss_scale.counter))

    return Recipe("jmp recipe (select_tree)", step, init, kept=lambda s: s[0])


def _mpx_recipe(adam, loss_fn, grads_of) -> Recipe:
    """MPX (pip install mixed-precision-for-jax): all_finite + optimizer_update."""
    import mpx

    if not hasattr(mpx, "DynamicLossScaling"):
        raise ImportError("mpx is not mixed-precision-for-jax")

    def init(params):
        return adam.init(params), mpx.DynamicLossScaling(jnp.float32(SCALE), jnp.float32(1.0),
                                                         period=2000)

    def step(params, state, batch):
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

    return Recipe("MPX (optimizer_update)", step, init, kept=lambda s: s[0])


def _flax_recipe(adam, loss_fn, grads_of) -> Recipe:
    """Flax DynamicScale recipe: jnp.where on every leaf, as in Flax's examples."""
    from flax.training.dynamic_scale import DynamicScale

    def init(params):
        return adam.init(params), DynamicScale(scale=jnp.float32(SCALE))

    def step(params, state, batch):
        opt_state, dyn_scale = state
        if loss_fn is None:
            # DynamicScale only offers value_and_grad: differentiate a linear
            # function whose gradient is the given tree (its forward is dead code).
            fn = lambda p: sum(jnp.vdot(x, jax.lax.stop_gradient(g)) for x, g in  # noqa: E731
                               zip(jax.tree.leaves(p), jax.tree.leaves(batch)))
        else:
            fn = lambda p: loss_fn(p, batch)  # noqa: E731
        dyn_scale, is_fin, _, grads = dyn_scale.value_and_grad(fn)(params)
        updates, new_opt_state = adam.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        select = functools.partial(jnp.where, is_fin)
        params = jax.tree.map(select, new_params, params)
        opt_state = jax.tree.map(select, new_opt_state, opt_state)
        return params, (opt_state, dyn_scale)

    return Recipe("Flax DynamicScale recipe", step, init, kept=lambda s: s[0])


def _keras_recipes(keras, loss_fn) -> List[Recipe]:
    """Keras optimizers keep their state in Variables; ``stateless_apply`` is the jit-able form."""

    def make(with_loss_scale: bool):
        built: dict = {}

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
    return [Recipe("Keras LossScaleOptimizer(Adam)", lso_step, lso_init),
            Recipe("Keras Adam", adam_step, adam_init,
                   note="reference: Keras' own Adam, no loss scale", skips=False)]


# --------------------------------------------------------------------------- #
# Recipes as harness cases, with the skip check.
# --------------------------------------------------------------------------- #

def _bits(tree: Any) -> List[bytes]:
    """Each leaf's bytes, every NaN written as one NaN.

    A skipped step adds -0.0 to each parameter, which keeps every number bit for
    bit; a NaN parameter (the poisoned one) stays NaN but GPUs return their own
    canonical NaN from arithmetic, whatever payload went in.
    """
    def canonical(x: Any) -> np.ndarray:
        x = np.asarray(x)
        if np.issubdtype(x.dtype, np.inexact) or x.dtype.kind == "V" or "float" in x.dtype.name:
            x = np.where(np.isnan(x), np.array(np.nan, x.dtype), x)
        return x
    return [canonical(x).tobytes() for x in jax.tree.leaves(tree)]


def _poison(tree: Any) -> Any:
    """``tree`` with a NaN in one element of its middle floating leaf."""
    leaves, treedef = jax.tree.flatten(tree)
    floats = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.floating)]
    i = floats[len(floats) // 2]
    leaves[i] = leaves[i].at[(0,) * leaves[i].ndim].set(jnp.nan)
    return jax.tree.unflatten(treedef, leaves)


def skip_check(recipe: Recipe, poison: str) -> Callable[[Any, tuple], None]:
    """A `harness.Case.check`: one non-finite step leaves params (and ``recipe.kept``) unchanged.

    ``poison="batch"`` puts a NaN into the batch (the gradients of the
    optimizer-only workload); ``"params"`` into the params, so that the loss
    and every gradient of a full train step are NaN.
    """

    def check(compiled, args):
        params, state, batch = args
        if poison == "batch":
            batch = _poison(batch)
        else:
            params = _poison(params)
        before = (_bits(params), _bits(recipe.kept(state)) if recipe.kept else None)
        new_params, new_state = compiled(params, state, batch)[:2]
        if _bits(new_params) != before[0]:
            raise AssertionError(f"{recipe.name} changed the params on a non-finite step")
        if recipe.kept and _bits(recipe.kept(new_state)) != before[1]:
            raise AssertionError(f"{recipe.name} changed the optimizer state on a non-finite step")

    return check


def recipe_cases(recipes: List[Recipe], params: Any, batch: Any, donate: bool,
                 poison: str) -> List[harness.Case]:
    """One `harness.Case` per recipe; outputs ``(params, state)`` feed the next step."""
    cases = []
    for r in recipes:
        state = r.init_state(params)
        cases.append(harness.Case(
            r.name, r.step, (params, state, batch), donate_argnums=(0, 1) if donate else (),
            carry=2, note=r.note, check=skip_check(r, poison) if r.skips else None))
    return cases


def run_workload(report: harness.Report, key: str, title: str, desc: str, loss_fn, params,
                 batch, args) -> None:
    poison = "batch" if loss_fn is None else "params"
    for donate in {"both": (True, False), "donated": (True,), "not-donated": (False,)}[args.mode]:
        mode = "donated" if donate else "not donated"
        print(f"\n== {title}, {mode}: {desc} ==", flush=True)
        skipped: List[dict] = []
        recipes = build_recipes(loss_fn, skipped)
        rows, failed = harness.measure(
            recipe_cases(recipes, params, batch, donate, poison),
            compile_rounds=args.compile_rounds, rounds=args.rounds, iters=args.iters,
            wall=not args.no_wall)
        table = report.table(f"{key}-{mode.replace(' ', '-')}", f"{title}, {mode}",
                             baseline=BASELINE, description=desc)
        table.add_rows(rows)
        report.failed(skipped + failed, f"{key}, {mode}")
        print(harness.render_table(table.to_json()), flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=["opt", "lm", "all"], default="all")
    ap.add_argument("--params", type=float, default=8e6, help="optimizer-only: total params")
    ap.add_argument("--leaves", type=int, default=100, help="optimizer-only: about this many leaves")
    for field in dataclasses.fields(LMConfig):
        ap.add_argument(f"--lm-{field.name}", type=int, default=field.default)
    ap.add_argument("--mode", choices=["both", "donated", "not-donated"], default=None,
                    help="donation of params and state (default: both; donated with --quick)")
    harness.add_common_arguments(ap, rounds=15, iters=5, compile_rounds=3)
    args = ap.parse_args(argv)
    args.mode = args.mode or ("donated" if args.quick else "both")
    if args.quick:
        args.params, args.leaves, args.rounds, args.iters, args.compile_rounds = 2e5, 27, 3, 2, 1
        args.lm_vocab, args.lm_width, args.lm_depth, args.lm_seq, args.lm_batch = 256, 32, 1, 16, 2

    report = harness.Report("bench_loss_scaling", __doc__.split("\n\n")[0], vars(args), argv)
    print(f"jax {jax.__version__} on {jax.default_backend()}; optax {optax.__version__}", flush=True)
    if args.workload in ("opt", "all"):
        params, grads, desc = optimizer_only_workload(args.params, args.leaves)
        run_workload(report, "opt", "optimizer-only step", desc, None, params, grads, args)
    if args.workload in ("lm", "all"):
        config = LMConfig(**{f.name: getattr(args, f"lm_{f.name}")
                             for f in dataclasses.fields(LMConfig)})
        params, tokens, desc, loss_fn = lm_workload(config)
        run_workload(report, "lm", "full train step", desc, loss_fn, params, tokens, args)
    path = args.json or harness.default_json_path("bench_loss_scaling", args.quick)
    report.write(path)
    if report.failures:
        print("\nDid not run: " + "; ".join(f"{f['name']}: {f['error']}" for f in report.failures))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

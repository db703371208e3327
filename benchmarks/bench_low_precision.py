"""bfloat16 weights and optimizer states: memory and cost against float32 weights and Adam.

Recipes (Adam throughout; ``jmp_policy.low_precision_params`` for the
methods, ``jmp_policy.cast_state`` for bfloat16 moments,
``jmp_policy.quantize_state`` for 8-bit and 4-bit ones):

* ``adam``: float32 weights, float32 moments (the baseline: float32 master
  weights, 12 bytes per parameter);
* ``adam, bf16 moments``: float32 weights, ``cast_state(adam)``;
* ``bf16 nearest``: bfloat16 weights and plain ``optax.adam`` (bfloat16
  moments, every update rounded to nearest);
* ``adam, 8-bit moments``, ``adam, 4-bit moments``: float32 weights,
  ``quantize_state(adam, bits=8 | 4)``;
* ``kahan``, ``stochastic``, ``split``: bfloat16 weights, with float32,
  bfloat16 (``+ bf16 moments``), 8-bit or 4-bit moments.

Two workloads, each step donating weights and optimizer state:

* ``opt`` (cost): the optimizer step alone, ``update`` + ``optax.apply_updates``,
  on ``--params`` parameters in transformer-shaped leaves, gradients given in
  the weights' dtype. Bytes accessed (``cost_analysis()``), wall time per step
  (median of interleaved rounds), compile time and temporaries, as ratios to
  plain Adam on the same parameters in the same run.
* ``train`` (memory): a whole train step (forward, backward, update) of the
  byte-level transformer LM of ``examples/transformer_lm.py``: bytes per
  parameter of weights + optimizer state + buffers, and XLA's memory account
  of the compiled step (``memory_analysis()``: arguments + outputs +
  temporaries - donated, and the peak where the backend reports one).

``--exhaustive`` also checks the exactness argument on every pair of
bfloat16 values (about 4 minutes on 2 CPU cores): the float32 update
``new - p`` (``-0.0`` when unchanged) with which the library moves a weight
``p`` to ``new``, applied as ``optax.apply_updates`` does, lands on ``new``
except in the classes the table lists.

Commands (from the repository root; JSON to ``benchmarks/results/bench_low_precision.json``)::

    python -m benchmarks.bench_low_precision                 # ~3-5 min on 2 CPU cores
    python -m benchmarks.bench_low_precision --quick         # smoke run, ~1 min
    python -m benchmarks.bench_low_precision --exhaustive    # + the 2**32 pairs
    python -m benchmarks.bench_low_precision --size gpu      # the GPU sizes (default on a GPU)
    # the LM at the GPU size (101.8M parameters), XLA's figures only: ~5 min on a CPU
    python -m benchmarks.bench_low_precision --size gpu --workloads train --no-wall \
        --json benchmarks/results/bench_low_precision_lm_gpu_size.json
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import harness
import jmp_policy

BF16 = jnp.bfloat16
SIZES = {
    # opt: parameters of the optimizer-only step; lm: the transformer LM's config.
    "quick": {"opt": 2e5, "lm": dict(d_model=64, heads=4, layers=2, seq_len=64, batch_size=8)},
    # Few tokens per step, so that weights and optimizer state outweigh the activations,
    # as when fine-tuning a large model.
    "cpu": {"opt": 4e6, "lm": dict(d_model=256, heads=4, layers=4, seq_len=64, batch_size=2)},
    "gpu": {"opt": 1e8, "lm": dict(d_model=1024, heads=16, layers=8, seq_len=512, batch_size=16)},
}
COST_COLUMNS = [
    harness.Column("bytes_per_param", "bytes/param", ""),
    harness.Column("bytes_accessed", "bytes accessed", "bytes"),
    harness.Column("wall_s", "wall time", "s"),
    harness.Column("compile_s", "compile time", "s"),
    harness.Column("hlo_instructions", "HLO instructions", ""),
    harness.Column("temp_bytes", "temp memory", "bytes", ratio=False),
]
MEMORY_COLUMNS = [
    harness.Column("bytes_per_param", "bytes/param", ""),
    harness.Column("state_bytes", "weights + optimizer state", "bytes"),
    harness.Column("step_bytes", "step memory (XLA)", "bytes"),
    harness.Column("peak_bytes", "peak (XLA)", "bytes"),
    harness.Column("temp_bytes", "temporaries", "bytes"),
    harness.Column("wall_s", "step time", "s"),
]


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    weights: Any  # the weights' dtype
    method: Optional[str]  # low_precision_params method, or None
    moments: Any  # the moments' dtype (None: plain optax, which keeps them in the weights'
    #               dtype; EIGHT_BIT, FOUR_BIT: quantize_state's 8- and 4-bit states)

    def optimizer(self, inner: optax.GradientTransformation) -> optax.GradientTransformation:
        if self.moments == BF16:
            inner = jmp_policy.cast_state(inner, BF16)
        if self.moments in (EIGHT_BIT, FOUR_BIT):
            inner = jmp_policy.quantize_state(inner, bits=int(self.moments[0]))
        if self.method is not None:
            inner = jmp_policy.low_precision_params(inner, self.method)
        return inner


EIGHT_BIT, FOUR_BIT = "8-bit", "4-bit"

RECIPES = [
    Recipe("adam", jnp.float32, None, jnp.float32),
    Recipe("adam, bf16 moments", jnp.float32, None, BF16),
    Recipe("adam, 8-bit moments", jnp.float32, None, EIGHT_BIT),
    Recipe("adam, 4-bit moments", jnp.float32, None, FOUR_BIT),
    Recipe("bf16 nearest", BF16, None, None),
    *(Recipe(f"{method}{suffix}", BF16, method, moments)
      for method in ("kahan", "stochastic", "split")
      for suffix, moments in (("", jnp.float32), (" + bf16 moments", BF16),
                              (" + 8-bit moments", EIGHT_BIT),
                              (" + 4-bit moments", FOUR_BIT))),
]


def tree_bytes(tree: Any) -> int:
    # Bits, not itemsize: XLA stores int4 (4-bit states) two values per byte.
    return sum(math.prod(x.shape) * jax.dtypes.itemsize_bits(x.dtype) // 8
               for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def memory_extra(params: Any, state: Any) -> Callable[[harness.Build], Dict[str, float]]:
    """Bytes per parameter stored between steps, and the compiled step's memory account."""
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    stored = tree_bytes(params) + tree_bytes(state)

    def extra(build: harness.Build) -> Dict[str, float]:
        m = harness.memory_figures(build.compiled)
        parts = [m[k] for k in ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes")]
        figures = {"bytes_per_param": stored / n, "state_bytes": stored,
                   "step_bytes": None if None in parts else parts[0] + parts[1] + parts[2] - parts[3]}
        if jax.default_backend() == "cpu":
            figures["peak_bytes"] = None  # XLA:CPU's figure is not the step's peak
        return figures

    return extra


# --------------------------------------------------------------------------- #
# The optimizer-only step.
# --------------------------------------------------------------------------- #

def transformer_shapes(n_params: float) -> Dict[str, tuple]:
    """Leaves of a transformer with about ``n_params`` parameters, in at least 4 layers if it can."""
    d = 128
    while 12 * 4 * (2 * d) ** 2 <= n_params:
        d *= 2
    shapes = {}
    for i in range(max(1, round(n_params / (12 * d * d)))):
        shapes.update({f"l{i}.qkv": (d, 3 * d), f"l{i}.proj": (d, d), f"l{i}.up": (d, 4 * d),
                       f"l{i}.down": (4 * d, d), f"l{i}.up_bias": (4 * d,), f"l{i}.ln": (d,)})
    return shapes


def opt_cases(n_params: float) -> List[harness.Case]:
    shapes = transformer_shapes(n_params)
    rng = np.random.default_rng(0)
    values = {k: rng.normal(0, 0.02, s).astype(np.float32) for k, s in shapes.items()}
    cases = []
    for recipe in RECIPES:
        params = {k: jnp.asarray(v, recipe.weights) for k, v in values.items()}
        grads = {k: jnp.asarray(v * 0.1, recipe.weights) for k, v in values.items()}
        tx = recipe.optimizer(optax.adam(1e-4))
        state = jax.jit(tx.init)(params)

        def step(params: Any, state: Any, grads: Any, tx: Any = tx) -> Any:
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        cases.append(harness.Case(recipe.name, step, (params, state, grads), donate_argnums=(0, 1),
                                  carry=2, extra=memory_extra(params, state)))
    return cases


# --------------------------------------------------------------------------- #
# The transformer LM's train step.
# --------------------------------------------------------------------------- #

def lm_cases(size: Dict[str, int]) -> List[harness.Case]:
    lm = harness.load_file("examples/transformer_lm.py")
    config = lm.Config(**size)
    model = lm.TransformerLM(config)
    batch = jnp.asarray(next(lm.batches(lm.load_text(), config, seed=0)))
    policies = {jnp.dtype(jnp.float32): "mixed_bfloat16",
                jnp.dtype(BF16): "params=bfloat16,compute=bfloat16"}

    def init(policy: str) -> Any:
        with lm.module_policies(policy):
            return jax.jit(model.init)(jax.random.key(0), batch[:1, :-1])["params"]

    wide = init("mixed_bfloat16")
    narrow = jax.tree.map(lambda w, s: w.astype(s.dtype), wide,
                          jax.eval_shape(lambda: init(policies[jnp.dtype(BF16)])))
    cases = []
    for recipe in RECIPES:
        params = wide if recipe.weights == jnp.float32 else narrow
        rules = lm.module_policies(policies[jnp.dtype(recipe.weights)])
        tx = recipe.optimizer(optax.adamw(1e-4, weight_decay=0.01))
        state = jax.jit(tx.init)(params)

        def step(params: Any, state: Any, tokens: Any, tx: Any = tx, rules: Any = rules) -> Any:
            def loss_fn(params: Any) -> jax.Array:
                with rules:
                    logits = model.apply({"params": params}, tokens[:, :-1])
                return optax.softmax_cross_entropy_with_integer_labels(
                    logits.astype(jnp.float32), tokens[:, 1:]).mean()

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss

        cases.append(harness.Case(recipe.name, step, (params, state, batch), donate_argnums=(0, 1),
                                  carry=2, extra=memory_extra(params, state)))
    return cases


# --------------------------------------------------------------------------- #
# Every pair of bfloat16 values.
# --------------------------------------------------------------------------- #

CLASSES = ("pairs", "landed exactly", "new is -0.0, p is not", "p is inf or NaN",
           "new is subnormal (flushed)", "new - p is subnormal (flushed)",
           "new - p overflows float32", "new < 2**-16 p and off p's float32 grid", "other")


def exhaustive(chunk: int = 1024) -> Dict[str, int]:
    """Classifies all 2**32 (p, new) pairs of bfloat16 values by whether the update lands.

    The update is the library's: float32(new) - float32(p), or -0.0 where the
    bits are equal; it is applied as optax.apply_updates does. The last
    classes are unreachable by any float32 update; the library's methods never
    produce the "off p's grid" one (a new value that small comes from a
    cancellation p + v, which is exact, so it lies on p's float32 grid).
    """
    every = jnp.asarray(np.arange(2**16, dtype=np.uint16).view(BF16))

    def fields(b: jax.Array) -> Any:
        b = b.astype(jnp.int32)
        e, m = (b >> 7) & 0xFF, b & 0x7F
        exponent = jnp.where(e == 0, -126, e - 127)
        mantissa = jnp.where(e == 0, m, m | 0x80)
        trailing = jnp.log2((mantissa & -mantissa).astype(jnp.float32)).astype(jnp.int32)
        return e, m, exponent, mantissa, trailing

    @jax.jit
    def count(p: jax.Array, new: jax.Array) -> jax.Array:
        p, new = jnp.broadcast_arrays(p[:, None], new[None, :])
        pb, nb = (jax.lax.bitcast_convert_type(x, jnp.uint16) for x in (p, new))
        update = jnp.where(pb == nb, -0.0, new.astype(jnp.float32) - p.astype(jnp.float32))
        landed = (p.astype(jnp.float32) + update).astype(BF16)
        ok = (jax.lax.bitcast_convert_type(landed, jnp.uint16) == nb) | (
            jnp.isnan(new) & jnp.isnan(landed))
        ne, nm, nE, nM, ntz = fields(nb)
        pe, pm, pE, _, _ = fields(pb)
        classes = [ok,
                   (nb == 0x8000) & (pb != 0x8000),
                   pe == 0xFF,
                   (ne == 0) & (nm != 0),
                   jnp.maximum(nE, pE) <= -118,
                   (jnp.maximum(nE, pE) >= 126) & ((nb ^ pb) >= 0x8000),
                   # new is a multiple of 2**(E_p - 23), or of 2**(E_p - 24) with p a power
                   # of two of new's sign: what a cancellation p + v can give.
                   (nE < pE - 16) & ~((nM == 0) | (nE - 7 + ntz >= pE - 23) | (
                       (pm == 0) & ((nb ^ pb) < 0x8000) & (nE - 7 + ntz >= pE - 24)))]
        counts, left = [], ~ok
        for c in classes[1:]:
            counts.append(jnp.sum(left & c))
            left = left & ~c
        return jnp.stack([jnp.sum(ok)] + counts + [jnp.sum(left)])

    totals = np.zeros(len(CLASSES) - 1, np.int64)
    for i in range(0, 2**16, chunk):
        totals += np.asarray(count(every[i:i + chunk], every), np.int64)
    return dict(zip(CLASSES, [2**32] + [int(t) for t in totals]))


# --------------------------------------------------------------------------- #

def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="sizes (default: gpu on a GPU, else cpu; quick with --quick)")
    parser.add_argument("--workloads", nargs="+", default=["opt", "train"],
                        choices=["opt", "train"])
    parser.add_argument("--params", type=float, default=None,
                        help="parameters of the optimizer-only step (default: the size's)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--compile-rounds", type=int, default=1)
    parser.add_argument("--no-wall", action="store_true", help="XLA figures only")
    parser.add_argument("--exhaustive", action="store_true",
                        help="also classify every pair of bfloat16 values (~4 min)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, 2 rounds")
    parser.add_argument("--json", help="write the report here (default: "
                        "benchmarks/results/bench_low_precision.json; .quick.json with --quick)")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.rounds, args.iters = args.size or "quick", 2, 2
    if args.size is None:
        args.size = "gpu" if jax.default_backend() == "gpu" else "cpu"
    size = SIZES[args.size]
    n_params = args.params or size["opt"]

    report = harness.Report("bench_low_precision", __doc__.split("\n")[0], vars(args), argv)
    measure = dict(compile_rounds=args.compile_rounds, rounds=args.rounds, iters=args.iters,
                   wall=not args.no_wall)
    if "opt" in args.workloads:
        cases = opt_cases(n_params)
        n = sum(math.prod(x.shape) for x in jax.tree.leaves(cases[0].args[0]))
        print(f"opt: optimizer step on {n:,} parameters in {len(cases[0].args[0])} leaves",
              flush=True)
        rows, failed = harness.measure(cases, **measure)
        table = report.table("cost", "Optimizer step (update + apply_updates), donated",
                             baseline="adam", columns=COST_COLUMNS,
                             description=f"{n:,} parameters, Adam")
        table.add_rows(rows)
        report.failed(failed, "opt")
        print(harness.render_table(table.to_json()), flush=True)
    if "train" in args.workloads:
        cases = lm_cases(size["lm"])
        n = sum(math.prod(x.shape) for x in jax.tree.leaves(cases[0].args[0]))
        print(f"train: transformer LM {size['lm']}, {n:,} parameters", flush=True)
        rows, failed = harness.measure(cases, **{**measure, "rounds": min(args.rounds, 3)})
        table = report.table("memory", "Transformer LM train step, donated", baseline="adam",
                             columns=MEMORY_COLUMNS,
                             description=f"{n:,} parameters, AdamW, {size['lm']}")
        table.add_rows(rows)
        report.failed(failed, "train")
        print(harness.render_table(table.to_json()), flush=True)
    if args.exhaustive:
        start = time.perf_counter()
        counts = exhaustive()
        print(f"exhaustive: {time.perf_counter() - start:.0f} s", flush=True)
        table = report.table("exactness", "Every (p, new) pair of bfloat16 values", baseline=None,
                             columns=[harness.Column("pairs", "pairs", "count")])
        for name, value in counts.items():
            table.add_row(name, {"pairs": value})
        print(harness.render_table(table.to_json()), flush=True)
    if jax.default_backend() == "cpu":
        report.note("CPU: bfloat16 arithmetic is emulated, so wall times say little about a "
                    "GPU's; bytes accessed and memory are what XLA:CPU compiles.")
    path = args.json or harness.default_json_path("bench_low_precision", args.quick)
    report.write(path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

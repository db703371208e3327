"""bfloat16 weights and optimizer states that train like float32 master weights.

    python examples/bf16_weights.py                        # several minutes on a laptop CPU
    python examples/bf16_weights.py --tasks digits --steps 100 --out /tmp/bf16

Trains the digits CNN of ``train_digits.py`` and the byte-level transformer LM
of ``transformer_lm.py`` with the same data, seed, steps and initial weights
under each recipe:

* ``float32 master``: the ``mixed_bfloat16`` reference, float32 weights and
  float32 Adam moments (12 bytes per parameter);
* ``bf16 nearest``: bfloat16 weights and plain ``optax`` Adam, whose moments
  are then bfloat16 too, rounding every update to nearest (6 bytes);
* ``bf16 kahan`` / ``bf16 stochastic`` / ``bf16 split``: bfloat16 weights with
  ``jmp_policy.low_precision_params`` and bfloat16 moments with
  ``jmp_policy.cast_state`` (8, 6 and 8 bytes);
* ``f32 master, bf16 moments`` (stochastic or nearest rounding of the moments):
  what storing the moments in bfloat16 costs on its own (8 bytes);
* ``bf16 stochastic, 8-bit moments`` / ``f32 master, 8-bit moments`` and the
  same with 4-bit moments: the moments quantized with
  ``jmp_policy.quantize_state`` (about 4 and 6, 3 and 5 bytes).

``--seeds 0 1 2`` repeats every run per seed (data order, initial weights and
rounding all follow the seed) and reports each recipe's mean, its gap to the
float32 master run of the same seed, and the spread over seeds.

Both tasks use a learning rate small enough that most Adam updates fall below
half a bfloat16 ulp of their weight, the regime where rounding to nearest
loses them (``--digits-lr``, ``--lm-lr``). The script prints one table per
task (test metric, difference from the float32 master run, bytes per
parameter, XLA's memory account of one step, steps/s), checks each recipe
against the tolerances (0.5 points of accuracy, 1% of bits per byte), and writes ``results.json`` and ``bf16_weights.png``
to ``--out`` (default ``results/bf16_weights/``). ``--report PATH`` also
writes the tables as a benchmark report (``benchmarks.harness``'s JSON
schema), which the documentation renders.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import math
import os
import shlex
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_policy

HERE = os.path.dirname(os.path.abspath(__file__))
REFERENCE = "float32 master"
METHODS = ("kahan", "stochastic", "split")
TOLERANCE = {"digits": 0.5, "lm": 1.0}  # percentage points of accuracy; percent of bits/byte


def _example(name: str) -> Any:
    """Another example of this folder, as a module (they are scripts, not a package)."""
    module_name = f"_example_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, os.path.join(HERE, name + ".py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # flax modules are dataclasses: they look it up
        spec.loader.exec_module(module)
    return sys.modules[module_name]


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    params: str  # "float32" (float32 master weights) or "bfloat16"
    method: Optional[str]  # low_precision_params method; None: none
    moments: str  # "float32", "bfloat16" (stochastic), "bfloat16-nearest", "8-bit" or "4-bit"
    style: str  # matplotlib line style and marker, so that overlapping curves stay apart


RECIPES = (
    Recipe(REFERENCE, "float32", None, "float32", "-"),
    Recipe("bf16 nearest", "bfloat16", None, "bfloat16-nearest", "-x"),
    Recipe("bf16 kahan", "bfloat16", "kahan", "bfloat16", "--o"),
    Recipe("bf16 stochastic", "bfloat16", "stochastic", "bfloat16", "-.s"),
    Recipe("bf16 split", "bfloat16", "split", "bfloat16", ":^"),
    Recipe("f32 master, bf16 moments", "float32", None, "bfloat16", "--v"),
    Recipe("f32 master, bf16 moments (nearest)", "float32", None, "bfloat16-nearest", ":d"),
    Recipe("bf16 stochastic, 8-bit moments", "bfloat16", "stochastic", "8-bit", "-.P"),
    Recipe("f32 master, 8-bit moments", "float32", None, "8-bit", "--*"),
    Recipe("bf16 stochastic, 4-bit moments", "bfloat16", "stochastic", "4-bit", "-.X"),
    Recipe("f32 master, 4-bit moments", "float32", None, "4-bit", "--h"),
)


def optimizer(recipe: Recipe, inner: optax.GradientTransformation,
              seed: int) -> optax.GradientTransformation:
    """``inner`` as the recipe stores it, inside loss_scaling (no scale for bfloat16)."""
    if recipe.params == "bfloat16" and recipe.method is None:
        return jmp_policy.loss_scaling(inner, None)  # plain optax: everything bfloat16
    if recipe.moments in ("8-bit", "4-bit"):
        inner = jmp_policy.quantize_state(inner, bits=int(recipe.moments[0]), seed=seed)
    elif recipe.moments != "float32":
        rounding = "nearest" if recipe.moments.endswith("nearest") else "stochastic"
        inner = jmp_policy.cast_state(inner, jnp.bfloat16, rounding=rounding, seed=seed)
    if recipe.method is not None:
        inner = jmp_policy.low_precision_params(inner, recipe.method, seed=seed)
    return jmp_policy.loss_scaling(inner, None)


# --------------------------------------------------------------------------- #
# Tasks: the digits CNN and the byte-level LM of the other examples.
# --------------------------------------------------------------------------- #

@dataclasses.dataclass
class Task:
    name: str
    metric: str  # what evaluate() returns
    higher_is_better: bool
    init: Callable[[str], Any]  # policy name -> parameters (dtypes of the policy)
    loss: Callable[[str], Callable[[Any, Any], jax.Array]]  # policy -> loss(params, batch)
    evaluate: Callable[[str, Any], float]
    batches: Callable[[], Iterator[Any]]
    inner: Callable[[float], optax.GradientTransformation]


def digits_task(seed: int) -> Task:
    digits = _example("train_digits")
    x_train, x_test, y_train, y_test = digits.load_data(seed)
    model = lambda policy: digits.CNN(jmp_policy.Policy(policy))  # noqa: E731

    def loss(policy: str) -> Callable[[Any, Any], jax.Array]:
        def loss_fn(params: Any, batch: Any) -> jax.Array:
            x, y = batch
            logits = model(policy).apply({"params": params}, x).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss_fn

    def evaluate(policy: str, params: Any) -> float:
        logits = jax.jit(model(policy).apply)({"params": params}, x_test)
        return 100 * float(jnp.mean(jnp.argmax(logits, -1) == y_test))

    def batches() -> Iterator[Any]:
        rng = np.random.RandomState(seed)
        while True:
            order = rng.permutation(len(x_train))
            for i in range(0, len(order) - 63, 64):
                yield x_train[order[i:i + 64]], y_train[order[i:i + 64]]

    return Task(
        "digits", "test accuracy %", True,
        init=lambda policy: jax.jit(model(policy).init)(
            jax.random.key(seed), jnp.zeros((1, 8, 8, 1)))["params"],
        loss=loss, evaluate=evaluate, batches=batches, inner=lambda lr: optax.adam(lr))


def lm_task(seed: int) -> Task:
    lm = _example("transformer_lm")
    config = lm.Config()
    text = lm.load_text()
    split = int(0.9 * len(text))
    test_batch = next(lm.batches(text[split:], dataclasses.replace(config, batch_size=64), seed + 1))
    model = lm.TransformerLM(config)

    def loss(policy: str) -> Callable[[Any, Any], jax.Array]:
        rules = lm.module_policies(policy)  # LayerNorm, softmax and logits in float32

        def loss_fn(params: Any, tokens: Any) -> jax.Array:
            with rules:
                logits = model.apply({"params": params}, tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), tokens[:, 1:]).mean()
        return loss_fn

    def init(policy: str) -> Any:
        with lm.module_policies(policy):
            return jax.jit(model.init)(jax.random.key(seed),
                                       jnp.zeros((1, config.seq_len), jnp.int32))["params"]

    return Task(
        "lm", "test bits/byte", False, init=init, loss=loss,
        evaluate=lambda policy, params: float(jax.jit(loss(policy))(params, test_batch)) / math.log(2),
        batches=lambda: lm.batches(text[:split], config, seed),
        inner=lambda lr: optax.adamw(lr, weight_decay=0.01))


# --------------------------------------------------------------------------- #
# Training.
# --------------------------------------------------------------------------- #

def initial_params(task: Task) -> Dict[str, Any]:
    """Per params dtype, the same initial values: float32 weights rounded to bfloat16."""
    wide = task.init("mixed_bfloat16")
    narrow_dtypes = jax.eval_shape(lambda: task.init("params=bfloat16,compute=bfloat16"))
    narrow = jax.tree.map(lambda w, s: w.astype(s.dtype), wide, narrow_dtypes)
    return {"float32": jax.tree.map(lambda w: w.astype(jnp.float32), narrow), "bfloat16": narrow}


def state_bytes(tree: Any) -> int:
    # Bits, not itemsize: XLA stores int4 (4-bit states) two values per byte.
    return sum(int(np.prod(x.shape)) * jax.dtypes.itemsize_bits(x.dtype) // 8
               for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def train(task: Task, recipe: Recipe, params: Any, *, steps: int, lr: float, seed: int,
          progress: bool = False) -> Dict[str, Any]:
    policy = "mixed_bfloat16" if recipe.params == "float32" else "params=bfloat16,compute=bfloat16"
    loss_fn = task.loss(policy)
    tx = optimizer(recipe, task.inner(lr), seed)

    def train_step(params: Any, opt_state: Any, batch: Any) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = jax.tree.map(jnp.copy, params)  # the step donates it
    opt_state = jax.jit(tx.init)(params)
    data = task.batches()
    first = next(data)
    # Donated, as a train loop would: the step's memory is then the state plus temporaries.
    step = jax.jit(train_step, donate_argnums=(0, 1)).lower(params, opt_state, first).compile()
    memory = step.memory_analysis()
    n_params = sum(x.size for x in jax.tree.leaves(params))
    stored = (state_bytes(params) + state_bytes(opt_state)) / n_params
    losses = []
    batches = [first] + [next(data) for _ in range(steps - 1)]
    start = None
    for i, batch in enumerate(batches):
        if i == 1:
            jax.block_until_ready(params)
            start = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(loss)
    jax.block_until_ready(params)
    elapsed = time.perf_counter() - start if start is not None else float("nan")
    if progress:
        print(f"  {task.name} / {recipe.name}: {steps} steps in {elapsed:.1f} s", flush=True)
    return {
        "recipe": recipe.name,
        "params": recipe.params,
        "method": recipe.method or ("nearest" if recipe.params == "bfloat16" else "float32"),
        "moments": recipe.moments,
        "metric": task.evaluate(policy, params),
        "final_loss": float(np.mean([float(l) for l in losses[-max(1, steps // 20):]])),
        "bytes_per_param": stored,
        "step_memory_bytes": None if memory is None else int(
            memory.argument_size_in_bytes + memory.output_size_in_bytes
            + memory.temp_size_in_bytes - memory.alias_size_in_bytes),
        "steps_per_s": (steps - 1) / elapsed if steps > 1 else float("nan"),
        "params_finite": bool(jax.jit(jmp_policy.all_finite)(params)),
        "losses": [float(l) for l in losses],
    }


def relative_gap(task: Task, value: float, reference: float) -> float:
    """How much worse than the reference: percentage points (accuracy) or percent (bits/byte)."""
    if task.higher_is_better:
        return reference - value
    return 100 * (value - reference) / reference


def summary(task: Task, runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per recipe (in run order): its runs' mean metric and spread, and its gap to the
    float32 master run of the same seed, averaged over seeds."""
    reference = {r["seed"]: r["metric"] for r in runs if r["recipe"] == REFERENCE}
    rows: Dict[str, Dict[str, Any]] = {}
    for r in runs:
        row = rows.setdefault(r["recipe"], {"recipe": r["recipe"], "params": r["params"],
                                            "moments": r["moments"], "runs": []})
        row["runs"].append(r)
    for row in rows.values():
        metrics = [r["metric"] for r in row["runs"]]
        gaps = [relative_gap(task, r["metric"], reference[r["seed"]]) for r in row["runs"]]
        row.update(
            metric=float(np.mean(metrics)), spread=float(np.max(metrics) - np.min(metrics)),
            gap=float(np.mean(gaps)), gap_range=(float(np.min(gaps)), float(np.max(gaps))),
            seeds=[r["seed"] for r in row["runs"]],
            **{key: float(np.mean([r[key] for r in row["runs"]])) for key in
               ("final_loss", "bytes_per_param", "steps_per_s")},
            step_memory_bytes=row["runs"][0]["step_memory_bytes"])
    return list(rows.values())


def checks(task: Task, runs: List[Dict[str, Any]]) -> List[str]:
    unit = "pp" if task.higher_is_better else "%"
    lines = []
    for row in summary(task, runs):
        if row["recipe"] == REFERENCE:
            continue
        low, high = row["gap_range"]
        gap = (f"{row['gap']:+.2f} {unit} from float32 master (seeds {low:+.2f} to "
               f"{high:+.2f})")
        if row["recipe"] == "bf16 nearest":
            verdict = "worse" if row["gap"] > TOLERANCE[task.name] else "NOT measurably worse"
            lines.append(f"{task.name}: bf16 nearest is {gap} ({verdict})")
            continue
        ok = row["gap"] <= TOLERANCE[task.name]
        lines.append(f"{task.name}: {row['recipe']} is {gap} (tolerance "
                     f"{TOLERANCE[task.name]} {unit}): {'ok' if ok else 'FAILED'}")
    return lines


def table(task: Task, runs: List[Dict[str, Any]]) -> str:
    unit = "pp" if task.higher_is_better else "%"
    digits = 2 if task.higher_is_better else 4
    header = ("recipe", "weights", "moments", "bytes/param", f"{task.metric} (mean)",
              "spread over seeds", f"worse by ({unit}), mean", "per seed", "final loss",
              "step memory", "steps/s")
    rows = [(r["recipe"], r["params"], r["moments"], f"{r['bytes_per_param']:.2f}",
             f"{r['metric']:.{digits}f}", f"{r['spread']:.{digits}f}", f"{r['gap']:+.2f}",
             f"{r['gap_range'][0]:+.2f} to {r['gap_range'][1]:+.2f}", f"{r['final_loss']:.4f}",
             "n/a" if r["step_memory_bytes"] is None else f"{r['step_memory_bytes'] / 2**20:.2f} MiB",
             f"{r['steps_per_s']:.1f}") for r in summary(task, runs)]
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]
    line = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [line(r) for r in rows])


def plot(tasks: List[Task], results: Dict[str, List[Dict[str, Any]]], path: str) -> None:
    """Per task: the training losses, and their ratio to the float32 master run's.

    The curves of the methods lie on top of one another; each has its own line
    style and markers, placed at steps of its own, and the lower panel zooms
    in on how far each is from the reference.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {r.name: r.style for r in RECIPES}
    fig, axes = plt.subplots(2, len(tasks), figsize=(6.5 * len(tasks), 8), squeeze=False,
                             sharex="col")
    for column, task in enumerate(tasks):
        top, bottom = axes[0][column], axes[1][column]
        rows = summary(task, results[task.name])
        scale = 1 if task.higher_is_better else math.log(2)
        window = max(1, len(rows[0]["runs"][0]["losses"]) // 25)
        # Per recipe, the mean over seeds of the training losses, smoothed.
        smooth = {row["recipe"]: np.convolve(
            np.mean([r["losses"] for r in row["runs"]], axis=0) / scale,
            np.ones(window) / window, mode="valid") for row in rows}
        reference = smooth[REFERENCE]
        close = []
        for i, (name, curve) in enumerate(smooth.items()):
            every = max(1, len(curve) // 10)
            kw = dict(label=name, linewidth=1.3, markersize=5, alpha=0.9,
                      markevery=(i * every // len(smooth), every))
            top.plot(curve, styles.get(name, "-"), **kw)
            bottom.plot(curve / reference, styles.get(name, "-"), **kw)
            if name != "bf16 nearest":
                close.append(curve / reference)
        seeds = len(rows[0]["runs"])
        top.set(title=f"{task.name}: training loss (moving average, mean of {seeds} seed"
                      f"{'s' if seeds > 1 else ''})", yscale="log",
                ylabel="cross-entropy" if task.higher_is_better else "bits per byte")
        spread = max(0.01, float(np.max(np.abs(np.concatenate(close) - 1))) * 1.2)
        bottom.set(title="ratio to float32 master (bf16 nearest may leave the axis)",
                   xlabel="step", ylabel="loss / float32 master's", ylim=(1 - spread, 1 + spread))
        for ax in (top, bottom):
            ax.grid(alpha=0.3, which="both")
        top.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(path: str, tasks: List[Task], results: Dict[str, List[Dict[str, Any]]],
                 settings: Dict[str, Any], notes: List[str], argv: Optional[List[str]]) -> None:
    """The tables as a ``benchmarks.harness`` report (loaded by path: an example runs as a
    file, without the repository root on ``sys.path``)."""
    spec = importlib.util.spec_from_file_location(
        "_bf16_weights_harness", os.path.join(HERE, os.pardir, "benchmarks", "harness.py"))
    harness = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = harness  # its dataclasses look their module up
    spec.loader.exec_module(harness)
    report = harness.Report("bf16_weights", __doc__.split("\n")[0], settings, argv)
    for task in tasks:
        unit = "pp" if task.higher_is_better else "%"
        columns = [harness.Column("bytes_per_param", "bytes/param", ""),
                   harness.Column("metric", f"{task.metric}, mean over seeds", ""),
                   harness.Column("spread", "spread over seeds (max - min)", "", ratio=False),
                   harness.Column("gap", f"worse than float32 master by ({unit}), mean", "",
                                  ratio=False),
                   harness.Column("gap_low", "... least, per seed", "", ratio=False),
                   harness.Column("gap_high", "... most, per seed", "", ratio=False),
                   harness.Column("final_loss", "final train loss", ""),
                   harness.Column("step_memory_bytes", "step memory (XLA)", "bytes", ratio=False)]
        steps = len(results[task.name][0]["losses"])
        lr = settings["learning_rates"][task.name]
        rows = summary(task, results[task.name])
        table = report.table(task.name, f"{task.name}: bfloat16 weights and moments", columns=columns,
                             baseline=REFERENCE, description=(
                                 f"{steps} steps, learning rate {lr:g}, seeds "
                                 f"{', '.join(map(str, rows[0]['seeds']))}"))
        for r in rows:
            table.add_row(r["recipe"], {
                "bytes_per_param": r["bytes_per_param"], "metric": r["metric"],
                "spread": r["spread"], "gap": r["gap"], "gap_low": r["gap_range"][0],
                "gap_high": r["gap_range"][1], "final_loss": r["final_loss"],
                "step_memory_bytes": r["step_memory_bytes"]})
    for note in notes:
        report.note(note)
    report.write(path)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", default=["digits", "lm"], choices=["digits", "lm"])
    parser.add_argument("--steps", type=int, default=None,
                        help="train steps per run (default: 1500 digits, 600 lm)")
    parser.add_argument("--digits-lr", type=float, default=1e-4)
    parser.add_argument("--lm-lr", type=float, default=1e-4)
    parser.add_argument("--recipes", nargs="+", default=[r.name for r in RECIPES],
                        help="recipe names (quote them), the first being the reference")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="repeat every run per seed (data order, initial weights, rounding)")
    parser.add_argument("--out", default=os.path.join("results", "bf16_weights"))
    parser.add_argument("--report", default=None,
                        help="also write the tables as a benchmark report (JSON) here")
    args = parser.parse_args(argv)
    recipes = [r for r in RECIPES if r.name in args.recipes]
    if not recipes or recipes[0].name != REFERENCE:
        parser.error(f"the recipes must include {REFERENCE!r}, the reference")

    builders = {"digits": digits_task, "lm": lm_task}
    defaults = {"digits": (1500, args.digits_lr), "lm": (600, args.lm_lr)}
    tasks, results = [], {}
    for name in args.tasks:
        steps = args.steps or defaults[name][0]
        lr = defaults[name][1]
        results[name] = []
        for seed in args.seeds:
            task = builders[name](seed)
            start = {dtype: params for dtype, params in initial_params(task).items()}
            print(f"{name}, seed {seed}: {steps} steps, learning rate {lr:g}, "
                  f"{sum(x.size for x in jax.tree.leaves(start['float32'])):,} parameters")
            results[name] += [{"seed": seed, **train(task, r, start[r.params], steps=steps,
                                                      lr=lr, seed=seed, progress=True)}
                              for r in recipes]
        print("\n" + table(task, results[name]) + "\n")
        tasks.append(task)
    lines = [line for task in tasks for line in checks(task, results[task.name])]
    print("\n".join(lines))
    os.makedirs(args.out, exist_ok=True)
    command = " ".join(["python", "examples/bf16_weights.py"] + [
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)])
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"command": command, "device": str(jax.devices()[0]), "jax": jax.__version__,
                   "date": datetime.date.today().isoformat(), "seeds": args.seeds,
                   "learning_rates": {t.name: defaults[t.name][1] for t in tasks},
                   "tolerances": TOLERANCE, "checks": lines, "results": results}, f, indent=1)
    plot(tasks, results, os.path.join(args.out, "bf16_weights.png"))
    if args.report:
        learning_rates = {t.name: defaults[t.name][1] for t in tasks}
        write_report(args.report, tasks, results, {**vars(args), "learning_rates": learning_rates},
                     lines, argv)
        print(f"wrote {args.report}")
    print(f"\nwrote {os.path.join(args.out, 'results.json')} and "
          f"{os.path.join(args.out, 'bf16_weights.png')}")


if __name__ == "__main__":
    main()

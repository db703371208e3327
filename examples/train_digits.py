"""Train a small Flax CNN on scikit-learn's handwritten digits under three policies.

    python examples/train_digits.py                # ~1 min on a laptop CPU
    python examples/train_digits.py --steps 50 --out /tmp/digits
    python examples/train_digits.py --loss-weight 1e-6 \
        --policies float32 "mixed_float16,loss_scale=none" mixed_float16   # float16 underflow

Runs float32, mixed_bfloat16, and mixed_float16 with dynamic loss scaling on the
same data, seed and number of steps, then prints a table (test accuracy, final
loss, fraction of exactly-zero gradient entries, skipped steps, final loss
scale) and writes ``results.json`` and ``digits.png`` to ``--out`` (default
``results/train_digits/``). The plot has three panels: training loss, test
accuracy during training, and the loss scale of the runs that scale the loss,
with the skipped steps marked. The dynamic loss scale runs with a short
``--loss-scale-period`` (50 finite steps before it doubles; the library's
default is 2000) so that 600 steps show its schedule: it grows until a step
overflows, that step is skipped, and the scale halves. The data (1797 8x8
images) ships inside scikit-learn: no download.

Layers get the policy's dtypes through ``jmp_policy.flax.module_kwargs``
(the Flax way; the documentation's Getting started page compares it with
``autocast`` and ``Policy.wrap``), the optimizer is wrapped in
``jmp_policy.loss_scaling`` (which reads the loss scale from the policy:
dynamic for float16, none for bfloat16 and float32), and gradients come from
``jmp_policy.scaled_value_and_grad``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import sys
from typing import Any, Dict, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_policy
import jmp_policy.flax

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
_FROM_POLICY: Any = "policy"


class CNN(nn.Module):
    """Two 3x3 convolutions and two dense layers; dtypes from the policy."""

    policy: jmp_policy.Policy
    width: int = 32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = jmp_policy.flax.module_kwargs(self.policy)
        x = nn.relu(nn.Conv(self.width // 2, (3, 3), **kw)(x))
        x = nn.relu(nn.Conv(self.width, (3, 3), **kw)(x))
        x = nn.avg_pool(x, (2, 2), (2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(2 * self.width, **kw)(x))
        return nn.Dense(10, **kw)(x)


def load_data(seed: int = 0):
    """Digits as float32 NHWC images in [0, 1]; a fixed stratified 80/20 split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    return train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)


def _zero_fraction(grads: Any) -> jax.Array:
    leaves = jax.tree.leaves(grads)
    zeros = sum(jnp.sum(g == 0) for g in leaves)
    return zeros / sum(g.size for g in leaves)


@jax.jit
def _distance(a: Any, b: Any) -> jax.Array:
    return optax.tree_utils.tree_norm(optax.tree_utils.tree_sub(a, b))


def _build(policy: jmp_policy.Policy, learning_rate: float, loss_scale: Any, loss_weight: float):
    """The model, optimizer and jitted train/eval steps of one configuration."""
    model = CNN(policy)
    tx = jmp_policy.loss_scaling(
        optax.adam(learning_rate), policy if loss_scale is _FROM_POLICY else loss_scale)

    def loss_fn(params, x, y):
        logits = model.apply({"params": params}, x)
        # Softmax cross-entropy in float32, whatever the compute dtype.
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
        return loss_weight * ce.mean()

    @jax.jit
    def train_step(params, opt_state, x, y):
        scale = jmp_policy.get_loss_scale(opt_state)
        loss, grads = jmp_policy.scaled_value_and_grad(loss_fn)(scale, params, x, y)
        zero_fraction = _zero_fraction(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, zero_fraction

    @jax.jit
    def accuracy(params, x, y):
        return jnp.mean(jnp.argmax(model.apply({"params": params}, x), -1) == y)

    return model, tx, train_step, accuracy


# Repeated runs of one configuration (tests, notebooks) reuse the compiled steps.
_build_cached = functools.lru_cache(maxsize=16)(_build)


def train(
    policy: Any = "mixed_float16",
    *,
    steps: int = 600,
    seed: int = 0,
    batch_size: int = 64,
    learning_rate: float = 3e-3,
    loss_scale: Any = _FROM_POLICY,
    loss_weight: float = 1.0,
    data: Optional[tuple] = None,
    progress: bool = False,
    eval_every: int = 0,
) -> Dict[str, Any]:
    """Trains the CNN under ``policy``; returns metrics and per-step curves.

    ``loss_scale``: the policy's own (default), or anything `jmp_policy.loss_scaling`
    accepts (``None``: no scaling, a number, a `DynamicLossScale`...).
    ``loss_weight`` multiplies the loss (as an auxiliary-loss weight would);
    Adam is invariant to it, so only precision problems change the outcome.
    ``eval_every``: also measure test accuracy every that many steps (0: at
    the end only).
    """
    policy = jmp_policy.Policy(policy)
    x_train, x_test, y_train, y_test = data if data is not None else load_data()
    try:
        model, tx, train_step, accuracy = _build_cached(policy, learning_rate, loss_scale, loss_weight)
    except TypeError:  # an unhashable loss-scale object: build afresh
        model, tx, train_step, accuracy = _build(policy, learning_rate, loss_scale, loss_weight)
    params = jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, 8, 8, 1)))["params"]
    opt_state = jax.jit(tx.init)(params)
    initial_params = params
    initial_loss_scale = float(opt_state.loss_scale.loss_scale)

    rng = np.random.RandomState(seed)
    order = np.concatenate([rng.permutation(len(x_train))
                            for _ in range(steps * batch_size // len(x_train) + 1)])

    def batch(i):
        idx = order[i * batch_size:(i + 1) * batch_size]
        return x_train[idx], y_train[idx]

    losses, scales, zero_fractions, finite = [], [], [], []
    accuracy_curve = []
    x_test_dev, y_test_dev = jnp.asarray(x_test), jnp.asarray(y_test)
    bar = range(steps)
    if progress:
        from tqdm import tqdm
        bar = tqdm(bar, desc=f"{policy.name:>15}", leave=True)
    for i in bar:
        params, opt_state, loss, zero_fraction = train_step(params, opt_state, *batch(i))
        losses.append(loss)
        scales.append(opt_state.loss_scale.loss_scale)
        finite.append(opt_state.grads_finite)
        zero_fractions.append(zero_fraction)
        if eval_every and (i + 1) % eval_every == 0 and i + 1 < steps:
            accuracy_curve.append((i + 1, accuracy(params, x_test_dev, y_test_dev)))
    accuracy_curve.append((steps, accuracy(params, x_test_dev, y_test_dev)))

    losses = [float(l) / loss_weight for l in losses]
    return {
        "policy": str(policy),
        "loss_scale": _describe(opt_state.loss_scale),
        "steps": steps,
        "test_accuracy": float(accuracy_curve[-1][1]),
        "skipped_steps": int(opt_state.skipped_steps),
        "initial_loss_scale": initial_loss_scale,
        "final_loss_scale": float(scales[-1]),
        "final_loss": float(np.mean(losses[-20:])),
        "params_finite": bool(jax.jit(jmp_policy.all_finite)(params)),
        "param_change": float(_distance(params, initial_params)),
        "zero_grad_fraction": float(np.mean([float(z) for z in zero_fractions])),
        "losses": losses,
        "loss_scales": [float(s) for s in scales],
        "skipped_at": [i for i, f in enumerate(finite) if not bool(f)],
        "accuracy_curve": [[step, float(a)] for step, a in accuracy_curve],
    }


def _describe(loss_scale: Any) -> str:
    if isinstance(loss_scale, jmp_policy.DynamicLossScale):
        return f"dynamic, period {loss_scale.period}"
    if isinstance(loss_scale, jmp_policy.StaticLossScale):
        return f"static {float(loss_scale.loss_scale):g}"
    return "none"


def with_period(policy: Any, period: int) -> Any:
    """``policy``'s own loss scale with another ``period`` (when it is dynamic)."""
    loss_scale = jmp_policy.Policy(policy).loss_scale
    if not isinstance(loss_scale, jmp_policy.DynamicLossScale):
        return _FROM_POLICY
    return jmp_policy.DynamicLossScale(
        loss_scale.loss_scale, period=period, factor=loss_scale.factor,
        min_loss_scale=loss_scale.min_loss_scale, max_loss_scale=loss_scale.max_loss_scale)


def table(results) -> str:
    header = ("policy", "loss scaling", "test acc", "final loss", "zero grads", "skipped",
              "final scale")
    rows = [(r["policy"], r["loss_scale"], f"{100 * r['test_accuracy']:.2f}%",
             f"{r['final_loss']:.4f}", f"{100 * r['zero_grad_fraction']:.1f}%",
             str(r["skipped_steps"]), f"{r['final_loss_scale']:g}")
            for r in results]
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]
    line = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep] + [line(r) for r in rows])


# One look per run, so that curves stay apart where they overlap: colour, line
# style and marker all differ, and markers are staggered between runs.
STYLES = [dict(color="#1f77b4", linestyle="-", marker="o"),
          dict(color="#ff7f0e", linestyle="--", marker="s"),
          dict(color="#2ca02c", linestyle=":", marker="^", linewidth=2.2),
          dict(color="#d62728", linestyle="-.", marker="D")]


def _label(r: Dict[str, Any]) -> str:
    name = r["policy"].split(",loss_scale=")[0]
    if r["loss_scale"] == "none":
        return name if name == r["policy"] else f"{name} (no loss scaling)"
    return f"{name} ({r['loss_scale']})"


def plot(results, path: str, title: str = "") -> None:
    """Loss and test accuracy of each run (top), loss scale of the scaled runs (bottom)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(10, 7.2))
    grid = fig.add_gridspec(2, 2, height_ratios=[1.15, 1])
    ax_loss, ax_acc = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    ax_scale = fig.add_subplot(grid[1, :])
    unscaled, lowest = [], 100.0
    for k, r in enumerate(results):
        style = STYLES[k % len(STYLES)]
        label = _label(r)
        losses = np.asarray(r["losses"])
        window = max(1, len(losses) // 50)
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        steps = np.arange(len(smooth)) + window
        marks = max(1, len(smooth) // 8)
        ax_loss.plot(steps, smooth, label=label, markevery=(k * marks // len(results), marks),
                     markersize=5, **style)
        acc_steps, acc = np.asarray(r["accuracy_curve"]).T
        ax_acc.plot(acc_steps, 100 * acc, label=label, markersize=4, **style)
        lowest = min(lowest, 100 * float(acc.min()))
        if r["loss_scale"] == "none":
            unscaled.append(label)
        else:
            # The scale in force during each step: the initial one, then after each step.
            scales = np.asarray([r["initial_loss_scale"]] + r["loss_scales"])
            ax_scale.plot(np.arange(len(scales)), scales, label=label, drawstyle="steps-post",
                          **{**style, "marker": None, "linestyle": "-"})
            skipped = np.asarray(r["skipped_at"], dtype=int)
            if skipped.size:  # at the scale that overflowed, where it is halved
                ax_scale.plot(skipped + 1, scales[skipped], linestyle="none", marker="x",
                              markersize=8, color="black",
                              label=f"skipped step ({skipped.size})")
    ax_loss.set(title="training loss (moving average)", xlabel="step", ylabel="cross-entropy",
                yscale="log")
    ax_acc.set(title="test accuracy", xlabel="step", ylabel="%",
               ylim=(max(0.0, 10 * np.floor(lowest / 10) - 5), 100.5))
    ax_scale.set(title="loss scale (x: a skipped step, its gradients were not finite)",
                 xlabel="step", ylabel="scale")
    ax_scale.set_yscale("log", base=2)
    if unscaled:
        ax_scale.text(0.99, 0.04, "no loss scaling: " + ", ".join(unscaled),
                      transform=ax_scale.transAxes, ha="right", va="bottom", color="gray",
                      fontsize=9)
    for ax in (ax_loss, ax_acc, ax_scale):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=9)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600, help="train steps per policy")
    parser.add_argument("--out", default=os.path.join("results", "train_digits"),
                        help="folder for results.json and digits.png")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES),
                        help="policy names, e.g. 'mixed_float16,loss_scale=none'")
    parser.add_argument("--loss-weight", type=float, default=1.0,
                        help="multiply the loss (1e-6 shows float16 underflow)")
    parser.add_argument("--loss-scale-period", type=int, default=50,
                        help="finite steps before a dynamic loss scale grows (library "
                             "default: 2000; short here so that the plot shows the schedule)")
    parser.add_argument("--eval-every", type=int, default=25,
                        help="measure test accuracy every that many steps")
    args = parser.parse_args(argv)

    data = load_data(args.seed)
    results = [train(p, steps=args.steps, seed=args.seed, data=data, progress=True,
                     loss_weight=args.loss_weight, eval_every=args.eval_every,
                     loss_scale=with_period(p, args.loss_scale_period))
               for p in args.policies]
    print()
    print(table(results))
    os.makedirs(args.out, exist_ok=True)
    command = "python examples/train_digits.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"command": command.strip(), "device": str(jax.devices()[0]),
                   "jax": jax.__version__, "results": results}, f, indent=1)
    title = (f"digits CNN, {args.steps} steps, batch 64"
             + (f", loss x {args.loss_weight:g}" if args.loss_weight != 1 else ""))
    plot(results, os.path.join(args.out, "digits.png"), title)
    print(f"\nwrote {os.path.join(args.out, 'results.json')} and "
          f"{os.path.join(args.out, 'digits.png')}")


if __name__ == "__main__":
    main()

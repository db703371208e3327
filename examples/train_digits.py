"""Train a small Flax CNN on scikit-learn's handwritten digits under three policies.

    python examples/train_digits.py                # ~1 min on a laptop CPU
    python examples/train_digits.py --steps 50 --out /tmp/digits

Runs float32, mixed_bfloat16, and mixed_float16 with dynamic loss scaling on the
same data, seed and number of steps, then prints a table (test accuracy, steps/s,
skipped steps, final loss scale, memory of one train step) and writes
``results.json`` and ``digits.png`` (loss curves and the loss-scale trajectory)
to ``--out`` (default ``results/train_digits/``). The data (1797 8x8 images)
ships inside scikit-learn: no download.

The train step is the one of the jmp_policy README: layers get the policy's
dtypes through ``jmp_policy.flax.module_kwargs``, the optimizer is wrapped in
``jmp_policy.loss_scaling`` (which reads the loss scale from the policy:
dynamic for float16, none for bfloat16 and float32), and gradients come from
``jmp_policy.scaled_value_and_grad``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
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
    measure_memory: bool = False,
) -> Dict[str, Any]:
    """Trains the CNN under ``policy``; returns metrics and per-step curves.

    ``loss_scale``: the policy's own (default), or anything `jmp_policy.loss_scaling`
    accepts (``None``: no scaling, a number, a `DynamicLossScale`...).
    ``loss_weight`` multiplies the loss (as an auxiliary-loss weight would);
    Adam is invariant to it, so only precision problems change the outcome.
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

    rng = np.random.RandomState(seed)
    order = np.concatenate([rng.permutation(len(x_train))
                            for _ in range(steps * batch_size // len(x_train) + 1)])

    def batch(i):
        idx = order[i * batch_size:(i + 1) * batch_size]
        return x_train[idx], y_train[idx]

    step_bytes = None
    if measure_memory:
        # Compile ahead of time to read XLA's memory account, and train with that
        # executable (calling the jitted function would compile a second time).
        train_step = train_step.lower(params, opt_state, *batch(0)).compile()
        step_bytes = _step_bytes(train_step)

    losses, scales, zero_fractions = [], [], []
    bar = range(steps)
    if progress:
        from tqdm import tqdm
        bar = tqdm(bar, desc=f"{policy.name:>15}", leave=True)
    start = None
    for i in bar:
        if i == 1:  # time from the second step: the first one compiles
            jax.block_until_ready(params)
            start = time.perf_counter()
        params, opt_state, loss, zero_fraction = train_step(params, opt_state, *batch(i))
        losses.append(loss)
        scales.append(jmp_policy.get_loss_scale(opt_state).loss_scale)
        zero_fractions.append(zero_fraction)
    jax.block_until_ready(params)
    elapsed = time.perf_counter() - start if start is not None else float("nan")

    state = optax.tree_utils.tree_get(opt_state, "skipped_steps")
    losses = [float(l) / loss_weight for l in losses]
    return {
        "policy": str(policy),
        "steps": steps,
        "test_accuracy": float(accuracy(params, x_test, y_test)),
        "steps_per_s": (steps - 1) / elapsed if steps > 1 else float("nan"),
        "skipped_steps": int(state),
        "final_loss_scale": float(scales[-1]),
        "step_memory_bytes": step_bytes,
        "peak_device_bytes": _peak_device_bytes(),
        "final_loss": float(np.mean(losses[-20:])),
        "params_finite": bool(jax.jit(jmp_policy.all_finite)(params)),
        "param_change": float(_distance(params, initial_params)),
        "zero_grad_fraction": float(np.mean([float(z) for z in zero_fractions])),
        "losses": losses,
        "loss_scales": [float(s) for s in scales],
    }


def _step_bytes(compiled) -> Optional[int]:
    """XLA's own account of one step's memory: arguments + outputs + temporaries."""
    memory = compiled.memory_analysis()
    if memory is None:
        return None
    return int(memory.argument_size_in_bytes + memory.output_size_in_bytes
               + memory.temp_size_in_bytes)


def _peak_device_bytes() -> Optional[int]:
    stats = jax.local_devices()[0].memory_stats()  # None on CPU
    return None if not stats else int(stats.get("peak_bytes_in_use", 0)) or None


def _fmt_bytes(n: Optional[int]) -> str:
    return "n/a" if n is None else f"{n / 2**20:.2f} MiB"


def table(results) -> str:
    header = ("policy", "test acc", "final loss", "zero grads", "steps/s", "skipped", "final scale",
              "step memory", "peak device")
    rows = [(r["policy"], f"{100 * r['test_accuracy']:.2f}%", f"{r['final_loss']:.4f}",
             f"{100 * r['zero_grad_fraction']:.1f}%", f"{r['steps_per_s']:.1f}",
             str(r["skipped_steps"]), f"{r['final_loss_scale']:g}",
             _fmt_bytes(r["step_memory_bytes"]), _fmt_bytes(r["peak_device_bytes"]))
            for r in results]
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]
    line = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep] + [line(r) for r in rows])


def plot(results, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_scale) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        losses = np.asarray(r["losses"])
        window = max(1, len(losses) // 50)
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        ax_loss.plot(smooth, label=r["policy"])
        ax_scale.plot(r["loss_scales"], label=r["policy"])
    ax_loss.set(title="training loss (moving average)", xlabel="step", ylabel="cross-entropy",
                yscale="log")
    ax_scale.set(title="loss scale", xlabel="step", ylabel="scale", yscale="log")
    for ax in (ax_loss, ax_scale):
        ax.legend()
        ax.grid(alpha=0.3)
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
    args = parser.parse_args(argv)

    data = load_data(args.seed)
    results = [train(p, steps=args.steps, seed=args.seed, data=data, progress=True,
                     measure_memory=True, loss_weight=args.loss_weight)
               for p in args.policies]
    print()
    print(table(results))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"device": str(jax.devices()[0]), "results": results}, f, indent=1)
    plot(results, os.path.join(args.out, "digits.png"))
    print(f"\nwrote {os.path.join(args.out, 'results.json')} and "
          f"{os.path.join(args.out, 'digits.png')}")


if __name__ == "__main__":
    main()

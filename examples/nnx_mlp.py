"""The digits story with Flax NNX: an MLP trained under three policies.

    python examples/nnx_mlp.py                     # ~30 s on a laptop CPU
    python examples/nnx_mlp.py --steps 50 --out /tmp/nnx

NNX modules are plain mutable Python objects, so a policy is applied to the
model itself: ``jmp_policy.flax.set_nnx_policy`` sets every layer's ``dtype``
and ``param_dtype`` (here: LayerNorm kept float32). Training uses
``nnx.Optimizer`` around ``jmp_policy.loss_scaling``, so the loss scale lives
in the optimizer state, and ``jmp_policy.flax.nnx_scaled_value_and_grad``
inside ``nnx.jit``. Parameters and gradients stay float32 throughout.

Prints a table (test accuracy, steps/s, skipped steps, final loss scale) and
writes ``results.json`` and ``nnx_mlp.png`` to ``--out`` (default
``results/nnx_mlp/``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Dict

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jmp_policy
import jmp_policy.flax

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, hidden: int = 128):
        self.hidden = nnx.Linear(64, hidden, rngs=rngs)
        self.norm = nnx.LayerNorm(hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.norm(self.hidden(x))))


def load_data(seed: int = 0):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    return train_test_split(x, digits.target.astype(np.int32), test_size=0.2,
                            random_state=seed, stratify=digits.target)


def loss_fn(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    logits = model(x).astype(jnp.float32)  # cross-entropy in float32
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@nnx.jit
def train_step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array):
    scale = jmp_policy.flax.optimizer_loss_scale(optimizer)
    loss, grads = jmp_policy.flax.nnx_scaled_value_and_grad(loss_fn)(scale, model, x, y)
    optimizer.update(model, grads)  # unscales, skips non-finite steps, adjusts the scale
    return loss


@nnx.jit
def accuracy(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.argmax(model(x), -1) == y)


def train(policy: Any, *, steps: int = 500, seed: int = 0, batch_size: int = 64,
          data=None, progress: bool = False) -> Dict[str, Any]:
    policy = jmp_policy.Policy(policy)
    x_train, x_test, y_train, y_test = data if data is not None else load_data()
    model = MLP(nnx.Rngs(seed))
    jmp_policy.flax.set_nnx_policy(model, policy, rules={nnx.LayerNorm: "float32"})
    optimizer = nnx.Optimizer(model, jmp_policy.loss_scaling(optax.adam(1e-3), policy),
                              wrt=nnx.Param)

    rng = np.random.RandomState(seed)
    losses, scales = [], []
    bar = range(steps)
    if progress:
        from tqdm import tqdm
        bar = tqdm(bar, desc=f"{policy.name:>15}")
    start = None
    for i in bar:
        if i == 1:  # the first step compiles
            start = time.perf_counter()
        idx = rng.randint(0, len(x_train), batch_size)
        losses.append(train_step(model, optimizer, x_train[idx], y_train[idx]))
        scales.append(jmp_policy.flax.optimizer_loss_scale(optimizer).loss_scale)
    jax.block_until_ready(losses[-1])
    elapsed = time.perf_counter() - start if start is not None else float("nan")
    params = nnx.state(model, nnx.Param)
    return {
        "policy": str(policy),
        "steps": steps,
        "test_accuracy": float(accuracy(model, x_test, y_test)),
        "steps_per_s": (steps - 1) / elapsed if steps > 1 else float("nan"),
        "skipped_steps": int(jmp_policy.flax.optimizer_skipped_steps(optimizer)),
        "final_loss_scale": float(scales[-1]),
        "param_dtypes": sorted({str(p.dtype) for p in jax.tree.leaves(params)}),
        "params_finite": bool(jax.jit(jmp_policy.all_finite)(params)),
        "losses": [float(l) for l in losses],
        "loss_scales": [float(s) for s in scales],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--out", default=os.path.join("results", "nnx_mlp"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    args = parser.parse_args(argv)

    data = load_data(args.seed)
    results = [train(p, steps=args.steps, seed=args.seed, data=data, progress=True)
               for p in args.policies]
    print()
    header = ("policy", "test acc", "steps/s", "skipped", "final scale", "param dtypes")
    rows = [(r["policy"], f"{100 * r['test_accuracy']:.2f}%", f"{r['steps_per_s']:.1f}",
             str(r["skipped_steps"]), f"{r['final_loss_scale']:g}", ",".join(r["param_dtypes"]))
            for r in results]
    widths = [max(len(x[i]) for x in rows + [header]) for i in range(len(header))]
    for n, row in enumerate([header] + rows):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
        if n == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"device": str(jax.devices()[0]), "results": results}, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_scale) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        ax_loss.plot(r["losses"], label=r["policy"], alpha=0.8)
        ax_scale.plot(r["loss_scales"], label=r["policy"])
    ax_loss.set(title="training loss", xlabel="step", yscale="log")
    ax_scale.set(title="loss scale", xlabel="step", yscale="log")
    for ax in (ax_loss, ax_scale):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "nnx_mlp.png"), dpi=110)
    print(f"\nwrote {os.path.join(args.out, 'results.json')} and "
          f"{os.path.join(args.out, 'nnx_mlp.png')}")


if __name__ == "__main__":
    main()

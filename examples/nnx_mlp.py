"""The digits story with Flax NNX: an MLP trained under three policies.

    python examples/nnx_mlp.py                     # ~30 s on a laptop CPU
    python examples/nnx_mlp.py --steps 50 --out /tmp/nnx

NNX modules are plain mutable Python objects, so a policy is applied to the
model itself: ``jmp_policy.flax.set_nnx_policy`` sets every layer's ``dtype``
and ``param_dtype`` (here: LayerNorm kept float32). Training uses
``nnx.Optimizer`` around ``jmp_policy.loss_scaling``, so the loss scale lives
in the optimizer state, and ``jmp_policy.flax.nnx_scaled_value_and_grad``
inside ``nnx.jit``. Parameters and gradients stay float32 throughout.

Prints a table (test accuracy, skipped steps, final loss scale, parameter
dtypes) and writes ``results.json`` and ``nnx_mlp.png`` to ``--out`` (default
``results/nnx_mlp/``): training loss, test accuracy during training, and the
loss scale with the skipped steps marked, drawn as ``train_digits.py`` draws
its plot. As there, the dynamic loss scale runs with a short
``--loss-scale-period`` (default 50; the library's is 2000) so that the plot
shows its schedule.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
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


def loss_scale_with_period(policy: jmp_policy.Policy, period: int) -> Any:
    """``policy``'s loss scale, with another ``period`` when it is dynamic."""
    ls = policy.loss_scale
    if not isinstance(ls, jmp_policy.DynamicLossScale):
        return policy
    return jmp_policy.DynamicLossScale(ls.loss_scale, period=period, factor=ls.factor,
                                       min_loss_scale=ls.min_loss_scale,
                                       max_loss_scale=ls.max_loss_scale)


def train(policy: Any, *, steps: int = 500, seed: int = 0, batch_size: int = 64,
          data=None, progress: bool = False, loss_scale_period: int = 2000,
          eval_every: int = 0) -> Dict[str, Any]:
    policy = jmp_policy.Policy(policy)
    x_train, x_test, y_train, y_test = data if data is not None else load_data()
    model = MLP(nnx.Rngs(seed))
    jmp_policy.flax.set_nnx_policy(model, policy, rules={nnx.LayerNorm: "float32"})
    tx = jmp_policy.loss_scaling(optax.adam(1e-3),
                                 loss_scale_with_period(policy, loss_scale_period))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    loss_scale = jmp_policy.flax.optimizer_loss_scale(optimizer)
    initial_loss_scale = float(loss_scale.loss_scale)

    rng = np.random.RandomState(seed)
    losses, scales, skipped, accuracy_curve = [], [], [], []
    bar = range(steps)
    if progress:
        from tqdm import tqdm
        bar = tqdm(bar, desc=f"{policy.name:>15}")
    for i in bar:
        idx = rng.randint(0, len(x_train), batch_size)
        losses.append(train_step(model, optimizer, x_train[idx], y_train[idx]))
        scales.append(jmp_policy.flax.optimizer_loss_scale(optimizer).loss_scale)
        skipped.append(jmp_policy.flax.optimizer_skipped_steps(optimizer))
        if eval_every and (i + 1) % eval_every == 0 and i + 1 < steps:
            accuracy_curve.append((i + 1, accuracy(model, x_test, y_test)))
    accuracy_curve.append((steps, accuracy(model, x_test, y_test)))
    params = nnx.state(model, nnx.Param)
    counts = [0] + [int(s) for s in skipped]
    return {
        "policy": str(policy),
        "loss_scale": (f"dynamic, period {loss_scale.period}"
                       if isinstance(loss_scale, jmp_policy.DynamicLossScale) else
                       "none" if isinstance(loss_scale, jmp_policy.NoOpLossScale) else
                       f"static {float(loss_scale.loss_scale):g}"),
        "steps": steps,
        "test_accuracy": float(accuracy_curve[-1][1]),
        "skipped_steps": counts[-1],
        "initial_loss_scale": initial_loss_scale,
        "final_loss_scale": float(scales[-1]),
        "param_dtypes": sorted({str(p.dtype) for p in jax.tree.leaves(params)}),
        "params_finite": bool(jax.jit(jmp_policy.all_finite)(params)),
        "losses": [float(l) for l in losses],
        "loss_scales": [float(s) for s in scales],
        "skipped_at": [i for i in range(steps) if counts[i + 1] > counts[i]],
        "accuracy_curve": [[step, float(a)] for step, a in accuracy_curve],
    }


def _train_digits():
    """examples/train_digits.py, whose plot this example shares."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_digits.py")
    spec = importlib.util.spec_from_file_location("_train_digits_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # flax modules are dataclasses: they look their module up
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--out", default=os.path.join("results", "nnx_mlp"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--loss-scale-period", type=int, default=50,
                        help="finite steps before a dynamic loss scale grows (library "
                             "default: 2000; short here so that the plot shows the schedule)")
    parser.add_argument("--eval-every", type=int, default=25)
    args = parser.parse_args(argv)

    data = load_data(args.seed)
    results = [train(p, steps=args.steps, seed=args.seed, data=data, progress=True,
                     loss_scale_period=args.loss_scale_period, eval_every=args.eval_every)
               for p in args.policies]
    print()
    header = ("policy", "loss scaling", "test acc", "skipped", "final scale", "param dtypes")
    rows = [(r["policy"], r["loss_scale"], f"{100 * r['test_accuracy']:.2f}%",
             str(r["skipped_steps"]), f"{r['final_loss_scale']:g}", ",".join(r["param_dtypes"]))
            for r in results]
    widths = [max(len(x[i]) for x in rows + [header]) for i in range(len(header))]
    for n, row in enumerate([header] + rows):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
        if n == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"device": str(jax.devices()[0]), "jax": jax.__version__, "results": results},
                  f, indent=1)
    _train_digits().plot(results, os.path.join(args.out, "nnx_mlp.png"),
                         f"NNX MLP on digits, {args.steps} steps, batch 64")
    print(f"\nwrote {os.path.join(args.out, 'results.json')} and "
          f"{os.path.join(args.out, 'nnx_mlp.png')}")


if __name__ == "__main__":
    main()

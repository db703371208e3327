"""The digits story with Equinox: a small Vision Transformer trained under three policies.

    python examples/equinox_vit.py                 # ~30 s on a laptop CPU
    python examples/equinox_vit.py --steps 50 --out /tmp/eqx_vit

A ViT (patches of 2x2 pixels, a class token, two pre-LayerNorm encoder blocks
(``--depth``) of ``eqx.nn.MultiheadAttention`` and a GELU MLP, a ``head``
classifier) on scikit-learn's 8x8 handwritten digits, trained in float32,
mixed_bfloat16 and mixed_float16 with dynamic loss scaling. The model is plain
Equinox code with float32 parameters and no dtype arguments:
``jmp_policy.autocast`` runs its products in the policy's compute dtype
(accumulating in float32) and keeps LayerNorm, the attention softmax and the
loss in float32. The train step is
``eqx.filter_jit``-ed; the optimizer is ``optax.adam`` with a cosine-decayed
learning rate, wrapped in ``jmp_policy.loss_scaling`` (the policy's own loss
scale: dynamic for float16, none for bfloat16 and float32), and the
gradients of the scaled loss come from ``jmp_policy.scaled_value_and_grad``,
which takes the module as it is (its float arrays are differentiated, its
``int`` fields left alone).

Prints a table (test accuracy, final loss, skipped steps, final loss scale,
parameter dtypes, training time) and writes ``results.json`` and
``equinox_vit.png`` to ``--out`` (default ``results/equinox_vit/``): training
loss, test accuracy during training, and the loss scale with the skipped
steps marked, drawn as ``train_digits.py`` draws its plot. As there, the
dynamic loss scale runs with a short ``--loss-scale-period`` (default 50; the
library's is 2000) so that the plot shows its schedule.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sys
import time
from typing import Any, Dict

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_policy

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")


class EncoderBlock(eqx.Module):
    """Pre-LayerNorm transformer encoder block on one sequence ``[tokens, width]``."""

    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, width: int, heads: int, hidden: int, *, key: jax.Array):
        k_attn, k_fc1, k_fc2 = jax.random.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(width)
        self.attn = eqx.nn.MultiheadAttention(heads, width, key=k_attn)
        self.norm2 = eqx.nn.LayerNorm(width)
        self.fc1 = eqx.nn.Linear(width, hidden, key=k_fc1)
        self.fc2 = eqx.nn.Linear(hidden, width, key=k_fc2)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jax.vmap(self.norm1)(x)
        x = x + self.attn(y, y, y)
        y = jax.nn.gelu(jax.vmap(self.fc1)(jax.vmap(self.norm2)(x)))
        return x + jax.vmap(self.fc2)(y)


class ViT(eqx.Module):
    """A small ViT for one ``[8, 8, 1]`` image; ``patch_size`` is a plain int field."""

    patch_size: int
    patch_embed: eqx.nn.Linear
    cls_token: jax.Array
    pos_embed: jax.Array
    blocks: list[EncoderBlock]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, *, key: jax.Array, image_size: int = 8, channels: int = 1,
                 patch_size: int = 2, width: int = 32, depth: int = 2, heads: int = 4,
                 hidden: int = 64, num_classes: int = 10):
        k_patch, k_cls, k_pos, k_head, *k_blocks = jax.random.split(key, 4 + depth)
        tokens = (image_size // patch_size) ** 2 + 1
        self.patch_size = patch_size
        self.patch_embed = eqx.nn.Linear(patch_size * patch_size * channels, width,
                                         key=k_patch)
        self.cls_token = 0.02 * jax.random.normal(k_cls, (1, width))
        self.pos_embed = 0.02 * jax.random.normal(k_pos, (tokens, width))
        self.blocks = [EncoderBlock(width, heads, hidden, key=k) for k in k_blocks]
        self.norm = eqx.nn.LayerNorm(width)
        self.head = eqx.nn.Linear(width, num_classes, key=k_head)

    def __call__(self, image: jax.Array) -> jax.Array:
        h, w, c = image.shape
        p = self.patch_size  # a Python int under autocast and filter_jit: a shape
        patches = image.reshape(h // p, p, w // p, p, c).transpose(0, 2, 1, 3, 4)
        x = jax.vmap(self.patch_embed)(patches.reshape(-1, p * p * c))
        x = jnp.concatenate([self.cls_token, x]) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[0]))


def load_data(seed: int = 0):
    """Digits as float32 ``[8, 8, 1]`` images in [0, 1]; a fixed stratified 80/20 split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    return train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)


def loss_fn(model: ViT, x: jax.Array, y: jax.Array) -> jax.Array:
    logits = jax.vmap(model)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def loss_scale_with_period(policy: jmp_policy.Policy, period: int) -> Any:
    """``policy``'s loss scale, with another ``period`` when it is dynamic."""
    ls = policy.loss_scale
    if not isinstance(ls, jmp_policy.DynamicLossScale):
        return policy
    return jmp_policy.DynamicLossScale(ls.loss_scale, period=period, factor=ls.factor,
                                       min_loss_scale=ls.min_loss_scale,
                                       max_loss_scale=ls.max_loss_scale)


def _describe(loss_scale: Any) -> str:
    if isinstance(loss_scale, jmp_policy.DynamicLossScale):
        return f"dynamic, period {loss_scale.period}"
    if isinstance(loss_scale, jmp_policy.StaticLossScale):
        return f"static {float(loss_scale.loss_scale):g}"
    return "none"


def train(policy: Any, *, steps: int = 600, seed: int = 0, batch_size: int = 64,
          learning_rate: float = 3e-3, data=None, progress: bool = False,
          loss_scale_period: int = 2000, eval_every: int = 0,
          depth: int = 2) -> Dict[str, Any]:
    """Trains the ViT under ``policy``; returns metrics and per-step curves."""
    policy = jmp_policy.Policy(policy)
    x_train, x_test, y_train, y_test = data if data is not None else load_data(seed)
    mixed_loss = jmp_policy.autocast(loss_fn, policy)
    schedule = optax.cosine_decay_schedule(learning_rate, max(steps, 1))
    tx = jmp_policy.loss_scaling(optax.adam(schedule),
                                 loss_scale_with_period(policy, loss_scale_period))

    @eqx.filter_jit
    def train_step(model, opt_state, x, y):
        scale = jmp_policy.get_loss_scale(opt_state)
        loss, grads = jmp_policy.scaled_value_and_grad(mixed_loss)(scale, model, x, y)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = tx.update(grads, opt_state, params)  # unscale, skip, adjust
        return eqx.apply_updates(model, updates), opt_state, loss

    @eqx.filter_jit
    def accuracy(model, x, y):
        logits = jax.vmap(jmp_policy.autocast(model, policy))(x)
        return jnp.mean(jnp.argmax(logits, -1) == y)

    model = eqx.filter_jit(ViT)(key=jax.random.key(seed), depth=depth)
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    loss_scale = jmp_policy.get_loss_scale(opt_state)
    initial_loss_scale = float(loss_scale.loss_scale)

    rng = np.random.RandomState(seed)
    order = np.concatenate([rng.permutation(len(x_train))
                            for _ in range(steps * batch_size // len(x_train) + 1)])
    x_test_dev, y_test_dev = jnp.asarray(x_test), jnp.asarray(y_test)
    losses, scales, skipped, accuracy_curve = [], [], [], []
    bar = range(steps)
    if progress:
        from tqdm import tqdm
        bar = tqdm(bar, desc=f"{policy.name:>15}")
    start = time.perf_counter()
    for i in bar:
        idx = order[i * batch_size:(i + 1) * batch_size]
        model, opt_state, loss = train_step(model, opt_state, x_train[idx], y_train[idx])
        losses.append(loss)
        scales.append(jmp_policy.get_loss_scale(opt_state).loss_scale)
        skipped.append(opt_state.skipped_steps)
        if eval_every and (i + 1) % eval_every == 0 and i + 1 < steps:
            accuracy_curve.append((i + 1, accuracy(model, x_test_dev, y_test_dev)))
    accuracy_curve.append((steps, accuracy(model, x_test_dev, y_test_dev)))
    jax.block_until_ready(accuracy_curve[-1][1])
    seconds = time.perf_counter() - start
    params = eqx.filter(model, eqx.is_inexact_array)
    counts = [0] + [int(s) for s in skipped]
    losses = [float(l) for l in losses]
    return {
        "policy": str(policy),
        "loss_scale": _describe(loss_scale),
        "steps": steps,
        "test_accuracy": float(accuracy_curve[-1][1]),
        "final_loss": float(np.mean(losses[-20:])),
        "skipped_steps": counts[-1],
        "initial_loss_scale": initial_loss_scale,
        "final_loss_scale": float(scales[-1]),
        "param_dtypes": sorted({str(p.dtype) for p in jax.tree.leaves(params)}),
        "params_finite": bool(jax.jit(jmp_policy.all_finite)(params)),
        "seconds": seconds,
        "losses": losses,
        "loss_scales": [float(s) for s in scales],
        "skipped_at": [i for i in range(steps) if counts[i + 1] > counts[i]],
        "accuracy_curve": [[step, float(a)] for step, a in accuracy_curve],
    }


def table(results) -> str:
    header = ("policy", "loss scaling", "test acc", "final loss", "skipped", "final scale",
              "param dtypes", "time")
    rows = [(r["policy"], r["loss_scale"], f"{100 * r['test_accuracy']:.2f}%",
             f"{r['final_loss']:.4f}", str(r["skipped_steps"]), f"{r['final_loss_scale']:g}",
             ",".join(r["param_dtypes"]), f"{r['seconds']:.1f} s")
            for r in results]
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]
    line = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep] + [line(r) for r in rows])


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
    parser.add_argument("--steps", type=int, default=600, help="train steps per policy")
    parser.add_argument("--out", default=os.path.join("results", "equinox_vit"),
                        help="folder for results.json and equinox_vit.png")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES),
                        help="policy names, e.g. 'mixed_float16,loss_scale=none'")
    parser.add_argument("--loss-scale-period", type=int, default=50,
                        help="finite steps before a dynamic loss scale grows (library "
                             "default: 2000; short here so that the plot shows the schedule)")
    parser.add_argument("--eval-every", type=int, default=25,
                        help="measure test accuracy every that many steps")
    parser.add_argument("--depth", type=int, default=2, help="encoder blocks")
    args = parser.parse_args(argv)

    data = load_data(args.seed)
    results = [train(p, steps=args.steps, seed=args.seed, data=data, progress=True,
                     loss_scale_period=args.loss_scale_period, eval_every=args.eval_every,
                     depth=args.depth)
               for p in args.policies]
    print()
    print(table(results))
    os.makedirs(args.out, exist_ok=True)
    command = "python examples/equinox_vit.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"command": command.strip(), "device": str(jax.devices()[0]),
                   "jax": jax.__version__, "equinox": eqx.__version__, "results": results},
                  f, indent=1)
    _train_digits().plot(results, os.path.join(args.out, "equinox_vit.png"),
                         f"Equinox ViT on digits, {args.steps} steps, batch 64")
    print(f"\nwrote {os.path.join(args.out, 'results.json')} and "
          f"{os.path.join(args.out, 'equinox_vit.png')}")


if __name__ == "__main__":
    main()

"""A small byte-level transformer language model under three policies.

    python examples/transformer_lm.py               # ~1-2 min on a laptop CPU
    python examples/transformer_lm.py --steps 20 --out /tmp/lm

The text is the source code of a few Python standard-library modules, read from
disk (it ships with every Python: no download). The model code below never
mentions a dtype: the policy is applied from outside, around ``init`` and
``apply``, with ``jmp_policy.flax.module_policy``:

* every layer runs under the policy (``mixed_bfloat16``: bfloat16 compute,
  float32 parameters);
* every ``nn.LayerNorm`` and the output ``logits`` layer stay float32;
* the attention softmax is computed in float32 and handed back in the
  compute dtype (a policy whose output dtype differs from its compute dtype).

float32, mixed_bfloat16 and mixed_float16 (+ dynamic loss scaling) are trained
with the same seed and batches; the script prints a table (held-out loss in
bits per byte, steps/s, skipped steps, final loss scale, step memory) and
writes ``results.json`` and ``lm.png`` to ``--out`` (default
``results/transformer_lm/``).

Float8 matmuls (slow on a CPU, which emulates float8: use a GPU or few steps):

    python examples/transformer_lm.py --policies mixed_bfloat16 --fp8 tensorwise rowwise
    python examples/transformer_lm.py --policies mixed_bfloat16 --fp8 rowwise --fp8-head

``--fp8 SCALING...`` adds one run per scaling of the first policy with the
model's ``apply`` wrapped in ``jmp_policy.autocast(..., fp8=SCALING)``: the
same model code and module policies, its matrix products in float8 (or, with
``nvfp4``, 4-bit floats), except the ``logits`` head, which the default recipe
excludes. ``--fp8-head`` adds a run of the first scaling with the head in
float8 too (``exclude=()``).

``--experts E`` makes each block's MLP a mixture of E experts (top-2 routing,
the experts' products one ``lax.ragged_dot`` each), which autocast's float8
recipes run in float8 like the dense products:

    python examples/transformer_lm.py --experts 4 --policies mixed_bfloat16 --fp8 mxfp8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
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
TEXT_MODULES = ("textwrap", "string", "difflib", "argparse", "json.decoder", "json.encoder")


@dataclasses.dataclass(frozen=True)
class Config:
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    seq_len: int = 64
    batch_size: int = 16
    learning_rate: float = 2e-3
    vocab: int = 256  # bytes
    experts: int = 0  # > 0: each block's MLP is a mixture of experts
    top_k: int = 2    # experts per token


class Softmax(nn.Module):
    """``jax.nn.softmax`` in the module's ``dtype`` (set by a policy)."""

    dtype: Any = None

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.softmax(x if self.dtype is None else x.astype(self.dtype), axis=-1)


class CausalSelfAttention(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        q, k, v = jnp.split(nn.Dense(3 * d, use_bias=False, name="qkv")(x), 3, axis=-1)
        q, k, v = (a.reshape(b, t, self.heads, d // self.heads) for a in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // self.heads)
        mask = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        weights = Softmax()(scores)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)
        return nn.Dense(d, name="proj")(out)


class MixtureOfExperts(nn.Module):
    """A top-k mixture of MLP experts: tokens sorted by expert, each expert's two
    products one ``lax.ragged_dot`` over all of them, outputs weighted by the router."""

    experts: int
    top_k: int
    hidden: int
    dtype: Any = None  # set by a policy: the experts' compute dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        tokens = x.reshape(b * t, d)
        # The router in float32 (its products are too small for float8 anyway).
        probs = jax.nn.softmax(nn.Dense(self.experts, use_bias=False, name="router")(
            tokens.astype(jnp.float32)), axis=-1)
        weights, chosen = jax.lax.top_k(probs, self.top_k)
        weights = weights / weights.sum(-1, keepdims=True)
        order = jnp.argsort(chosen.reshape(-1), stable=True)  # (token, slot) by expert
        token = order // self.top_k
        sizes = jnp.bincount(chosen.reshape(-1), length=self.experts).astype(jnp.int32)
        init = nn.initializers.lecun_normal(batch_axis=(0,))
        w1 = self.param("w1", init, (self.experts, d, self.hidden))
        w2 = self.param("w2", init, (self.experts, self.hidden, d))
        dtype = self.dtype or x.dtype
        h = nn.gelu(jax.lax.ragged_dot(tokens[token].astype(dtype), w1.astype(dtype), sizes))
        y = jax.lax.ragged_dot(h, w2.astype(dtype), sizes)
        y = y * weights.reshape(-1)[order][:, None].astype(y.dtype)
        return jnp.zeros_like(tokens, y.dtype).at[token].add(y).reshape(b, t, d)


class Block(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        x = x + CausalSelfAttention(c.heads)(nn.LayerNorm()(x))
        if c.experts:
            return x + MixtureOfExperts(c.experts, c.top_k, 4 * c.d_model)(nn.LayerNorm()(x))
        h = nn.gelu(nn.Dense(4 * c.d_model)(nn.LayerNorm()(x)))
        return x + nn.Dense(c.d_model)(h)


class TransformerLM(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.config
        x = nn.Embed(c.vocab, c.d_model)(tokens)
        pos = self.param("pos", nn.initializers.normal(0.02), (c.seq_len, c.d_model))
        x = x + pos[: tokens.shape[1]].astype(x.dtype)
        for _ in range(c.layers):
            x = Block(c)(x)
        return nn.Dense(c.vocab, name="logits")(nn.LayerNorm()(x))


def module_policies(policy: Any) -> jmp_policy.flax.ModulePolicy:
    """``policy`` for every layer; LayerNorm, softmax and logits in float32."""
    policy = jmp_policy.Policy(policy)
    return jmp_policy.flax.module_policy(
        {
            nn.LayerNorm: "float32",
            "logits": "float32",
            Softmax: jmp_policy.Policy("float32", "float32", policy.compute_dtype),
        },
        default=policy,
    )


def load_text() -> np.ndarray:
    """Bytes of a few stdlib modules' source files."""
    import importlib

    chunks = []
    for name in TEXT_MODULES:
        with open(importlib.import_module(name).__file__, "rb") as f:
            chunks.append(f.read())
    return np.frombuffer(b"\n".join(chunks), dtype=np.uint8).astype(np.int32)


def make_train_step(policy: Any, config: Config = Config(), loss_scale: Any = "policy",
                    fp8: Any = None, residuals: Any = None):
    """Returns ``(init, train_step, eval_loss)`` for ``policy``; all jitted.

    With ``fp8`` (a scaling name or ``jmp_policy.Float8Recipe``), the model's
    matrix products run in float8 through ``jmp_policy.autocast``. With
    ``residuals="float8"``, the whole loss (model and cross-entropy) is one
    autocast function whose backward pass keeps its activations in float8.

    The optimizer state ``train_step`` carries is ``(opt_state, fp8_state)``: the
    second is ``None``, or with delayed float8 scaling (``fp8="delayed"``) the amax
    histories of the products (``jmp_policy.float8_state``), recorded every step.
    ``eval_loss(params, tokens, fp8_state=None)``.
    """
    policy = jmp_policy.Policy(policy)
    model = TransformerLM(config)
    policies = module_policies(policy)
    tx = jmp_policy.loss_scaling(optax.adamw(config.learning_rate, weight_decay=0.01),
                                 policy if loss_scale == "policy" else loss_scale)
    apply = model.apply if fp8 is None else jmp_policy.autocast(model.apply, policy, fp8=fp8)
    delayed = fp8 == "delayed" or getattr(fp8, "delayed", False)

    def cross_entropy(apply, state, params, tokens):
        logits = apply(*state, {"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), tokens[:, 1:]).mean()

    if residuals is not None:  # the loss too: its softmax is a residual
        whole = jmp_policy.autocast(
            lambda params, tokens: cross_entropy(model.apply, (), params, tokens),
            policy, fp8=fp8, residuals=residuals)

    def loss_fn(params, tokens, fp8_state=None):
        state = (fp8_state,) if delayed else ()  # delayed scaling: the histories first
        with policies:
            if residuals is not None:
                return whole(*state, params, tokens)
            return cross_entropy(apply, state, params, tokens)

    @jax.jit
    def init_params(key):
        with policies:
            return model.init(key, jnp.zeros((1, config.seq_len), jnp.int32))["params"]

    def init(seed: int = 0):
        params = init_params(jax.random.key(seed))
        fp8_state = None
        if delayed:
            with policies:
                fp8_state = jmp_policy.float8_state(
                    apply, {"params": params}, jnp.zeros((1, config.seq_len - 1), jnp.int32)
                ) if residuals is None else jmp_policy.float8_state(
                    whole, params, jnp.zeros((1, config.seq_len), jnp.int32))
        return params, (jax.jit(tx.init)(params), fp8_state)

    @jax.jit
    def train_step(params, state, tokens):
        opt_state, fp8_state = state
        scale = jmp_policy.get_loss_scale(opt_state)
        if delayed:  # the gradient for the histories holds this step's maxima
            loss, (grads, observed) = jmp_policy.scaled_value_and_grad(loss_fn, (0, 2))(
                scale, params, tokens, fp8_state)
            fp8_state = fp8_state.record(observed)
        else:
            loss, grads = jmp_policy.scaled_value_and_grad(loss_fn)(scale, params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), (opt_state, fp8_state), loss

    return init, train_step, jax.jit(loss_fn)


def batches(text: np.ndarray, config: Config, seed: int):
    rng = np.random.RandomState(seed)
    while True:
        starts = rng.randint(0, len(text) - config.seq_len - 1, size=config.batch_size)
        yield np.stack([text[s:s + config.seq_len + 1] for s in starts])


def held_out_batches(text: np.ndarray, config: Config, batch_size: int = 64) -> np.ndarray:
    """Every non-overlapping window of ``text``, in batches: ``(batches, batch_size, seq + 1)``.

    The same windows for every run and seed, and all of them: one random batch
    would make the held-out loss vary between seeds more than between recipes.
    """
    windows = (len(text) - 1) // config.seq_len // batch_size * batch_size
    if windows == 0:
        raise ValueError(f"held-out text of {len(text)} bytes holds no batch of {batch_size} "
                         f"windows of {config.seq_len + 1} bytes")
    starts = np.arange(windows) * config.seq_len
    seqs = np.stack([text[s:s + config.seq_len + 1] for s in starts])
    return seqs.reshape(-1, batch_size, config.seq_len + 1)


def run_name(policy: Any, fp8: Any = None) -> str:
    """``"mixed_bfloat16"``, ``"mixed_bfloat16 fp8 rowwise"``, ``"... fp8 rowwise, head fp8"``."""
    name = jmp_policy.Policy(policy).name
    if fp8 is None:
        return name
    recipe = fp8 if isinstance(fp8, jmp_policy.Float8Recipe) else jmp_policy.Float8Recipe(fp8)
    head = "" if recipe.exclude else ", head fp8"
    return f"{name} fp8 {recipe.scaling}{head}"


def train(policy: Any, *, steps: int = 300, seed: int = 0, config: Config = Config(),
          text: Optional[np.ndarray] = None, progress: bool = False,
          measure_memory: bool = False, fp8: Any = None,
          final_steps_without_fp8: int = 0, residuals: Any = None) -> Dict[str, Any]:
    """Trains for ``steps`` steps; with ``fp8``, the last ``final_steps_without_fp8`` of
    them without it: a second train step of the same loss (a new autocast), which takes
    the same parameters and optimizer state (a delayed recipe's histories are dropped).
    ``residuals="float8"`` keeps the backward pass's activations in float8."""
    policy = jmp_policy.Policy(policy)
    name = run_name(policy, fp8) + (f", {residuals} residuals" if residuals else "")
    text = load_text() if text is None else text
    split = int(0.9 * len(text))
    train_text, test_text = text[:split], text[split:]
    init, train_step, eval_loss = make_train_step(policy, config, fp8=fp8, residuals=residuals)
    _, plain_step, plain_loss = (init, train_step, eval_loss) if fp8 is None \
        else make_train_step(policy, config)
    params, opt_state = init(seed)
    data = batches(train_text, config, seed)
    test_batches = held_out_batches(test_text, config)

    step_bytes = None
    if measure_memory:
        # Compile ahead of time to read XLA's memory account, and train with that
        # executable (calling the jitted function would compile a second time).
        train_step = train_step.lower(params, opt_state, next(batches(train_text, config, 0))) \
            .compile()
        memory = train_step.memory_analysis()
        if memory is not None:
            step_bytes = int(memory.argument_size_in_bytes + memory.output_size_in_bytes
                             + memory.temp_size_in_bytes)

    losses, scales = [], []
    bar = range(steps)
    if progress:
        from tqdm import tqdm
        bar = tqdm(bar, desc=f"{name:>15}")
    start = None
    for i in bar:
        if i == 1:  # the first step compiles
            jax.block_until_ready(params)
            start = time.perf_counter()
        if fp8 is not None and i == steps - final_steps_without_fp8:
            train_step, eval_loss, opt_state = plain_step, plain_loss, (opt_state[0], None)
        params, opt_state, loss = train_step(params, opt_state, next(data))
        losses.append(loss)
        scales.append(jmp_policy.get_loss_scale(opt_state).loss_scale)
    jax.block_until_ready(params)
    elapsed = time.perf_counter() - start if start is not None else float("nan")
    test_bits = float(np.mean([eval_loss(params, b, opt_state[1])
                               for b in test_batches])) / math.log(2)
    return {
        "policy": str(policy),
        "run": name,
        "steps": steps,
        "test_bits_per_byte": test_bits,
        # The same weights without float8: the model the recipe trained, not its inference.
        "test_bits_per_byte_without_fp8": test_bits if fp8 is None else float(
            np.mean([plain_loss(params, b) for b in test_batches])) / math.log(2),
        "steps_per_s": (steps - 1) / elapsed if steps > 1 else float("nan"),
        "skipped_steps": int(optax.tree_utils.tree_get(opt_state, "skipped_steps")),
        "final_loss_scale": float(scales[-1]),
        "step_memory_bytes": step_bytes,
        "params_finite": bool(jax.jit(jmp_policy.all_finite)(params)),
        "losses": [float(l) for l in losses],
        "loss_scales": [float(s) for s in scales],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default=os.path.join("results", "transformer_lm"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--fp8", nargs="+", default=[],
                        choices=("tensorwise", "rowwise", "delayed", "mxfp8", "nvfp4"),
                        help="also train the first policy with float8 matmuls, per scaling")
    parser.add_argument("--fp8-head", action="store_true",
                        help="also train the first --fp8 scaling with the logits head in float8")
    for field in ("d_model", "heads", "layers", "seq_len", "batch_size", "experts", "top_k"):
        parser.add_argument("--" + field.replace("_", "-"), type=int,
                            default=getattr(Config(), field))
    args = parser.parse_args(argv)
    config = Config(d_model=args.d_model, heads=args.heads, layers=args.layers,
                    seq_len=args.seq_len, batch_size=args.batch_size, experts=args.experts,
                    top_k=args.top_k)

    text = load_text()
    print(f"text: {len(text):,} bytes of {', '.join(TEXT_MODULES)} sources")
    if args.fp8_head and not args.fp8:
        parser.error("--fp8-head needs --fp8 SCALING")
    runs = [(p, None) for p in args.policies]
    runs += [(args.policies[0], scaling) for scaling in args.fp8]
    if args.fp8_head:
        runs.append((args.policies[0], jmp_policy.Float8Recipe(args.fp8[0], exclude=())))
    results = [train(p, steps=args.steps, seed=args.seed, config=config, text=text,
                     progress=True, measure_memory=True, fp8=fp8) for p, fp8 in runs]
    print()
    header = ("policy", "test bits/byte", "steps/s", "skipped", "final scale", "step memory")
    rows = [(r["run"], f"{r['test_bits_per_byte']:.3f}", f"{r['steps_per_s']:.1f}",
             str(r["skipped_steps"]), f"{r['final_loss_scale']:g}",
             "n/a" if r["step_memory_bytes"] is None else f"{r['step_memory_bytes'] / 2**20:.1f} MiB")
            for r in results]
    widths = [max(len(x[i]) for x in rows + [header]) for i in range(len(header))]
    for n, row in enumerate([header] + rows):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
        if n == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"device": str(jax.devices()[0]), "config": dataclasses.asdict(config),
                   "results": results}, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fp8_runs = [r for r in results if r["run"] != jmp_policy.Policy(r["policy"]).name]
    # A loss-scale panel only where a run scales its loss (float16): bfloat16's is 1.
    scaled = [r for r in results if any(s != 1 for s in r["loss_scales"])]
    panels = ["loss"] + ["scale"] * bool(scaled) + ["fp8"] * bool(fp8_runs)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    ax = dict(zip(panels, axes[0]))
    window = max(1, args.steps // 20)

    def smooth(r: dict) -> np.ndarray:  # bits per byte, moving average: noisy batches
        return np.convolve(np.asarray(r["losses"]) / math.log(2), np.ones(window) / window,
                           mode="valid")

    steps = np.arange(window - 1, args.steps)
    marks = max(1, len(steps) // 10)
    for k, r in enumerate(results):  # line styles and markers keep overlapping curves apart
        style = dict(color=f"C{k}", linestyle=["-", "--", ":", "-."][k % 4], marker="osD^v"[k % 5],
                     markevery=(k * marks // len(results), marks))
        label = f"{r['run']} (held out {r['test_bits_per_byte']:.3f})"
        ax["loss"].plot(steps, smooth(r), label=label, **style)
        if r in scaled:
            ax["scale"].plot(r["loss_scales"], label=r["run"], color=f"C{k}")
        if r in fp8_runs:  # the float8 curves overlap the others: show their difference
            ax["fp8"].plot(steps, smooth(r) - smooth(results[0]), label=r["run"], **style)
    ax["loss"].set(title=f"training loss (mean of {window} steps)", xlabel="step",
                   ylabel="bits per byte")
    if scaled:
        ax["scale"].set(title="loss scale", xlabel="step", yscale="log")
    if fp8_runs:
        ax["fp8"].axhline(0, color="black", lw=0.8)
        ax["fp8"].set(title=f"float8 runs minus {results[0]['run']}", xlabel="step",
                      ylabel="training loss difference (bits per byte)")
    axes = axes[0]
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "lm.png"), dpi=110)
    print(f"\nwrote {os.path.join(args.out, 'results.json')} and {os.path.join(args.out, 'lm.png')}")


if __name__ == "__main__":
    main()

"""A MaxText/Gemma-style decoder LM, FSDP-sharded, with the full low-precision recipe.

    python examples/scale_lm.py                 # 300 steps, ~7 min on a 2-core CPU
    python examples/scale_lm.py --quick --out /tmp/scale_lm   # 10 steps, a smoke test

The model is plain JAX: RMSNorm, rotary position embeddings (RoPE),
grouped-query attention, a SwiGLU MLP, an untied output head; each layer is
``jax.checkpoint``-ed with ``dots_with_no_batch_dims_saveable`` (the weight
products' outputs are kept for the backward pass, the attention products are
recomputed). Parameters are sharded FSDP-style over a ``"data"`` mesh axis (each
on its largest axis that the devices divide), and so is the batch. Run as a
script, it simulates 8 devices on the CPU.

It trains the same model, from the same initial weights and on the same
byte-level batches (the standard-library sources of ``transformer_lm.py``), twice:

* ``float32``: float32 weights, plain ``optax.adamw``, no autocast;
* ``bf16+fp8``: the whole recipe, ``jmp_policy.autocast(loss, "mixed_bfloat16",
  fp8="tensorwise", residuals="float8")`` (every product in float8 but the output
  head, the activations the backward pass keeps in float8), bfloat16 weights
  updated with ``low_precision_params(..., "stochastic")``, AdamW's moments in 8
  bits (``quantize_state``), all under ``loss_scaling(..., "dynamic")``, the
  outermost transformation.

It prints a table (held-out loss and bits per byte, XLA's memory account of one
step per device, step time) and writes ``results.json`` (or ``--json PATH``) and
``scale_lm.png`` (the two loss curves) to ``--out`` (default
``results/scale_lm/``). On a CPU, float8 is emulated and bfloat16 is not faster
than float32: the step-time ratio says nothing about an accelerator.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and "jax" not in sys.modules:
    # Simulate 8 devices on the host (read when JAX starts). Not when imported into a
    # running JAX (a test process): its device count is fixed already.
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()

import argparse
import dataclasses
import importlib.util
import json
import math
import time
from typing import Any, Callable, Dict, List, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jmp_policy

HERE = os.path.dirname(os.path.abspath(__file__))
REMAT_POLICY = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


@dataclasses.dataclass(frozen=True)
class Config:
    d_model: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2      # grouped-query attention: 2 query heads per key/value head
    head_dim: int = 32
    mlp: int = 512         # SwiGLU hidden width
    seq_len: int = 128
    batch_size: int = 16   # global: 2 sequences per device on 8 devices
    learning_rate: float = 3e-3
    vocab: int = 256       # bytes


# The smoke test (tests/test_examples.py): one remat-ed layer and short sequences, as
# compiling the two steps is most of its time; the width keeps the per-device memory
# ratio of the full recipe (bfloat16 weights, 8-bit moments: about a third).
QUICK = Config(d_model=64, layers=1, mlp=256, seq_len=32)


# --- data -----------------------------------------------------------------------------

def _transformer_lm() -> Any:
    """``transformer_lm.py`` as a module (the examples are scripts, not a package)."""
    name = "_example_transformer_lm"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, "transformer_lm.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its flax modules are dataclasses: they look it up
        spec.loader.exec_module(module)
    return sys.modules[name]


# --- the model: plain functions of a dict of parameters -------------------------------

def init_params(key: jax.Array, c: Config) -> Dict[str, Any]:
    """float32 weights, scaled so that every layer's output starts at unit scale."""
    def dense(key, n_in, n_out):
        return jax.random.normal(key, (n_in, n_out)) / math.sqrt(n_in)

    keys = iter(jax.random.split(key, 2 + 7 * c.layers))
    layers = []
    for _ in range(c.layers):
        layers.append({
            "attn_norm": jnp.ones(c.d_model),
            "wq": dense(next(keys), c.d_model, c.heads * c.head_dim),
            "wk": dense(next(keys), c.d_model, c.kv_heads * c.head_dim),
            "wv": dense(next(keys), c.d_model, c.kv_heads * c.head_dim),
            "wo": dense(next(keys), c.heads * c.head_dim, c.d_model) / math.sqrt(2 * c.layers),
            "mlp_norm": jnp.ones(c.d_model),
            "w_gate": dense(next(keys), c.d_model, c.mlp),
            "w_up": dense(next(keys), c.d_model, c.mlp),
            "w_down": dense(next(keys), c.mlp, c.d_model) / math.sqrt(2 * c.layers),
        })
    return {"embed": jax.random.normal(next(keys), (c.vocab, c.d_model)),
            "layers": layers,
            "final_norm": jnp.ones(c.d_model),
            "head": dense(next(keys), c.d_model, c.vocab)}


def param_shapes(c: Config) -> Dict[str, Any]:
    return jax.eval_shape(lambda key: init_params(key, c), jax.random.key(0))


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    # No dtype here: under autocast the mean square and rsqrt run in float32 anyway.
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def rope(x: jax.Array, positions: np.ndarray) -> jax.Array:
    """Rotates each pair (x[i], x[i + d/2]) of every head by position * frequency."""
    half = x.shape[-1] // 2
    freq = 1.0 / 10_000 ** (np.arange(half) / half)
    angle = positions[:, None] * freq[None, :]                 # (t, d/2), numpy constants
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]  # broadcast over heads
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention(x: jax.Array, p: Dict[str, jax.Array], c: Config) -> jax.Array:
    """Causal grouped-query attention: each key/value head serves heads/kv_heads queries."""
    b, t, _ = x.shape
    groups = c.heads // c.kv_heads
    positions = np.arange(t, dtype=np.float32)
    q = rope((x @ p["wq"]).reshape(b, t, c.heads, c.head_dim), positions)
    k = rope((x @ p["wk"]).reshape(b, t, c.kv_heads, c.head_dim), positions)
    v = (x @ p["wv"]).reshape(b, t, c.kv_heads, c.head_dim)
    q = q.reshape(b, t, c.kv_heads, groups, c.head_dim) / math.sqrt(c.head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k)
    causal = np.tril(np.ones((t, t), bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", weights, v).reshape(b, t, c.heads * c.head_dim)
    return out @ p["wo"]


def swiglu(x: jax.Array, p: Dict[str, jax.Array]) -> jax.Array:
    return (jax.nn.silu(x @ p["w_gate"]) * (x @ p["w_up"])) @ p["w_down"]


def decoder_layer(x: jax.Array, p: Dict[str, jax.Array], c: Config) -> jax.Array:
    x = x + attention(rms_norm(x, p["attn_norm"]), p, c)
    return x + swiglu(rms_norm(x, p["mlp_norm"]), p)


def forward(params: Dict[str, Any], tokens: jax.Array, c: Config) -> jax.Array:
    # Remat each layer: the backward pass recomputes what the policy does not save
    # (here everything but the weight products' outputs), layer by layer.
    layer = jax.checkpoint(decoder_layer, policy=REMAT_POLICY, static_argnums=(2,))
    x = params["embed"][tokens]
    for p in params["layers"]:
        x = layer(x, p, c)
    x = rms_norm(x, params["final_norm"])
    with jax.named_scope("logits"):  # Float8Recipe's default excludes the output head
        return x @ params["head"]


def loss_fn(params: Dict[str, Any], tokens: jax.Array, c: Config) -> jax.Array:
    logits = forward(params, tokens[:, :-1], c)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), tokens[:, 1:]).mean()


# --- sharding -------------------------------------------------------------------------

def fsdp_spec(shape: tuple, devices: int) -> P:
    """Shards an array on its largest axis that ``devices`` divides; replicates it if none."""
    for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):  # stable: first of ties
        if shape[axis] % devices == 0 and shape[axis] >= devices:
            return P(*[("data" if a == axis else None) for a in range(len(shape))])
    return P()


def fsdp_shardings(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """The FSDP sharding of every array of ``tree`` (the parameters)."""
    n = mesh.shape["data"]
    return jax.tree.map(lambda x: NamedSharding(mesh, fsdp_spec(x.shape, n)), tree)


def state_shardings(state: Any, params: Any, param_sh: Any, mesh: jax.sharding.Mesh) -> Any:
    """Each optimizer-state array sharded like its parameter, found by key path (a
    moment's path, or a quantized moment's codes' and exponents', holds its parameter's),
    where the sharded axis has the parameter's length; replicated otherwise (counts,
    keys, the exponents of blocks that the devices do not divide)."""
    by_path = {jax.tree_util.keystr(path): (leaf.shape, sharding.spec) for (path, leaf), sharding
               in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(param_sh))}

    def sharding(path, leaf):
        key = jax.tree_util.keystr(path)
        found = [k for k in by_path if k in key]
        if found:
            shape, spec = by_path[max(found, key=len)]
            if leaf.ndim == len(shape) and all(
                    axis is None or leaf.shape[i] == shape[i] for i, axis in enumerate(spec)):
                return NamedSharding(mesh, spec)
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(sharding, state)


# --- the two runs ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    loss: Callable              # (params, tokens) -> loss
    tx: optax.GradientTransformation
    param_dtype: Any
    scaled: bool                # loss_scaling outermost: train with scaled_value_and_grad


def adamw(c: Config, steps: int) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, c.learning_rate, max(1, steps // 10), max(2, steps), c.learning_rate / 10)
    return optax.adamw(schedule, b2=0.95, weight_decay=0.01)


def runs(c: Config, steps: int, seed: int, residuals: Any = "float8") -> List[Run]:
    loss = lambda params, tokens: loss_fn(params, tokens, c)
    recipe = jmp_policy.Float8Recipe("tensorwise")  # the output head stays bfloat16
    mixed_tx = jmp_policy.loss_scaling(                      # outermost: sees scaled grads
        jmp_policy.low_precision_params(                     # bfloat16 weights
            jmp_policy.quantize_state(adamw(c, steps), bits=8, seed=seed),  # 8-bit moments
            "stochastic", seed=seed),
        "dynamic")
    return [
        Run("float32", loss, adamw(c, steps), jnp.float32, scaled=False),
        Run("bf16+fp8", jmp_policy.autocast(loss, "mixed_bfloat16", fp8=recipe,
                                            residuals=residuals), mixed_tx,
            jnp.bfloat16, scaled=True),
    ]


def mixed_bfloat16(c: Config, steps: int) -> Run:
    """The usual mixed precision, to measure memory against: float32 weights and AdamW,
    bfloat16 compute (``autocast(loss, "mixed_bfloat16")``), no float8."""
    return Run("mixed_bfloat16", jmp_policy.autocast(
        lambda params, tokens: loss_fn(params, tokens, c), "mixed_bfloat16"),
        adamw(c, steps), jnp.float32, scaled=False)


def make_step(run: Run) -> Callable:
    def step(params, opt_state, tokens):
        if run.scaled:  # SPEC section 3's train step
            scale = jmp_policy.get_loss_scale(opt_state)
            loss, grads = jmp_policy.scaled_value_and_grad(run.loss)(scale, params, tokens)
        else:
            loss, grads = jax.value_and_grad(run.loss)(params, tokens)
        updates, opt_state = run.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step


def jitted_step(run: Run, c: Config, mesh: jax.sharding.Mesh) -> tuple:
    """The train step, jitted with FSDP shardings on ``mesh`` and the weights and state
    donated (as a train loop would), and those shardings: ``(step, (params, state,
    batch))``."""
    param_sh = fsdp_shardings(param_shapes(c), mesh)
    params = jax.eval_shape(lambda p: jax.tree.map(lambda x: x.astype(run.param_dtype), p),
                            param_shapes(c))
    state_sh = state_shardings(jax.eval_shape(run.tx.init, params), params, param_sh, mesh)
    batch_sh = NamedSharding(mesh, P("data", None))
    step = jax.jit(make_step(run), in_shardings=(param_sh, state_sh, batch_sh),
                   out_shardings=(param_sh, state_sh, None), donate_argnums=(0, 1))
    return step, (param_sh, state_sh, batch_sh)


def step_memory(run: Run, c: Config, mesh: jax.sharding.Mesh,
                options: Optional[Dict[str, Any]] = None) -> Any:
    """XLA's memory account of one train step per device, compiled from shapes alone
    (for ``mesh``'s devices, which may be a deviceless GPU's) with compiler ``options``."""
    step, shardings = jitted_step(run, c, mesh)
    params = jax.eval_shape(lambda p: jax.tree.map(lambda x: x.astype(run.param_dtype), p),
                            param_shapes(c))
    shapes = (params, jax.eval_shape(run.tx.init, params),
              jax.ShapeDtypeStruct((c.batch_size, c.seq_len + 1), jnp.int32))
    structs = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                           shapes, shardings)
    return step.lower(*structs).compile(options).memory_analysis()


def train(run: Run, c: Config, mesh: jax.sharding.Mesh, text: np.ndarray, steps: int,
          seed: int) -> Dict[str, Any]:
    lm = _transformer_lm()
    split = int(0.9 * len(text))
    step, (param_sh, state_sh, batch_sh) = jitted_step(run, c, mesh)

    # Same initial weights for both runs: drawn in float32, then cast.
    params = jax.jit(lambda k: jax.tree.map(lambda x: x.astype(run.param_dtype),
                                            init_params(k, c)),
                     out_shardings=param_sh)(jax.random.key(seed))
    opt_state = jax.jit(run.tx.init, out_shardings=state_sh)(params)

    data = lm.batches(text[:split], c, seed)  # same batches for both runs
    put = lambda b: jax.device_put(b, batch_sh)
    first = put(next(data))
    # Ahead of time, to read XLA's per-device memory account; training then runs this
    # executable.
    step = step.lower(params, opt_state, first).compile()
    memory = step.memory_analysis()

    losses, scales, start = [], [], None
    for i in range(steps):
        if i == 1:  # step 0 warms up; time the rest
            jax.block_until_ready(params)
            start = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, first if i == 0 else put(next(data)))
        # float() waits for the step: one step in flight at a time (XLA:CPU's simulated
        # devices share a small thread pool, and steps queued behind each other could
        # starve a collective of its threads), and the timings are of whole steps.
        losses.append(float(loss))
        if run.scaled:
            scales.append(jmp_policy.get_loss_scale(opt_state).loss_scale)
    jax.block_until_ready(params)
    step_s = (time.perf_counter() - start) / (steps - 1) if steps > 1 else float("nan")

    held_out = lm.batches(text[split:], dataclasses.replace(c, batch_size=64), seed + 1)
    eval_loss = jax.jit(run.loss)
    test_loss = float(np.mean([eval_loss(params, put(next(held_out))) for _ in range(4)]))
    return {
        "run": run.name,
        "steps": steps,
        "test_loss": test_loss,
        "test_bits_per_byte": test_loss / math.log(2),
        "step_time_s": step_s,
        "argument_bytes_per_device": int(memory.argument_size_in_bytes),
        "temp_bytes_per_device": int(memory.temp_size_in_bytes),
        "param_dtype": jnp.dtype(run.param_dtype).name,
        "params_finite": bool(jax.jit(jmp_policy.all_finite)(params)),
        "skipped_steps": (int(optax.tree_utils.tree_get(opt_state, "skipped_steps"))
                          if run.scaled else 0),
        "final_loss_scale": float(scales[-1]) if scales else 1.0,
        "losses": losses,
    }


# --- report ---------------------------------------------------------------------------

def print_table(results: List[Dict[str, Any]]) -> None:
    mib = lambda b: f"{b / 2**20:.2f} MiB"
    header = ("run", "held-out loss", "bits/byte", "args/device", "temp/device", "step time")
    rows = [(r["run"], f"{r['test_loss']:.4f}", f"{r['test_bits_per_byte']:.4f}",
             mib(r["argument_bytes_per_device"]), mib(r["temp_bytes_per_device"]),
             f"{1e3 * r['step_time_s']:.0f} ms") for r in results]
    widths = [max(len(x[i]) for x in rows + [header]) for i in range(len(header))]
    for n, row in enumerate([header] + rows):
        print("| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |")
        if n == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def ratios(results: List[Dict[str, Any]]) -> Dict[str, float]:
    """The low-precision run over the float32 one."""
    f32, low = results
    return {key: low[key] / f32[key] for key in (
        "test_bits_per_byte", "argument_bytes_per_device", "temp_bytes_per_device",
        "step_time_s")}


def plot(results: List[Dict[str, Any]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = len(results[0]["losses"])
    window = max(1, steps // 20)  # moving average: each batch is noisy
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for k, r in enumerate(results):
        bits = np.asarray(r["losses"]) / math.log(2)
        smooth = np.convolve(bits, np.ones(window) / window, mode="valid")
        ax.plot(np.arange(window - 1, steps), smooth, ["-", "--"][k], color=f"C{k}",
                label=f"{r['run']} (held out {r['test_bits_per_byte']:.3f})")
    ax.set(title=f"training loss (mean of {window} steps)", xlabel="step",
           ylabel="bits per byte")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="default 300 (--quick: 10)")
    parser.add_argument("--quick", action="store_true", help="a smaller model for 10 steps")
    parser.add_argument("--out", default=os.path.join("results", "scale_lm"))
    parser.add_argument("--json", default=None, help="default OUT/results.json")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    c = QUICK if args.quick else Config()
    steps = args.steps or (10 if args.quick else 300)

    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    text = _transformer_lm().load_text()
    n_params = sum(x.size for x in jax.tree.leaves(
        param_shapes(c)))
    print(f"{n_params:,} parameters, FSDP over {mesh.size} {jax.devices()[0].platform} devices, "
          f"{len(text):,} bytes of text, {steps} steps")
    results = []
    for run in runs(c, steps, args.seed):
        results.append(train(run, c, mesh, text, steps, args.seed))
        print(f"  {run.name}: loss {results[-1]['losses'][0]:.3f} -> "
              f"{results[-1]['losses'][-1]:.3f}")
    print()
    print_table(results)
    ratio = ratios(results)
    print("\n" + ", ".join(f"{k} ratio {v:.3f}" for k, v in ratio.items())
          + f" (bf16+fp8 / float32; step time on {jax.devices()[0].platform}"
          + (", where float8 is emulated and slower)" if jax.devices()[0].platform == "cpu"
             else ")"))

    os.makedirs(args.out, exist_ok=True)
    json_path = args.json or os.path.join(args.out, "results.json")
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump({"device": str(jax.devices()[0]), "devices": mesh.size, "jax": jax.__version__,
                   "config": dataclasses.asdict(c), "params": int(n_params),
                   "remat_policy": "dots_with_no_batch_dims_saveable",
                   "ratios": ratio, "results": results}, f, indent=1)
    plot_path = os.path.join(args.out, "scale_lm.png")
    plot(results, plot_path)
    print(f"\nwrote {json_path} and {plot_path}")


if __name__ == "__main__":
    main()

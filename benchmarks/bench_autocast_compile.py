"""What autocast adds to a train step's compile: trace + lower + compile against the plain loss.

For each model, ``jax.jit`` of the gradient of its loss, traced, lowered and compiled
from cold caches (``jax.clear_caches``): the plain float32 loss, the loss under
``autocast(loss, "mixed_bfloat16")`` and with ``fp8="tensorwise"``; the fastest of
interleaved rounds. The models:

* the language models of the tests' real-model zoo (``tests/support/real_models.py``):
  ``nnx_decoder`` (Flax NNX, after Gemma) and ``linen_lm`` (Flax linen, after lm1b);
* with ``--flax-examples DIR`` (a checkout of Flax's ``examples/`` folder), Flax's own
  NNX Gemma (``gemma3_270m`` with 2 layers and a 4096-token vocabulary) and linen lm1b
  (2 layers, the same vocabulary), batch 4x64, with their own bfloat16
  (``dtype=jnp.bfloat16`` in the model's config) as a peer.

``--target h100`` compiles for an H100 without one (JAX's CUDA plugin, deviceless);
the default is this machine's backend. On XLA:CPU, bfloat16 and float8 are emulated,
which costs compile time whoever casts (the framework's own bfloat16 too).

Commands (from the repository root; JSON to ``benchmarks/results/bench_autocast_compile.json``)::

    python -m benchmarks.bench_autocast_compile            # ~2 min on 2 CPU cores
    python -m benchmarks.bench_autocast_compile --quick    # one round
    python -m benchmarks.bench_autocast_compile --flax-examples <flax>/examples \\
        --target h100 --json benchmarks/results/bench_autocast_compile_flax_h100.json
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import optax

from benchmarks import harness
import jmp_policy

Gradient = Tuple[Callable[..., Any], Tuple[Any, ...]]  # (gradient function, its arguments)
Build = Callable[[Optional[str], Optional[str], Any], Gradient]  # (policy, fp8, dtype)


def autocast(loss: Callable[..., Any], policy: Optional[str], fp8: Optional[str]) -> Any:
    return loss if policy is None else jmp_policy.autocast(loss, policy, fp8=fp8)


def zoo_model(name: str) -> Build:
    """A language model of the tests' zoo (its own bfloat16: none)."""
    model = harness.load_file("tests/support/real_models.py", "real_models").MODELS[name]
    key = jax.random.key(0)
    state, batch = model.init(key), model.batch(key)

    def build(policy: Optional[str], fp8: Optional[str], dtype: Any) -> Gradient:
        loss = autocast(model.loss, policy, fp8)
        if model.framework == "nnx":
            from flax import nnx
            return lambda m: nnx.grad(lambda m: loss(m, batch, True)[0])(m), (state,)
        rest = {k: v for k, v in state.items() if k != "params"}
        return (lambda p: jax.grad(lambda p: loss(p, rest, batch, key, True)[0])(p),
                (state["params"],))
    return build


TOKENS = jnp.ones((4, 64), jnp.int32)


def flax_gemma(examples: str) -> Build:
    from flax import nnx
    gemma = harness.load_file(f"{examples}/gemma/transformer.py")  # its siblings too
    TransformerConfig = harness.load_file(f"{examples}/gemma/transformer_cfg.py").TransformerConfig
    positions = jnp.broadcast_to(jnp.arange(TOKENS.shape[1]), TOKENS.shape)
    mask = jnp.tril(jnp.ones((*TOKENS.shape, TOKENS.shape[1]), bool))

    def build(policy: Optional[str], fp8: Optional[str], dtype: Any) -> Gradient:
        config = TransformerConfig.gemma3_270m(num_layers=2, num_embed=4096, dtype=dtype)
        graphdef, state = nnx.split(gemma.Transformer(config, rngs=nnx.Rngs(0)))

        def loss(state: Any, tokens: Any) -> Any:
            logits, _ = nnx.merge(graphdef, state)(tokens, positions, None, mask)
            return optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), tokens).mean()
        return jax.grad(autocast(loss, policy, fp8)), (state, TOKENS)
    return build


def flax_lm1b(examples: str) -> Build:
    lm1b = harness.load_file(f"{examples}/lm1b/models.py", "lm1b_models")

    def build(policy: Optional[str], fp8: Optional[str], dtype: Any) -> Gradient:
        model = lm1b.TransformerLM(lm1b.TransformerConfig(
            vocab_size=4096, output_vocab_size=4096, deterministic=True, num_layers=2,
            dtype=dtype))
        params = jax.jit(model.init)(jax.random.key(0), TOKENS)["params"]

        def loss(params: Any, tokens: Any) -> Any:
            logits = model.apply({"params": params}, tokens)
            return optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), tokens).mean()
        return jax.grad(autocast(loss, policy, fp8)), (params, TOKENS)
    return build


def seconds(gradient: Gradient, target: Any) -> float:
    fn, args = gradient
    if target is not None:
        args = harness.on_target(args, target)
    jax.clear_caches()
    start = time.perf_counter()
    jax.jit(fn).trace(*args).lower().compile()
    return time.perf_counter() - start


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_common_arguments(parser, rounds=3, iters=1, compile_rounds=1)
    parser.add_argument("--flax-examples", help="a checkout of Flax's examples/ folder")
    parser.add_argument("--target", choices=("local", "h100"), default="local")
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    target = harness.gpu_target()[0] if args.target == "h100" else None
    models: Dict[str, Tuple[Build, bool]] = {  # (build, has a bfloat16 of its own)
        "zoo nnx_decoder": (zoo_model("nnx_decoder"), False),
        "zoo linen_lm": (zoo_model("linen_lm"), False)}
    if args.flax_examples:
        models = {"flax NNX Gemma": (flax_gemma(args.flax_examples), True),
                  "flax linen lm1b": (flax_lm1b(args.flax_examples), True)}
    report = harness.Report(
        "bench_autocast_compile", __doc__.split("\n")[0],
        settings={"models": list(models), "rounds": rounds, "target": args.target,
                  "quick": args.quick}, argv=argv)
    for name, (build, own_bf16) in models.items():
        cases = {"plain": (None, None, jnp.float32),
                 "mixed_bfloat16": ("mixed_bfloat16", None, jnp.float32),
                 "mixed_bfloat16, fp8 tensorwise": ("mixed_bfloat16", "tensorwise", jnp.float32)}
        if own_bf16:
            cases["the model's own bfloat16"] = (None, None, jnp.bfloat16)
        gradients = {case: build(*how) for case, how in cases.items()}
        samples: Dict[str, List[float]] = {case: [] for case in cases}
        for _ in range(rounds):
            for case, gradient in gradients.items():
                samples[case].append(seconds(gradient, target))
        table = report.table(
            name.replace(" ", "_"), f"{name}: jit(grad(loss)) traced, lowered and compiled",
            baseline="plain", columns=[harness.Column("seconds", "trace + lower + compile", "s")],
            description=f"Fastest of {rounds} cold rounds, interleaved; {args.target}.")
        for case, runs in samples.items():
            table.add_row(case, {"seconds": min(runs)}, samples={"seconds": runs})
    print(report.markdown())
    report.write(args.json or harness.default_json_path("bench_autocast_compile", args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())

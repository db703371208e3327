"""Autocast's tracing cost on the example transformer LM: eager calls and jit traces.

Autocast is a transformation: each call runs the loss function's Python and
re-emits its jaxpr at autocast's precisions (under ``jit``, once per trace).
Measured, for ``examples/transformer_lm.py``'s LM (default ``Config``) and its
loss, against the same loss without autocast:

* ``eager call``: one call outside ``jit`` (the forward loss), as in an
  evaluation loop written without ``jit``;
* ``jit trace``: tracing ``jax.value_and_grad`` of the loss to a jaxpr under
  ``jax.jit`` (``jit(...).trace``), the cost a train step pays once;
* ``lower``: tracing and lowering that step to StableHLO.

Each figure is the median of interleaved rounds (fresh functions for the
traces, so that no cache of JAX's answers). On a CPU, half precision is
emulated: eager figures include that; trace figures do not depend on it.

Commands (from the repository root; JSON to ``benchmarks/results/bench_autocast_trace.json``)::

    python -m benchmarks.bench_autocast_trace            # ~1-2 min on 2 CPU cores
    python -m benchmarks.bench_autocast_trace --quick    # a smoke run on a tiny LM
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import jax
import jax.numpy as jnp
import optax

from benchmarks import harness
import jmp_policy

POLICY = "mixed_bfloat16"


def loss_of(model: Any) -> Callable[..., Any]:
    def loss_fn(params: Any, tokens: Any) -> Any:
        logits = model.apply({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), tokens[:, 1:]).mean()
    return loss_fn


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_common_arguments(parser, rounds=7, iters=1, compile_rounds=1)
    args = parser.parse_args(argv)
    lm = harness.load_file("examples/transformer_lm.py")
    config = lm.Config(d_model=16, heads=2, layers=1, seq_len=16, batch_size=4) if args.quick \
        else lm.Config()
    rounds = 2 if args.quick else args.rounds
    model = lm.TransformerLM(config)
    tokens = jnp.asarray(next(lm.batches(lm.load_text(), config, 0)))
    params = jax.jit(model.init)(jax.random.key(0), tokens[:, :-1])["params"]
    plain = loss_of(model)

    # One function of each kind, as a user holds it; jax.value_and_grad makes a fresh
    # function per trace, so that jit's cache never answers.
    functions = {"plain": plain, "autocast": jmp_policy.autocast(loss_of(model), POLICY)}
    cases: Dict[str, Callable[[], Any]] = {}
    for kind, fn in functions.items():
        cases[f"{kind}: eager call"] = lambda fn=fn: fn(params, tokens)
        cases[f"{kind}: jit trace"] = lambda fn=fn: jax.jit(
            jax.value_and_grad(fn)).trace(params, tokens).jaxpr
        cases[f"{kind}: trace + lower"] = lambda fn=fn: jax.jit(
            jax.value_and_grad(fn)).trace(params, tokens).lower()
    for call in cases.values():  # first calls: JAX's own one-time costs
        timed(call)
    samples: Dict[str, List[float]] = {name: [] for name in cases}
    for k in range(rounds):
        names = list(cases)
        for name in names[k % len(names):] + names[:k % len(names)]:
            samples[name].append(timed(cases[name]))
    print(f"jax {jax.__version__}; float32 loss {float(plain(params, tokens)):.4f}", flush=True)

    report = harness.Report(
        "bench_autocast_trace", __doc__.split("\n")[0],
        settings={"config": vars(config) if hasattr(config, "__dict__") else str(config),
                  "policy": POLICY, "rounds": rounds, "quick": args.quick}, argv=argv)
    for what in ("eager call", "jit trace", "trace + lower"):
        table = report.table(
            what.replace(" ", "-").replace("+", "and"), f"{what}: autocast against the plain loss",
            baseline=f"plain: {what}", columns=[harness.Column("wall_s", "time", "s")],
            description=f"The example LM's loss, {POLICY}; median of {rounds} rounds.")
        for kind in ("plain", "autocast"):
            name = f"{kind}: {what}"
            table.add_row(name, {"wall_s": statistics.median(samples[name])},
                          samples={"wall_s": samples[name]})
    print(report.markdown())
    report.write(args.json or harness.default_json_path("bench_autocast_trace", args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())

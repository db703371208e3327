"""The numerics inspector's cost: one inspection against one float32 train step.

The model is ``examples/transformer_lm.py``'s byte-level transformer LM
(loaded by path, default ``Config``). Measured:

* ``float32 train step``: the example's jitted step (forward, backward, AdamW,
  loss scaling) in float32, the baseline;
* ``inspect mixed_float16``: ``jmp_policy.inspect_numerics(loss_fn,
  "mixed_float16", argnums=0)(params, tokens)``, the whole public call (the
  compiled program, the statistics' transfer, the report built on the host),
  forward and backward pass;
* ``inspect mixed_bfloat16 + fp8``: the same with ``fp8="rowwise"`` (float8
  products and their operands' counts).

Wall time: medians of interleaved rounds (``harness.time_interleaved``), after
each has run once: an inspection's later call traces again and reuses its
compiled program (the same jaxpr), so this is its steady state. First call:
tracing, compiling and running, the step's as ``jax.jit(step)(...)`` makes it. On a CPU, half precision and float8 are emulated: the
ratios, not the absolute times, are the figures to read.

Commands (from the repository root; JSON to ``benchmarks/results/bench_inspect.json``)::

    python -m benchmarks.bench_inspect            # ~3-5 min on 2 CPU cores
    python -m benchmarks.bench_inspect --quick    # a smoke run on a tiny LM
    python -m benchmarks.bench_inspect --config d_model=512 heads=8 layers=4 seq_len=256
                                                  # a GPU-sized LM (on a GPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import jax
import jax.numpy as jnp
import optax

from benchmarks import harness
import jmp_policy

def lm_problem(lm: Any, config: Any) -> tuple[Callable[..., Any], Any, Any, Any, Any]:
    """The example LM's loss ``loss_fn(params, tokens)`` (float32 logits, as the example's
    step computes it), its float32 train step, parameters, optimizer state and a batch."""
    model = lm.TransformerLM(config)
    tokens = jnp.asarray(next(lm.batches(lm.load_text(), config, 0)))

    def loss_fn(params: Any, tokens: Any) -> Any:
        logits = model.apply({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), tokens[:, 1:]).mean()

    init, train_step, _ = lm.make_train_step("float32", config)
    params, opt_state = init(0)
    return loss_fn, train_step, params, opt_state, tokens


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_common_arguments(parser, rounds=7, iters=3, compile_rounds=1)
    parser.add_argument("--config", nargs="*", default=[], metavar="FIELD=INT",
                        help="override fields of the example's Config, e.g. d_model=512 "
                             "layers=4 (a GPU-sized LM)")
    args = parser.parse_args(argv)
    lm = harness.load_file("examples/transformer_lm.py")
    config = lm.Config(d_model=16, heads=2, layers=1, seq_len=16, batch_size=4) if args.quick \
        else lm.Config()
    overrides = {k: int(v) for k, v in (item.split("=", 1) for item in args.config)}
    config = dataclasses.replace(config, **overrides)
    rounds = 2 if args.quick else args.rounds

    loss_fn, train_step, params, opt_state, tokens = lm_problem(lm, config)

    harness.warm_up_compiler()
    # The step's first call as a user makes it (tracing, lowering, compiling, running), of
    # a function jax has not seen: nothing cached.
    start = time.perf_counter()
    jax.block_until_ready(jax.jit(lambda *a: train_step.__wrapped__(*a))(
        params, opt_state, tokens))
    step_first_call = time.perf_counter() - start
    print("compiling the float32 train step", flush=True)
    step = harness.build(harness.Case("float32 train step", train_step.__wrapped__,
                                      (params, opt_state, tokens), carry=2))
    calls: Dict[str, Callable[[], Any]] = {
        "float32 train step": harness.Runner(step.compiled, (params, opt_state, tokens), carry=2)}
    first_call_s: Dict[str, float] = {"float32 train step": step_first_call}
    for name, policy, fp8 in [("inspect mixed_float16", "mixed_float16", None),
                              ("inspect mixed_bfloat16 + fp8", "mixed_bfloat16", "rowwise")]:
        inspector = jmp_policy.inspect_numerics(loss_fn, policy, fp8=fp8, argnums=0)
        print(f"first call of {name}", flush=True)
        start = time.perf_counter()
        report = inspector(params, tokens)
        first_call_s[name] = time.perf_counter() - start
        calls[name] = (lambda inspector=inspector: inspector(params, tokens))
        print(f"  {len(report)} rows, {first_call_s[name]:.1f} s", flush=True)
    jax.block_until_ready(calls["float32 train step"]())

    print(f"timing: {rounds} interleaved rounds of {args.iters} calls", flush=True)
    samples = harness.time_interleaved(calls, rounds, args.iters)
    wall = {name: statistics.median(s["wall_s"]) for name, s in samples.items()}

    report = harness.Report(
        "bench_inspect", __doc__.split("\n")[0],
        settings={"config": vars(config) if hasattr(config, "__dict__") else str(config),
                  "rounds": rounds, "iters": args.iters, "quick": args.quick}, argv=argv)
    table = report.table(
        "inspect", "One inspection against one float32 train step (transformer LM)",
        baseline="float32 train step",
        columns=[harness.Column("wall_s", "wall time", "s"),
                 harness.Column("first_call_s", "first call", "s")],
        description="Inspections: the public call, forward and backward pass. Wall time: "
                    "after a first call (the compiled program reused); first call: tracing, "
                    "compiling and running.")
    for name in calls:
        table.add_row(name, {"wall_s": wall[name], "first_call_s": first_call_s[name]},
                      samples=samples[name])
    print(report.markdown())
    report.write(args.json or harness.default_json_path("bench_inspect", args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())

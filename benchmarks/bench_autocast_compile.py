"""What autocast adds to a train step's compile: trace + lower + compile against the plain loss.

Measured on the language models of the tests' real-model zoo
(``tests/support/real_models.py``): ``nnx_decoder`` (Flax NNX, after Gemma: RMSNorm,
grouped-query attention, rotary embeddings, GeGLU) and ``linen_lm`` (Flax linen, after
Flax's lm1b example). For each: ``jax.jit`` of the gradient of the loss (``nnx.grad``
or ``jax.grad``, as the framework's users write it), traced, lowered and compiled from
cold caches (``jax.clear_caches``), plain, under ``autocast(loss, "mixed_bfloat16")``
and with ``fp8="tensorwise"``; the fastest of interleaved rounds, per stage. The
ratio that a user waits for is the whole (trace + lower + compile) against the
plain loss's.

Commands (from the repository root; JSON to ``benchmarks/results/bench_autocast_compile.json``)::

    python -m benchmarks.bench_autocast_compile            # ~2 min on 2 CPU cores
    python -m benchmarks.bench_autocast_compile --quick    # one round
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import jax

from benchmarks import harness
import jmp_policy

MODELS = ("nnx_decoder", "linen_lm")
STAGES = ("trace", "lower", "compile")


def gradient(model: Any, loss: Callable[..., Any]) -> tuple[Callable[..., Any], Any]:
    """``(gradient of loss, its argument)``, as the model's framework writes it."""
    key = jax.random.key(0)
    state, batch = model.init(key), model.batch(key)
    if model.framework == "nnx":
        from flax import nnx
        return lambda m: nnx.grad(lambda m: loss(m, batch, True)[0])(m), state
    params = state["params"]
    rest = {k: v for k, v in state.items() if k != "params"}
    return lambda p: jax.grad(lambda p: loss(p, rest, batch, key, True)[0])(p), params


def stages(fn: Callable[..., Any], arg: Any) -> Dict[str, float]:
    jax.clear_caches()
    t0 = time.perf_counter()
    traced = jax.jit(fn).trace(arg)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    lowered.compile()
    t3 = time.perf_counter()
    return {"trace": t1 - t0, "lower": t2 - t1, "compile": t3 - t2}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_common_arguments(parser, rounds=3, iters=1, compile_rounds=1)
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    zoo = harness.load_file("tests/support/real_models.py", "real_models")
    report = harness.Report(
        "bench_autocast_compile", __doc__.split("\n")[0],
        settings={"models": list(MODELS), "rounds": rounds, "quick": args.quick}, argv=argv)
    for name in MODELS:
        model = zoo.MODELS[name]
        cases = {"plain": model.loss,
                 "mixed_bfloat16": jmp_policy.autocast(model.loss, "mixed_bfloat16"),
                 "mixed_bfloat16, fp8 tensorwise": jmp_policy.autocast(
                     model.loss, "mixed_bfloat16", fp8="tensorwise")}
        samples: Dict[str, List[Dict[str, float]]] = {case: [] for case in cases}
        for _ in range(rounds):
            for case, loss in cases.items():
                samples[case].append(stages(*gradient(model, loss)))
        table = report.table(
            name, f"{name}: jit(grad(loss)) traced, lowered and compiled",
            baseline="plain",
            columns=[harness.Column("total_s", "trace + lower + compile", "s"),
                     *(harness.Column(f"{s}_s", s, "s", ratio=False) for s in STAGES)],
            description=f"Fastest of {rounds} cold rounds per stage, interleaved.")
        for case, runs in samples.items():
            best = {f"{s}_s": min(run[s] for run in runs) for s in STAGES}
            table.add_row(case, {"total_s": sum(best.values()), **best})
    print(report.markdown())
    report.write(args.json or harness.default_json_path("bench_autocast_compile", args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())

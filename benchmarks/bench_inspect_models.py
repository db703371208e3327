"""The numerics inspector on the real-model suite: first-call cost, rows, suggested loss scale.

The models are those of ``tests/support/real_models.py`` (linen LM and ResNet, NNX
decoder and BatchNorm MLP, Equinox ViT), in train mode, and the example
transformer LM (``examples/transformer_lm.py``, default ``Config``). Per model,
``inspect_numerics(loss, "mixed_float16", argnums=0)``:

* ``step``: a float32 train step's compile and first run (the model's loss,
  gradients and ``adam``, jitted by the framework's idiom), the baseline;
* ``first call``, ``again``: the inspection's first call and a second one
  (each call traces and compiles: ``again`` is the steady state); ``ratio``:
  first call over step;
* ``rows``, ``empty scope``: the report's rows, and those without a scope;
* ``scale``: log2 of ``suggest_loss_scale()``; ``skipped``: steps skipped in
  ``--steps`` train steps of ``loss_scaling(adam(3e-3), scale)`` (a static
  scale); ``error (suggested)`` and ``error (dynamic)``: the gradients'
  relative error against float32 at the suggested scale and at the default
  dynamic scale's first one (2**15); for the example LM, loss and
  gradients of its own ``mixed_float16`` step.

The script uses the public API only, so it measures an older checkout's
inspector too (before and after a change)::

    python -m benchmarks.harness run --library <old checkout> bench_inspect_models

Commands (from the repository root; JSON to
``benchmarks/results/bench_inspect_models.json``)::

    python -m benchmarks.bench_inspect_models            # ~3 min on 2 CPU cores
    python -m benchmarks.bench_inspect_models --quick    # two models, 2 steps
"""

from __future__ import annotations

import argparse
import functools
import inspect
import math
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Optional

import jax
import optax

from benchmarks import bench_inspect
from benchmarks import harness
import jmp_policy

COLUMNS = [
    harness.Column("step_s", "step", "s", ratio=False),
    harness.Column("first_s", "first call", "s", ratio=False),
    harness.Column("ratio", "ratio", "x", ratio=False),
    harness.Column("again_s", "again", "s", ratio=False),
    harness.Column("rows", "rows", "count", ratio=False),
    harness.Column("empty_scope", "empty scope", "count", ratio=False),
    harness.Column("scale_log2", "scale (log2)", "", ratio=False),
    harness.Column("skipped", "skipped", "count", ratio=False),
    harness.Column("error_suggested", "error (suggested)", "", ratio=False),
    harness.Column("error_dynamic", "error (dynamic)", "", ratio=False),
]
DYNAMIC_INITIAL = 2.0 ** 15


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - start


def inspection(inspector: Callable[..., Any], args: tuple[Any, ...]) -> Dict[str, Any]:
    report, first = timed(lambda: inspector(*args))
    _, again = timed(lambda: inspector(*args))
    return {"first_s": first, "again_s": again, "rows": len(report),
            "empty_scope": sum(1 for r in report if not r.scope),
            "scale": report.suggest_loss_scale()}


def zoo_model(tests: Any, name: str, steps: int) -> Dict[str, Any]:
    model = tests.rm.MODELS[name]
    trainer = tests.TRAINERS[model.framework]
    float32 = jmp_policy.loss_scaling(optax.adam(3e-3), 1.0)
    trainer(model, model.loss, float32, steps=1)  # init and batch compiled: not the step's
    _, step = timed(lambda: trainer(model, model.loss, float32, steps=1))
    k_init, k_batch, k_drop = jax.random.split(jax.random.key(0), 3)
    state, batch = model.init(k_init), model.batch(k_batch)
    inspector = jmp_policy.inspect_numerics(lambda *a: model.loss(*a)[0], "mixed_float16",
                                          argnums=0)
    if model.framework == "linen":
        params, rest = state["params"], {k: v for k, v in state.items() if k != "params"}
        args: tuple[Any, ...] = (params, rest, batch, k_drop, True)
    elif model.framework == "nnx":
        args = (state, batch, True)
    else:
        args = (state, batch, k_drop, True)
    figures = inspection(inspector, args)
    scale = figures.pop("scale")
    mixed = jmp_policy.autocast(model.loss, "mixed_float16")
    _, skipped = trainer(model, mixed, jmp_policy.loss_scaling(optax.adam(3e-3), scale),
                         steps=steps)

    def scaled(s: float) -> Callable[..., Any]:
        def loss(*a: Any) -> Any:
            value, aux = mixed(*a)
            return value * s, aux
        return loss

    runs = tests.evaluate(name, {"float32": model.loss, "suggested": scaled(scale),
                                 "dynamic": scaled(DYNAMIC_INITIAL)})
    errors = {k: float(tests.relative_error(jax.tree.map(lambda g, s=s: g / s, runs[k][1]),
                                            runs["float32"][1]))
              for k, s in (("suggested", scale), ("dynamic", DYNAMIC_INITIAL))}
    return {**figures, "step_s": step, "ratio": figures["first_s"] / step,
            "scale_log2": math.log2(scale), "skipped": skipped,
            "error_suggested": errors["suggested"], "error_dynamic": errors["dynamic"]}


def example_lm(tests: Any, steps: int) -> Dict[str, Any]:
    lm = harness.load_file("examples/transformer_lm.py")
    loss_fn, train_step, params, opt_state, tokens = bench_inspect.lm_problem(lm, lm.Config())
    _, step = timed(lambda: jax.jit(train_step.__wrapped__)(params, opt_state, tokens))
    inspector = jmp_policy.inspect_numerics(loss_fn, "mixed_float16", argnums=0)
    figures = inspection(inspector, (params, tokens))
    scale = figures.pop("scale")
    mixed = jmp_policy.autocast(loss_fn, "mixed_float16")
    tx = jmp_policy.loss_scaling(optax.adam(3e-3), scale)
    state = tx.init(params)

    @jax.jit
    def mixed_step(params: Any, state: Any) -> Any:
        _, grads = jmp_policy.scaled_value_and_grad(mixed)(
            jmp_policy.get_loss_scale(state), params, tokens)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    p = params
    for _ in range(steps):
        p, state = mixed_step(p, state)
    want = jax.grad(loss_fn)(params, tokens)
    errors = {}
    for k, s in (("suggested", scale), ("dynamic", DYNAMIC_INITIAL)):
        _, g = jmp_policy.scaled_value_and_grad(mixed)(s, params, tokens)
        errors[k] = float(tests.relative_error(jax.tree.map(lambda x, s=s: x / s, g), want))
    return {**figures, "step_s": step, "ratio": figures["first_s"] / step,
            "scale_log2": math.log2(scale), "skipped": int(state.skipped_steps),
            "error_suggested": errors["suggested"], "error_dynamic": errors["dynamic"]}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    tests = harness.load_file("tests/test_real_models_autocast.py")
    names = ["nnx_bn_mlp", "linen_lm"] if args.quick else sorted(tests.rm.MODELS)
    steps = 2 if args.quick else args.steps
    report = harness.Report("bench_inspect_models", __doc__.split("\n")[0],
                            settings={"steps": steps, "models": names,
                                      "jmp_policy": inspect.getfile(jmp_policy)}, argv=argv)
    table = report.table(
        "models", "inspect_numerics(loss, 'mixed_float16', argnums=0) per model", baseline=None,
        columns=COLUMNS,
        description="Seconds on this machine; ratio: the inspection's first call over a "
                    "float32 train step's compile and first run.")
    harness.warm_up_compiler()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = [(n, functools.partial(zoo_model, tests, n, steps)) for n in names]
        if not args.quick:
            cases.append(("example transformer LM", functools.partial(example_lm, tests, steps)))
        for name, measure in cases:
            print(name, flush=True)
            try:
                table.add_row(name, measure())
            except Exception as error:  # an older checkout may fail a model: say so
                report.failed([{"name": name, "error": f"{type(error).__name__}: {error}"[:300]}])
    print(report.markdown())
    report.write(args.json or harness.default_json_path("bench_inspect_models", args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Autocast on the real-model zoo: each model's loss and gradients under every precision.

The models are those of ``tests/support/real_models.py`` (a Flax linen LM with a tied
head, padding and dropout; a linen ResNet with BatchNorm; an NNX decoder with
RMSNorm, grouped-query attention and rotary embeddings; an NNX MLP with
BatchNorm; an Equinox ViT with integer fields), in train mode under ``jit``.
Per model and variant: the loss's and the gradients' relative errors against
float32 (``|a - b| / |b|``, the gradients as one vector), whether every
gradient is finite; and, for ``mixed_float16`` with dynamic loss scaling,
the skipped steps and the loss ratio after ``--steps`` jitted train steps of
``adam(3e-3)`` on the model's fixed batch.

The zoo's language models have one block since 2026-11-27, and its ViT one since
2026-11-28 (each had two when the committed tables in ``benchmarks/results`` were
measured; a run now measures one).

Commands (from the repository root; JSON to ``benchmarks/results/bench_real_models.json``)::

    python benchmarks/bench_real_models.py            # ~1 min on 2 CPU cores
    python benchmarks/bench_real_models.py --quick    # two models, 3 steps
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import warnings
from typing import Any, List, Optional

import numpy as np
import optax

import harness
import jmp_policy

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests")


def load(name: str) -> Any:
    """A module of ``tests/`` by path, registered under its name; first the suite's
    helpers, the package ``tests/support``, which the test modules import."""
    if name == "support":  # a package: ``support.real_models`` is found on its path
        folder = os.path.join(TESTS, "support")
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder])
    else:
        if "support" not in sys.modules:
            load("support")
        spec = importlib.util.spec_from_file_location(name, os.path.join(TESTS, f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


COLUMNS = [
    harness.Column("loss_error", "loss error", "", ratio=False),
    harness.Column("grad_error", "gradient error", "", ratio=False),
    harness.Column("finite", "finite gradients", "", ratio=False),
    harness.Column("skipped_steps", "skipped steps", "count", ratio=False),
    harness.Column("loss_ratio", "last / first loss", "", ratio=False),
]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    tests = load("test_real_models_autocast")
    names = ["linen_lm", "eqx_vit"] if args.quick else tests.NAMES
    steps = 3 if args.quick else args.steps
    report = harness.Report("bench_real_models", __doc__.split("\n")[0],
                            settings={"steps": steps, "models": names}, argv=argv)
    table = report.table(
        "precisions", "Loss and gradients against float32, and float16 training", baseline=None,
        columns=COLUMNS,
        description="Train mode under jit, dropout and padding on; fp8 variants in "
                    "mixed_bfloat16; the float16 row trains with dynamic loss scaling.")
    with warnings.catch_warnings():
        warnings.simplefilter("error", jmp_policy.AutocastWarning)
        for name in names:
            print(f"{name}: every precision", flush=True)
            runs = tests.evaluate_all(name)
            (want, _), want_grads = runs["float32"]
            for variant, ((loss, _), grads) in runs.items():
                if variant == "float32":
                    continue
                figures = {"loss_error": abs(float(loss) - float(want)) / abs(float(want)),
                           "grad_error": float(tests.relative_error(grads, want_grads)),
                           "finite": all(bool(np.isfinite(g).all())
                                         for g in tests.float_leaves(grads))}
                if variant == "mixed_float16":
                    model = tests.rm.MODELS[name]
                    loss_fn = jmp_policy.autocast(model.loss, "mixed_float16")
                    tx = jmp_policy.loss_scaling(optax.adam(3e-3), "mixed_float16")
                    losses, skipped = tests.TRAINERS[model.framework](model, loss_fn, tx,
                                                                      steps=steps)
                    figures.update(skipped_steps=skipped, loss_ratio=losses[-1] / losses[0])
                label = variant if variant in tests.HALF else f"fp8 {variant}"
                table.add_row(f"{name}: {label}", figures)
    print(report.markdown())
    report.write(args.json or harness.default_json_path("bench_real_models", args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())

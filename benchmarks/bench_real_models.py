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

Commands (from the repository root; JSON to ``benchmarks/results/bench_real_models.json``)::

    python -m benchmarks.bench_real_models            # ~1 min on 2 CPU cores
    python -m benchmarks.bench_real_models --quick    # two models, 3 steps
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import List, Optional

import numpy as np
import optax

from benchmarks import harness
import jmp_policy

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
    tests = harness.load_file("tests/test_real_models_autocast.py")
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

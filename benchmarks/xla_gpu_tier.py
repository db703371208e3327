"""The deviceless XLA:GPU test tier's figures, before and after a change, as a report.

The tier (``tests/test_xla_gpu.py``, ``pytest -m xla_gpu``) compiles the library's
programs for an H100 without one and reads the optimized program: the roundings
each format keeps against the roundings the jaxpr asks for (and against a compile
with ``xla_allow_excess_precision`` off), the float8 GEMMs per product, and the
compile time of rowwise float8 against tensorwise. With
``JMP_POLICY_XLA_GPU_FIGURES=<file>`` it writes those figures; this script puts
two such files side by side (a commit before a change and the tree after it).

Commands (from the repository root, in an environment with the CUDA plugin:
``pip install -e '.[test,xla-gpu]'``; the earlier commit in a worktree with the
tier's files copied in, run with ``PYTHONPATH`` at the worktree)::

    JMP_POLICY_XLA_GPU_FIGURES=/tmp/after.json python -m pytest -m xla_gpu -n 0 -q tests/test_xla_gpu.py
    python benchmarks/xla_gpu_tier.py --before /tmp/before.json --before-label 24aa08b \\
        --after /tmp/after.json --after-label HEAD

JSON to ``benchmarks/results/xla_gpu_tier.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

# No compile here, but JAX starts its backends for the report's environment: without a
# driver the CUDA plugin's version check would fail noisily.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import harness  # noqa: E402

COUNT = dict(unit="count", ratio=False)


def load(path: str) -> Dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def roundings_table(report: harness.Report, before: Dict[str, Any], after: Dict[str, Any],
                    labels: List[str]) -> None:
    columns = [harness.Column("sites", "sites (jaxpr)", **COUNT)]
    for label in labels:
        columns += [harness.Column(f"kept_{label}", f"kept, {label}", **COUNT),
                    harness.Column(f"reference_{label}", f"kept without excess precision, "
                                   f"{label}", **COUNT)]
    table = report.table("roundings", "Roundings kept in the optimized H100 program",
                         baseline=None, columns=columns,
                         description="per program and format: narrowing conversions of the "
                                     "jaxpr (sites), and the conversions to the format plus "
                                     "reduce-precisions to its mantissa in the optimized HLO "
                                     "(kept); the test asks kept >= min(sites, reference)")
    names = sorted(set(before.get("roundings", {})) | set(after.get("roundings", {})))
    for name in names:
        formats = sorted(set(before.get("roundings", {}).get(name, {}))
                         | set(after.get("roundings", {}).get(name, {})))
        for fmt in formats:
            figures: Dict[str, Optional[int]] = {}
            for label, run in zip(labels, (before, after)):
                row = run.get("roundings", {}).get(name, {}).get(fmt, {})
                figures.setdefault("sites", row.get("sites"))
                figures[f"kept_{label}"] = row.get("kept")
                figures[f"reference_{label}"] = row.get("reference")
            table.add_row(f"{name}: {fmt}", figures)
        if not formats:
            table.add_row(name, {}, note="no float rounding in the jaxpr")


def gemm_table(report: harness.Report, before: Dict[str, Any], after: Dict[str, Any],
               labels: List[str]) -> None:
    columns = [harness.Column("products", "eligible products", **COUNT)]
    for label in labels:
        columns += [harness.Column(f"cublaslt_f8_{label}", f"cuBLASLt f8 calls, {label}",
                                   **COUNT),
                    harness.Column(f"float8_dots_{label}", f"float8 GEMMs (Triton), {label}",
                                   **COUNT)]
    table = report.table("gemms", "Float8 GEMMs of a two-layer MLP, forward + backward",
                         baseline=None, columns=columns,
                         description="cuBLASLt calls with Triton GEMMs off; dots on float8 "
                                     "operands by default; 3 per eligible product expected")
    for recipe in sorted(set(before.get("gemms", {})) | set(after.get("gemms", {}))):
        figures: Dict[str, Any] = {}
        for label, run in zip(labels, (before, after)):
            row = run.get("gemms", {}).get(recipe, {})
            figures.setdefault("products", row.get("products"))
            figures[f"cublaslt_f8_{label}"] = row.get("cublaslt_f8")
            figures[f"float8_dots_{label}"] = row.get("float8_dots")
        table.add_row(recipe, figures)


def compile_table(report: harness.Report, before: Dict[str, Any], after: Dict[str, Any],
                  labels: List[str]) -> None:
    columns = []
    for label in labels:
        columns += [harness.Column(f"tensorwise_{label}", f"tensorwise, {label}", "s",
                                   ratio=False),
                    harness.Column(f"rowwise_{label}", f"rowwise, {label}", "s", ratio=False),
                    harness.Column(f"ratio_{label}", f"rowwise / tensorwise, {label}", "x",
                                   ratio=False)]
    table = report.table("compile", "XLA compile time for an H100, rowwise vs tensorwise float8",
                         baseline=None, columns=columns,
                         description="the fastest of 2 deviceless compiles each (no "
                                     "autotuning), persistent cache off; the test asks rowwise <= 2x tensorwise + 2 s")
    for program in sorted(set(before.get("compile_s", {})) | set(after.get("compile_s", {}))):
        figures: Dict[str, Any] = {}
        for label, run in zip(labels, (before, after)):
            row = run.get("compile_s", {}).get(program, {})
            t, r = row.get("tensorwise"), row.get("rowwise")
            figures.update({f"tensorwise_{label}": t, f"rowwise_{label}": r,
                            f"ratio_{label}": r / t if t and r else None})
        table.add_row(program, figures)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the tier's figures, earlier commit")
    parser.add_argument("--after", required=True, help="the tier's figures, after the change")
    parser.add_argument("--before-label", default="before")
    parser.add_argument("--after-label", default="after")
    parser.add_argument("--note", action="append", default=[],
                        help="a note for the report (what each label's tree was)")
    parser.add_argument("--json", help="default: benchmarks/results/xla_gpu_tier.json")
    args = parser.parse_args(argv)
    labels = [args.before_label, args.after_label]
    env = harness.environment()
    env["target"] = harness.H100_KIND
    report = harness.Report("xla_gpu_tier", __doc__.splitlines()[0], vars(args), argv, env=env)
    for note in args.note:
        report.note(note)
    before, after = load(args.before), load(args.after)
    roundings_table(report, before, after, labels)
    gemm_table(report, before, after, labels)
    compile_table(report, before, after, labels)
    print(report.markdown())
    path = args.json or harness.default_json_path("xla_gpu_tier")
    report.write(path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a float8 train step's time goes on an H100, predicted from a deviceless compile.

The programs are ``gpu_fp8.py``'s MLP block (its train step and its forward +
backward; bfloat16 and each float8 recipe), compiled for an H100 without one
(JAX's ahead-of-time path, `harness.h100_sharding`). From the optimized program
a roofline model predicts each step's time, checks the prediction against
step times measured on an H100 (`MEASURED`), and says which kernels take it.

The model, per kernel of the optimized HLO (`harness.kernels`: every top-level
instruction that launches work):

* a GEMM (a cuBLAS/cuBLASLt custom call, or a fusion holding a ``dot``, as a
  Triton GEMM): ``2 * M * N * K`` FLOPs (from its operands' shapes and dot
  dimension numbers) at the dense peak of its operand type, or its bytes at the
  memory bandwidth, whichever is slower;
* any other kernel: the bytes it reads and writes (operands and result, as
  `harness.kernel_bytes`) at the memory bandwidth; a kernel XLA emits as a
  transpose (the float8 casts that write a backward GEMM's transposed copy) at
  ``transpose_efficiency`` of it (``--fit-transpose-efficiency`` fits it on the
  measured tensorwise train step);
* every kernel, GEMMs included: a fixed launch overhead.

The parameters (`Machine`) are figures measured on H100s where there is one,
not datasheet peaks: bfloat16 GEMMs at 798 TFLOP/s (an 8192^3 matrix product),
float8 at twice that (the datasheet's float8/bfloat16 ratio), TF32 at half of
it, 3.0 TB/s device-to-device counting bytes read and written, and 2.5 us per
kernel (a CUDA launch plus the gap between kernels that XLA's stream leaves;
not measured). ``gemm_efficiency`` scales both GEMM peaks (1.0 = the 8192^3
rate); ``--fit-gemm-efficiency`` fits it on the bfloat16 train step.

A deviceless compile does not autotune: XLA makes every GEMM a Triton fusion
with a default tiling. On an H100 the autotuner chooses cuBLAS(Lt) for all six
GEMMs of every case (``results/h100.md``), so by default the programs are
compiled with Triton GEMMs off (``xla_gpu_enable_triton_gemm=false``), which is
what XLA does when cuBLAS wins; ``--triton-gemm`` keeps XLA's defaults. The
compile uses the environment's JAX and CUDA plugin, whose fusion decisions may
differ a little from those of the JAX the H100 ran.

Output: a table per program (GEMM FLOPs, float8 share, bytes of GEMM and other
kernels, kernels, predicted time by term, the H100's measured time and the
error) and, per recipe, the non-GEMM kernels by role and the largest ones;
JSON in ``benchmarks/results/roofline.json``.

Commands (from the repository root; needs JAX's CUDA plugin, no GPU)::

    /tmp/gpuvenv/bin/python -m benchmarks.roofline           # ~1 min
    /tmp/gpuvenv/bin/python -m benchmarks.roofline --smoke   # tiny sizes
    # the validation: the library the H100 ran (MEASURED_LIBRARY), with the fit
    /tmp/gpuvenv/bin/python -m benchmarks.harness run --library <its checkout> \
        roofline --fit-transpose-efficiency --json benchmarks/results/roofline_validation.json
"""

from __future__ import annotations

import os

# Without a GPU the CUDA plugin's version check fails (no driver); the
# deviceless compile needs only the plugin's compiler.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import argparse  # noqa: E402
import collections  # noqa: E402
import dataclasses  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from typing import Any, Dict, List, Optional, Sequence, Tuple  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import gpu_fp8  # noqa: E402
from benchmarks import harness  # noqa: E402
import jmp_policy  # noqa: E402

# --------------------------------------------------------------------------- #
# The machine: what the model charges for FLOPs, bytes and kernels.
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class Machine:
    """An H100 SXM as the model sees it (figures measured on this workplace's H100s
    where there is one; see the module's docstring)."""

    bf16_flops: float = 798e12      # dense bfloat16 GEMM, FLOP/s (8192^3, measured)
    fp8_ratio: float = 2.0          # float8 peak / bfloat16 peak (datasheet ratio)
    f32_ratio: float = 0.5          # TF32 peak / bfloat16 peak (datasheet ratio)
    bandwidth: float = 3.0e12       # bytes read + written per second (measured copy)
    launch_s: float = 2.5e-6        # per kernel: launch and inter-kernel gap
    gemm_efficiency: float = 1.0    # achieved / peak GEMM rate at these shapes
    # Achieved / `bandwidth` of kernels that transpose (the float8 casts writing the
    # transposed copy a backward GEMM needs: 1-byte elements): `--fit-transpose-efficiency`
    # on the measured tensorwise train step, with MEASURED_LIBRARY
    # (results/roofline_validation.json).
    transpose_efficiency: float = 0.395

    def gemm_rate(self, dtype: str) -> float:
        ratio = {"f8": self.fp8_ratio, "bf16": 1.0, "f16": 1.0}.get(dtype, self.f32_ratio)
        return self.bf16_flops * ratio * self.gemm_efficiency


# --------------------------------------------------------------------------- #
# What each kernel does.
# --------------------------------------------------------------------------- #

Kernel = harness.Kernel


def role(k: Kernel) -> str:
    """What a kernel does, read off its result types, XLA's fusion name and the JAX
    operation it came from (a heuristic, for the tables of where the bytes go)."""
    if k.is_gemm:
        return f"GEMM ({k.gemm_dtype})"
    op = k.op_name.rsplit("/", 1)[-1]
    results = re.findall(r"([a-z][a-z0-9]*)\[([\d,]*)\]", k.shape)
    largest = max((math.prod(int(d) for d in dims.split(",") if d) for _, dims in results),
                  default=0)
    if any(t.startswith("f8") for t, _ in results):
        return "quantize to float8" + (" + transposed copy" if "transpose" in k.name else "") \
            + (" + partial amax" if "reduce" in k.name else "")
    if all(t == "pred" for t, _ in results):
        return "rounding masks (pred) of a weight's quantization"
    if k.op_name and "jvp(" not in k.op_name:  # outside the differentiated loss
        return "optimizer update (AdamW)"
    if k.opcode == "copy":
        return "copy"
    if op == "reduce_max" or (largest <= 1 << 16 and k.bytes > 1 << 24):
        return "amax pass (also writes the tensor it reduces)" if largest > 1 << 16 \
            else "amax pass"
    if largest <= 1 << 16:
        return "scale arithmetic (tiny kernels)"
    if "tanh" in k.name:
        return "GELU (+ casts)"
    if "softmax" in k.name or op in ("mean", "rsqrt", "reduce_sum"):
        return "LayerNorm / its gradient"
    if op in ("mul", "div") and "transpose(" in k.op_name:
        return "rescale of a GEMM output (scale_a * scale_b)"
    if op == "convert_element_type":
        return "cast to/from bfloat16"
    return f"other ({op or k.name})"


# --------------------------------------------------------------------------- #
# The model.
# --------------------------------------------------------------------------- #

def kernel_seconds(k: Kernel, m: Machine) -> float:
    """A kernel's time without its launch: FLOP-bound or byte-bound, the slower."""
    bytes_s = k.bytes / m.bandwidth
    if k.is_gemm:
        return max(k.flops / m.gemm_rate(k.gemm_dtype), bytes_s)
    return bytes_s / m.transpose_efficiency if is_transpose(k) else bytes_s


def is_transpose(k: Kernel) -> bool:
    """Whether XLA:GPU emits the kernel as a transpose (its fusion's name says so)."""
    return "transpose" in k.name


def predict(ks: Sequence[Kernel], m: Machine) -> Dict[str, float]:
    """The figures of one program: FLOPs and bytes by kind, predicted time by term."""
    gemms = [k for k in ks if k.is_gemm]
    others = [k for k in ks if not k.is_gemm]
    return {
        "gemm_flops": sum(k.flops for k in gemms),
        "f8_gemm_flops": sum(k.flops for k in gemms if k.gemm_dtype == "f8"),
        "gemms": len(gemms),
        "f8_gemms": sum(k.gemm_dtype == "f8" for k in gemms),
        "gemm_bytes": sum(k.bytes for k in gemms),
        "other_bytes": sum(k.bytes for k in others),
        "kernels": len(ks),
        "gemm_s": sum(kernel_seconds(k, m) for k in gemms),
        "other_s": sum(kernel_seconds(k, m) for k in others),
        "launch_s": len(ks) * m.launch_s,
        "predicted_s": sum(kernel_seconds(k, m) for k in ks) + len(ks) * m.launch_s,
    }


# --------------------------------------------------------------------------- #
# The programs: gpu_fp8's MLP block, compiled for an H100.
# --------------------------------------------------------------------------- #

# Step times measured on an H100 by gpu_fp8.py (benchmarks/results/h100.md, the run of
# 2026-11-25), by (program, recipe): what the model must predict within TOLERANCE to be
# trusted. They hold for the library that H100 ran, MEASURED_LIBRARY.
MEASURED = {("train", None): 11.1e-3, ("train", "tensorwise"): 10.1e-3,
            ("train", "rowwise"): 9.48e-3, ("grad", None): 10.2e-3,
            ("grad", "tensorwise"): 8.85e-3, ("grad", "rowwise"): 8.25e-3}
MEASURED_LIBRARY = "6df0195"
TOLERANCE = 0.15
PROGRAMS = {"train": "MLP block train step (AdamW)", "grad": "MLP block forward + backward"}


def program(which: str, kind: Optional[str], size: dict) -> Tuple[Any, tuple, tuple]:
    """gpu_fp8's function, abstract arguments and donated arguments, as it measures them."""
    d, b, t = size["d_model"], size["batch"], size["seq"]
    p = jax.eval_shape(lambda: gpu_fp8.mlp_params(d))
    x = jax.ShapeDtypeStruct((b, t, d), jnp.bfloat16)
    y = jax.ShapeDtypeStruct((b, t, d), jnp.float32)
    if which == "train":
        return gpu_fp8.train_step(kind), (p, gpu_fp8.init_state(kind, p, x), x, y), (0, 1)
    return gpu_fp8.grad_step(kind), (p, x, y, gpu_fp8.fp8_state(kind, p, x)), ()


def compile_hlo(fn: Any, args: tuple, donate: tuple, sharding: Any,
                options: Dict[str, Any]) -> str:
    """The optimized HLO of ``fn`` compiled for the target of ``sharding``."""
    lowered = jax.jit(fn, donate_argnums=donate).trace(*harness.on_target(args, sharding)).lower()
    return lowered.compile(options).as_text()


def fit_transpose_efficiency(ks: Sequence[Kernel], measured: float, m: Machine) -> float:
    """The transpose efficiency that makes the model hit ``measured`` on ``ks``: what the
    other kernels leave of the time, over the transposes' time at full bandwidth."""
    full = dataclasses.replace(m, transpose_efficiency=1.0)
    at_bandwidth = sum(kernel_seconds(k, full) for k in ks if not k.is_gemm and is_transpose(k))
    rest = predict(ks, full)["predicted_s"] - at_bandwidth
    left = measured - rest
    return at_bandwidth / left if left > 0 and at_bandwidth > 0 else float("nan")


def fit_gemm_efficiency(ks: Sequence[Kernel], measured: float, m: Machine) -> float:
    """The GEMM efficiency that makes the model hit ``measured`` on ``ks`` (GEMMs
    FLOP-bound): what the other terms leave of the time, over the GEMMs' time at peak."""
    rest = predict(ks, m)
    gemm_at_peak = sum(k.flops / m.gemm_rate(k.gemm_dtype) for k in ks if k.is_gemm)
    left = measured - rest["other_s"] - rest["launch_s"]
    return m.gemm_efficiency * gemm_at_peak / left if left > 0 else float("nan")


# --------------------------------------------------------------------------- #
# Report.
# --------------------------------------------------------------------------- #

COLUMNS = [
    harness.Column("predicted_s", "predicted", "s"),
    harness.Column("measured_s", "H100 measured", "s"),
    harness.Column("error_pct", "error %", "", ratio=False),
    harness.Column("gemm_s", "GEMM time", "s"),
    harness.Column("other_s", "other kernels' time", "s"),
    harness.Column("launch_s", "launches", "s", ratio=False),
    harness.Column("gemm_tflop", "GEMM TFLOP", ""),
    harness.Column("f8_share", "of it float8", "", ratio=False),
    harness.Column("other_bytes", "other kernels' bytes", "bytes"),
    harness.Column("gemm_bytes", "GEMM bytes", "bytes"),
    harness.Column("kernels", "kernels", "count"),
    harness.Column("predicted_speedup", "predicted speedup", "x"),
    harness.Column("measured_speedup", "measured speedup", "x"),
]
TOP_COLUMNS = [
    harness.Column("bytes", "bytes read + written", "bytes", ratio=False),
    harness.Column("time_s", "time at bandwidth", "s", ratio=False),
]
ROLE_COLUMNS = [
    harness.Column("kernels", "kernels", "count", ratio=False),
    harness.Column("bytes", "bytes read + written", "bytes", ratio=False),
    harness.Column("time_s", "time (+ launches)", "s", ratio=False),
]


def program_rows(which: str, hlo: Dict[Any, List[Kernel]], m: Machine,
                 full: bool) -> List[Dict[str, Any]]:
    """One row per recipe compiled: the model's figures, the measurement and the error."""
    rows, base = [], predict(hlo[(which, None)], m)["predicted_s"]
    for kind in [k for k in gpu_fp8.KINDS if (which, k) in hlo]:
        f = predict(hlo[(which, kind)], m)
        measured = MEASURED.get((which, kind)) if full else None
        f.update(gemm_tflop=f["gemm_flops"] / 1e12,
                 f8_share=round(f["f8_gemm_flops"] / f["gemm_flops"], 3) if f["gemm_flops"] else 0.0,
                 measured_s=measured,
                 error_pct=round(100 * (f["predicted_s"] / measured - 1), 1) if measured else None,
                 predicted_speedup=base / f["predicted_s"],
                 measured_speedup=(MEASURED[(which, None)] / measured) if measured else None)
        rows.append({"name": gpu_fp8.kind_name(kind), "figures": f})
    return rows


def roles(ks: Sequence[Kernel], m: Machine) -> List[Dict[str, Any]]:
    """Non-GEMM kernels grouped by what they do, the costliest first."""
    groups: Dict[str, List[Kernel]] = collections.defaultdict(list)
    for k in ks:
        if not k.is_gemm:
            groups[role(k)].append(k)
    rows = [{"name": r, "figures": {"kernels": len(g), "bytes": sum(k.bytes for k in g),
                                     "time_s": sum(kernel_seconds(k, m) + m.launch_s for k in g)}}
            for r, g in groups.items()]
    return sorted(rows, key=lambda r: -r["figures"]["time_s"])


def largest(ks: Sequence[Kernel], m: Machine, n: int) -> List[Dict[str, Any]]:
    """The ``n`` non-GEMM kernels that move the most bytes."""
    top = sorted((k for k in ks if not k.is_gemm), key=lambda k: -k.bytes)[:n]
    return [{"name": f"{k.name}: {role(k)}", "note": f"{k.shape[:60]}; {k.op_name[-48:]}",
             "figures": {"bytes": k.bytes, "time_s": kernel_seconds(k, m)}} for k in top]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, no validation")
    parser.add_argument("--triton-gemm", action="store_true",
                        help="XLA's default GEMMs (Triton fusions without autotuning) instead "
                             "of cuBLAS(Lt), which the H100's autotuner chose")
    parser.add_argument("--fit-gemm-efficiency", action="store_true",
                        help="fit the GEMM efficiency on the bfloat16 train step")
    parser.add_argument("--launch-us", type=float, default=Machine.launch_s * 1e6,
                        help="launch overhead per kernel, microseconds")
    parser.add_argument("--fp8-ratio", type=float, default=Machine.fp8_ratio,
                        help="float8 GEMM rate / bfloat16 GEMM rate")
    parser.add_argument("--transpose-efficiency", type=float,
                        default=Machine.transpose_efficiency,
                        help="achieved / full bandwidth of transposing kernels (1.0: none lost)")
    parser.add_argument("--fit-transpose-efficiency", action="store_true",
                        help="fit it on the tensorwise train step's H100 time; meaningful only "
                             f"with the library the H100 ran ({MEASURED_LIBRARY}: python -m "
                             "benchmarks.harness run --library <its checkout> roofline ...)")
    parser.add_argument("--top", type=int, default=8, help="largest non-GEMM kernels listed")
    parser.add_argument("--json", help="write the report here (default: "
                        "benchmarks/results/roofline.json; roofline.quick.json with --smoke)")
    a = parser.parse_args(argv)
    size = gpu_fp8.SIZES["smoke" if a.smoke else "full"]
    sharding, target = harness.gpu_target()
    options = {} if a.triton_gemm else {"xla_gpu_enable_triton_gemm": False}
    m = Machine(launch_s=a.launch_us * 1e-6, fp8_ratio=a.fp8_ratio,
                transpose_efficiency=a.transpose_efficiency)

    hlo: Dict[Tuple[str, Optional[str]], List[Kernel]] = {}
    kinds = list(gpu_fp8.KINDS)
    for which in PROGRAMS:
        for kind in list(kinds):
            try:
                text = compile_hlo(*program(which, kind, size), sharding, options)
            except (ValueError, AttributeError) as e:  # a library without this recipe
                print(f"skipped {gpu_fp8.kind_name(kind)}: {e}", flush=True)
                kinds.remove(kind)
                continue
            hlo[(which, kind)] = ks = harness.kernels(text)
            check_bytes(ks, text)
            print(f"compiled {which} {gpu_fp8.kind_name(kind)}: {len(ks)} kernels", flush=True)
    fitted = None
    if a.fit_gemm_efficiency and not a.smoke:
        fitted = fit_gemm_efficiency(hlo[("train", None)], MEASURED[("train", None)], m)
        m = dataclasses.replace(m, gemm_efficiency=fitted)
    fitted_transpose = None
    if a.fit_transpose_efficiency and not a.smoke:
        fitted_transpose = fit_transpose_efficiency(
            hlo[("train", "tensorwise")], MEASURED[("train", "tensorwise")], m)
        m = dataclasses.replace(m, transpose_efficiency=fitted_transpose)

    env = harness.environment()
    env["target"] = target
    report = harness.Report("roofline", __doc__.splitlines()[0],
                            {**vars(a), **size, "machine": dataclasses.asdict(m),
                             "xla_options": options}, argv, env=env)
    out = [f"{target}; GEMMs: {'Triton (no autotuning)' if a.triton_gemm else 'cuBLAS(Lt)'}; "
           f"model: {json.dumps(dataclasses.asdict(m))}"]
    for which, title in PROGRAMS.items():
        table = report.table(which, title, baseline="bfloat16", columns=COLUMNS,
                             description=f"d_model {size['d_model']}, "
                                         f"{size['batch'] * size['seq']} tokens")
        for r in program_rows(which, hlo, m, not a.smoke):
            table.add_row(r["name"], r["figures"])
        out.append(f"\n**{title}**\n\n{harness.render_table(table.to_json())}")
    for kind in kinds:
        ks = hlo[("train", kind)]
        by_role = report.table(f"roles-{kind or 'bfloat16'}",
                               f"train step, {gpu_fp8.kind_name(kind)}: non-GEMM kernels by role",
                               baseline=None, columns=ROLE_COLUMNS)
        for r in roles(ks, m):
            by_role.add_row(r["name"], r["figures"])
        top = report.table(f"largest-{kind or 'bfloat16'}",
                           f"train step, {gpu_fp8.kind_name(kind)}: largest non-GEMM kernels",
                           baseline=None, columns=TOP_COLUMNS)
        for r in largest(ks, m, a.top):
            top.add_row(r["name"], r["figures"], r["note"])
        out += [f"\n**{by_role.title}**\n\n{harness.render_table(by_role.to_json())}",
                f"\n**{top.title}**\n\n{harness.render_table(top.to_json())}"]
    if fitted is not None:
        report.note(f"GEMM efficiency fitted on the bfloat16 train step: {fitted:.3f}")
    if fitted_transpose is not None:
        report.note(f"transpose efficiency fitted on the tensorwise train step: "
                    f"{fitted_transpose:.3f}")
    report.note(f"library: {inspect.getfile(jmp_policy)}. The H100 times are those of the library "
                f"at commit {MEASURED_LIBRARY}: the errors validate the model only when "
                "that library is the one compiled (python -m benchmarks.harness run --library)")
    errors = [r["figures"]["error_pct"] for t in report.tables[:2] for r in t.rows
              if r["figures"].get("error_pct") is not None]
    if errors:
        worst = max(abs(e) for e in errors)
        report.note(f"largest error against the H100's times: {worst:.1f}% "
                    f"({'within' if worst <= 100 * TOLERANCE else 'NOT within'} "
                    f"{TOLERANCE:.0%}; a validation only with library {MEASURED_LIBRARY})")
    print("\n".join(out + [""] + [f"- {n}" for n in report.notes]), flush=True)
    path = a.json or harness.default_json_path("roofline", a.smoke)
    report.write(path)
    print(f"\nwrote {path}")
    return 0


def check_bytes(ks: Sequence[Kernel], text: str) -> None:
    """The kernels' bytes are `harness.kernel_bytes` less cuBLAS's workspaces (and the
    scalar ops of reduction regions, which that sum counts as kernels)."""
    workspaces = harness.cuda_workspace_bytes(text)
    total, ours = harness.kernel_bytes(text), sum(k.bytes for k in ks)
    assert abs(total - workspaces - ours) <= 1e-3 * total + 4096, (total, workspaces, ours)


if __name__ == "__main__":
    sys.exit(main())

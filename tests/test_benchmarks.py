"""The benchmark harness: a tiny measurement, its JSON report, and the scripts' import rules."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from benchmarks import harness as _harness

BENCHMARKS = os.path.dirname(os.path.abspath(_harness.__file__))


@pytest.fixture(scope="module")
def harness():
    """``benchmarks.harness``, the module the scripts import."""
    return _harness


def _steps():
    def plain(p, g):
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), g

    def guarded(p, g):
        ok = jnp.isfinite(sum(jnp.sum(x) for x in jax.tree.leaves(g)))
        new = jax.tree.map(lambda a, b: a - 0.1 * b, p, g)
        return jax.lax.cond(ok, lambda: new, lambda: p), g

    return plain, guarded


def test_measure_report_and_json_schema(harness, tmp_path, monkeypatch):
    plain, guarded = _steps()
    p = {"w": jnp.ones((64, 32)), "b": jnp.ones(7)}
    cases = [harness.Case("plain", plain, (p, p), donate_argnums=(0,), carry=1),
             harness.Case("guarded", guarded, (p, p), donate_argnums=(0,), carry=1, note="cond"),
             harness.Case("broken", lambda p, g: undefined_name, (p, p))]  # noqa: F821
    rows, failed = harness.measure(cases, compile_rounds=2, rounds=2, iters=2,
                                   progress=lambda s: None)
    assert [r["name"] for r in rows] == ["plain", "guarded"]
    assert [f["name"] for f in failed] == ["broken"] and "NameError" in failed[0]["error"]

    # The command reproduces the run: with the XLA flags it ran under.
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    report = harness.Report("test_bench", "a tiny benchmark", settings={"n": 1}, argv=["--x"])
    report.table("main", "tiny steps", baseline="plain").add_rows(rows)
    report.failed(failed)
    report.note("a note")
    path = tmp_path / "out" / "test_bench.json"
    report.write(str(path))
    data = json.loads(path.read_text())

    assert data["schema"] == "jmp_policy-benchmark/1"
    assert {"benchmark", "description", "command", "environment", "settings", "tables", "failed",
            "notes"} <= set(data)
    assert data["command"].startswith("XLA_FLAGS=--xla_cpu_enable_fast_math=false python ")
    assert data["command"].endswith("--x")
    env = data["environment"]
    for key in ("date", "git_commit", "python", "packages", "backend", "device_kind",
                "device_count", "host_cpus", "xla_flags"):
        assert key in env
    assert env["packages"]["jax"] == jax.__version__ and env["backend"] == jax.default_backend()

    (table,) = data["tables"]
    assert table["baseline"] == "plain" and {c["key"] for c in table["columns"]} >= {
        "bytes_accessed", "wall_s", "compile_s"}
    by_name = {r["name"]: r for r in table["rows"]}
    for r in by_name.values():
        f = r["figures"]
        assert f["bytes_accessed"] > 0 and f["hlo_instructions"] > 0 and f["top_level_ops"] > 0
        assert f["wall_s"] > 0 and f["enqueue_s"] > 0 and f["compile_s"] > 0
        assert len(r["samples"]["compile_s"]) == 2 and len(r["samples"]["wall_s"]) == 2
    assert by_name["plain"]["ratios"]["bytes_accessed"] == 1.0
    guarded_row = by_name["guarded"]
    assert guarded_row["note"] == "cond" and guarded_row["figures"]["conditionals"] == 1
    assert guarded_row["ratios"]["wall_s"] == pytest.approx(
        guarded_row["figures"]["wall_s"] / by_name["plain"]["figures"]["wall_s"])
    # The non-donated g comes back as a fresh buffer: one parameter-sized copy.
    assert by_name["plain"]["figures"]["param_sized_copies"] == 1

    markdown = harness.render_markdown(data)
    assert "| plain (baseline) | 1.00x" in markdown and "broken" in markdown


def test_hlo_figures_of_a_known_module(harness):
    text = """HloModule m

%fused (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p0)
}

ENTRY %main (a: f32[4], t: (f32[4], s32[])) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %t = (f32[4]{0}, s32[]) parameter(1)
  %c = f32[4]{0} copy(%a)
  %f = f32[4]{0} fusion(%c), kind=kLoop, calls=%fused
  ROOT %g = f32[4]{0} add(%f, %a)
}
"""
    figures = harness.hlo_figures(text, {("float32", (4,))})
    assert figures == {"hlo_instructions": 7, "top_level_ops": 3, "fusions": 1,
                       "conditionals": 0, "while_loops": 0, "copies": 1, "param_sized_copies": 1,
                       "entry_param_sized_copies": 1}
    # copy 16 + 16, fusion 16 + 16, add 16 + 16 + 16 (the fusion body's negate: none)
    assert harness.kernel_bytes(text) == 112
    int4 = text.replace("%c = f32[4]{0} copy(%a)", "%c = s4[4]{0:E(4)} convert(%a)")
    assert harness.kernel_bytes(int4) == 112 - 16 + 2 - 16 + 2   # int4: half a byte


def test_a_report_names_the_script_as_a_module(harness, monkeypatch):
    monkeypatch.setattr(sys, "argv", [os.path.join(BENCHMARKS, "bench_policy.py"), "--quick"])
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert harness.command_line() == "python -m benchmarks.bench_policy --quick"


def test_a_child_process_imports_the_library_it_is_given(harness, tmp_path):
    """``run_child(..., library=...)``: that checkout's jmp_policy, this checkout's
    benchmarks (whatever the other checkout holds), whichever directory Python starts in."""
    other = tmp_path / "checkout"
    (other / "jmp_policy").mkdir(parents=True)
    (other / "jmp_policy" / "__init__.py").write_text("WHERE = 'other'\n")
    (other / "benchmarks").mkdir()
    (other / "benchmarks" / "__init__.py").write_text("")
    code = "import benchmarks, jmp_policy; print(jmp_policy.WHERE, benchmarks.__file__)"
    with harness.child_environment(str(other)) as (env, _):
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(other),
                             capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "other" and os.path.dirname(out[1]) == BENCHMARKS


def test_scripts_use_the_public_api_and_leave_sys_path_alone():
    for name in sorted(os.listdir(BENCHMARKS)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(BENCHMARKS, name)) as f:
            source = f.read()
        assert not re.search(r"sys\.path\s*(\.\s*(insert|append|extend)|\+?=|\[)", source), name
        assert not re.search(r"jmp_policy(\.\w+)*\._\w+|from\s+jmp_policy[\w.]*\s+import[^\n]*"
                             r"\b_[a-z]\w*", source), name


# --- benchmarks/roofline.py ------------------------------------------------------------------

_ROOFLINE_HLO = """HloModule m

%gemm_body (p0: f8e4m3fn[8,16], p1: f8e4m3fn[16,32]) -> f32[8,32] {
  %p0 = f8e4m3fn[8,16]{1,0} parameter(0)
  %p1 = f8e4m3fn[16,32]{1,0} parameter(1)
  ROOT %d = f32[8,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: bf16[8,16], b: bf16[16,32], c: f8e4m3fn[8,16], e: f8e4m3fn[16,32]) -> f32[8,32] {
  %a = bf16[8,16]{1,0} parameter(0)
  %b = bf16[16,32]{1,0} parameter(1)
  %c = f8e4m3fn[8,16]{1,0} parameter(2)
  %e = f8e4m3fn[16,32]{1,0} parameter(3)
  %g = (bf16[8,32]{1,0}, s8[1024]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %x = bf16[8,32]{1,0} get-tuple-element(%g), index=0
  %t = f32[8,32]{1,0} fusion(%c, %e), kind=kCustom, calls=%gemm_body
  %y = f32[8,32]{1,0} convert(%x)
  ROOT %s = f32[8,32]{1,0} add(%y, %t)
}
"""


def test_roofline_reads_gemms_and_bytes_of_a_known_module(harness):
    """Without the CUDA plugin: a cuBLAS call and a Triton GEMM fusion are GEMMs of
    2*M*N*K FLOPs, split by operand type; bytes are operands + result (no workspace)."""
    from benchmarks import roofline

    ks = {k.name: k for k in harness.kernels(_ROOFLINE_HLO)}
    assert list(ks) == ["g", "t", "y", "s"]
    assert (ks["g"].flops, ks["g"].gemm_dtype, ks["g"].bytes) == (2 * 8 * 32 * 16, "bf16", 1792)
    assert (ks["t"].flops, ks["t"].gemm_dtype, ks["t"].bytes) == (2 * 8 * 32 * 16, "f8", 1664)
    assert not ks["y"].is_gemm and ks["s"].bytes == 3 * 1024
    assert harness.gemm_counts(_ROOFLINE_HLO) == {"gemms": 2, "f8_gemms": 1}
    roofline.check_bytes(list(ks.values()), _ROOFLINE_HLO)  # = kernel_bytes less the workspace
    m = roofline.Machine(bf16_flops=1e12, bandwidth=1e9, launch_s=1e-6)
    f = roofline.predict(list(ks.values()), m)
    assert f["f8_gemm_flops"] == f["gemm_flops"] / 2 and f["kernels"] == 4
    # GEMMs this small are byte-bound: each costs its bytes at the bandwidth.
    assert f["gemm_s"] == pytest.approx((1792 + 1664) / 1e9)
    assert f["predicted_s"] == pytest.approx(f["gemm_s"] + f["other_s"] + 4e-6)


def _requires_cuda_plugin(test):
    from support import xla_gpu

    return pytest.mark.slow(pytest.mark.xla_gpu(xla_gpu.requires_plugin(test)))


@_requires_cuda_plugin
def test_roofline_smoke_run(tmp_path):
    """``roofline.py --smoke`` compiles gpu_fp8's MLP block for an H100 (no GPU) and
    reports six GEMMs per program, all float8 under a float8 recipe."""

    out = tmp_path / "roofline.json"
    root = os.path.dirname(BENCHMARKS)
    env = {**os.environ, "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.roofline", "--smoke",
                           "--json", str(out)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    tables = {t["id"]: t for t in data["tables"]}
    d, tokens = 64, 2 * 32  # gpu_fp8.SIZES["smoke"]
    for program in ("train", "grad"):
        rows = {r["name"]: r["figures"] for r in tables[program]["rows"]}
        assert list(rows) == ["bfloat16", "fp8 tensorwise", "fp8 rowwise", "fp8 delayed"]
        for name, f in rows.items():
            assert f["gemms"] == 6 and f["gemm_flops"] == 6 * 2 * tokens * d * 4 * d
            assert f["f8_share"] == (0.0 if name == "bfloat16" else 1.0)
            assert f["predicted_s"] > 0 and f["kernels"] > f["gemms"]
    assert "roles-tensorwise" in tables and "largest-rowwise" in tables and "roles-delayed" in tables

"""The benchmark harness: a tiny measurement, its JSON report, and the scripts' import rules."""

import importlib.util
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks")


@pytest.fixture(scope="module")
def harness():
    """``benchmarks/harness.py``, loaded by path (the scripts import it as ``harness``)."""
    spec = importlib.util.spec_from_file_location("harness", os.path.join(BENCHMARKS, "harness.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("harness", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


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


def test_scripts_use_the_public_api_and_leave_sys_path_alone():
    for name in sorted(os.listdir(BENCHMARKS)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(BENCHMARKS, name)) as f:
            source = f.read()
        assert not re.search(r"sys\.path\s*(\.\s*(insert|append|extend)|\+?=|\[)", source), name
        assert not re.search(r"jmp_policy(\.\w+)*\._\w+|from\s+jmp_policy[\w.]*\s+import[^\n]*"
                             r"\b_[a-z]\w*", source), name

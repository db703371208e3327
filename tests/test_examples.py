"""Smoke tests: every example runs as a script with a tiny --steps and writes its outputs."""

import warnings
import importlib.util
import json
import os
import runpy
import sys

import numpy as np
import pytest

import jmp_policy

pytestmark = pytest.mark.slow  # system tests: the examples as scripts

pytest.importorskip("flax")


@pytest.fixture(autouse=True)
def _examples_extras():
    """The examples' extras, imported when a test runs, not while collecting (-m "not slow"
    collects this module too, and scikit-learn alone takes 0.5 s to import)."""
    for name in ("sklearn", "matplotlib", "tqdm"):
        pytest.importorskip(name)


EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples")
POLICIES = ["float32", "mixed_bfloat16", "mixed_float16"]


def _run_script(name, argv, monkeypatch):
    monkeypatch.setattr(sys, "argv", [name] + argv)
    runpy.run_path(os.path.join(EXAMPLES, name), run_name="__main__")


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_example_{name}", os.path.join(EXAMPLES, name))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # flax modules are dataclasses: they look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script,plot,metric,extra", [
    ("train_digits.py", "digits.png", "test_accuracy", []),
    ("transformer_lm.py", "lm.png", "test_bits_per_byte",
     ["--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "4"]),
    ("nnx_mlp.py", "nnx_mlp.png", "test_accuracy", []),
    # One encoder block: the loop over blocks runs as with two, at half the compile time.
    pytest.param("equinox_vit.py", "equinox_vit.png", "test_accuracy", ["--depth", "1"],
                 marks=pytest.mark.skipif(importlib.util.find_spec("equinox") is None,
                                          reason="needs equinox")),
])
def test_example_runs_and_writes_table_json_and_plot(script, plot, metric, extra, tmp_path,
                                                     monkeypatch, capsys):
    steps = 3
    _run_script(script, ["--steps", str(steps), "--out", str(tmp_path)] + extra, monkeypatch)
    out = capsys.readouterr().out
    for policy in POLICIES:
        assert f"| {policy} " in out  # one table row per policy
    with open(tmp_path / "results.json") as f:
        results = json.load(f)["results"]
    assert [r["policy"] for r in results] == POLICIES
    for r in results:
        assert len(r["losses"]) == steps and all(np.isfinite(r["losses"]))
        assert np.isfinite(r[metric]) and r["params_finite"]
        assert r["skipped_steps"] == 0
    assert [r["final_loss_scale"] for r in results] == [1.0, 1.0, 2.0**15]
    png = (tmp_path / plot).read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_train_digits_is_reproducible():
    td = _load("train_digits.py")
    data = td.load_data()
    a = td.train("mixed_bfloat16", steps=5, data=data)
    b = td.train("mixed_bfloat16", steps=5, data=data)
    assert a["losses"] == b["losses"] and a["test_accuracy"] == b["test_accuracy"]


def test_transformer_lm_keeps_layernorm_softmax_and_logits_in_float32():
    import jax
    import jax.numpy as jnp

    lm = _load("transformer_lm.py")
    config = lm.Config(d_model=16, heads=2, layers=1, seq_len=8)
    model = lm.TransformerLM(config)
    tokens = jnp.zeros((1, config.seq_len), jnp.int32)
    policies = lm.module_policies("mixed_bfloat16")
    variables = jax.jit(policies(model.init))(jax.random.key(0), tokens)
    _, state = jax.jit(policies(lambda v, t: model.apply(v, t, capture_intermediates=True)))(
        variables, tokens)
    assert {p.dtype for p in jax.tree.leaves(variables)} == {jnp.dtype("float32")}
    outputs = {"/".join(path): leaf.dtype for path, leaf in _flat(state["intermediates"])}
    assert outputs["logits"] == jnp.float32
    assert outputs["LayerNorm_0"] == jnp.float32
    assert outputs["Block_0/LayerNorm_0"] == jnp.float32
    assert outputs["Block_0/Dense_0"] == jnp.bfloat16
    assert outputs["Block_0/CausalSelfAttention_0/qkv"] == jnp.bfloat16
    # The softmax is computed in float32 and handed back in the compute dtype.
    assert outputs["Block_0/CausalSelfAttention_0/Softmax_0"] == jnp.bfloat16
    softmax = lm.Softmax()
    scores = jax.random.normal(jax.random.key(1), (4, 8)).astype(jnp.bfloat16) * 8
    with warnings.catch_warnings():
        # The LayerNorm and logits rules have nothing to match in a lone softmax.
        warnings.simplefilter("ignore", jmp_policy.UnmatchedRuleWarning)
        with lm.module_policies("mixed_bfloat16"):
            got = softmax.apply({}, scores)
    expected = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(jnp.bfloat16)
    np.testing.assert_array_equal(got, expected)


def _flat(tree, prefix=()):
    for key, value in tree.items():
        if key == "__call__":
            yield prefix, value[0]
        elif isinstance(value, dict):
            yield from _flat(value, prefix + (key,))


def test_scale_lm_quick_trains_fsdp_on_8_devices_and_writes_table_json_and_plot(tmp_path):
    # Not run in this process like the examples above: the FSDP example needs 8 devices,
    # and this process's JAX already has its device count. A subprocess gets 8 host
    # devices and the suite's XLA flags (conftest.py).
    import re
    import subprocess

    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                   os.environ.get("XLA_FLAGS", ""))
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=8")
    table = tmp_path / "table.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "scale_lm.py"), "--quick",
         "--out", str(tmp_path), "--json", str(table)],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for run in ("float32", "bf16+fp8"):
        assert f"| {run} " in proc.stdout  # one table row per run
    with open(table) as f:
        report = json.load(f)
    assert report["devices"] == 8
    results = report["results"]
    assert [r["run"] for r in results] == ["float32", "bf16+fp8"]
    for r in results:
        assert len(r["losses"]) == 10 and all(np.isfinite(r["losses"]))
        assert r["losses"][-1] < r["losses"][0]
        assert np.isfinite(r["test_bits_per_byte"]) and r["params_finite"]
        assert r["skipped_steps"] == 0
        assert r["argument_bytes_per_device"] > 0 and r["temp_bytes_per_device"] > 0
    f32, low = results
    assert (f32["param_dtype"], low["param_dtype"]) == ("float32", "bfloat16")
    assert low["final_loss_scale"] == 2.0**15  # dynamic, 10 finite steps: not grown yet
    # bfloat16 weights and 8-bit moments: a third of float32 weights + float32 Adam.
    assert report["ratios"]["argument_bytes_per_device"] < 0.5
    assert set(report["ratios"]) >= {"test_bits_per_byte", "argument_bytes_per_device",
                                     "temp_bytes_per_device", "step_time_s"}
    png = (tmp_path / "scale_lm.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000

"""Smoke test: examples/equinox_vit.py runs as a script with a tiny --steps and writes its outputs."""

import json
import os
import runpy
import sys

import numpy as np
import pytest

pytest.importorskip("equinox")
pytest.importorskip("flax")  # the plot is train_digits.py's, a Flax example
pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples")
POLICIES = ["float32", "mixed_bfloat16", "mixed_float16"]


def test_example_runs_and_writes_table_json_and_plot(tmp_path, monkeypatch, capsys):
    steps = 3
    monkeypatch.setattr(sys, "argv", ["equinox_vit.py", "--steps", str(steps),
                                      "--out", str(tmp_path)])
    runpy.run_path(os.path.join(EXAMPLES, "equinox_vit.py"), run_name="__main__")
    out = capsys.readouterr().out
    for policy in POLICIES:
        assert f"| {policy} " in out  # one table row per policy
    with open(tmp_path / "results.json") as f:
        results = json.load(f)["results"]
    assert [r["policy"] for r in results] == POLICIES
    for r in results:
        assert len(r["losses"]) == steps and all(np.isfinite(r["losses"]))
        assert np.isfinite(r["test_accuracy"]) and r["params_finite"]
        assert r["skipped_steps"] == 0
        assert r["param_dtypes"] == ["float32"]  # float32 master weights under every policy
    assert [r["final_loss_scale"] for r in results] == [1.0, 1.0, 2.0**15]
    png = (tmp_path / "equinox_vit.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000

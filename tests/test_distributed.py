"""loss_scaling on many devices and many processes.

A non-finite gradient anywhere -- one shard, one device of a `shard_map`, one
process of a multi-process job -- must make *every* shard skip the update, and
every copy of the loss scale must stay identical. Each scenario needs a device
count fixed before JAX starts, so it runs in a fresh interpreter
(tests/support/distributed_worker.py) that reports what it observed; the checks are here.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # system tests: child interpreters, devices and processes

TESTS = pathlib.Path(__file__).resolve().parent
WORKER = TESTS / "support" / "distributed_worker.py"
TIMEOUT_S = 120
INITIAL_SCALE = 2.0**10  # as in the worker


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS.parent)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("XLA_FLAGS", None)  # the worker sets its own device count
    return env


def _run_worker(scenario, tmp_path):
    out = tmp_path / f"{scenario}.json"
    proc = subprocess.run(
        [sys.executable, str(WORKER), scenario, str(out)],
        env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{scenario} worker failed:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("scenario", ["mesh", "mesh_auto"], ids=["explicit", "automatic"])
def test_sharded_jit_skips_on_every_shard_and_keeps_shardings(scenario, tmp_path):
    facts = _run_worker(scenario, tmp_path)
    first, nan_step, after = facts["steps"]

    # The NaN sat on one device only...
    assert len(facts["nan_owner_devices"]) == 1
    # ...yet the whole update was skipped: no shard of params or Adam state moved.
    assert nan_step["grads_finite"] is False
    assert nan_step["params_unchanged"] and nan_step["inner_state_unchanged"]
    assert nan_step["all_params_finite"]
    assert nan_step["loss_scale"] == first["loss_scale"] / 2
    assert nan_step["skipped_steps"] == 1
    # Finite steps do update (so "unchanged" above is not vacuous), and training goes on.
    assert first["grads_finite"] and not first["params_unchanged"]
    assert after["grads_finite"] and not after["params_unchanged"]
    assert after["all_params_finite"] and after["skipped_steps"] == 1

    # Shardings: Adam's moments follow the params, and a step gives back what it got.
    assert facts["mu_sharding_matches_params"]
    assert facts["compiled_output_shardings_kept"]
    for step in facts["steps"]:
        assert step["param_shardings_kept"] and step["state_shardings_kept"]

    # No data moves between devices: the only communication is the finiteness
    # vote (scalar all-reduces), never a gather or reshuffle of params, grads
    # or moments (adding up "attn/q" and "attn/out", which share a shape but
    # not a sharding, would be one).
    assert facts["collectives"], "expected the finiteness check to be agreed by an all-reduce"
    assert all(op == "all-reduce" and n == 1 for op, n in facts["collectives"]), facts["collectives"]
    # The HLO parser does find a gather when there is one.
    assert ("all-gather", 3072) in [tuple(c) for c in facts["control_collectives"]]


def test_axis_name_under_shard_map_makes_every_device_skip(tmp_path):
    facts = _run_worker("shard_map", tmp_path)
    n = facts["num_devices"]
    agreed = facts["d"]
    assert agreed["finite_per_device"] == [False] * n
    assert agreed["device_updated_params"] == [False] * n
    assert agreed["device_updated_moments"] == [False] * n  # Adam's moments start at 0
    assert agreed["skipped_per_device"] == [1] * n
    assert agreed["scales_per_device"] == [INITIAL_SCALE / 2] * n
    assert agreed["all_params_finite"]

    # Without axis_name each device only sees its own slice, so only device 5
    # skips and the scales drift apart: the agreement above is axis_name's doing.
    alone = facts["None"]
    assert alone["device_updated_params"] == [i != 5 for i in range(n)]
    assert alone["device_updated_moments"] == [i != 5 for i in range(n)]
    assert alone["scales_per_device"] == [INITIAL_SCALE / 2 if i == 5 else INITIAL_SCALE
                                          for i in range(n)]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_skip_together_and_stay_identical(tmp_path):
    port = _free_port()
    outs = [tmp_path / f"process{i}.json" for i in range(2)]
    procs = [subprocess.Popen(
        [sys.executable, str(WORKER), "multiprocess", str(outs[i]), str(i), str(port)],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    try:
        logs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:  # a hung peer (e.g. waiting on the other's collective) must not outlive us
            if p.poll() is None:
                p.kill()
                p.communicate()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} failed:\n{logs[i][1][-4000:]}"
    facts = [json.loads(o.read_text()) for o in outs]

    for f in facts:
        assert (f["process_count"], f["device_count"]) == (2, 8)
    p0, p1 = (f["steps"] for f in facts)
    # The NaN was injected into process 1's data only.
    assert p0[1]["local_grads_finite"] and not p1[1]["local_grads_finite"]
    for steps in (p0, p1):
        first, nan_step, after = steps
        assert nan_step["grads_finite"] is False and nan_step["skipped_steps"] == 1
        assert nan_step["params"] == first["params"] and nan_step["mu"] == first["mu"]
        assert nan_step["loss_scale"] == INITIAL_SCALE / 2 and nan_step["counter"] == 0
        assert after["grads_finite"] and after["params"] != nan_step["params"]
    # Both processes hold the same params, moments and loss scale after every step.
    for a, b in zip(p0, p1):
        assert {k: v for k, v in a.items() if k != "local_grads_finite"} == \
               {k: v for k, v in b.items() if k != "local_grads_finite"}

"""Helpers for the tests that run on 8 simulated CPU devices (not a test module itself).

The device count must be fixed before JAX starts, so those tests run their cases in a
child interpreter (`shared_run`) that reports plain facts as JSON, among them the
collectives XLA put in the optimized HLO (`collective_ops`).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
from typing import Any, Sequence

import jax

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
SUPPORT = pathlib.Path(__file__).resolve().parent  # the worker scripts
TESTS = SUPPORT.parent


def collective_ops(text: str) -> list[dict[str, Any]]:
    """Every collective of optimized HLO ``text``: its ``kind``, the ``reducer`` of an
    all-reduce or reduce-scatter (``"maximum"``, ``"add"``...; ``None`` for the others)
    and the ``types`` of its results (``"u8[32,8]"``; several where XLA combined
    collectives into one)."""
    bodies = dict(re.findall(r"\n(%\S+) [^\n]*\{\n(.*?)\n\}", text, re.S))
    found = []
    for line in text.splitlines():
        m = re.search(r"= (.+?) (" + "|".join(KINDS) + r")(-start)?\(", line)
        if not m:
            continue
        apply = re.search(r"to_apply=(%[^,\s]+)", line)
        reducer = None
        if apply:
            ops = re.findall(r"= \S+ ([a-z-]+)\(", bodies.get(apply.group(1), ""))
            reducer = next((op for op in ops if op not in ("parameter", "copy")), None)
        types = [t.split("{")[0] for t in re.findall(r"[a-z]+[0-9]*\[[0-9,]*\]", m.group(1))]
        found.append({"kind": m.group(2), "reducer": reducer, "types": types})
    return found


def shared_run(tmp_path_factory: Any, name: str, argv: Sequence[Any],
               devices: int = 8, timeout: float = 600) -> Any:
    """The JSON that ``python argv... OUT`` writes to ``OUT``, run on ``devices``
    simulated CPU devices once per test session.

    The run is a test file's time, and each pytest-xdist worker that runs one of the
    file's tests sets its fixtures up: the workers share one run. The first to take the
    lock runs it in the session's directory (the workers' common parent, new each
    session), the others read its facts. The child imports the suite's helpers (`support`) and
    uses the suite's persistent compilation cache (tests/conftest.py)."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    out = shared / name / "facts.json"
    out.parent.mkdir(exist_ok=True)
    with open(out.with_name("lock"), "w") as lock:
        if fcntl is not None:  # POSIX; elsewhere each worker runs its own
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            _run(argv, out, devices, timeout)
    return json.loads(out.read_text())


def _run(argv: Sequence[Any], out: pathlib.Path, devices: int, timeout: float) -> None:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (f"{env.get('XLA_FLAGS', '')} "
                        f"--xla_force_host_platform_device_count={devices}")
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS)] + [
        p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cache = jax.config.jax_compilation_cache_dir  # set by tests/conftest.py
    if cache:
        env.setdefault("JAX_COMPILATION_CACHE_DIR", cache)
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    partial = out.with_name(out.name + ".partial")
    proc = subprocess.run([sys.executable, *map(str, argv), str(partial)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    partial.replace(out)  # whole or absent: a worker never reads half a file

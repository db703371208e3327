"""The package, the README's Python snippets and typical user code type-check.

Users run mypy and pyright on code that calls jmp_policy: a false error in
the README's examples is a false error in theirs. The checkers run from a
directory outside the repository, as a user's would, so they must find the
package through its installation (the README's ``pip install -e``).
"""

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # system tests: mypy and pyright on the package

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SNIPPETS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)

# The README's snippets are written as users write scripts, without annotations:
# mypy checks them with its defaults (this comment, appended to each, relaxes
# --strict for that file only; at the end, so that line numbers stay).
DEFAULTS = ("\n# mypy: allow-untyped-defs, allow-incomplete-defs, no-check-untyped-defs, "
            "allow-untyped-calls, allow-any-generics, no-warn-return-any, allow-untyped-decorators, "
            "allow-subclassing-any, no-warn-unused-ignores, no-strict-equality, no-extra-checks\n")

# Annotated user code, checked under --strict. A ``# type: ignore`` marks a line
# the checkers must reject: an ignore that is not needed is an error.
USER_CODE = '''
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jmp_policy
import jmp_policy.flax

policy = jmp_policy.Policy("mixed_float16")
name: str = policy.compute_dtype.name
param_dtype: np.dtype[Any] = policy.param_dtype
zeros = jnp.zeros(3, policy.output_dtype)
keras_style: jmp_policy.Policy = jmp_policy.Policy(name="mixed_bfloat16")
from_dtypes = jmp_policy.Policy(jnp.float32, np.float16, "float32", loss_scale=2.0**10)
policy.compute_dtype = np.dtype("float32")  # type: ignore[misc]


def double(x: jax.Array, scale: float = 2.0) -> jax.Array:
    return x * scale


y: jax.Array = policy.wrap(double)(jnp.ones(2), scale=3.0)
z: jax.Array = jmp_policy.wrap(double, "bfloat16")(jnp.ones(2))
policy.wrap(double)("not an array")  # type: ignore[arg-type]

tree: dict[str, jax.Array] = policy.cast_to_compute({"w": jnp.ones(2)})
policies = jmp_policy.PolicyMap({"LayerNorm": "float32", "bias$": jmp_policy.Policy("float16")},
                                default="mixed_bfloat16")


def apply(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return x * params["w"]


out: jax.Array = policies.wrap(apply)({"w": jnp.ones(2)}, jnp.ones(2))

linen_policies = jmp_policy.flax.module_policy({nn.LayerNorm: "float32", "logits": "float32"},
                                               default="mixed_bfloat16")
rules = {nn.LayerNorm: "float32", "logits": "float32"}
jmp_policy.flax.module_policy(rules)


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(4, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)


model = jmp_policy.flax.set_nnx_policy(MLP(nnx.Rngs(0)), policy, rules={nnx.LayerNorm: "float32"})
hidden: nnx.Linear = model.hidden
'''


def _write_sources(directory: pathlib.Path) -> None:
    """The README's snippets as modules ``readme.snippet_<n>``, and the user code."""
    (directory / "readme").mkdir()
    (directory / "readme" / "__init__.py").write_text("")
    for n, snippet in enumerate(SNIPPETS):
        (directory / "readme" / f"snippet_{n}.py").write_text(snippet + DEFAULTS)
    (directory / "user_code.py").write_text(USER_CODE)


def _run(args: list[str], cwd: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYRIGHT_PYTHON_IGNORE_WARNINGS": "1"})


@pytest.fixture
def installed_checkout():
    """Skips unless ``import jmp_policy`` resolves to this checkout from another directory."""
    spec = importlib.util.find_spec("jmp_policy")
    origin = pathlib.Path(spec.origin).resolve() if spec and spec.origin else None
    if origin is None or ROOT not in origin.parents:
        pytest.skip(f"jmp_policy is not installed from this checkout ({origin}); "
                    'run: pip install -e ".[test]"')


def test_package_readme_and_user_code_pass_mypy(tmp_path, installed_checkout):
    # One run for all, as mypy analyses jax and flax once per run: the package
    # as found through its installation (-p), the README and the user code.
    # The cache is kept between runs, but not across different options.
    _write_sources(tmp_path)
    result = _run([sys.executable, "-m", "mypy", "--strict",
                   "--config-file", str(ROOT / "pyproject.toml"),
                   "--cache-dir", str(ROOT / ".mypy_cache" / "test_typing"),
                   "-p", "jmp_policy", "-p", "readme", "-m", "user_code"], cwd=tmp_path)
    assert "Can't find package 'jmp_policy'" not in result.stderr, (
        "mypy cannot see the installed package: reinstall with pip install -e .\n" + result.stderr)
    assert result.returncode == 0, result.stdout + result.stderr


def test_readme_and_user_code_pass_pyright(tmp_path, installed_checkout):
    _write_sources(tmp_path)
    (tmp_path / "pyrightconfig.json").write_text(json.dumps({
        "include": ["readme", "user_code.py"],
        "pythonVersion": "3.11",
        "reportUnnecessaryTypeIgnoreComment": "error",
    }))
    version = _run([sys.executable, "-m", "pyright", "--version"], cwd=tmp_path)
    if version.returncode != 0:  # e.g. no Node.js and no registry to fetch pyright from
        pytest.skip(f"pyright cannot run here: {(version.stdout + version.stderr).strip()[-500:]}")
    result = _run([sys.executable, "-m", "pyright", "--pythonpath", sys.executable], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr

"""The size of an optimizer step's program per parameter, against plain Adam's.

XLA's compile time grows with the HLO instructions of every kernel (its fusion and
layout passes visit each one, some more than once): a step that rounds each array
stochastically with a large kernel compiles many times slower than Adam for the same
parameters. The figure here is the instructions one more parameter adds to the
optimized step, a count (not a time, which a shared machine disturbs), on XLA:CPU with
the suite's flags; `tests/test_xla_gpu.py` checks the same for an H100, and the
times of whole train steps against their budgets, and `benchmarks/bench_compile_time.py`
measures them.

The budgets are the counts measured when they were set, with a margin.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax
import pytest

import jmp_policy
from support.compiled_kernels import instructions_per_leaf

ADAM = lambda: optax.adam(1e-3)  # noqa: E731

# name: (the optimizer, the parameters' dtype, at most this many times Adam's count).
RECIPES = {
    "bf16 moments": (lambda: jmp_policy.cast_state(ADAM()), jnp.float32, 4.5),
    "8-bit moments": (lambda: jmp_policy.quantize_state(ADAM(), bits=8, min_size=0),
                      jnp.float32, 11.5),
    "4-bit moments": (lambda: jmp_policy.quantize_state(ADAM(), bits=4, min_size=0),
                      jnp.float32, 12.5),
    "stochastic": (lambda: jmp_policy.low_precision_params(ADAM(), "stochastic"),
                   jnp.bfloat16, 3.4),
    "kahan": (lambda: jmp_policy.low_precision_params(ADAM(), "kahan"), jnp.bfloat16, 3.0),
    "split": (lambda: jmp_policy.low_precision_params(ADAM(), "split"), jnp.bfloat16, 3.0),
}


@pytest.fixture(scope="module")
def adam() -> int:
    return instructions_per_leaf(ADAM, jnp.float32)


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_parameter_adds_at_most_a_few_times_the_instructions_of_adam(name, adam, xla_cpu):
    make, dtype, budget = RECIPES[name]
    count = instructions_per_leaf(make, dtype)
    assert count <= budget * adam, (count, adam, count / adam)

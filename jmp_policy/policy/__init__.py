"""Dtype policies: which dtype parameters, computation and outputs take.

A `Policy` is an immutable pytree of three dtypes and a loss-scale setting,
named the Keras way (``"mixed_float16"``) or the jmp way
(``"params=float32,compute=bfloat16,output=float32"``). The global policy, and
thread-local `policy_scope`\\ s, give code a default; `PolicyMap` gives each
parameter its own.

>>> import jax.numpy as jnp, jmp_policy
>>> policy = jmp_policy.Policy("mixed_bfloat16")
>>> policy.cast_to_compute(jnp.ones(2)).dtype
dtype(bfloat16)
"""

from jmp_policy.policy._map import PolicyMap
from jmp_policy.policy._rules import (
    Rule,
    UnmatchedRuleWarning,
    compile_path_regex,
    parse_rules,
    warn_unmatched,
)
from jmp_policy.policy._policy import (
    LossScaleLike,
    Policy,
    PolicyLike,
    as_loss_scale,
    as_policy,
    cast_to_full,
    cast_to_half,
    check_callable,
    dtype_policy,
    get_policy,
    global_policy,
    policy_scope,
    set_dtype_policy,
    set_global_policy,
    set_policy,
    wrap,
)

__all__ = [
    "LossScaleLike",
    "Policy",
    "PolicyLike",
    "PolicyMap",
    "Rule",
    "UnmatchedRuleWarning",
    "as_loss_scale",
    "as_policy",
    "cast_to_full",
    "cast_to_half",
    "check_callable",
    "compile_path_regex",
    "dtype_policy",
    "get_policy",
    "global_policy",
    "parse_rules",
    "policy_scope",
    "set_dtype_policy",
    "set_global_policy",
    "set_policy",
    "warn_unmatched",
    "wrap",
]

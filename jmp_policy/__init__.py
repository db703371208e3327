"""jmp_policy: mixed precision for JAX.

Dtype policies (Keras / jmp names), loss scaling and low-precision optimizer
states as optax transformations, per-operation autocast with float8 and
block-scaled products and float8 residuals, a numerics inspector, and Flax
integration (``jmp_policy.flax``, optional). One package per feature
(``policy``, ``optim``, ``float8``, ``residuals``, ``autocast``,
``inspector``, ``flax``) on a core of
number formats (``formats``), dtypes, paths, shardings and jaxprs; every
public name is here.

>>> import jmp_policy
>>> policy = jmp_policy.Policy("mixed_bfloat16")
>>> policy.compute_dtype
dtype(bfloat16)
"""

from jmp_policy.autocast import AutocastWarning, autocast, dot_general, float8_state
from jmp_policy.dtypes import half_dtype
from jmp_policy.float8 import AmaxHistory, Float8Recipe, Float8State
from jmp_policy.residuals import Float8Residuals
from jmp_policy.inspector import NumericsReport, ResidualReport, inspect_numerics, saved_residuals
from jmp_policy.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    select_tree,
)
from jmp_policy.optim import (
    CastState,
    KahanState,
    LossScalingState,
    QuantizedArray,
    QuantizedState,
    SplitState,
    StochasticRoundingState,
    cast_state,
    dequantize,
    get_loss_scale,
    loss_scaling,
    low_precision_params,
    master_params,
    quantize_state,
    scaled_value_and_grad,
)
from jmp_policy.policy import UnmatchedRuleWarning
from jmp_policy.policy import (
    Policy,
    PolicyMap,
    cast_to_full,
    cast_to_half,
    dtype_policy,
    get_policy,
    global_policy,
    policy_scope,
    set_dtype_policy,
    set_global_policy,
    set_policy,
    wrap,
)

__version__ = "0.1.0"

__all__ = [
    "AmaxHistory",
    "AutocastWarning",
    "CastState",
    "DynamicLossScale",
    "Float8Recipe",
    "Float8Residuals",
    "Float8State",
    "KahanState",
    "LossScale",
    "LossScalingState",
    "NoOpLossScale",
    "NumericsReport",
    "Policy",
    "PolicyMap",
    "QuantizedArray",
    "QuantizedState",
    "ResidualReport",
    "SplitState",
    "StaticLossScale",
    "StochasticRoundingState",
    "UnmatchedRuleWarning",
    "all_finite",
    "autocast",
    "cast_to_full",
    "cast_state",
    "cast_to_half",
    "dequantize",
    "dot_general",
    "dtype_policy",
    "float8_state",
    "get_loss_scale",
    "get_policy",
    "global_policy",
    "half_dtype",
    "inspect_numerics",
    "loss_scaling",
    "low_precision_params",
    "master_params",
    "policy_scope",
    "quantize_state",
    "saved_residuals",
    "scaled_value_and_grad",
    "select_tree",
    "set_dtype_policy",
    "set_global_policy",
    "set_policy",
    "wrap",
]

"""The optimizer side of mixed precision, as optax transformations.

* `loss_scaling`: unscale the gradients of a scaled loss, skip non-finite
  steps, adjust the scale (`scaled_value_and_grad` makes those gradients);
* `low_precision_params`: bfloat16 (or float16) weights that train like
  float32 (Kahan summation, stochastic rounding or split float32 words);
* `cast_state` and `quantize_state`: the inner optimizer's state stored in
  bfloat16, or block-quantized to 8 or 4 bits.

>>> import optax, jmp_policy
>>> tx = jmp_policy.loss_scaling(jmp_policy.quantize_state(optax.adam(1e-3)), "dynamic")
"""

from jmp_policy.optim._loss_scaling import (
    LossScalingState,
    get_loss_scale,
    loss_scaling,
    loss_scaling_state,
    scaled_loss_fn,
    scaled_value_and_grad,
)
from jmp_policy.optim._low_precision import (
    CastState,
    KahanState,
    SplitState,
    StochasticRoundingState,
    cast_state,
    low_precision_params,
    master_params,
)
from jmp_policy.optim._quantized_state import (
    QuantizedArray,
    QuantizedState,
    dequantize,
    quantize_state,
)

__all__ = [
    "CastState",
    "KahanState",
    "LossScalingState",
    "QuantizedArray",
    "QuantizedState",
    "SplitState",
    "StochasticRoundingState",
    "cast_state",
    "dequantize",
    "get_loss_scale",
    "loss_scaling",
    "loss_scaling_state",
    "low_precision_params",
    "master_params",
    "quantize_state",
    "scaled_loss_fn",
    "scaled_value_and_grad",
]

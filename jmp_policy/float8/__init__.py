"""Float8 and block-scaled float8/float4 matrix products.

A `Float8Recipe` says which products run in which format and how operands
are scaled: per tensor or per row from their current maximum
(``"tensorwise"``, ``"rowwise"``), from an amax history (``"delayed"``, whose
state is a `Float8State` of `AmaxHistory` values), or per block of 32 or 16
values (``"mxfp8"``, ``"nvfp4"``). `quantized_product` is the one product, with
its derivative, that every scheme runs through; autocast's ``fp8=`` argument
applies it to a function's products.

>>> import jax.numpy as jnp, jmp_policy
>>> f = jmp_policy.autocast(lambda x, w: x @ w, "mixed_bfloat16", fp8="tensorwise")
>>> f(jnp.ones((16, 32)), jnp.ones((32, 16))).dtype
dtype(bfloat16)
"""

from jmp_policy.float8._block_product import Blocks
from jmp_policy.float8._blocks import BLOCK_SCALES, TENSOR_SCALES
from jmp_policy.float8._delayed import (
    AmaxHistory,
    Float8State,
    Refused,
    Slots,
    empty_history,
    make_state,
    stacked,
)
from jmp_policy.float8._product import ForwardModeError, quantized_product
from jmp_policy.float8._quantize import QuantizationCounts, quantization_counts
from jmp_policy.float8._recipe import (
    RAGGED,
    SCALINGS,
    Float8Like,
    Float8Recipe,
    as_recipe,
    eligible,
    is_backward,
    native_block_products,
    operand_dtypes,
    why_not_float8,
)
from jmp_policy.float8._scaled import Float8

__all__ = [
    "BLOCK_SCALES",
    "Blocks",
    "AmaxHistory",
    "Float8",
    "Float8Like",
    "Float8Recipe",
    "Float8State",
    "ForwardModeError",
    "QuantizationCounts",
    "RAGGED",
    "Refused",
    "SCALINGS",
    "Slots",
    "TENSOR_SCALES",
    "as_recipe",
    "eligible",
    "empty_history",
    "is_backward",
    "make_state",
    "native_block_products",
    "operand_dtypes",
    "quantization_counts",
    "quantized_product",
    "stacked",
    "why_not_float8",
]

"""Float8 and block-scaled float8/float4 matrix products.

A `Float8Recipe` says which products run in which format and how operands
are scaled: per tensor or per row from their current maximum
(``"tensorwise"``, ``"rowwise"``), from an amax history (``"delayed"``, whose
state is a `Float8State` of `AmaxHistory` values), or per block of 32 or 16
values (``"mxfp8"``, ``"nvfp4"``). `quantized_product` is the one product, with
its derivative, that every scaling runs through; autocast's ``fp8=`` argument
applies it to a function's products. The modules, in reading order:

* ``_recipe``: the recipe (`Float8Recipe`, `as_recipe` for autocast's ``fp8=``),
  which products it runs in float8 (`eligible`, `why_not_float8`) and in which
  formats (`operand_dtypes`, `native_block_products`);
* ``_layers``: stacks of numbered layers among a function's scopes, and the layers
  ``Float8Recipe.high_precision_layers`` keeps in the compute dtype (`KeptLayers`,
  `find_stacks`); a jaxpr's products and where they are (`products`);
* ``_quantize``: the current- and delayed-scaling quantizers, a scale per tensor,
  row or group of a ragged product;
* ``_blocks``: the block formats, MXFP8 and NVFP4 (blocks of 16 or 32 values, and
  NVFP4's 16 x 16 weight tiles), and the scopes their scales are made under
  (`BLOCK_SCALES`, `TENSOR_SCALES`, for the numerics inspector);
* ``_hadamard``: NVFP4's random Hadamard transform of weight-gradient operands;
* ``_axes`` and ``_layout``: where each axis of a product goes, and a product's
  three contractions (forward, and the two of its backward pass), dense or ragged;
* ``_scaled`` and ``_block_product``: the schemes, how operands are quantized for a
  contraction and multiplied: per tensor or row, or per block;
* ``_product``: `quantized_product`, forward and backward (`ForwardModeError` for
  the derivatives it does not have);
* ``_delayed``: delayed scaling's amax histories (`Float8State`, `AmaxHistory`,
  `empty_history`), and how autocast's interpreter hands them to products in trace
  order, loops included (`Slots`, `Refused`, `stacked`, `make_state`).

>>> import jax.numpy as jnp, jmp_policy
>>> f = jmp_policy.autocast(lambda x, w: x @ w, "mixed_bfloat16", fp8="tensorwise")
>>> f(jnp.ones((16, 32)), jnp.ones((32, 16))).dtype
dtype(bfloat16)
"""

from jmp_policy.float8._blocks import BLOCK_SCALES, E4M3, E8M0, TENSOR_SCALES, pad_last, to_format
from jmp_policy.float8._delayed import (
    AmaxHistory,
    Float8State,
    Refused,
    Slots,
    empty_history,
    make_state,
    stacked,
)
from jmp_policy.float8._layers import (
    NO_LAYERS,
    KeptLayers,
    Product,
    Stack,
    find_stacks,
    products,
)
from jmp_policy.float8._product import ForwardModeError, quantized_product
from jmp_policy.float8._recipe import (
    SCALINGS,
    Float8Like,
    Float8Recipe,
    as_recipe,
    eligible,
    native_block_products,
    operand_dtypes,
    why_not_float8,
)
from jmp_policy.float8._scaled import FORWARD_SCALE, saving_scales

__all__ = [
    "BLOCK_SCALES",
    "E4M3",
    "E8M0",
    "FORWARD_SCALE",
    "NO_LAYERS",
    "SCALINGS",
    "TENSOR_SCALES",
    "AmaxHistory",
    "Float8Like",
    "Float8Recipe",
    "Float8State",
    "ForwardModeError",
    "KeptLayers",
    "Product",
    "Refused",
    "Slots",
    "Stack",
    "as_recipe",
    "eligible",
    "empty_history",
    "find_stacks",
    "make_state",
    "native_block_products",
    "operand_dtypes",
    "pad_last",
    "products",
    "quantized_product",
    "saving_scales",
    "stacked",
    "to_format",
    "why_not_float8",
]

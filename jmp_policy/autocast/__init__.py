"""Per-operation mixed precision for any JAX function, in the spirit of ``torch.autocast``.

``autocast(fn, policy)`` is a JAX transformation: on every call (once per trace
under an outer ``jit``) it traces ``fn`` to a jaxpr and evaluates that jaxpr
primitive by primitive, choosing each primitive's precision from three classes:

``"matmul"``
    ``dot_general``, ``conv_general_dilated``, ``ragged_dot_general``. Floating
    inputs are cast to the policy's compute dtype and the product accumulates
    in float32, returning the compute dtype (``preferred_element_type``), as
    plain JAX does. The products of the backward pass run so too.
``"float32"``
    Numerically sensitive primitives (see `FLOAT32_PRIMITIVES`). Floating
    inputs are widened to at least float32 (float64 stays float64); squares
    (`RANGE_PRIMITIVES`) only under float16, whose range they overflow.
``"follow"``
    Everything else: the widest floating input wins (JAX promotion; weakly
    typed Python scalars, and scalar constants of ``fn`` that the result's
    dtype holds, do not widen), so nothing is ever silently narrowed.

A float32 value, once produced, stays float32 for the operations that follow;
it is narrowed only where it feeds matrix work. Narrowing means fewer bits of
mantissa or exponent: float16 <-> bfloat16 is a narrowing too. Casts written
in ``fn`` are made as written. Integer, boolean and PRNG values are never
touched. An output of ``fn`` made by matrix work is returned in the policy's
output dtype; any other (a loss, normalization statistics, an argument passed
through) in the dtype it was computed in (see ``_outputs``).

Higher-order primitives are rewritten, not inlined, so they keep their own
semantics: a nested ``jit`` keeps its shardings and name, ``custom_jvp`` /
``custom_vjp`` functions keep their derivative rules, ``scan`` /
``while_loop`` carries get a stable dtype, ``cond`` branches agree on output
dtypes, ``checkpoint`` keeps its policy, ``shard_map`` bodies are autocast
with their collectives.

With ``fp8=`` (a scaling name or a `Float8Recipe`), the eligible
``dot_general`` and ``ragged_dot_general`` products, forward and backward, run
on float8 operands with current scaling instead, or on block-scaled MXFP8 and
NVFP4 operands; every such product, forward and backward, is
``jmp_policy.float8.quantized_product`` (see ``_float8``).

With ``residuals="float8"`` (or a `jmp_policy.Float8Residuals`), the arrays the
backward pass keeps are stored in float8 and the element-wise residuals
recomputed from them (``jmp_policy.residuals``).

A primitive that autocast does not know, and that has floating inputs, is
evaluated at the dtypes it was traced with, with one `AutocastWarning` per
trace naming it.

>>> import jax.numpy as jnp, jmp_policy
>>> from jmp_policy.autocast import FLOAT32_PRIMITIVES
>>> "exp" in FLOAT32_PRIMITIVES
True
>>> f = jmp_policy.autocast(lambda w, x: jnp.exp(x @ w), "mixed_float16")
>>> f(jnp.ones((2, 2)), jnp.ones((2, 2))).dtype   # exp: float32 class, returned float32
dtype('float32')

Layout: ``rules`` (the rule registry: each primitive's class, operand casts,
output kind; and the ``rules=`` argument), ``interpreter`` (evaluation, the
handler registry, the matmul class), ``_higher_order`` (one handler per
higher-order primitive), ``_float8`` (autocast's float8 rule; recipes,
quantization and products are ``jmp_policy.float8``), ``modules`` (NNX state
and module paths), ``_outputs`` (the dtypes of ``fn``'s outputs), ``_api``
(`autocast` itself), ``_dot_general`` (`dot_general`: autocast's product as a
``lax.dot_general``, for layers that take one). Dtype promotion is
``jmp_policy.dtypes``; scope paths ``jmp_policy.paths``; jaxpr walks
``jmp_policy.jaxprs``.
"""

from jmp_policy.autocast import _higher_order  # noqa: F401  (registers the handlers)
from jmp_policy.autocast._api import autocast, float8_state
from jmp_policy.float8 import AmaxHistory, Float8State
from jmp_policy.autocast._dot_general import dot_general
from jmp_policy.float8 import Float8Recipe
from jmp_policy.autocast.rules import (
    FLOAT32_PRIMITIVES,
    FOLLOW_PRIMITIVES,
    MATMUL_PRIMITIVES,
    RANGE_PRIMITIVES,
    AutocastWarning,
)

__all__ = [
    "AmaxHistory",
    "AutocastWarning",
    "FLOAT32_PRIMITIVES",
    "FOLLOW_PRIMITIVES",
    "Float8Recipe",
    "Float8State",
    "MATMUL_PRIMITIVES",
    "RANGE_PRIMITIVES",
    "autocast",
    "dot_general",
    "float8_state",
]

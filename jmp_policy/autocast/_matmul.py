"""The matmul class: matrix work in the compute dtype, accumulated in float32, both ways.

`matmul` is the default ``Context.matmul`` rule. Another precision scheme for
matrix work (float8, say) is another function of the same signature, given to
the `Context` instead, that falls back to `matmul` for the products it leaves
alone.

>>> import jax, jax.numpy as jnp, numpy as np
>>> from jmp_policy.autocast._interpreter import Context, eval_jaxpr
>>> from jmp_policy.autocast._rules import parse_rules
>>> ctx = Context(np.dtype(jnp.bfloat16), parse_rules(None), matmul)
>>> closed = jax.make_jaxpr(jnp.matmul)(jnp.ones((2, 3)), jnp.ones((3, 4)))
>>> eval_jaxpr(ctx, closed.jaxpr, closed.consts, [jnp.ones((2, 3)), jnp.ones((3, 4))])[0].dtype
dtype(bfloat16)
"""

from __future__ import annotations

from typing import Any

from jax.extend.core import JaxprEqn

from jmp_policy.autocast._interpreter import Context, bind


def matmul(ctx: Context, eqn: JaxprEqn, invals: list[Any]) -> Any:
    """Floating operands and result in ``ctx.compute``, accumulated in float32.

    ``dot_general``, ``conv_general_dilated`` and ``ragged_dot_general`` take
    their result dtype from ``preferred_element_type``, and accumulate in
    float32 whatever it is (XLA does so on every backend): a sum of many
    products is rounded to half precision once, at the end. The result is in the
    compute dtype, as in plain JAX and ``torch.autocast``: what a
    ``jax.checkpoint`` policy saves of a product (it sees the ``dot_general``
    itself), and the activations after it, take half the memory of float32.

    JAX's own derivative then keeps the backward pass in the compute dtype too:
    a product's cotangent has its result's dtype, so both transposed products
    take half-precision operands and give half-precision results.
    """
    operands = [ctx.cast(x, ctx.compute) for x in invals]
    if "preferred_element_type" not in eqn.params:
        return bind(eqn, operands)
    return bind(eqn, operands, dict(eqn.params, preferred_element_type=ctx.compute))

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
dtype('float32')
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import JaxprEqn

from jmp_policy.autocast._interpreter import Context, bind
from jmp_policy.autocast._lattice import F32, DType, convert, join


def matmul(ctx: Context, eqn: JaxprEqn, invals: list[Any]) -> Any:
    """Floating operands in ``ctx.compute``; a float32 result where the primitive can give one.

    ``dot_general``, ``conv_general_dilated`` and ``ragged_dot_general``
    accumulate in float32 (``preferred_element_type``) and return float32, so
    a sum of many products is not rounded to half precision at every step;
    their backward products run in the compute dtype too (see `mixed_product`).
    """
    operands = [ctx.cast(x, ctx.compute) for x in invals]
    if "preferred_element_type" not in eqn.params:
        return bind(eqn, operands)
    return mixed_product(eqn, ctx.compute, *operands)


def mixed_product(eqn: JaxprEqn, compute: DType, lhs: Any, rhs: Any, *rest: Any) -> Any:
    """``eqn``'s product of ``lhs`` and ``rhs`` (in ``compute``), accumulated in float32.

    ``rest`` are the primitive's other operands, not differentiated (the group
    sizes of ``ragged_dot_general``).

    Left to itself, JAX would differentiate a float32-accumulating product into
    backward products between a float32 cotangent and a half-precision operand,
    i.e. float32 matrix work. The JVP below keeps tangents in the compute dtype,
    so the transposed products of the backward pass run in half precision too,
    as in a hand-written mixed-precision model.

    The JVP's primal output is the forward product itself, a plain
    ``dot_general`` (or ``ragged_dot_general``, ``conv_general_dilated``), not
    this custom_jvp again: a differentiated product is then the primitive a
    ``jax.checkpoint`` policy looks for (``dots_saveable`` and the like test the
    primitive of each equation, and would see a ``custom_jvp_call`` instead), so
    it saves the product's float32 output as it does in plain JAX rather than
    recomputing it in the backward pass. The cost: a derivative of that primal
    output taken by an enclosing differentiation (reverse over reverse) is JAX's
    own, whose transposed products take a float32 cotangent.
    """
    acc = join(compute, F32)
    fwd_params = dict(eqn.params, preferred_element_type=acc)
    if acc == compute:  # float32 (or wider) compute: JAX's own derivative is already right
        return bind(eqn, (lhs, rhs, *rest), fwd_params)
    tan_params = dict(eqn.params, preferred_element_type=compute)

    # The rule below runs whenever this product is differentiated, possibly long after
    # this trace: it keeps the equation and dtypes, never a traced value.
    def product(a: Any, b: Any, *rest: Any) -> Any:
        return bind(eqn, (a, b, *rest), fwd_params)

    def product_jvp(primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> tuple[Any, Any]:
        a, b, *rest = primals
        ta, tb = tangents[:2]
        terms = []
        if not isinstance(ta, SymbolicZero):
            terms.append(bind(eqn, (convert(ta, compute), b, *rest), tan_params))
        if not isinstance(tb, SymbolicZero):
            terms.append(bind(eqn, (a, convert(tb, compute), *rest), tan_params))
        return product(a, b, *rest), convert(functools.reduce(lax.add, terms), acc)

    product.__name__ = eqn.primitive.name
    custom = jax.custom_jvp(product)
    custom.defjvp(product_jvp, symbolic_zeros=True)
    return custom(lhs, rhs, *rest)

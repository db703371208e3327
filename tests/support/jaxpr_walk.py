"""Every equation of a jaxpr, nested ones included: what the jaxpr tests look at.

The walk is the library's own (`jmp_policy.jaxprs.scoped_eqns`). `TANH_DERIVATIVE`
names what JAX's derivative of ``tanh`` keeps, which changed in JAX 0.11.
"""

import jax

from jmp_policy.jaxprs import scoped_eqns

TANH_DERIVATIVE = "one_minus_square" if hasattr(jax.lax, "one_minus_square") else "sub"
"""The primitive of the array JAX keeps for ``tanh``'s derivative ``1 - tanh(x) ** 2``,
besides ``tanh(x)`` where a later operation needs that: from JAX 0.11 the derivative
itself (``one_minus_square``), before it ``1 - tanh(x)`` (``sub``), with ``tanh(x)``
always kept."""


def eqns(jaxpr):
    """Every equation of ``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``), nested ones included."""
    for _, eqn in scoped_eqns(jaxpr):
        yield eqn


def checkpointed_backward(jaxpr):
    """The body of the last checkpointed backward pass (a differentiated ``remat2``) in
    ``jaxpr``, nested ones included."""
    passes = [e for e in eqns(jaxpr) if e.primitive.name == "remat2" and e.params["differentiated"]]
    return passes[-1].params["jaxpr"]


def products_before(jaxpr, eqn, batched):
    """How many products with (``batched``) or without batch axes ``eqn`` of ``jaxpr`` (not
    nested) is computed from."""
    made = {v: e for e in jaxpr.eqns for v in e.outvars}
    seen, stack = {}, [eqn]
    while stack:
        for v in stack.pop().invars:
            producer = None if isinstance(v, jax.extend.core.Literal) else made.get(v)
            if producer is not None and id(producer) not in seen:
                seen[id(producer)] = producer
                stack.append(producer)
    return sum(is_product(e, batched) for e in seen.values())


def is_product(eqn, batched):
    """Whether ``eqn`` is a ``dot_general`` with (``batched``) or without batch axes."""
    return eqn.primitive.name == "dot_general" and \
        bool(eqn.params["dimension_numbers"][1][0]) == batched


__all__ = ["TANH_DERIVATIVE", "checkpointed_backward", "eqns", "is_product", "products_before",
           "scoped_eqns"]

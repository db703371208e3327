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


__all__ = ["TANH_DERIVATIVE", "eqns", "scoped_eqns"]

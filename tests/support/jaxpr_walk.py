"""Every equation of a jaxpr, nested ones included: what the jaxpr tests look at.

The walk is the library's own (`jmp_policy.jaxprs.scoped_eqns`).
"""

from jmp_policy.jaxprs import scoped_eqns


def eqns(jaxpr):
    """Every equation of ``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``), nested ones included."""
    for _, eqn in scoped_eqns(jaxpr):
        yield eqn


__all__ = ["eqns", "scoped_eqns"]

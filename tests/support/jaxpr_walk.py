"""Every equation of a jaxpr, nested ones included: what the jaxpr tests look at."""

from jax.extend.core import ClosedJaxpr, Jaxpr


def _sub_jaxprs(params):
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, Jaxpr):
                yield v


def eqns(jaxpr):
    """Every equation of ``jaxpr``, nested ones included."""
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _sub_jaxprs(eqn.params):
            yield from eqns(sub)


def scoped_eqns(jaxpr, prefix=""):
    """``(scope, eqn)`` for every equation, nested ones with their callers' scopes prefixed."""
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        scope = "/".join(p for p in (prefix, str(eqn.source_info.name_stack)) if p)
        yield scope, eqn
        for sub in _sub_jaxprs(eqn.params):
            yield from scoped_eqns(sub, scope)

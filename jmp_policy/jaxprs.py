"""Jaxpr equations, read and evaluated again: what autocast, float8 and the inspector share.

>>> import jax, jax.numpy as jnp
>>> eqn = jax.make_jaxpr(jnp.sin)(1.0).jaxpr.eqns[0]
>>> float(bind(eqn, [0.0]))
0.0
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from jax.extend.core import JaxprEqn

__all__ = ["bind"]


def bind(eqn: JaxprEqn, invals: Sequence[Any], params: Optional[dict[str, Any]] = None) -> Any:
    """Binds ``eqn``'s primitive to ``invals``, with ``params`` instead of its own if given."""
    params = eqn.params if params is None else params
    bind_params = eqn.primitive.get_bind_params(params)  # type: ignore[no-untyped-call]
    return eqn.primitive.bind(*invals, **bind_params)  # type: ignore[no-untyped-call]

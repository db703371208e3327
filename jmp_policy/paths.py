"""Paths: the ``/``-joined names that rules match, for pytree leaves and for operations.

A leaf's path is its key path (``params/Dense_0/kernel``); an operation's scope
is its ``jax.named_scope`` path, in which JAX wraps the scopes a
transformation traced (``transpose(jvp(block))``).

>>> scope_names("transpose(jvp(block))/dense")
['block', 'dense']
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import jax

__all__ = ["path_str", "scope_names"]


def path_str(path: Sequence[Any]) -> str:
    """A key path as the ``/``-joined string policies match on, e.g. ``params/Dense_0/kernel``."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


_TRANSFORMS = re.compile(r"^(?:\w+\()+|\)+$")


def scope_names(path: str) -> list[str]:
    """The ``jax.named_scope`` names in a name-stack path, without JAX's transformations.

    JAX wraps the scopes a transformation traced in its name
    (``transpose(jvp(block))``); a float32 scope matches those equations too.
    """
    return [name for name in (_TRANSFORMS.sub("", part) for part in path.split("/")) if name]

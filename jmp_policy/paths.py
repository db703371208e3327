"""Paths: the ``/``-joined names that rules match, for pytree leaves and for operations.

A leaf's path is its key path (``params/Dense_0/kernel``); an operation's scope
is its ``jax.named_scope`` path, in which JAX wraps the scopes a
transformation traced (``transpose(jvp(block))``) and names the forward
values that a ``jax.checkpoint`` recomputes in the backward pass
(``rematted_computation``).

>>> scope_names("transpose(jvp(block))/dense")
['block', 'dense']
>>> join_scope("model", "block/dense")
'model/block/dense'
>>> is_backward("transpose(jvp(block))/dense"), is_backward("jvp(block)/dense")
(True, False)
"""

from __future__ import annotations

import functools
import re
from typing import Any, Iterable, Sequence

import jax

__all__ = ["display_scope", "is_backward", "join_scope", "path_str", "scope_names",
           "scope_patterns", "search_scopes", "unmatched_patterns"]


def path_str(path: Sequence[Any]) -> str:
    """A key path as the ``/``-joined string policies match on, e.g. ``params/Dense_0/kernel``."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


_TRANSFORMS = re.compile(r"^(?:\w+\()+|\)+$")

# JAX names the recomputation of a `jax.checkpoint` in the backward pass with this scope:
# forward values computed again, not gradients.
_REMAT_SCOPE = "rematted_computation"


def scope_names(path: str) -> list[str]:
    """The ``jax.named_scope`` names in a name-stack path, without JAX's transformations.

    JAX wraps the scopes a transformation traced in its name
    (``transpose(jvp(block))``); a float32 scope matches those equations too.
    """
    return [name for name in (_TRANSFORMS.sub("", part) for part in path.split("/")) if name]


def join_scope(prefix: str, path: str) -> str:
    """The scope path of an equation with name stack ``path`` inside a call at ``prefix``
    (either may be empty): how a nested jaxpr's equations get their callers' scopes.

    >>> join_scope("", "dense"), join_scope("block", "")
    ('dense', 'block')
    """
    return f"{prefix}/{path}" if prefix and path else prefix or path


@functools.lru_cache(maxsize=4096)
def is_backward(path: str) -> bool:
    """Whether the equation at scope ``path`` belongs to the backward pass.

    JAX's transposition wraps the scopes it writes (``transpose(jvp(block))``);
    inside them, a ``jax.checkpoint`` recomputes forward values under
    ``rematted_computation``, which are forward work again. The innermost of
    the two decides, so a gradient taken inside a recomputation is backward.

    >>> is_backward("transpose(jvp(model))/rematted_computation/mlp")
    False
    """
    backward = False
    for part in path.split("/"):
        if part == _REMAT_SCOPE:
            backward = False
        elif "transpose(" in part:
            backward = True
    return backward


@functools.lru_cache(maxsize=4096)
def display_scope(path: str) -> str:
    """A name-stack path as users wrote it: ``/``-joined scope names, JAX's wrappers removed.

    A transformation repeats the name of the scope it traced
    (``transpose(jvp(block))/jvp(block)``): a name repeated next to a wrapped
    one is shown once. JAX's own recomputation scope is dropped.

    >>> display_scope("transpose(jvp(model))/jvp(model)/rematted_computation/mlp")
    'model/mlp'
    """
    names: list[str] = []
    wrapped_before = False
    for part in path.split("/"):
        name = "/".join(scope_names(part))
        wrapped = name != part
        if name and name != _REMAT_SCOPE and not (
                names and names[-1] == name and (wrapped or wrapped_before)):
            names.append(name)
        wrapped_before = wrapped
    return "/".join(names)


# --- Scope patterns --------------------------------------------------------------------------

def scope_patterns(value: Any, owner: str) -> tuple[str, ...]:
    """``value`` (a regular expression or a sequence of them) read as ``owner``'s scope
    patterns (``"Float8Recipe exclude"``), each checked to compile.

    >>> scope_patterns("head", "Float8Recipe exclude")
    ('head',)
    """
    patterns = (value,) if isinstance(value, str) else value
    try:
        patterns = tuple(patterns)
    except TypeError:
        raise TypeError(
            f"{owner} must be a regular expression or a sequence of them, got {value!r}.") \
            from None
    for p in patterns:
        if not isinstance(p, str):
            raise TypeError(f"{owner} entries must be strings, got {p!r}.")
        try:
            re.compile(p)
        except re.error as e:
            raise ValueError(f"{owner} entry {p!r} is not a valid regular expression: {e}.") \
                from None
    return patterns


def search_scopes(patterns: Sequence[str], scope: str) -> bool:
    """True when a pattern is found (``re.search``) in the ``/``-joined scope names of the
    name-stack path ``scope``, JAX's transformation wrappers removed.

    >>> search_scopes(["logits$"], "transpose(jvp(TransformerLM))/logits")
    True
    """
    path = "/".join(scope_names(scope))
    return any(re.search(p, path) for p in patterns)  # re caches compiled patterns


def unmatched_patterns(patterns: Sequence[str], scopes: Iterable[str]) -> list[str]:
    """The patterns found in none of ``scopes``, searched as `search_scopes` searches.

    >>> unmatched_patterns(["router", "experts"], ["moe/router"])
    ['experts']
    """
    paths = {"/".join(scope_names(s)) for s in scopes}
    return [p for p in patterns if not any(re.search(p, path) for path in paths)]

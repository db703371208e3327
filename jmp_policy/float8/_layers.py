"""Stacks of numbered layers among a function's scopes, and the layers kept out of float8.

A stack is a set of sibling scopes, under one parent path, whose names differ
only by a trailing number: linen's ``Block_0, Block_1, ...``, NNX's
``layers/0, layers/1, ...`` (a list of modules), ``jax.named_scope(f"layer_{i}")``.
`KeptLayers.of` finds the stacks among the scopes of a function's float8
products and keeps the first and last layers of each, as
``Float8Recipe.high_precision_layers`` asks: its `KeptLayers.why` says why a
product's scope stays in the compute dtype. `find_stacks` says which stacks
there are, `products` where a jaxpr's products are.

>>> scopes = [f"LM/Block_{i}/Dense_{j}" for i in range(4) for j in range(2)]
>>> kept = KeptLayers.of((1, 1), scopes)
>>> [stack.name for stack in kept.stacks]
['LM/Block_*']
>>> print(kept.why("transpose(jvp(LM))/Block_3/Dense_1"))  # doctest: +ELLIPSIS
its scope is in layer 3 of the stack 'LM/Block_*', kept in the compute dtype by ...
>>> kept.why("LM/Block_2/Dense_0") is None
True
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Iterator, NamedTuple, Optional, Union

from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn

from jmp_policy.jaxprs import sub_jaxprs
from jmp_policy.paths import display_scope, join_scope

_NUMBERED = re.compile(r"^(.*?)(\d+)$")
_PRODUCTS = frozenset({"dot_general", "ragged_dot_general"})
_LOOPS = frozenset({"scan", "while"})

Layer = tuple[tuple[str, ...], str, int]
"""A layer of a stack: the stack's parent path (as names), its stem, the layer's number."""


def _names(scope: str) -> tuple[str, ...]:
    """A scope path as users wrote it, as names; a module method's name (NNX's
    ``layers/0.decode``) dropped, so that its scopes are the module's."""
    return tuple(name.split(".", 1)[0] for name in display_scope(scope).split("/") if name)


def _numbered(name: str) -> Optional[tuple[str, int]]:
    """``(stem, number)`` of a name ending in a number (``"Block_11"``: ``("Block_", 11)``)."""
    found = _NUMBERED.match(name)
    return None if found is None else (found[1], int(found[2]))


def _layers(names: tuple[str, ...]) -> Iterable[Layer]:
    """Every numbered name of a path, as the layer it would be of a stack."""
    for i, name in enumerate(names):
        numbered = _numbered(name)
        if numbered is not None:
            yield names[:i], numbered[0], numbered[1]


@dataclasses.dataclass(frozen=True)
class Stack:
    """Sibling scopes numbered at the end: ``parent/stem<n>`` for each ``n`` in ``numbers``."""

    parent: tuple[str, ...]
    stem: str
    numbers: tuple[int, ...]  # ascending

    @property
    def name(self) -> str:
        """The stack as a pattern: ``"TransformerLM/Block_*"``, ``"Decoder/layers/*"``."""
        return "/".join((*self.parent, f"{self.stem}*"))

    def ends(self, first: int, last: int) -> tuple[int, ...]:
        """The numbers of the first ``first`` and the last ``last`` layers."""
        return tuple(sorted({*self.numbers[:first],
                             *self.numbers[max(0, len(self.numbers) - last):]}))


def find_stacks(scopes: Iterable[str]) -> tuple[Stack, ...]:
    """The stacks among ``scopes`` (name-scope paths), by name.

    A stack has at least two layers. A block's own numbered parts are not
    layers of a stack: one inside a layer of another stack (each block's
    ``Dense_0`` and ``Dense_1``) is part of that layer, and under a numbered
    scope that is no stack (linen's ``Block_0`` of a one-block model, its
    ``Encoder_0``) only layers holding scopes of their own
    (``Encoder_0/Layer_0/attention``) make one.

    >>> [s.name for s in find_stacks(["m/layers/0/mlp", "m/layers/1/mlp", "m/head"])]
    ['m/layers/*']
    >>> find_stacks(["m/Block_0/Dense_0", "m/Block_0/Dense_1"])   # one block
    ()
    """
    numbers: dict[tuple[tuple[str, ...], str], set[int]] = {}
    composite = set()  # stacks with a layer holding scopes of its own
    for names in {_names(s) for s in scopes}:
        for parent, stem, number in _layers(names):
            numbers.setdefault((parent, stem), set()).add(number)
            if len(names) > len(parent) + 1:
                composite.add((parent, stem))
    stacks = {key: found for key, found in numbers.items() if len(found) >= 2}

    def counts(parent: tuple[str, ...], stem: str) -> bool:
        above = list(_layers(parent))
        return not any(number in stacks.get((p, s), ()) for p, s, number in above) and (
            not above or (parent, stem) in composite)

    return tuple(sorted((Stack(parent, stem, tuple(sorted(found)))
                         for (parent, stem), found in stacks.items() if counts(parent, stem)),
                        key=lambda s: s.name))


@dataclasses.dataclass(frozen=True)
class KeptLayers:
    """The layers that ``Float8Recipe.high_precision_layers`` keeps in the compute dtype.

    Attributes:
      rule: ``(first, last)``, as the recipe has it.
      stacks: the stacks found (none for ``(0, 0)``, which looks for none).
      layers: the kept layers.
    """

    rule: tuple[int, int] = (0, 0)
    stacks: tuple[Stack, ...] = ()
    layers: frozenset[Layer] = frozenset()

    @classmethod
    def of(cls, rule: tuple[int, int], scopes: Iterable[str]) -> KeptLayers:
        """The layers ``rule`` keeps among the stacks of ``scopes``: the scopes of the
        products the recipe would run in float8 (the size of a stack is known from
        them), loops unrolled to their own scopes (`Product.unrolled`)."""
        first, last = rule
        if not first and not last:
            return cls(rule)
        stacks = find_stacks(scopes)
        return cls(rule, stacks, frozenset((s.parent, s.stem, number) for s in stacks
                                           for number in s.ends(first, last)))

    def why(self, scope: str) -> Optional[str]:
        """Why a product under ``scope`` stays in the compute dtype, if it is in a kept layer."""
        if not self.layers:
            return None
        for layer in _layers(_names(scope)):
            if layer in self.layers:
                parent, stem, number = layer
                stack = "/".join((*parent, f"{stem}*"))
                return (f"its scope is in layer {number} of the stack {stack!r}, kept in the "
                        f"compute dtype by high_precision_layers={self.rule}")
        return None


NO_LAYERS = KeptLayers()
"""What a recipe with ``high_precision_layers=(0, 0)`` keeps: nothing."""


class Product(NamedTuple):
    """A matrix product (``dot_general``, ``ragged_dot_general``) of a jaxpr."""

    scope: str
    """Its name-scope path."""
    unrolled: str
    """The scope path of the outermost loop (``scan``, ``while_loop``) it is in, or its
    own scope outside loops: what numbers its layer. A loop body runs for every
    iteration, so the names inside it number no layers (a scanned stack has none)."""
    eqn: JaxprEqn


def products(jaxpr: Union[Jaxpr, ClosedJaxpr], scope: str = "",
             loop: Optional[str] = None) -> Iterator[Product]:
    """Every matrix product of ``jaxpr`` in order, nested ones included.

    >>> import jax, jax.numpy as jnp
    >>> def f(x):
    ...     with jax.named_scope("layers"):
    ...         return jax.lax.scan(lambda c, _: (jnp.tanh(c @ c), None), x, length=2)[0]
    >>> [(p.scope, p.unrolled) for p in products(jax.make_jaxpr(f)(jnp.ones((2, 2))))]
    [('layers', 'layers')]
    """
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        path = join_scope(scope, str(eqn.source_info.name_stack))
        if eqn.primitive.name in _PRODUCTS:
            yield Product(path, path if loop is None else loop, eqn)
        inner = path if loop is None and eqn.primitive.name in _LOOPS else loop
        for sub in sub_jaxprs(eqn):
            yield from products(sub, path, inner)

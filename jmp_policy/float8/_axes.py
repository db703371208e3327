"""Where each axis of a matrix product goes.

A ``dot_general``'s dimension numbers name each operand's contracting and batch
axes; its other axes are its free axes, and its result is laid out as
``(batch, lhs free, rhs free)``. `free_axes` finds an operand's free axes: the
eligibility rule sizes products by them, the block-scaled scheme arranges operands
by them, the current-scaled one lays scales out against the result by them.
`DenseAxes` holds every axis of a product, where each goes in the result, and the
dimension numbers of the two backward products.

>>> axes = DenseAxes.of((((1,), (0,)), ((), ())), 2, 2)   # x @ w
>>> axes.lhs.free, axes.rhs.free, axes.rhs.out_free
((0,), (1,), (1,))
>>> axes.gradient(0)   # dot_general(g, w) contracting g's axis 1 with w's 1: x's layout
((((1,), (1,)), ((), ())), (0, 1))
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence


def free_axes(ndim: int, contract: Sequence[int], batch: Sequence[int]) -> tuple[int, ...]:
    """The axes of an operand of ``ndim`` axes that a product neither sums over
    (``contract``) nor batches (``batch``), in increasing order.

    >>> free_axes(3, (2,), (0,))
    (1,)
    """
    return tuple(i for i in range(ndim) if i not in contract and i not in batch)


class OperandAxes(NamedTuple):
    """One operand's axes in a ``dot_general``, and where its free axes go in the result."""

    contract: tuple[int, ...]
    batch: tuple[int, ...]
    free: tuple[int, ...]
    out_free: tuple[int, ...]


class DenseAxes(NamedTuple):
    """The axes of ``dot_general(lhs, rhs)``; its result is (batch, lhs free, rhs free)."""

    lhs: OperandAxes
    rhs: OperandAxes

    @classmethod
    def of(cls, dims: Any, lhs_ndim: int, rhs_ndim: int) -> DenseAxes:
        """The axes of a product of ``dot_general`` dimension numbers ``dims``."""
        (lc, rc), (lb, rb) = dims
        lhs_free, rhs_free = free_axes(lhs_ndim, lc, lb), free_axes(rhs_ndim, rc, rb)
        start = len(lb) + len(lhs_free)
        return cls(
            OperandAxes(tuple(lc), tuple(lb), lhs_free, tuple(range(len(lb), start))),
            OperandAxes(tuple(rc), tuple(rb), rhs_free,
                        tuple(range(start, start + len(rhs_free)))))

    @property
    def out_batch(self) -> tuple[int, ...]:
        return tuple(range(len(self.lhs.batch)))

    def gradient(self, position: int) -> tuple[Any, tuple[int, ...]]:
        """The ``dot_general(g, other)`` dimension numbers giving the gradient of the
        operand at ``position`` (0 lhs, 1 rhs), and the transpose taking that product
        to the operand's layout.

        The product's axes are (batch, the operand's free axes, the other operand's
        contracting axes in increasing order); the transpose puts them in the
        operand's order.
        """
        own, other = (self.lhs, self.rhs) if position == 0 else (self.rhs, self.lhs)
        dims = ((other.out_free, other.free), (self.out_batch, other.batch))
        return dims, _gradient_axes(own, other.contract)


def _gradient_axes(own: OperandAxes, other_contract: Sequence[int]) -> tuple[int, ...]:
    """For each axis of an operand, its axis in a gradient product laid out as
    (batch, free, the other operand's contracting axes in increasing order)."""
    ndim = len(own.batch) + len(own.free) + len(own.contract)
    rest = sorted(other_contract)
    position = {}
    for i, a in enumerate(own.batch):
        position[a] = i
    for i, a in enumerate(own.free):
        position[a] = len(own.batch) + i
    for a, b in zip(own.contract, other_contract):
        position[a] = len(own.batch) + len(own.free) + rest.index(b)
    return tuple(position[a] for a in range(ndim))

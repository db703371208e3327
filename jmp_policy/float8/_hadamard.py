"""NVFP4's random Hadamard transform: an orthogonal rotation of each block of 16 values.

A weight-gradient product sums over tokens, and one outlier token in a block of
16 sets that block's scale and flushes its other values to zero in a 4-bit
format. Rotating each block of both operands by the same orthogonal matrix ``R``
leaves the product as it was (``(a R) . (b R) = a . b``) and spreads an outlier
over the whole block, so the block's values quantize with a scale that suits them
all (NVIDIA's NVFP4 training recipe, which Transformer Engine ships).

``R = diag(signs) H / 4``: ``H`` the 16 x 16 Sylvester Hadamard matrix of ones and
minus ones, ``signs`` 16 random signs drawn once from the documented seed stream
``formats.SEED_STREAMS.hadamard_signs``. Every entry is ``1/4`` or ``-1/4``, so
``R`` and ``R.T`` are exact in float32 and ``R @ R.T`` is the identity exactly.
The signs are the same for every block, array, program and sharding: a block's
rotation depends on its values alone.

>>> import numpy as np
>>> r = rotation()
>>> r.shape, bool((r @ r.T == np.eye(16, dtype=np.float32)).all())
((16, 16), True)
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_policy import formats

SIZE = 16
"""Values per rotated block: NVFP4's block size, as in the study and Transformer Engine."""


@functools.lru_cache(maxsize=None)
def signs() -> np.ndarray:
    """The 16 random signs (float32 ones and minus ones) of the rotation: the top bit of
    `formats.random_bits` of ``formats.fixed_seed(SEED_STREAMS.hadamard_signs)``.

    >>> signs().tolist()[:4], int(np.abs(signs()).sum())
    ([-1.0, -1.0, 1.0, 1.0], 16)
    """
    with jax.ensure_compile_time_eval():
        bits = formats.random_bits(formats.fixed_seed(formats.SEED_STREAMS.hadamard_signs),
                                   (SIZE,))
        top = np.asarray(lax.shift_right_logical(bits, np.uint32(31)))
    out: np.ndarray = np.where(top == 1, np.float32(-1), np.float32(1))
    return out


def _sylvester(size: int) -> np.ndarray:
    """The ``size`` x ``size`` Hadamard matrix of ones and minus ones (``size`` a power
    of two): ``H_2n = [[H_n, H_n], [H_n, -H_n]]``."""
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < size:
        h = np.block([[h, h], [h, -h]])
    return h


@functools.lru_cache(maxsize=None)
def rotation() -> np.ndarray:
    """``R = diag(signs()) H / 4`` (float32, 16 x 16): orthogonal, ``R @ R.T == I``."""
    r: np.ndarray = signs()[:, None] * _sylvester(SIZE) / np.float32(4)
    r.setflags(write=False)
    return r


def rotated(x: Any) -> jax.Array:
    """``x`` (float32) with each block of 16 consecutive values along its last axis (a
    multiple of 16) multiplied by `rotation`: ``block @ R``, in float32.

    Two operands rotated alike multiply, along that axis, to their product: ``R`` is
    orthogonal.

    >>> a, b = np.arange(32, dtype=np.float32), np.linspace(-1, 1, 32, dtype=np.float32)
    >>> bool(np.isclose(jnp.dot(rotated(a), rotated(b)), np.dot(a, b), rtol=1e-6))
    True
    """
    x = formats.widen(x)
    shape = jnp.shape(x)
    if shape[-1] % SIZE:
        raise ValueError(f"the Hadamard transform rotates blocks of {SIZE} along the last "
                         f"axis, got one of size {shape[-1]}.")
    blocks = lax.reshape(x, (*shape[:-1], shape[-1] // SIZE, SIZE))
    out = lax.dot_general(blocks, jnp.asarray(rotation()), (((blocks.ndim - 1,), (0,)), ((), ())),
                          precision=lax.Precision.HIGHEST,
                          preferred_element_type=np.float32)
    return lax.reshape(out, shape)

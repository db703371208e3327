"""The inspector: which operations overflow, underflow or lose precision, and where; which
activations a backward pass keeps.

``inspect_numerics(fn, policy)`` runs ``autocast(fn, policy)`` and observes
every operation computed below float32 precision against the same operation in
float32 (``_observer``); the `NumericsReport` (``_report``) holds a row per
operation, suggests float32 scopes and a loss scale, and plots value ranges
(``_plot``, with matplotlib). ``saved_residuals(fn, *args)`` (``_residuals``) lists
what ``fn``'s backward pass keeps between the passes, by scope, in a
`ResidualReport`.

>>> import jax.numpy as jnp, jmp_policy
>>> report = jmp_policy.inspect_numerics(lambda x, w: (x * 1000.0) @ w, "mixed_float16")(
...     jnp.full((2, 3), 100.0), jnp.ones((3, 4)))    # 1e5 is beyond float16's 65504
>>> report.worst(1)[0].overflow
6
"""

from jmp_policy.inspector._report import NumericsReport, NumericsRow, inspect_numerics
from jmp_policy.inspector._residuals import ResidualReport, ResidualRow, saved_residuals

__all__ = ["NumericsReport", "NumericsRow", "ResidualReport", "ResidualRow", "inspect_numerics",
           "saved_residuals"]

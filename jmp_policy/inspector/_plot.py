"""Draws a numerics report's dynamic ranges against the floating formats (needs matplotlib).

Imported only by `NumericsReport.plot`, so that ``import jmp_policy`` never
imports matplotlib.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Sequence

import jax.numpy as jnp

from jmp_policy.formats import facts_of

FORMATS = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn")
_PHASE_COLORS = {"forward": "tab:blue", "backward": "tab:orange"}
_FORMAT_COLOR = "0.45"


@dataclasses.dataclass(frozen=True)
class ScopeRange:
    """The float32 dynamic range of one scope in one phase, for `NumericsReport.plot`."""

    label: str
    smallest: float
    largest: float
    phase: Literal["forward", "backward"]
    overflow: bool


def scope_ranges(rows: Sequence[Any]) -> list[ScopeRange]:
    """One `ScopeRange` per scope and phase of a report's rows."""
    ranges: dict[tuple[str, str], ScopeRange] = {}
    for r in rows:
        if r.float32_min is None:
            continue
        key = (r.scope or "(no scope)", r.phase)
        old = ranges.get(key)
        if old is None:
            ranges[key] = ScopeRange(key[0], r.float32_min, r.float32_max, r.phase,
                                     r.overflow > 0)
        else:
            ranges[key] = ScopeRange(key[0], min(old.smallest, r.float32_min),
                                     max(old.largest, r.float32_max), r.phase,
                                     old.overflow or r.overflow > 0)
    return list(ranges.values())


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ModuleNotFoundError as e:
        if e.name is None or e.name.partition(".")[0] != "matplotlib":
            raise
        raise ImportError(
            "NumericsReport.plot needs matplotlib, which is not installed: pip install "
            '"jmp_policy[examples]" (or matplotlib). The rest of the report works without it.'
        ) from e
    return Figure


def _format_range(name: str) -> tuple[float, float, float]:
    """(smallest subnormal, smallest normal, largest) magnitudes of a format."""
    fmt = facts_of(getattr(jnp, name))
    return fmt.smallest, fmt.tiny, fmt.max


# The axis spans the data within these bounds: a mask's -3.4e38 or a flushed 1e-40 would
# otherwise squeeze every other range into a corner (their bars run to the edge).
_AXIS = (2.0 ** -80, 2.0 ** 80)


def plot_ranges(ranges: Sequence[ScopeRange], path: str, title: str) -> None:
    """Writes a horizontal bar per scope range, under a bar per format, to ``path``."""
    Figure = _figure_class()
    formats = [(name, *_format_range(name)) for name in FORMATS]
    labels = [f"{r.label} ({r.phase})" for r in ranges]
    n = len(formats) + len(ranges)
    fig = Figure(figsize=(10, 1.8 + 0.27 * n))
    ax = fig.add_subplot()
    y = list(range(n))[::-1]
    for row, (name, sub, tiny, top) in zip(y, formats):
        ax.plot([sub, tiny], [row, row], color=_FORMAT_COLOR, lw=6, alpha=0.35,
                solid_capstyle="butt")
        ax.plot([tiny, top], [row, row], color=_FORMAT_COLOR, lw=6, solid_capstyle="butt")
    for row, r in zip(y[len(formats):], ranges):
        color = "tab:red" if r.overflow else _PHASE_COLORS[r.phase]
        ax.plot([r.smallest, max(r.largest, r.smallest)], [row, row], color=color, lw=6,
                solid_capstyle="butt")
    _, f16_sub, f16_tiny, f16_max = formats[0]
    for x in (f16_tiny, f16_max):
        ax.axvline(x, color="0.3", ls=":", lw=1)
    low = min([f16_sub] + [r.smallest for r in ranges]) / 10
    high = max([f16_max] + [r.largest for r in ranges if r.largest > 0]) * 10
    ax.set_xscale("log")
    ax.set_xlim(max(low, _AXIS[0]), min(high, _AXIS[1]))
    ax.set_yticks(y, [f"[{name}]" for name, *_ in formats] + labels, fontsize=8)
    ax.set_ylim(-1, n)
    ax.set_xlabel("magnitude (in the float32 evaluation)")
    styles = [(_PHASE_COLORS["forward"], 1.0, "-", 6, "forward"),
              (_PHASE_COLORS["backward"], 1.0, "-", 6, "backward"),
              ("tab:red", 1.0, "-", 6, "overflows in low precision"),
              (_FORMAT_COLOR, 1.0, "-", 6, "format: normal range"),
              (_FORMAT_COLOR, 0.35, "-", 6, "format: subnormals"),
              ("0.3", 1.0, ":", 1, "float16's normal range")]
    handles = [ax.plot([], [], color=c, alpha=a, ls=ls, lw=lw)[0] for c, a, ls, lw, _ in styles]
    ax.legend(handles, [label for *_, label in styles], loc="lower right", fontsize=8)
    ax.set_title(f"Dynamic range per scope: {title}", fontsize=10)
    ax.grid(axis="x", alpha=0.3, which="major")
    fig.tight_layout()
    fig.savefig(path, dpi=80, bbox_inches="tight")

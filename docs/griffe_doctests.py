"""A griffe extension (mkdocs.yml): doctest examples in docstrings become code blocks.

The library's docstrings show examples as doctests (``>>>`` lines followed by
their output), anywhere in the text, as pytest's ``--doctest-modules`` runs
them. Markdown would read them as block quotes (and ``x["a"]["b"]`` as a
link), so each run of doctest lines, up to the next blank line, is fenced as
a ``pycon`` code block before mkdocstrings renders the docstring.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_PROMPT = re.compile(r"^(\s*)>>>( |$)")


def fence_doctests(text: str) -> str:
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = _PROMPT.match(lines[i])
        if not match:
            out.append(lines[i])
            i += 1
            continue
        indent = match.group(1)
        block = []
        while i < len(lines) and lines[i].strip():
            line = lines[i]
            block.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            i += 1
        if out and out[-1].strip():
            out.append("")  # a fence needs a blank line before it in a paragraph's flow
        out += [f"{indent}```pycon"] + [f"{indent}{b}" for b in block] + [f"{indent}```"]
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        docstring = getattr(obj, "docstring", None)
        if docstring is not None and ">>>" in docstring.value:
            docstring.value = fence_doctests(docstring.value)

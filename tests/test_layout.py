"""The package layout is the architecture: layers import downwards, privately only inside.

Packages of `jmp_policy`, bottom to top: the core modules (``formats``,
``dtypes``, ``paths``, ``sharding``, ``jaxprs``, ``loss_scale``), ``policy``,
``optim``, ``float8``, ``autocast``, ``inspector``, ``flax``. A module may
import the public names of a package below it, or anything of its own
package; never a private (``_``) module or name of another package, and no
module imports itself back through a chain (an import circle).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "jmp_policy"
LAYERS = ["core", "policy", "optim", "float8", "residuals", "autocast", "inspector", "flax"]


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str:
    parts = module.split(".")
    if len(parts) >= 2 and (ROOT / parts[1]).is_dir():
        return parts[1]
    return "core"


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(module: str) -> list[tuple[str, str, int]]:
    """``(module imported, name imported or "", line)`` for every import at any depth."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name.startswith("jmp_policy")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            if not base.startswith("jmp_policy"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub, "", node.lineno) if sub in MODULES else (base, alias.name, node.lineno))
    return found


def _private(module: str, name: str) -> bool:
    return any(part.startswith("_") and part != "__init__" for part in module.split(".")) \
        or name.startswith("_")


def test_no_private_name_is_imported_across_packages():
    crossings = [
        f"{MODULES[m].relative_to(ROOT.parent)}:{line} imports {imported}{'.' + name if name else ''}"
        for m in MODULES for imported, name, line in _imports(m)
        if _package(imported) != _package(m) and _private(imported, name)
    ]
    assert not crossings, "\n".join(crossings)


def test_packages_import_only_downwards():
    upwards = [
        f"{MODULES[m].relative_to(ROOT.parent)}:{line} ({_package(m)}) imports {imported} "
        f"({_package(imported)})"
        for m in MODULES for imported, _, line in _imports(m)
        if m != "jmp_policy" and LAYERS.index(_package(imported)) > LAYERS.index(_package(m))
    ]
    assert not upwards, "\n".join(upwards)


def test_no_import_circles():
    graph = {m: {i for i, _, _ in _imports(m) if i in MODULES and i != m} for m in MODULES}
    # A package's __init__ re-exports its modules: an edge from a module to its own package's
    # __init__ (or to the top-level package) is a circle through the re-export.
    cycles = []
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(" -> ".join(stack[stack.index(n):] + [n]))
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.rpartition(".")[2].startswith("_")))
def test_every_public_module_says_what_it_exports(module):
    tree = ast.parse(MODULES[module].read_text())
    names = {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
             if isinstance(t, ast.Name)}
    assert "__all__" in names, f"{module} has no __all__"

"""MkDocs hooks (mkdocs.yml `hooks:`): pages rendered from data, and checks.

Directives, written as HTML comments on a line of their own in a page:

``<!-- benchmarks -->``
    Every benchmark report in ``benchmarks/results/*.json`` (the files the
    benchmark scripts write; smoke runs, ``*.quick.json`` / ``*.smoke.json``,
    are left out) as markdown: provenance (command, date, commit, device,
    versions) and tables, less the tables that ``benchmark:`` directives of
    the same page already show (a report they show whole is left out). Each
    report's heading has the anchor ``report-<file name>`` (non-word
    characters as ``-``). Nothing on the Benchmarks page is copied by hand.

``<!-- benchmark: FILE TABLE_ID [TABLE_ID ...] -->``
    The named tables of one report (``FILE`` relative to
    ``benchmarks/results/``), with a line of provenance naming the file. A report that is not
    in this checkout becomes a note saying how to measure it; a table id that
    the report does not have is a build warning (an error under ``--strict``).

``<!-- example-results: FILE -->``
    The summary table of an example's ``results.json`` (``FILE`` relative to
    ``docs/``), with the command that wrote it.

``<!-- api-index -->``
    Every documented name of ``docs/api/*.md``, page by page, with the first
    line of its docstring (read statically with griffe).

Checks (warnings, so ``mkdocs build --strict`` fails on them): every name in
``jmp_policy.__all__``, ``jmp_policy.flax.__all__`` and
``jmp_policy.autocast.__all__`` has a ``::: name`` entry in ``docs/api/``.

The tables are drawn by ``benchmarks.harness``'s own ``render_table``, so
the page and ``python -m benchmarks.harness render`` agree.
"""

from __future__ import annotations

import ast
import glob
import importlib
import json
import logging
import math
import os
import re
import sys
from typing import Any

log = logging.getLogger("mkdocs.hooks.jmp_policy")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
DIRECTIVE = re.compile(
    r"^<!-- (benchmarks|benchmark|example-results|api-index)(?::\s*(.*?))?\s*-->$", re.M)

_harness: Any = None
# The versions shown first; the rest of a report's packages are the peers measured.
_OURS = ("jax", "jaxlib", "optax", "flax", "jmp_policy")


def _load_harness() -> Any:
    """``benchmarks.harness``, imported from this checkout (mkdocs loads this file by
    path, so the repository root need not be on ``sys.path`` yet)."""
    global _harness
    if _harness is None:
        if ROOT not in sys.path:
            sys.path.insert(0, ROOT)
        _harness = importlib.import_module("benchmarks.harness")
    return _harness


# --------------------------------------------------------------------------- #
# Benchmark reports.
# --------------------------------------------------------------------------- #

def report_files() -> list[str]:
    """The committed kind of report: full runs, not smoke runs."""
    files = glob.glob(os.path.join(RESULTS, "*.json"))
    return sorted(f for f in files if not f.endswith((".quick.json", ".smoke.json")))


def _load(path: str) -> dict[str, Any]:
    with open(path) as f:
        payload = json.load(f)
    if payload.get("schema") != "jmp_policy-benchmark/1":
        raise ValueError(f"{path}: not a jmp_policy-benchmark/1 report")
    return payload


def _device(env: dict[str, Any]) -> str:
    kind, backend, count = env.get("device_kind"), env.get("backend"), env.get("device_count")
    text = f"{kind}" + (f" x {count}" if count and count != 1 else "")
    if backend and str(backend).lower() not in str(kind).lower():
        text += f" ({backend})"
    return text


def report_anchor(path: str) -> str:
    """The anchor of a report's heading on the Benchmarks page."""
    return "report-" + re.sub(r"[^\w-]", "-", os.path.basename(path).removesuffix(".json"))


def provenance(payload: dict[str, Any], *, short: bool = False, name: str = "") -> str:
    """Where, when, with what and by which command a report was measured."""
    env = payload.get("environment", {})
    commit = env.get("git_commit") or "unknown"
    dirty = " with uncommitted changes" if env.get("git_dirty") else ""
    date = str(env.get("date") or "unknown date").replace("T", " ").replace("+00:00", " UTC")
    packages = env.get("packages") or {}
    ours = {k: v for k, v in packages.items() if k in _OURS or k.startswith(("jax-cuda", "jax_cuda"))}
    versions = ", ".join(f"{k} {v}" for k, v in ours.items()) or "not recorded"
    command = payload.get("command", "?")
    if short:
        report = f"Report `{name}` (`benchmarks/results/`), measured" if name else "Measured"
        return (f"<small>{report} {date} on {_device(env)}, commit `{commit}`{dirty}; "
                f"{versions}. Command: `{command}`. All reports: [Benchmarks](benchmarks.md).</small>")
    host = []
    if env.get("host_cpus"):
        host.append(f"{env['host_cpus']} host CPUs")
    if env.get("load_average"):
        host.append(f"load average {env['load_average'][0]}")
    rows = [("Command", f"`{command}`"),
            ("Measured", f"{date}, commit `{commit}`{dirty}"),
            ("Device", _device(env) + (f"; {', '.join(host)}" if host else "")),
            ("Versions", versions + (f"; Python {env['python']}" if env.get("python") else ""))]
    if env.get("xla_flags"):
        rows.append(("XLA_FLAGS", f"`{env['xla_flags']}`"))
    others = {k: v for k, v in packages.items() if k not in ours and k not in ("numpy", "chex")}
    if others:
        rows.append(("Peers", ", ".join(f"{k} {v}" for k, v in others.items())))
    return "\n".join(f"- **{k}**: {v}" for k, v in rows)


def _table(payload: dict[str, Any], table: dict[str, Any], level: str = "####") -> list[str]:
    harness = _load_harness()
    out = [f"{level} {table['title']}", ""]
    if table.get("description"):
        out += [table["description"], ""]
    out += ['<div class="benchmark" markdown>', "", harness.render_table(table), "", "</div>", ""]
    if table.get("baseline"):
        out += [f"<small>Ratios are to the baseline row, `{table['baseline']}`, "
                "measured in the same run.</small>", ""]
    return out


def render_report(payload: dict[str, Any], path: str, skip: frozenset[str] = frozenset()) -> str:
    """A whole report, less the tables ``skip`` names ("" if that leaves none)."""
    name = os.path.basename(path)
    tables = [t for t in payload.get("tables", []) if t["id"] not in skip]
    if skip and not tables:
        return ""
    out = [f"### {payload['benchmark']}: `{name}` {{ #{report_anchor(path)} }}", ""]
    if payload.get("description"):
        out += [payload["description"], ""]
    out += [provenance(payload), ""]
    if payload.get("notes"):
        out += ["Notes:", ""] + [f"- {note}" for note in payload["notes"]] + [""]
    if skip:
        out += [f"Tables shown earlier on this page: {', '.join(sorted(skip))}.", ""]
    for table in tables:
        out += _table(payload, table)
    if payload.get("failed"):
        out += ["Did not run:", ""] + [f"- {f['name']}: `{f['error']}`" for f in payload["failed"]]
        out.append("")
    return "\n".join(out)


def render_all_reports(shown: dict[str, set[str]] | None = None) -> str:
    """Every report; ``shown``: the tables of each file already on the page."""
    shown = shown or {}
    files = report_files()
    if not files:
        return ("!!! note \"No reports\"\n    No benchmark report in `benchmarks/results/`: "
                "run a script of `benchmarks/` (see its README).\n")
    loaded = []
    for path in files:
        try:
            loaded.append((path, _load(path)))
        except (ValueError, KeyError) as e:  # json.JSONDecodeError is a ValueError
            log.warning("benchmarks/results/%s is not a readable report: %s",
                        os.path.basename(path), e)
    gpu = [(p, r) for p, r in loaded if r["environment"].get("backend") not in ("cpu", None)]
    cpu = [(p, r) for p, r in loaded if (p, r) not in gpu]
    out = []
    for title, group, intro in [
        ("GPU", gpu, "Step times measured on a GPU: these are the figures that say what half "
                     "precision and loss scaling cost."),
        ("CPU", cpu, "XLA's figures (bytes accessed, instruction counts, copies, memory) are "
                     "deterministic; wall and compile times on a shared CPU are noisy, and CPU "
                     "step times say nothing about half-precision speed (CPUs emulate it)."),
    ]:
        if not group:
            continue
        rendered = [render_report(r, p, frozenset(shown.get(os.path.basename(p), ())))
                    for p, r in group]
        rendered = [text for text in rendered if text]
        if not rendered:
            continue
        out += [f"## {title}", "", intro, ""]
        out += rendered
    return "\n".join(out)


def _writer(name: str) -> str:
    """The script that writes the report ``name``: the longest ``benchmarks/*.py`` whose
    name starts it (``bench_fp8_training_moe.json``: ``bench_fp8``)."""
    stem = name.split(".")[0]
    scripts = [os.path.basename(f)[:-3] for f in glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))]
    found = [s for s in scripts if stem == s or stem.startswith(s + "_")]
    return f"`python -m benchmarks.{max(found, key=len)}`" if found else "a benchmark"


def render_tables(spec: str) -> str:
    parts = spec.split()
    if len(parts) < 2:
        log.warning("benchmark directive needs a file and table ids: %r", spec)
        return ""
    name, ids = parts[0], parts[1:]
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        log.info("benchmark report %s is not in this checkout", name)
        return (f"!!! note \"Not measured in this checkout\"\n"
                f"    `benchmarks/results/{name}` is not here yet: {_writer(name)} writes it "
                f"(benchmarks/README.md).\n")
    payload = _load(path)
    tables = {t["id"]: t for t in payload["tables"]}
    out = []
    for table_id in ids:
        if table_id not in tables:
            log.warning("benchmarks/results/%s has no table %r (it has: %s)",
                        name, table_id, ", ".join(tables))
            continue
        out += _table(payload, tables[table_id], level="#####")
    out += [provenance(payload, short=True, name=name), ""]
    return "\n".join(out)


# --------------------------------------------------------------------------- #
# Example results.
# --------------------------------------------------------------------------- #

def _scale(value: float) -> str:
    exponent = math.log2(value) if value > 0 else 0.5
    return f"2<sup>{int(exponent)}</sup>" if exponent == int(exponent) and value != 1 else f"{value:g}"


def render_example(spec: str) -> str:
    path = os.path.join(ROOT, "docs", spec.strip())
    if not os.path.exists(path):
        log.warning("example results %s not found", spec)
        return ""
    with open(path) as f:
        payload = json.load(f)
    lines = ['<div class="names" markdown>', "",
             "| policy (loss scaling) | test accuracy | final loss | zero gradients "
             "| skipped steps | final scale |", "|---|---|---|---|---|---|"]
    for r in payload["results"]:
        name = r["policy"].split(",loss_scale=")[0]
        lines.append(f"| `{name}` ({r['loss_scale']}) | {100 * r['test_accuracy']:.2f}% "
                     f"| {r['final_loss']:.4f} | {100 * r['zero_grad_fraction']:.1f}% "
                     f"| {r['skipped_steps']} | {_scale(r['final_loss_scale'])} |")
    lines += ["", "</div>", "", f"<small>Made by `{payload.get('command', '?')}` on {payload.get('device', '?')}, "
                  f"jax {payload.get('jax', '?')}"
                  + (f", {payload['date']}" if payload.get("date") else "")
                  + ". Final loss: mean of the last 20 steps; zero gradients: the fraction of "
                    "gradient entries exactly 0, over all steps.</small>", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- #
# Hooks.
# --------------------------------------------------------------------------- #

def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    shown: dict[str, set[str]] = {}
    for match in DIRECTIVE.finditer(markdown):
        if match.group(1) == "benchmark":
            name, *ids = (match.group(2) or "").split()
            shown.setdefault(name, set()).update(ids)

    def replace(match: re.Match[str]) -> str:
        kind, arg = match.group(1), match.group(2) or ""
        if kind == "benchmarks":
            return render_all_reports(shown)
        if kind == "benchmark":
            return render_tables(arg)
        if kind == "api-index":
            return render_api_index()
        return render_example(arg)

    return DIRECTIVE.sub(replace, markdown)


def public_names() -> dict[str, list[str]]:
    """``__all__`` of the public modules, read from their source (nothing is imported)."""
    out = {}
    for module, path in [("jmp_policy", "jmp_policy/__init__.py"),
                         ("jmp_policy.flax", "jmp_policy/flax/__init__.py"),
                         ("jmp_policy.autocast", "jmp_policy/autocast/__init__.py"),
                         ("jmp_policy.formats", "jmp_policy/formats.py")]:
        with open(os.path.join(ROOT, path)) as f:
            tree = ast.parse(f.read())
        names: list[str] = []
        for node in tree.body:
            if (isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)):
                names = list(ast.literal_eval(node.value))
        out[module] = names
    return out


def _summary(obj: Any) -> str:
    try:
        doc = obj.docstring
    except Exception:  # an alias griffe cannot resolve
        doc = None
    if doc is None or not doc.value.strip():
        value = getattr(obj, "value", None)
        return f"Same as `{value}`." if value is not None else ""
    first = doc.value.strip().split("\n\n")[0]
    return " ".join(first.split())


def render_api_index() -> str:
    import griffe

    package = griffe.load("jmp_policy", search_paths=[ROOT], resolve_aliases=True,
                          resolve_external=False)
    titles = {"policies.md": 0, "loss-scaling.md": 1, "low-precision.md": 2, "float8.md": 3,
              "autocast.md": 4, "inspector.md": 5, "formats.md": 6, "flax.md": 7}
    out = []
    pages = sorted(glob.glob(os.path.join(ROOT, "docs", "api", "*.md")),
                   key=lambda p: (titles.get(os.path.basename(p), 99), p))
    for path in pages:
        if os.path.basename(path) == "index.md":
            continue
        with open(path) as f:
            text = f.read()
        title = text.splitlines()[0].lstrip("# ").strip()
        names = re.findall(r"^::: ([\w.]+)", text, flags=re.M)
        out += [f"## [{title}]({os.path.basename(path)})", "", '<div class="names" markdown>', "",
                "| name | summary |", "|---|---|"]
        for full in names:
            obj: Any = package
            try:
                for part in full.split(".")[1:]:
                    obj = obj[part]
            except KeyError:
                log.warning("docs/api/%s documents %s, which does not exist",
                            os.path.basename(path), full)
                continue
            short = full[len("jmp_policy."):]
            head, _, last = short.rpartition(".")
            if head.endswith(last):  # autocast.autocast: the function jmp_policy.autocast
                short = last
            out.append(f"| [`{short}`][{full}] | {_summary(obj)} |")
        out += ["", "</div>", ""]
    return "\n".join(out)


def documented_names() -> set[str]:
    found = set()
    for path in glob.glob(os.path.join(ROOT, "docs", "api", "*.md")):
        with open(path) as f:
            found.update(re.findall(r"^::: ([\w.]+)", f.read(), flags=re.M))
    return found


def missing_api_names() -> list[str]:
    documented = documented_names()
    missing = []
    for module, names in public_names().items():
        for name in names:
            if f"{module}.{name}" in documented:
                continue
            if module == "jmp_policy.autocast" and f"jmp_policy.{name}" in documented:
                continue  # re-exported at the top level and documented there
            if f"{module}.{name}.{name}" in documented:
                continue  # jmp_policy.autocast: the function, which its package also holds
            missing.append(f"{module}.{name}")
    return missing


def unknown_api_names() -> list[str]:
    """Documented names that are not public (renamed or removed since)."""
    public = {f"{module}.{name}" for module, names in public_names().items() for name in names}
    public |= {f"jmp_policy.{name}" for name in public_names()["jmp_policy.autocast"]}
    public |= {f"{name}.{name.rsplit('.', 1)[1]}" for name in list(public)}
    return sorted(documented_names() - public)


def on_files(files: Any, config: Any) -> Any:
    for name in missing_api_names():
        log.warning("public name %s has no '::: %s' entry in docs/api/*.md", name, name)
    for name in unknown_api_names():
        log.warning("docs/api/*.md documents %s, which is not in its module's __all__", name)
    return files

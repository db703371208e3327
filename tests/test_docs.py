"""Every ``python`` code block of README.md and docs/ runs, and asserts what it shows.

Conventions (docs/writing-docs.md):

* A fence opened with exactly ```` ```python ```` is run. The blocks of one
  page run top to bottom in one namespace, as a reader would run them, so a
  page can build on its earlier blocks. Each page is one test (pages run in
  parallel under ``pytest -n``).
* Every block that runs contains an ``assert`` (or a ``np.testing.assert_*``
  call, or ``pytest.raises``): it checks what it shows, not only that it runs.
* Python that must not run (another library's code in a migration guide) is
  fenced ```` ```{.python .no-run} ````. Any other fence whose language starts
  with ``py`` is an error, so that no block is skipped by accident.
* jmp_policy's own warnings (``UnmatchedRuleWarning``, ``AutocastWarning``)
  are errors inside blocks, unless a block catches them itself.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest

import jmp_policy

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md"] + sorted(DOCS.rglob("*.md"))

RUN = "python"
NO_RUN = "{.python .no-run}"
# A fence at any indentation (content tabs and admonitions indent theirs).
FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ ]*$",
                   re.M | re.S)


@dataclasses.dataclass
class Block:
    page: pathlib.Path
    line: int  # 1-based line of the first line of code
    info: str
    code: str
    in_grid: bool = False  # one of two side-by-side columns

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: pathlib.Path) -> list[Block]:
    text = page.read_text()
    out = []
    for m in FENCE.finditer(text):
        indent = len(m.group("indent"))
        body = "".join(line[indent:] if line[:indent].strip() == "" else line
                       for line in m.group("body").splitlines(keepends=True))
        line = text.count("\n", 0, m.start("body")) + 1
        before = text[:m.start()]
        in_grid = before.rfind('<div class="grid"') > before.rfind("</div>")
        out.append(Block(page, line, m.group("info").strip(), body, in_grid))
    return out


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]
RUNNABLE = [b for b in ALL_BLOCKS if b.info == RUN]
# A README block that a docs page repeats verbatim (the train step of Getting
# started) runs there, with that page: it is not compiled twice.
_IN_DOCS = {b.code for b in RUNNABLE if b.page != ROOT / "README.md"}
TO_RUN = [b for b in RUNNABLE if b.page != ROOT / "README.md" or b.code not in _IN_DOCS]
PAGES_WITH_CODE = sorted({b.page for b in TO_RUN}, key=lambda p: (p != ROOT / "README.md", p))


def _asserts(code: str) -> bool:
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Assert):
            return True
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name.startswith("assert") or name in ("raises", "warns"):
                return True
    return False


def test_docs_have_runnable_blocks():
    assert len(RUNNABLE) >= 30, len(RUNNABLE)
    assert any(b.page == ROOT / "README.md" for b in RUNNABLE)


def test_python_fences_follow_the_convention():
    bad = [f"{b.where}: ```{b.info}" for b in ALL_BLOCKS
           if b.info.lstrip("{.").startswith("py") and b.info not in (RUN, NO_RUN)]
    assert not bad, ("use ```python (runs) or ```{.python .no-run} (does not):\n" + "\n".join(bad))


def test_every_runnable_block_asserts_what_it_shows():
    missing = [b.where for b in RUNNABLE if not _asserts(b.code)]
    assert not missing, "blocks without an assertion:\n" + "\n".join(missing)


def test_code_fits_the_page_width():
    # Wider lines scroll sideways on the site: 88 characters fit the content
    # column, 64 one of two side-by-side columns (pages without side bars).
    long = [f"{b.where}+{n}: {len(line)} > {limit}" for b in ALL_BLOCKS
            if b.info in (RUN, NO_RUN) for limit in [64 if b.in_grid else 88]
            for n, line in enumerate(b.code.splitlines()) if len(line) > limit]
    assert not long, "\n".join(long)


def test_no_run_blocks_at_least_parse():
    # Other libraries' code is not run, but it must still be Python.
    for b in ALL_BLOCKS:
        if b.info == NO_RUN:
            ast.parse(b.code, filename=b.where)


# Pages whose blocks compare two compiled programs bit for bit, which holds where XLA
# rounds both alike: with its default code generator. The suite compiles with a faster
# one (conftest.py), so these run in a child process with the user's XLA flags.
DEFAULT_CODEGEN = {"docs/low_precision.md"}

_CHILD = """
import json, sys, warnings
import jmp_policy
namespace = {"__name__": "__docs__"}
for line, code, name in json.load(sys.stdin):
    with warnings.catch_warnings():
        warnings.simplefilter("error", jmp_policy.UnmatchedRuleWarning)
        warnings.simplefilter("error", jmp_policy.AutocastWarning)
        exec(compile("\\n" * (line - 1) + code, name, "exec", dont_inherit=True), namespace)
"""


def _run_in_child(page):
    blocks = [(b.line, b.code, str(b.page.relative_to(ROOT))) for b in TO_RUN if b.page == page]
    env = dict(os.environ, XLA_FLAGS=os.environ.get("JMP_POLICY_TESTS_USER_XLA_FLAGS", "")
               + " --xla_backend_optimization_level=0")
    out = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(blocks), env=env,
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]


@pytest.mark.slow  # a system test: the page's code, run in a child interpreter
@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_blocks_run(page):
    if str(page.relative_to(ROOT)) in DEFAULT_CODEGEN:
        _run_in_child(page)
        return
    namespace = {"__name__": "__docs__"}
    before_policy = jmp_policy.global_policy()
    before_env = dict(os.environ)
    try:
        for b in (b for b in TO_RUN if b.page == page):
            # Padding with newlines makes tracebacks point at the page's own lines.
            # dont_inherit: the page's code is not compiled with this module's
            # `from __future__ import annotations` (dataclass fields need real types).
            code = compile("\n" * (b.line - 1) + b.code, str(b.page.relative_to(ROOT)), "exec",
                           dont_inherit=True)
            with warnings.catch_warnings():
                warnings.simplefilter("error", jmp_policy.UnmatchedRuleWarning)
                warnings.simplefilter("error", jmp_policy.AutocastWarning)
                exec(code, namespace)
    finally:
        jmp_policy.set_global_policy(before_policy)
        os.environ.clear()
        os.environ.update(before_env)


# --------------------------------------------------------------------------- #
# Tables that state facts the code can check.
# --------------------------------------------------------------------------- #

def _table_rows(text: str, header_start: str) -> list[list[str]]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def _code_names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_policy_name_table_matches_the_library():
    """Each row of the name table in docs/policies.md: name -> params, compute, output."""
    rows = _table_rows((DOCS / "policies.md").read_text(), "| name")
    assert len(rows) >= 15
    half = np.dtype(jmp_policy.half_dtype()).name
    for row in rows:
        names, dtypes = _code_names(row[0]), row[1:4]
        assert names, row
        expected = [None if d.strip("*") == "input" else half if d == "half" else d.strip("`")
                    for d in dtypes]
        for name in names:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                p = jmp_policy.Policy(name)
            got = [None if d is None else d.name for d in
                   (p.param_dtype, p.compute_dtype, p.output_dtype)]
            assert got == expected, (name, got, expected)


def test_autocast_rules_table_matches_the_library():
    from jmp_policy.autocast import FLOAT32_PRIMITIVES, FOLLOW_PRIMITIVES, MATMUL_PRIMITIVES

    text = (DOCS / "autocast.md").read_text()
    rows = {r[0].strip("*"): r for r in _table_rows(text, "| class")}
    for cls, members in [("matmul", MATMUL_PRIMITIVES), ("float32", FLOAT32_PRIMITIVES),
                         ("follow", FOLLOW_PRIMITIVES)]:
        listed = [n for n in _code_names(rows[cls][1]) if re.fullmatch(r"[a-z_0-9]+", n)]
        assert listed, cls
        assert set(listed) <= set(members), (cls, set(listed) - set(members))


# --------------------------------------------------------------------------- #
# The site's structure.
# --------------------------------------------------------------------------- #

def _hooks():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_documents_every_public_name():
    hooks = _hooks()
    assert set(hooks.public_names()["jmp_policy"]) == set(jmp_policy.__all__)
    assert hooks.missing_api_names() == []
    assert hooks.unknown_api_names() == []


def test_benchmarks_page_renders_every_committed_report():
    hooks = _hooks()
    page = hooks.on_page_markdown((DOCS / "benchmarks.md").read_text(), None, None, None)
    assert "<!-- benchmarks -->" not in page
    for path in hooks.report_files():
        assert f"`{os.path.basename(path)}`" in page
    # No figure is typed into the page itself: its tables all come from JSON.
    assert "|---" not in (DOCS / "benchmarks.md").read_text()


def test_readme_train_step_is_the_getting_started_one():
    readme = [b.code for b in RUNNABLE if b.page == ROOT / "README.md"]
    guide = [b.code for b in RUNNABLE if b.page == DOCS / "getting-started.md"]
    assert len(readme) == 1 and readme[0] in guide
    assert len(readme[0].splitlines()) <= 25


def test_examples_page_figures_exist():
    for name in re.findall(r"\]\((img/[^)]+)\)", (DOCS / "examples.md").read_text()):
        assert (DOCS / name).exists(), name


def test_fp8_accuracy_tables_match_their_reports():
    """The accuracy tables typed into docs/fp8.md: each figure as its report has it."""
    text = (DOCS / "fp8.md").read_text()
    results = ROOT / "benchmarks" / "results"
    for header, report in [("| recipe | held-out", "bench_fp8_training_delayed.json")]:
        assert f"--json benchmarks/results/{report}" in text, report  # its command is shown
        table = json.loads((results / report).read_text())["tables"][0]
        figures = {r["name"]: r["figures"] for r in table["rows"]}
        base = figures[table["baseline"]]
        rows = _table_rows(text, header)
        assert len(rows) >= 4
        for name, held, held_pct, train, train_pct in rows:
            got = figures[name.strip("`\"")]
            assert float(held) == round(got["held_out_bpb"], 3), (report, name)
            assert float(train) == round(got["train_bpb"], 3), (report, name)
            for pct, key in [(held_pct, "held_out_bpb"), (train_pct, "train_bpb")]:
                expected = 100 * (got[key] / base[key] - 1)
                assert (pct == "" if got is base else
                        pct == f"{expected:+.1f}%"), (report, name, pct, expected)


def test_nvfp4_ablation_table_matches_its_reports():
    """The 2000-step table of docs/fp8.md: each figure as one of its two reports has it."""
    text = (DOCS / "fp8.md").read_text()
    runs = {}
    for report in ("bench_fp8_training_nvfp4.json", "bench_fp8_training_nvfp4_defaults.json",
                   "bench_fp8_training_nvfp4_four_over_six.json",
                   "bench_fp8_training_nvfp4_combined.json"):
        assert f"--json benchmarks/results/{report}" in text, report  # its command is shown
        table = json.loads((ROOT / "benchmarks" / "results" / report).read_text())["tables"][0]
        for row in table["rows"]:
            runs.setdefault(row["name"], row)
    base = runs["mixed_bfloat16"]["figures"]

    def pct(value, key):
        return f"{100 * (value / base[key] - 1):+.1f}%"

    rows = _table_rows(text, "| recipe (2000 steps, 5 seeds)")
    assert len(rows) >= 12
    for name, held, held_pct, worst, plain, train in rows:
        run = runs[name.strip("`\"")]
        got, samples = run["figures"], run["samples"]
        assert held == f"{got['held_out_bpb']:.3f}", name
        assert plain.split()[0] == f"{got['held_out_plain_bpb']:.3f}", name
        assert train.split()[0] == f"{got['train_bpb']:.3f}", name
        if got is base:
            continue
        assert held_pct == pct(got["held_out_bpb"], "held_out_bpb"), name
        assert plain.split()[1] == f"({pct(got['held_out_plain_bpb'], 'held_out_plain_bpb')})"
        base_seeds = runs["mixed_bfloat16"]["samples"]["held_out_bpb"]
        per_seed = max(h / b - 1 for h, b in zip(samples["held_out_bpb"], base_seeds))
        assert worst == f"{100 * per_seed:+.1f}%", name

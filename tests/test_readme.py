"""The README: short, the two quick-start commands, links that resolve.

Its Python code runs in tests/test_docs.py (with the documentation's) and
type-checks in tests/test_typing.py.
"""

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TEXT = README.read_text()


def test_readme_is_short():
    assert len(TEXT.splitlines()) <= 200


def test_readme_has_the_two_quick_start_commands():
    assert ('python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[examples]" '
            "&& python examples/train_digits.py") in TEXT
    command = re.search(r"<!-- test-command:start -->\n```bash\n(.*)\n```\n<!-- test-command:end -->",
                        TEXT).group(1)
    assert command.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install -e")
    assert '".[test,docs]"' in command
    assert "python -m pytest" in command and command.endswith("mkdocs build --strict")


def test_ci_runs_the_readme_test_command():
    # .ci/run extracts the line between the markers: check it finds exactly that line.
    script = (ROOT / ".ci" / "run").read_text()
    extract = script[script.index("cmd=\"$(") + len("cmd=\"$("):script.index(")\"\nif")]
    out = subprocess.run(["bash", "-c", extract], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out.splitlines() == [re.search(r"<!-- test-command:start -->\n```bash\n(.*)\n", TEXT)
                                .group(1)]


def test_readme_links_resolve():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", TEXT):
        if "://" not in target:
            assert (ROOT / target).exists(), target

"""Every Python snippet in README.md runs (each in a fresh namespace)."""

import pathlib
import re

import pytest

import jmp_policy

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
SNIPPETS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_readme_has_snippets_and_the_two_quick_start_commands():
    text = README.read_text()
    assert len(SNIPPETS) >= 5
    assert 'pip install -e ".[examples]" && python examples/train_digits.py' in text
    assert "<!-- test-command:start -->" in text and 'pip install -e ".[test]"' in text


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs(index):
    before = jmp_policy.global_policy()
    try:
        exec(compile(SNIPPETS[index], f"README.md snippet #{index}", "exec"), {"__name__": "__readme__"})
    finally:
        jmp_policy.set_global_policy(before)

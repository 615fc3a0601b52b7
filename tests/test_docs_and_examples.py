"""README's snippets and the examples run as written (on the CPU in CI)."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def readme_snippet(heading: str) -> str:
    """The first python block after ``heading`` in README.md."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index(heading):]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]


@pytest.mark.parametrize("heading", ["## A tour of the API",
                                     "## A model's step, and shared indexer layers"])
def test_readme_snippet_runs(heading):
    exec(compile(readme_snippet(heading), "README.md", "exec"), {})


@pytest.mark.parametrize("first_line", ["# Export", "# Prefill"])
def test_readme_snippet_after_the_tour_runs(first_line):
    """The snippets that continue the tour ("Export": AOTInductor in tests/test_export.py)."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    snippet = next(b for b in blocks if b.startswith(first_line))
    exec(compile(blocks[0] + snippet, "README.md", "exec"), {})


@pytest.mark.parametrize("args", [["examples/decode.py", "--steps", "3", "--device", "cpu"],
                                  ["examples/prefill.py", "--device", "cpu"],
                                  ["examples/model_decode.py", "--layers", "4", "--steps", "2",
                                   "--device", "cpu"]])
def test_example_runs_on_cpu(args):
    result = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dcp_example_runs_on_two_cpu_processes():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "examples/dcp_decode.py"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("selects 64 keys") == 2, result.stdout


def test_readme_names_resolve_after_import_dsa():
    """Every ``dsa.<name>`` README mentions is an attribute chain reachable from a bare
    ``import dsa`` (a fresh process: other tests' imports of subpackages do not count)."""
    names = sorted(set(re.findall(r"(?<![\w.:])dsa\.[A-Za-z_][\w.]*[\w]",
                                  (ROOT / "README.md").read_text())))
    check = ("import functools, sys, dsa\n"
             "missing = [n for n in sys.argv[1:] if functools.reduce(\n"
             "    lambda obj, part: getattr(obj, part, None), n.split('.')[1:], dsa) is None]\n"
             "print(missing)\n")
    result = subprocess.run([sys.executable, "-c", check, *names], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout

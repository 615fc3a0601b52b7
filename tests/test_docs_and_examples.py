"""README's snippet and the examples run as written (on the CPU in CI)."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_snippet_runs():
    readme = (ROOT / "README.md").read_text()
    tour = re.findall(r"```python\n(.*?)```", readme, flags=re.S)[0]  # the runnable one
    exec(compile(tour, "README.md", "exec"), {})


def test_readme_export_snippet_runs():
    """The "Export" snippet, after the tour it continues (AOTInductor: tests/test_export.py)."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    export = next(b for b in blocks if b.startswith("# Export"))
    exec(compile(blocks[0] + export, "README.md", "exec"), {})


@pytest.mark.parametrize("args", [["examples/decode.py", "--steps", "3", "--device", "cpu"],
                                  ["examples/prefill.py", "--device", "cpu"]])
def test_example_runs_on_cpu(args):
    result = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr

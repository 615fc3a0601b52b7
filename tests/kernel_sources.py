"""Inductor's copies of dsa's Triton kernels: whether each is self-contained.

A traced ``triton_op`` (``DSA_TRITON_OP=1``) reaches Inductor as kernel calls; Inductor
compiles each kernel from a copy of its source plus what it finds the kernel reach (other
``@triton.jit`` functions, constexpr globals, names imported from triton), not from dsa's
modules. A helper that loads any other global (a module, a plain function) compiles in dsa
and fails there. ``undefined_globals()`` lists, for every ``*_kernel`` in ``dsa.ops``, the
globals its copy loads but does not define; ``python -m tests.kernel_sources`` prints them
as JSON (real Triton kernels are needed: not under ``TRITON_INTERPRET``).
"""

from __future__ import annotations

import builtins
import dis
import importlib.util
import json
import sys
import tempfile
import types
from pathlib import Path

from torch._inductor.codegen.wrapper import (
    user_defined_triton_kernel_transitive_closure_source_code as inductor_copy,
)
from triton.runtime.jit import JITFunction

import dsa.ops  # noqa: F401  (imports every op module)


def _kernels() -> dict[str, JITFunction]:
    found: dict[str, JITFunction] = {}
    for name, module in sorted(sys.modules.items()):
        if name.startswith("dsa.ops"):
            for attr, value in vars(module).items():
                if isinstance(value, JITFunction) and attr.endswith("_kernel"):
                    found.setdefault(f"{name}.{attr}", value)
    return found


def undefined_globals() -> dict[str, list[str]]:
    """``{kernel: [function.global, ...]}`` for the kernels whose copy loads an undefined
    global (empty when every copy is self-contained)."""
    missing: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, kernel) in enumerate(_kernels().items()):
            path = Path(tmp) / f"copy_{i}.py"
            path.write_text("import triton\nimport triton.language as tl\n" + inductor_copy(kernel))
            spec = importlib.util.spec_from_file_location(f"copy_{i}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            names = vars(module)
            for value in list(names.values()):
                fn = getattr(value, "fn", None)
                if not isinstance(fn, types.FunctionType):
                    continue
                for inst in dis.get_instructions(fn):
                    if (inst.opname == "LOAD_GLOBAL" and inst.argval not in names
                            and not hasattr(builtins, inst.argval)):
                        missing.setdefault(name, []).append(f"{fn.__name__}.{inst.argval}")
    return missing


if __name__ == "__main__":
    print(json.dumps({"kernels": len(_kernels()), "undefined": undefined_globals()}))

"""The package layout's rules, read from the sources with ``ast`` (no import, no process).

* The core library (everything but ``toolkit/dsat`` and the launcher CLI ``toolkit/run/``, which
  spawns ranks with dsat's argv builders and process bookkeeping) imports of dsat only
  ``toolkit.dsat.contract`` and ``toolkit.dsat.trial``: a training script never loads the tuner.
* No private name (``_name``) is imported from another package.
* Modules stay under 400 lines; functions under 60 (docstring included) unless their docstring
  says why (a line starting ``Long because``).
* One definition of the integer check and of the atomic write.
"""

from __future__ import annotations

import ast
from pathlib import Path

import procutil as p

TOOLKIT = p.REPO / "toolkit"
SOURCES = sorted(TOOLKIT.rglob("*.py"))


def _module(path: Path) -> str:
    parts = path.relative_to(p.REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str:
    """The concern a module belongs to: toolkit.<pkg> (toolkit.dsat.<sub> inside dsat)."""
    parts = module.split(".")
    if parts[:2] == ["toolkit", "dsat"] and len(parts) > 3:
        return ".".join(parts[:3])
    return ".".join(parts[:2])


def _imports(path: Path):
    """(imported module, name or None, line) for every toolkit import of ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("toolkit"):
            for alias in node.names:
                yield node.module, alias.name, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("toolkit"):
                    yield alias.name, None, node.lineno


def test_the_core_library_never_imports_the_tuner():
    allowed = ("toolkit.dsat.contract", "toolkit.dsat.trial")
    bad = []
    for path in SOURCES:
        if _module(path).startswith(("toolkit.dsat", "toolkit.run")):
            continue
        for module, name, line in _imports(path):
            target = f"{module}.{name}" if module == "toolkit.dsat" and name else module
            if target.startswith("toolkit.dsat") and not target.startswith(allowed):
                bad.append(f"{path.relative_to(p.REPO)}:{line} imports {target}")
    assert not bad, bad


# toolkit's private modules of shared helpers, used by every package
SHARED = ("_checks", "_files", "_names")


def test_no_private_name_is_imported_across_packages():
    bad = []
    for path in SOURCES:
        here = _package(_module(path))
        for module, name, line in _imports(path):
            names = [name] if name else []
            private = [n for n in names if n.startswith("_") and not n.startswith("__") and n not in SHARED]
            private_module = any(part.startswith("_") and part not in ("__init__",) and
                                 part not in SHARED for part in module.split("."))
            if (private or private_module) and _package(module) != here:
                bad.append(f"{path.relative_to(p.REPO)}:{line} imports {module}.{name or ''} from {here}")
    assert not bad, bad


def test_modules_and_functions_stay_small():
    big_modules = [f"{s.relative_to(p.REPO)} ({n} lines)" for s in SOURCES
                   if (n := len(s.read_text().splitlines())) >= 400]
    long_functions = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                why = any(line.strip().startswith("Long because") for line in
                          (ast.get_docstring(node) or "").splitlines())
                if length > 60 and not why:
                    long_functions.append(f"{path.relative_to(p.REPO)}:{node.lineno} {node.name} ({length})")
    assert not big_modules and not long_functions, (big_modules, long_functions)


def test_one_integer_check_and_one_atomic_write():
    defined = {"is_int": [], "atomic_write": [], "atomic_write_json": []}
    replaces = []
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") in defined:
                defined[node.name.lstrip("_")].append(str(path.relative_to(p.REPO)))
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "replace" and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "os"):
                replaces.append(f"{path.relative_to(p.REPO)}:{node.lineno}")
    assert defined == {"is_int": ["toolkit/_checks.py"], "atomic_write": ["toolkit/_files.py"],
                       "atomic_write_json": ["toolkit/_files.py"]}, defined
    assert replaces == [f"toolkit/_files.py:{_line_of('os.replace(tmp', TOOLKIT / '_files.py')}"], replaces


def _line_of(text: str, path: Path) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)

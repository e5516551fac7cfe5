"""The package layout's rules, read from the sources with ``ast`` (no import, no process).

* Imports point one way, down the layers (:data:`LAYERS`): the core library (``config``,
  ``runtime``, ``checkpoint``, ``metrics`` and toolkit's top-level modules), then ``launch``
  (process launching shared by dsat and ``toolkit.run``), then ``dsat``, then the public facade
  ``toolkit`` and ``compat``, then ``run``. A module imports only its own layer or those below:
  a training script never loads the tuner, and the tuner never loads the Determined layer.
* No private name (``_name``) is imported from another package.
* Modules over 400 lines and functions over 60 (docstring included, unless their docstring says
  why in a line starting ``Long because``) are reported as hints to split by meaning, not failures.
* One definition of the integer check and of the atomic write.
* No circle: none between the wings (core, launch, dsat, the facade, compat, run), none among the
  modules at import time but the one checkpoint/api.py documents; following toolkit.run's config
  from its command line to a trial's launch stays in run/, launch/ and the core.
* No two modules share a file name outside compat/ (which keeps Determined's module names).
* Docstrings take at most 18% of toolkit's lines, and no module docstring more than 15.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

from helpers import procutil

TOOLKIT = procutil.REPO / "toolkit"
SOURCES = sorted(TOOLKIT.rglob("*.py"))


def _module(path: Path) -> str:
    parts = path.relative_to(procutil.REPO).with_suffix("").parts
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


#: Layers from the bottom up; a module may import its own layer and those below, never one above.
LAYERS = {"core": 0, "toolkit.launch": 1, "toolkit.dsat": 2, "toolkit": 3, "toolkit.compat": 3,
          "toolkit.run": 4}
#: The same rule by name (issue 28): no core module imports launch, dsat, compat or run; launch
#: imports none of dsat, compat or run; dsat imports neither compat nor run; run (Determined's
#: runner) imports nothing of dsat (issue 40: what both runners share is in launch).
NEVER = {"core": ("toolkit.dsat", "toolkit.compat", "toolkit.run", "toolkit.launch"),
         "toolkit.launch": ("toolkit.dsat", "toolkit.compat", "toolkit.run"),
         "toolkit.dsat": ("toolkit.compat", "toolkit.run"),
         "toolkit.run": ("toolkit.dsat",)}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _layer(module: str) -> str:
    """The layer of a toolkit module: its package among :data:`LAYERS`, else the core."""
    if module == "toolkit":
        return "toolkit"
    return next((top for top in LAYERS if top not in ("core", "toolkit") and _within(module, top)), "core")


def _targets(path: Path):
    """(imported toolkit module, line) for every toolkit import of ``path`` (``from toolkit import
    _names`` imports ``toolkit._names``, ``from toolkit import dsat`` imports ``toolkit.dsat``)."""
    for module, name, line in _imports(path):
        yield (f"{module}.{name}" if module == "toolkit" and name else module), line


def _runs_up(module: str, path: Path, allowed: tuple[str, ...] = ()) -> list[str]:
    """The imports of ``path`` (module ``module``) that run up the layers or into a package
    :data:`NEVER` lists for its layer, as ``"file:line (layer) imports target (layer)"``."""
    layer, bad = _layer(module), []
    for target, line in _targets(path):
        if any(_within(target, exception) for exception in allowed):
            continue
        there = _layer(target)
        if LAYERS[there] > LAYERS[layer] or any(_within(target, pkg) for pkg in NEVER.get(layer, ())):
            bad.append(f"{path.name}:{line} ({layer}) imports {target} ({there})")
    return bad


def test_imports_point_one_way():
    allowed: tuple[str, ...] = ()   # no exception: every import runs down the layers
    bad = [f"{path.relative_to(procutil.REPO).parent}/{where}" for path in SOURCES
           for where in _runs_up(_module(path), path, allowed)]
    assert not bad, bad


def test_the_layer_rule_sees_an_import_that_runs_up(tmp_path):
    """The rule is not vacuous: the imports issue 28 removed are caught, a downward one is not."""
    assert [_layer(m) for m in ("toolkit.config.experiment", "toolkit.errors", "toolkit._names",
                                "toolkit.launch.procs", "toolkit.dsat.trial.oom", "toolkit",
                                "toolkit.compat.determined.info", "toolkit.run.cli", "toolkit.runtime")] == \
        ["core", "core", "core", "toolkit.launch", "toolkit.dsat", "toolkit", "toolkit.compat", "toolkit.run",
         "core"]
    source = tmp_path / "mod.py"
    cases = {
        ("toolkit.config.experiment", "from toolkit.dsat.contract import OUTPUT_DIR_ENV"): 1,
        ("toolkit.runtime.context", "def f():\n    from toolkit.dsat.trial.oom import hook"): 1,
        ("toolkit.dsat.execution.runner", "from toolkit.compat.determined.launch import unwrap_launcher"): 1,
        ("toolkit.launch.argv", "import toolkit.run.plan"): 1,
        ("toolkit.checkpoint.records", "from toolkit import dsat, _names"): 1,
        ("toolkit.compat.determined.info", "import toolkit\nfrom toolkit.dsat.contract import X"): 0,
        ("toolkit.dsat.full_run", "from toolkit.launch.procs import free_port"): 0,
        ("toolkit.run.scheduler", "from toolkit.dsat.execution.slots import SlotPool"): 1,
        ("toolkit.run.scheduler", "from toolkit.launch.slots import SlotPool"): 0,
        ("toolkit.config.experiment", "from toolkit.runtime.trial_env import OUTPUT_DIR_ENV"): 0,
    }
    for (module, code), expected in cases.items():
        source.write_text(code + "\n")
        assert len(_runs_up(module, source)) == expected, (module, code)


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
                where = path.relative_to(procutil.REPO)
                bad.append(f"{where}:{line} imports {module}.{name or ''} from {here}")
    assert not bad, bad


def test_modules_and_functions_over_their_size_are_reported():
    big_modules = [f"{s.relative_to(procutil.REPO)} ({n} lines)" for s in SOURCES
                   if (n := len(s.read_text().splitlines())) >= 400]
    long_functions = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                why = any(line.strip().startswith("Long because") for line in
                          (ast.get_docstring(node) or "").splitlines())
                if length > 60 and not why:
                    where = path.relative_to(procutil.REPO)
                    long_functions.append(f"{where}:{node.lineno} {node.name} ({length})")
    for hint in [*big_modules, *long_functions]:  # pytest's warnings summary lists them
        warnings.warn(f"a hint to split by meaning: {hint}", UserWarning, stacklevel=1)


def test_one_integer_check_and_one_atomic_write():
    defined = {"is_int": [], "atomic_write": [], "atomic_write_json": []}
    replaces = []
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") in defined:
                defined[node.name.lstrip("_")].append(str(path.relative_to(procutil.REPO)))
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "replace" and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "os"):
                replaces.append(f"{path.relative_to(procutil.REPO)}:{node.lineno}")
    assert defined == {"is_int": ["toolkit/_checks.py"], "atomic_write": ["toolkit/_files.py"],
                       "atomic_write_json": ["toolkit/_files.py"]}, defined
    assert replaces == [f"toolkit/_files.py:{_line_of('os.replace(tmp', TOOLKIT / '_files.py')}"], replaces


def _line_of(text: str, path: Path) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


# --------------------------------------------------------------------------- circles and names

MODULES = {_module(path): path for path in SOURCES}


def _module_targets(path: Path, *, import_time: bool = False) -> set[str]:
    """The toolkit modules ``path`` imports (``from toolkit.run import searchers``: the submodule);
    ``import_time``: only the statements run on import (not in functions or ``if TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    on_import = [n for top in tree.body if not isinstance(top, ast.If)
                 for n in ([top] if not isinstance(top, ast.Try) else top.body)]
    nodes = on_import if import_time else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("toolkit"):
            found.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                         for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("toolkit"))
    return {t for t in found if t in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = [stack.pop()]
            while part[-1] != node:
                part.append(stack.pop())
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _wing(module: str) -> str:
    return "toolkit" if module == "toolkit" else _layer(module) if _layer(module) != "core" else "core"


def test_no_circle_between_the_wings_nor_among_modules_at_import_time():
    wings: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        wings.setdefault(_wing(module), set()).update(_wing(t) for t in _module_targets(path) if
                                                       _wing(t) != _wing(module))
    assert _cycles(wings) == [], wings
    modules = {m: _module_targets(p, import_time=True) - {m} for m, p in MODULES.items()}
    # checkpoint/api.py imports remote, which uses api's helpers in calls only (said at the import)
    assert _cycles(modules) == [["toolkit.checkpoint.api", "toolkit.checkpoint.remote"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # not vacuous


def _closure(start: list[str]) -> set[str]:
    """Every toolkit module reached from ``start`` through its imports (lazy ones too), and the
    packages whose ``__init__`` those imports run (the facade ``toolkit`` aside: not a wing)."""
    seen, todo = set(), list(start)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parents = [".".join(module.split(".")[:i]) for i in range(2, module.count(".") + 1)]
        todo.extend(t for t in [*_module_targets(MODULES[module]), *parents] if t != "toolkit")
    return seen


def test_toolkit_runs_config_from_its_command_line_to_a_launch_stays_in_run_launch_and_the_core():
    reached = _closure(["toolkit.run.cli", "toolkit.run.slurm_job"])
    assert {"toolkit.run.plan", "toolkit.run.process", "toolkit.launch.argv", "toolkit.launch.trial_files",
            "toolkit.config.hyperparameters"} <= reached
    elsewhere = sorted(m for m in reached if _layer(m) not in ("core", "toolkit.launch", "toolkit.run"))
    assert elsewhere == [], elsewhere


def test_no_two_modules_share_a_file_name_outside_compat():
    names: dict[str, list[str]] = {}
    for path in SOURCES:
        if "compat" not in path.relative_to(TOOLKIT).parts and path.name not in ("__init__.py",
                                                                                  "__main__.py"):
            names.setdefault(path.name, []).append(str(path.relative_to(procutil.REPO)))
    assert {name: paths for name, paths in names.items() if len(paths) > 1} == {}


def _docstring_lines(tree: ast.Module) -> tuple[set[int], int]:
    """The line numbers docstrings take in a module, and its module docstring's length."""
    lines: set[int] = set()
    module_doc = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                span = range(first.lineno, (first.end_lineno or first.lineno) + 1)
                lines.update(span)
                if isinstance(node, ast.Module):
                    module_doc = len(span)
    return lines, module_doc


def test_docstrings_say_what_in_a_few_lines_and_designs_live_in_docs():
    """Issue 40: docstrings at most 18% of toolkit's lines, no module docstring over 15 lines
    (designs and decision tables go to docs/design-*.md)."""
    total = docs = 0
    long_modules = {}
    for path in SOURCES:
        source = path.read_text()
        lines, module_doc = _docstring_lines(ast.parse(source))
        total += len(source.splitlines())
        docs += len(lines)
        if module_doc > 15:
            long_modules[str(path.relative_to(procutil.REPO))] = module_doc
    assert long_modules == {}, f"module docstrings over 15 lines: {long_modules}"
    share = docs / total
    assert share <= 0.18, f"docstrings take {docs} of toolkit's {total} lines ({share:.1%} > 18%)"

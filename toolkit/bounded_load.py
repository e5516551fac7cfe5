"""The one loader for every YAML and JSON file toolkit reads, the user's and its own. Any rank.

Every load is bounded before anything is built from it: size, UTF-8, nesting, YAML aliases and
their expansion, finite numbers, unique keys, JSON's types only (``yaml.SafeLoader`` underneath).
A hostile or damaged file is a ConfigError naming the file and the problem, never a MemoryError,
a hang or a RecursionError. The bounds and why: docs/security.md."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Callable

import yaml
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node, SequenceNode

from toolkit.errors import ConfigError

__all__ = ["MAX_ALIASES", "MAX_CONFIG_BYTES", "MAX_DEPTH", "MAX_YAML_BYTES", "MAX_YAML_NODES", "load_json",
           "load_yaml", "parse_json", "parse_yaml", "read_text"]

#: Largest JSON file read by default (DeepSpeed configs, toolkit's own small records).
MAX_CONFIG_BYTES = 8 * 2**20
#: Largest YAML file read (experiment configs; the pure-Python parser takes seconds per MiB).
MAX_YAML_BYTES = 2**20
#: Deepest nesting of mappings and lists (DeepSpeed configs use 3 or 4 levels).
MAX_DEPTH = 100
#: Most alias uses (``*name``) in one YAML document.
MAX_ALIASES = 1000
#: Most nodes of one YAML document with every alias expanded (scalars, lists, mappings).
MAX_YAML_NODES = 200_000

_MERGE_TAG = "tag:yaml.org,2002:merge"


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n:,} bytes"


def read_text(path: str | os.PathLike[str], *, max_bytes: int = MAX_CONFIG_BYTES, what: str = "file") -> str:
    """The UTF-8 text of ``path``, reading at most ``max_bytes`` (+1). Any rank.

    OSError as ``open`` raises it (callers name the file); ConfigError when too big or not UTF-8."""
    with open(path, "rb") as fh:
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        try:
            size = _size(os.stat(path).st_size)
        except OSError:
            size = f"over {_size(max_bytes)}"
        raise ConfigError(f"the {what} is {size}, over the limit of {_size(max_bytes)}; is it the right "
                          "file?", source=str(path))
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ConfigError(f"not UTF-8 text: byte 0x{data[err.start]:02x} at offset {err.start} (line {line}) "
                          f"cannot be decoded ({err.reason}); save the {what} as UTF-8",
                          source=str(path)) from None


# ------------------------------------------------------------------------------------------ YAML
class _Refused(yaml.MarkedYAMLError):
    """A YAML document that parses but breaks a bound or a rule of this module."""


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with the nesting and alias counts, finite floats, unique keys, JSON types."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        if self.check_event(AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise _Refused(None, None, f"more than {MAX_ALIASES} aliases (*name): refused, a small "
                                    "file could expand to billions of values", self.peek_event().start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Refused(None, None, f"nested deeper than {MAX_DEPTH} levels",
                                    self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=False)
                try:
                    line = seen.get(key)
                except TypeError:
                    continue  # unhashable: the base class reports it
                if line is not None:
                    raise _Refused(None, None, f"duplicate key {key!r} (lines {line} and "
                                   f"{key_node.start_mark.line + 1}); YAML keeps only the last one silently, "
                                   "so remove one of them", key_node.start_mark)
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)

    def _finite_float(self, node: Node) -> float:
        value = self.construct_yaml_float(node)
        if not math.isfinite(value):
            raise _Refused(None, None, f"{node.value!r} is not a finite number; every number in a "
                                   "config must be finite", node.start_mark)
        return value

    def _as_written(self, node: Node) -> str:
        return str(node.value)

    def _refused(self, node: Node) -> Any:
        raise _Refused(None, None, f"the tag {node.tag} is not allowed: a config holds only "
                               "mappings, lists, strings, numbers, booleans and null", node.start_mark)


_BoundedLoader.add_constructor("tag:yaml.org,2002:float", _BoundedLoader._finite_float)
_BoundedLoader.add_constructor("tag:yaml.org,2002:timestamp", _BoundedLoader._as_written)
for _tag in ("binary", "set", "omap", "pairs"):
    _BoundedLoader.add_constructor(f"tag:yaml.org,2002:{_tag}", _BoundedLoader._refused)


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _check_expansion(root: Node) -> None:
    """Refuse a node graph that, with every alias expanded, is recursive, too deep or too big."""
    sizes: dict[int, tuple[int, int]] = {}   # id -> (nodes, depth), expanded
    open_: set[int] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            kids = [sizes[id(child)] for child in _children(node)]
            size = 1 + sum(n for n, _ in kids)
            depth = 1 + max((d for _, d in kids), default=0)
            open_.discard(key)
            if size > MAX_YAML_NODES:
                raise _Refused(None, None, f"the aliases (*name) expand to more than {MAX_YAML_NODES:,} "
                                    "values: refused", node.start_mark)
            if depth > MAX_DEPTH:
                raise _Refused(None, None, f"the aliases (*name) nest deeper than {MAX_DEPTH} levels",
                                    node.start_mark)
            sizes[key] = (size, depth)
            continue
        if key in sizes:
            continue
        open_.add(key)
        stack.append((node, True))
        for child in _children(node):
            if id(child) in open_:
                raise _Refused(None, None, "a recursive alias (a node that contains itself)",
                                    child.start_mark)
            if id(child) not in sizes:
                stack.append((child, False))


def parse_yaml(text: str, *, source: str) -> Any:
    """One YAML document from ``text``, bounded; ConfigError names ``source`` and the line. Any rank."""
    loader = None
    try:
        loader = _BoundedLoader(text)  # reads the text: a control character is refused here
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node)
        return loader.construct_document(node)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or err
        raise ConfigError(f"{where.strip()}: {problem}" if isinstance(err, _Refused) and where
                          else f"malformed YAML{where}: {problem}",
                          source=source) from None
    except ValueError as err:  # an integer too long for Python to read
        raise ConfigError(f"malformed YAML: a number Python cannot read ({err})", source=source) from None
    except RecursionError:  # nesting the checks above did not see (they should see all)
        raise ConfigError(f"nested deeper than {MAX_DEPTH} levels", source=source) from None
    finally:
        if loader is not None:
            loader.dispose()


def load_yaml(path: str | os.PathLike[str], *, max_bytes: int = MAX_YAML_BYTES,
              what: str = "YAML file") -> Any:
    """The YAML document in ``path``, bounded; FileNotFoundError, or ConfigError naming the file. Any rank."""
    return parse_yaml(read_text(path, max_bytes=max_bytes, what=what), source=str(path))


# ------------------------------------------------------------------------------------------ JSON
def _unique_keys(source: str) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """The ``object_pairs_hook`` that refuses a key written twice in one JSON object."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ConfigError(f"duplicate key {key!r} (values {out[key]!r:.80} and {value!r:.80}); JSON "
                                  "keeps only the last one silently, so remove one of them", source=source)
            out[key] = value
        return out
    return hook


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is not a finite number; every number must be finite")
    return value


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (every number must be finite)")


def _depth_problem(data: Any) -> str | None:
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                return f"nested deeper than {MAX_DEPTH} levels"
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return None


def parse_json(text: str, *, source: str, expect_object: bool = True) -> Any:
    """``text`` as JSON, bounded, an object at the top unless not ``expect_object``; ConfigError naming
    ``source``. Any rank."""
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys(source), parse_float=_finite,
                          parse_constant=_constant)
    except json.JSONDecodeError as err:
        raise ConfigError(f"malformed JSON at line {err.lineno}, column {err.colno}: {err.msg}",
                          source=source) from None
    except RecursionError:
        raise ConfigError(f"nested deeper than {MAX_DEPTH} levels", source=source) from None
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(str(err), source=source) from None
    problem = _depth_problem(data)
    if problem:
        raise ConfigError(problem, source=source)
    if expect_object and not isinstance(data, dict):
        raise ConfigError(f"expected a JSON object at the top, got {type(data).__name__}", source=source)
    return data


def load_json(path: str | os.PathLike[str], *, max_bytes: int = MAX_CONFIG_BYTES, what: str = "JSON file",
              expect_object: bool = True) -> Any:
    """The JSON in ``path``, bounded; FileNotFoundError, or ConfigError naming the file. Any rank."""
    return parse_json(read_text(path, max_bytes=max_bytes, what=what), source=str(Path(path)),
                      expect_object=expect_object)

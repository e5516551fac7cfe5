"""The user's guide (``docs/``, ``mkdocs.yml``) and the README that points into it.

* ``mkdocs build --strict`` passes: with ``mkdocs.yml``'s validation settings a broken link or
  anchor, a page missing from the nav or a nav entry without a page fails the build.
* ``README.md`` is a landing page: at most 200 lines, the two commands on its first screen, and
  every relative link in it (and in ``docs/``) names an existing file, and a heading of it where
  an anchor is given.
* Every repository path the pages name in code (``tests/...``, ``toolkit/...``, ``scripts/...``,
  ``examples/...``) exists, so a moved module or test file cannot leave the guide pointing at nothing.
* ``py.typed`` is shipped (PEP 561).
"""

from __future__ import annotations

import ast
import configparser
import re
import subprocess
import sys
from pathlib import Path

import markdown
import yaml

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def _links(text: str) -> list[str]:
    """The targets of the markdown links of ``text``, code blocks and inline code left out."""
    return LINK.findall(INLINE_CODE.sub("", FENCE.sub("", text)))


def _anchors(page: Path) -> set[str]:
    """The heading ids Python-Markdown's toc extension (mkdocs' own) gives ``page``."""
    md = markdown.Markdown(extensions=["toc", "tables", "fenced_code"])
    md.convert(page.read_text())

    def walk(tokens):
        for token in tokens:
            yield token["id"]
            yield from walk(token["children"])

    return set(walk(md.toc_tokens))  # type: ignore[attr-defined]


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    """Every relative link of ``page`` whose file, or heading, does not exist (named from ``root``)."""
    problems = []
    for target in _links(page.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        file = (page.parent / path_part).resolve() if path_part else page
        if not file.exists():
            problems.append(f"{page.relative_to(root)}: {target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            problems.append(f"{page.relative_to(root)}: {target}: no heading #{anchor} in {file.name}")
    return problems


def test_docs_build_strictly(tmp_path):
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    assert config["strict"] is True
    assert config["validation"]["nav"]["omitted_files"] == "warn"
    assert config["validation"]["links"]["anchors"] == "warn"
    assert config["validation"]["links"]["not_found"] == "warn"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                           "-f", str(REPO / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "security" / "index.html").is_file()


def test_readme_is_a_landing_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move the detail into docs/"
    first_screen = "\n".join(lines[:40])
    assert "bash scripts/main.sh" in first_screen and "bash scripts/test.sh" in first_screen
    assert any(target.startswith("docs/") for target in _links(README.read_text()))


def test_every_relative_link_resolves():
    problems = broken_links(README)
    for page in sorted(DOCS.glob("*.md")):
        problems += broken_links(page)
    assert not problems, "\n".join(problems)


def test_every_path_named_in_code_exists():
    named = re.compile(r"`((?:toolkit|tests|scripts|examples|docs)/[\w./-]*)`")
    missing = [f"{page.relative_to(REPO)}: {path}"
               for page in [README, *sorted(DOCS.glob("*.md"))]
               for path in named.findall(page.read_text()) if not (REPO / path).exists()]
    assert not missing, "\n".join(missing)


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "a.md").write_text("# A\n\n## Heading `code`, two\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#heading-code-two) [no file](c.md) [no anchor](a.md#nothing) "
                    "`[in code](d.md)` [web](https://example.com/x)\n")
    problems = broken_links(page, root=tmp_path)
    assert len(problems) == 2 and "c.md" in problems[0] and "#nothing" in problems[1], problems


def test_the_readme_loop_is_python():
    for block in re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M):
        ast.parse(block)


def test_py_typed_is_shipped():
    assert (REPO / "toolkit" / "py.typed").is_file()
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    assert "py.typed" in setup["options.package_data"]["toolkit"].split()

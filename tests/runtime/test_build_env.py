"""toolkit.runtime.build_env without a build: the ninja an op's directory records, what a load reports,
PATH around a build. Real files in tmp_path; the end-to-end builds are in test_op_builds.py."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from toolkit.runtime import build_env


def test_a_ninja_that_cannot_run_has_an_unknown_version(tmp_path):
    assert build_env._ninja_version(str(tmp_path / "no-such-ninja")) == "unknown"


def test_a_directory_built_by_another_ninja_is_named_and_warned_once_per_root(tmp_path, monkeypatch, caplog):
    ours = build_env._ours()
    root = tmp_path / "extensions"
    first, second = root / "fused_adam", root / "cpu_adam"
    for op in (first, second):
        op.mkdir(parents=True)
        (op / ".toolkit-ninja").write_text("0.0.1 /other/venv/bin/ninja\n", encoding="utf-8")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    with caplog.at_level(logging.WARNING, logger=build_env.__name__):
        assert build_env.other_ninja(str(first)) == "0.0.1 /other/venv/bin/ninja"
        assert build_env.other_ninja(str(second)) == "0.0.1 /other/venv/bin/ninja"
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings   # one per TORCH_EXTENSIONS_DIR, not one per op
    assert f"TORCH_EXTENSIONS_DIR={root} holds builds of another ninja (0.0.1 /other/venv/bin/ninja;" \
        in warnings[0]
    assert f"this environment's is {ours}" in warnings[0]
    (first / ".toolkit-ninja").write_text(ours + "\n", encoding="utf-8")
    assert build_env.other_ninja(str(first)) is None            # built by this environment's ninja
    assert build_env.other_ninja(str(root / "never_built")) is None


def _build_dir(tmp_path: Path) -> Path:
    """An op's directory holding a library linked earlier."""
    build_dir = tmp_path / "some_op"
    build_dir.mkdir()
    (build_dir / "some_op.so").write_bytes(b"old")
    os.utime(build_dir / "some_op.so", ns=(1_000_000_000, 1_000_000_000))
    return build_dir


@pytest.mark.parametrize("other, why", [
    ("0.0.1 /other/ninja", "its build was made by ninja 0.0.1 /other/ninja, whose records this ninja reads "
                           "as out of date"),
    (None, "ninja found its build out of date (its sources, flags or compiler changed)"),
])
def test_a_relink_records_this_ninja_and_says_why(tmp_path, caplog, other, why):
    build_dir = _build_dir(tmp_path)
    build_env.note_acquired(str(build_dir / "lock"))
    (build_dir / "some_op.so").write_bytes(b"new")             # what the build under the lock linked
    with caplog.at_level(logging.WARNING, logger=build_env.__name__):
        build_env.report_build("some_op", str(build_dir), other)
    assert (build_dir / ".toolkit-ninja").read_text(encoding="utf-8") == build_env._ours() + "\n"
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == [why]


def test_a_load_that_took_no_lock_or_linked_nothing_reports_nothing(tmp_path, caplog):
    build_dir = _build_dir(tmp_path)
    with caplog.at_level(logging.WARNING, logger=build_env.__name__):
        build_env.report_build("some_op", str(build_dir), None)        # another process built it
        build_env.note_acquired(str(build_dir / "lock"))
        build_env.report_build("some_op", str(build_dir), None)        # the build was up to date
    assert not caplog.records and not (build_dir / ".toolkit-ninja").exists()


def test_a_build_without_path_gets_ninja_first_then_no_path_again(monkeypatch):
    ninja = build_env.pinned_ninja()
    if ninja is None:
        pytest.skip("no ninja here (pip install ninja)")
    monkeypatch.delenv("PATH")
    found = shutil.which("ninja")          # os.defpath's, without PATH
    if found is not None and os.path.realpath(found) == os.path.realpath(ninja):
        pytest.skip("this environment's ninja is the system's: nothing to put first")
    with build_env.ninja_first():
        assert os.environ["PATH"] == f"{os.path.dirname(ninja)}{os.pathsep}{os.defpath}"
    assert "PATH" not in os.environ

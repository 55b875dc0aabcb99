"""The tests' own layout: every test module sits in a folder of tests/ named for the unit it tests
(none flat in tests/), none is over 800 lines, and no two share a file name (pytest's default
import mode imports a module of a folder without __init__.py by its file name alone)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
MAX_LINES = 800


def every_test_file() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def test_no_test_module_sits_flat_in_tests() -> None:
    assert [p.name for p in TESTS.glob("test_*.py")] == []


def test_no_test_module_is_over_the_limit() -> None:
    long = {str(p.relative_to(TESTS)): n for p in every_test_file()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}, f"split these by what they test (at most {MAX_LINES} lines a file)"


def test_file_names_are_unique() -> None:
    names = Counter(p.name for p in every_test_file())
    assert [name for name, n in names.items() if n > 1] == []

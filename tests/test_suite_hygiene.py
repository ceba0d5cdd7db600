"""Checks on the test suite itself: a test that computes a verdict and throws it away passes whatever the
code does, so such statements are refused here rather than found after a bug slipped through."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def discarded_verdicts(source: str, filename: str) -> list[int]:
    """Lines of expression statements whose value can only have been meant as an assertion: a
    comparison, an `and`/`or` chain (e.g. `check(x) and y == 1`, where a None-returning check makes the
    rest dead code) or a `not`. Calls are left alone: they are run for their effect."""
    lines = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Expr):
            continue
        value = node.value
        if isinstance(value, (ast.Compare, ast.BoolOp)) or (
                isinstance(value, ast.UnaryOp) and isinstance(value.op, ast.Not)):
            lines.append(node.lineno)
    return sorted(lines)


def test_no_discarded_comparisons_in_tests() -> None:
    found = [f"{path.relative_to(TESTS.parent)}:{line}"
             for path in sorted(TESTS.rglob("*.py"))
             for line in discarded_verdicts(path.read_text(), str(path))]
    assert not found, "expression statements that assert nothing (write `assert ...`): " + ", ".join(found)


def test_the_check_sees_each_kind() -> None:
    """The checker itself: each shape it must refuse is refused, and ordinary statements pass."""
    bad = "a == b\ncheck(a) and a[-1] == 1\nx or y\nnot ok\n1 < a <= 3\n"
    assert discarded_verdicts(bad, "bad.py") == [1, 2, 3, 4, 5]
    fine = 'assert a == b\ncheck(a)\nx = a and b\n"""doc"""\nprint(not a)\nf() if a else g()\n'
    assert discarded_verdicts(fine, "fine.py") == []

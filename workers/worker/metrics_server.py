"""The worker's `GET /metrics` (`--metrics-port`): a small HTTP server on a thread of its own.

It always answers in Prometheus's text format (0.0.4), whatever the scraper asks for. Prometheus 2
asks for OpenMetrics first, and prometheus_client's OpenMetrics output turns the colons of a name
into underscores on its sample lines (prometheus/client_python#1177): the series would be stored as
`vllm_generation_tokens_total`, and dashboards written for vLLM would find none of theirs.
"""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, generate_latest

from workers.ports import check_port_free

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class MetricsServer:
    """Serves `registry` on host:port from a daemon thread until `close`."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if urlsplit(self.path).path not in ("/metrics", "/"):
                    self.send_error(404, "only /metrics is served here")
                    return
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:  # not a log line per scrape
                pass

        class Server(ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
            daemon_threads = True

        self._server = Server((host, port), Handler)
        threading.Thread(target=self._server.serve_forever, name="streamer-metrics", daemon=True).start()

    def close(self) -> None:
        """Stop serving (waits up to half a second for the serving thread to notice)."""
        self._server.shutdown()
        self._server.server_close()


def check_port(host: str, port: int) -> None:
    """A one-line error now (before the model loads) when host:port cannot be listened on."""
    check_port_free(host, port, "--metrics-port", "--metrics-host")

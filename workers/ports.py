"""Checking a port before a server needs it: a one-line error at once, not a traceback after the
model has loaded."""

from __future__ import annotations

import errno
import socket

from workers.errors import PortInUse, UserError


def check_port_free(host: str, port: int, port_flag: str = "--port", host_flag: str = "--host") -> None:
    """PortInUse / UserError naming the flags to change when host:port cannot be listened on."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        # The servers set SO_REUSEADDR too, so a port in TIME_WAIT counts as free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            env = "STREAMER_" + port_flag.removeprefix("--").upper().replace("-", "_")
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(f"port {port} is already in use on {host}: stop the program using it "
                                f"or pick another with {port_flag} N (or {env})") from exc
            raise UserError(f"cannot listen on {host}:{port} ({exc.strerror}): check {host_flag}") from exc

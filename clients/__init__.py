"""Clients for streamer, and the home of the wire contract they share with the server side.

- protocol.py: the Redis wire contract (docs/protocol.md): names, job decoding, event encoding.
- events.py: the events a worker writes (token, done, error).
- errors.py: the contract's errors (ProtocolError, RequestFailed, UnknownRequest, NoWorker).
- heartbeats.py: which workers are alive (the heartbeat set).
- backoff.py: how every Redis loop retries a dropped connection.
- resume.py: what a request's event stream says about an earlier run of it.
- redis_client.py: the Python client (AsyncClient, Client); web/ holds the browser/Node client.

Nothing here imports the engine (`streamer`) or the servers (`workers`): they depend on this package.
"""

from clients.errors import NoWorker, ProtocolError, RequestFailed, UnknownRequest
from clients.redis_client import AsyncClient, Client, Generation

__all__ = ["AsyncClient", "Client", "Generation", "NoWorker", "ProtocolError", "RequestFailed", "UnknownRequest"]

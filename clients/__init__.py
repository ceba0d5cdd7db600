"""Clients for streamer: the Python Redis client here, the browser/Node client in web/."""

from clients.redis_client import AsyncClient, Client, Generation, RequestFailed

__all__ = ["AsyncClient", "Client", "Generation", "RequestFailed"]

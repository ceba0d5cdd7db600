"""`streamer gateway`: the browsers' door to the Redis worker (docs/gateway.md).

- command.py: the command line (`add_arguments`, `run`); config.py: `GatewayConfig`.
- server.py: `Gateway` (one Starlette app on uvicorn, one port: `/ws`, `/v1/*`, the chat page,
  `/healthz`, `/metrics`) and `running_gateway`.
- routes.py: plain HTTP and the handshake checks (API keys, origins); admission.py: what a job must
  pass before it is pushed.
- session.py: one WebSocket connection (frames, limits, send queue); socket_conn.py: the socket.
- openai/routes.py, openai/answers.py, openai/jobs.py, openai/request.py, openai/response.py,
  openai/stream.py: the OpenAI-compatible API.
- hub.py: the Redis side (jobs, cancels, pub/sub relay); watch.py: one request's events in order,
  gaps filled; metrics.py: the Prometheus metrics (prometheus_client).

Nothing is imported here; import what you need from its module.
"""

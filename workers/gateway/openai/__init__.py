"""The OpenAI-compatible API of the gateway: request parsing (request.py), the jobs one request becomes
(jobs.py), answer assembly (response.py), Server-Sent Events framing (stream.py) and the routes
(routes.py)."""

"""`streamer worker`: the Redis streaming worker (docs/protocol.md), one small object per job.

- command.py: the command line (`add_arguments`, `run`); config.py: `WorkerConfig`.
- redis_worker.py: `Worker`, which builds the parts below around one `WorkerState` and runs them.
- state.py: what the parts share (jobs held, capacity, stop flag); engine.py: the engine seam.
- intake.py (read and admit), reclaim.py (take over dead workers' entries), job.py (one job),
  answers.py (events, dead letters, acks), event_writer.py (batched writes to Redis),
  heartbeat.py (stats, entry freshness), cancel.py (the cancel listener).

Nothing is imported here, so that `streamer worker --help` does not load the engine.
"""

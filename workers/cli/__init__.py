"""The `streamer` command (`python -m workers.cli` is the same).

- main.py: the top-level parser, environment defaults, friendly errors, `main()`.
- parent.py: what `streamer up` tells its children (exit with the parent).
- up.py (`streamer up`), generate_cmd.py (`streamer generate`), bench_cmd.py (`streamer bench`);
  `streamer worker` and `streamer gateway` are workers/worker/command.py and workers/gateway/command.py.

Nothing is imported here, so that `streamer --help` stays instant.
"""

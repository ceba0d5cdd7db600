"""What the benchmarks share, so that each bench/*.py script holds only its own measurement.

- `workload`: the synthetic offline workloads and the speed-anchor workloads (with fingerprints).
- `stats`: percentiles.
- `machine`: the repository root, the checkpoint cache, CPU time and RSS of a process, waiting for a
  quiet machine.
- `servers`: starting and stopping `streamer worker`/`gateway` processes from a benchmark.
- `vllm`: how vLLM's CPU build is run beside streamer (its tuned flags, the sampled workload).

Benchmarks run from the repository root as modules (`python -m bench.throughput`), so `bench` and
the installed packages import without any change to `sys.path`.
"""

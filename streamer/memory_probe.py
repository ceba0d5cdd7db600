"""Measuring memory for the KV-cache sizing (streamer/kv_cache_sizing.py): free and available memory,
and the peak of a profiling forward at the full token budget."""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import torch

from streamer.request import Sequence
from streamer.sampling_params import SamplingParams
from streamer.scheduler_output import ScheduledSeq
from streamer.step import flatten_step, payload_tensor, unflatten_step


def available_memory() -> int:
    """Bytes of RAM the kernel says a new allocation can have (MemAvailable), else all of it."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class PeakMeter:
    """Peak memory of what runs between `start()` and `peak()`, above what was held at `start()`.

    CUDA: the caching allocator's own peak. CPU: the process's resident high-water mark (VmHWM),
    reset through /proc/self/clear_refs, so everything the work touched counts, torch's or not."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.base = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # 5: reset the peak resident set size to the current one
            self.base = _status_kib("VmRSS") * 1024

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.base
        return max(0, _status_kib("VmHWM") * 1024 - self.base)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    assert match, f"/proc/self/status has no {field}"
    return int(match.group(1))


def profile_step(num_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int, vocab_size: int
                 ) -> tuple[list[ScheduledSeq], int]:
    """The heaviest step the scheduler can hand the runner: `num_tokens` prompt tokens over as many
    sequences as may run (each sampling, so the LM head sees its most rows), none longer than the
    model allows. Returns the step and the number of blocks its tables use."""
    seqs = max(min(max_num_seqs, num_tokens), -(-num_tokens // max_model_len))
    scheduled, next_block = [], 0
    for i in range(seqs):
        n = num_tokens // seqs + (i < num_tokens % seqs)
        ids = [(7 * j + i) % vocab_size for j in range(n)]
        seq = Sequence(request_id=f"profile-{i}", index=0, token_ids=ids, num_prompt_tokens=n,
                       params=SamplingParams(max_tokens=1))
        blocks = -(-n // block_size)
        scheduled.append(ScheduledSeq(seq, n, block_ids=list(range(next_block, next_block + blocks))))
        next_block += blocks
    return scheduled, next_block


def forward_peak(run: Callable, scheduled: list[ScheduledSeq], block_size: int, device: torch.device) -> int:
    """Bytes the forward `run(StepInputs)` of this step takes at its peak, above what was held before."""
    step = flatten_step(scheduled, None, block_size)
    inputs = unflatten_step(step.header, payload_tensor(step.payload).to(device))
    meter = PeakMeter(device)
    meter.start()
    run(inputs)
    return meter.peak()

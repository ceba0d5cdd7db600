"""CUDA graphs for decode steps (issue 39, part 2): batch-size buckets, padding a decode step up to its
bucket, and the static buffers a captured graph reads.

A graph replays the exact kernels it captured, on the exact tensors: so each bucket (a batch size,
1, 2, 4, 8, 16, 24, ... as vLLM and nano-vllm use) gets one graph over fixed input buffers, and a
step of n decodes is copied into the buffers of the smallest bucket >= n. The rows past n are
dummies: token 0 at position 0, KV slot -1 (the cache write skips a negative slot: it writes
nowhere), a context of one position in block 0 (read, never written), so every kernel has valid
work and the real rows compute exactly what they would alone. Prefill, mixed steps and batches past
the largest bucket run eagerly. Everything here but `torch.cuda.graph` capture and replay is plain
tensor code, tested on the CPU by running the padded step eagerly (tests/engine/test_decode_graphs.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from streamer.attention.backend import AttentionMetadata
from streamer.step import StepInputs

DUMMY_SLOT = -1  # the KV-cache write skips negative slots (vLLM's padding convention)


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every 8, through the first >= max_num_seqs."""
    buckets = [1, 2, 4, 8]
    while buckets[-1] < max_num_seqs:
        buckets.append(buckets[-1] + 8)
    return [b for b in buckets if b < max_num_seqs] + [next(b for b in buckets if b >= max_num_seqs)]


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding n rows; None past the largest (that step runs eagerly)."""
    return next((b for b in buckets if b >= n), None)


def is_pure_decode(inputs: StepInputs) -> bool:
    """One new token per sequence, every sequence sampling, no block copies: the steps a graph replays."""
    n = inputs.input_ids.shape[0]
    return (inputs.meta.num_decodes == n == inputs.sample_rows.shape[0] == inputs.meta.seq_lens.shape[0]
            and inputs.block_copies.numel() == 0)


class DecodeBuffers:
    """The static inputs of every bucket's graph: views of the first `bucket` rows of one set of buffers
    sized for the largest bucket, so all graphs share them and a step is copied in once."""

    def __init__(self, max_batch: int, max_blocks_per_seq: int, max_model_len: int, device: torch.device) -> None:
        self.max_model_len = max_model_len
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch,), DUMMY_SLOT, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)

    def fill(self, inputs: StepInputs, bucket: int) -> None:
        """Copy a decode step's n rows in and make rows n..bucket dummies (they may hold an earlier step's)."""
        n = inputs.input_ids.shape[0]
        width = inputs.meta.block_tables.shape[1]
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping[:n].copy_(inputs.meta.slot_mapping)
        self.seq_lens[:n].copy_(inputs.meta.seq_lens)
        self.block_tables[:n, :width].copy_(inputs.meta.block_tables)
        self.block_tables[:n, width:].zero_()
        self.input_ids[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        self.slot_mapping[n:bucket].fill_(DUMMY_SLOT)
        self.seq_lens[n:bucket].fill_(1)
        self.block_tables[n:bucket].zero_()

    def view(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """input ids, positions and metadata of a bucket's graph. The lengths the kernels' grids need are
        the model's bound, not this step's: a graph must serve every step of its bucket."""
        meta = AttentionMetadata(num_decodes=bucket, query_start_loc=self.query_start_loc[:bucket + 1],
                                 seq_lens=self.seq_lens[:bucket], slot_mapping=self.slot_mapping[:bucket],
                                 block_tables=self.block_tables[:bucket], max_query_len=1,
                                 max_seq_len=self.max_model_len, max_decode_seq_len=self.max_model_len)
        return self.input_ids[:bucket], self.positions[:bucket], meta


Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]  # ids, positions, meta -> logits


class DecodeGraphs:
    """Runs pure decode steps through their bucket's graph: captured on first use on CUDA; on the CPU
    (no graphs) the same padded buffers run eagerly, which is what the tests check."""

    def __init__(self, forward: Forward, buffers: DecodeBuffers, buckets: list[int], device: torch.device) -> None:
        self.forward, self.buffers, self.buckets, self.device = forward, buffers, buckets, device
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None  # one memory pool shared by every bucket's graph, as vLLM does

    def handles(self, inputs: StepInputs) -> bool:
        return is_pure_decode(inputs) and bucket_for(inputs.input_ids.shape[0], self.buckets) is not None

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Logits of the step's n rows, computed as its bucket's padded batch."""
        n = inputs.input_ids.shape[0]
        bucket = bucket_for(n, self.buckets)
        assert bucket is not None and is_pure_decode(inputs), "only pure decode steps within the buckets"
        self.buffers.fill(inputs, bucket)
        if self.device.type != "cuda":
            return self.forward(*self.buffers.view(bucket))[:n]
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket)
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[:n]

    def _capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture one bucket's forward over the static buffers (now holding a real step, so the warm-up
        run before capture, which compiles and autotunes outside the graph, also writes its KV; a
        second write of the same values is harmless)."""
        args = self.buffers.view(bucket)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.forward(*args)  # warm-up: Triton compiles here, never inside the capture
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.forward(*args)
        self.pool = graph.pool()
        return graph, logits

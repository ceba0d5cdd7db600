"""Turns a scheduled step into flat tensors, runs the model, and samples."""

from __future__ import annotations

import gc
import math
import time

import numpy as np
import torch

from streamer.attention import get_backend
from streamer.attention.backend import Rows
from streamer.config import EngineConfig
from streamer.decode_graphs import DecodeBuffers, DecodeGraphs, graph_buckets
from streamer.kv_cache_dtype import cache_dtype
from streamer.kv_cache_sizing import GIB, GpuMemory, bytes_per_block, cpu_kv_blocks, gpu_kv_blocks
from streamer.layers.cpu_gemm import pack_model
from streamer.lora.manager import LoRAManager
from streamer.memory_probe import available_memory, forward_peak, profile_step
from streamer.model_config import ModelConfig
from streamer.model_loader import load_weights
from streamer.models.registry import model_class
from streamer.outputs import StepPhases
from streamer.parallel_state import SINGLE, TPGroup, building_with
from streamer.pooling import chunk_partial
from streamer.quantization import quantize_model
from streamer.quantization.compressed_tensors import (
    SKIPPED_SUFFIXES,
    add_scale_slots,
    is_compressed_int8,
    load_prequantized,
)
from streamer.request import Sequence
from streamer.sampler import Sampler, SamplerOutput
from streamer.scheduler_output import ScheduledSeq
from streamer.step import FlatStep, StepInputs, flatten_step, payload_tensor, sample_rows_meta, unflatten_step


class ModelRunner:
    """Runs the model on one device. With tensor parallelism every rank has one, built with its
    `TPGroup`: rank 0's is wrapped by the TPExecutor, the others are driven by `worker.py`."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, device: torch.device,
                 sampler: Sampler | None, tp_group: TPGroup = SINGLE) -> None:
        self.config = config
        self.model_config = model_config
        self.device = device
        self.block_size = config.block_size
        self.backend = get_backend(config.attention_backend, device)
        self.sampler = sampler
        self.phases: StepPhases | None = None  # of the last step run
        self.tp = tp_group
        torch.set_default_dtype(model_config.dtype)
        try:
            with torch.device(device), building_with(tp_group):
                self.model = model_class(model_config.hf_config)(model_config.hf_config, self.backend,
                                                                 model_config.max_model_len, device)
        finally:
            torch.set_default_dtype(torch.float32)
        prequantized = is_compressed_int8(model_config.hf_config)  # an int8 checkpoint: its own values kept
        if prequantized:
            add_scale_slots(self.model, model_config.path)
        load_weights(self.model, model_config.path, SKIPPED_SUFFIXES if prequantized else (),
                     optional=() if model_config.generates else ("lm_head.weight",))
        self.model.eval()
        # Adapters ride on the linear modules' outputs (forward hooks); with tensor parallelism each
        # rank would need its shard of every adapter, which is not built: LoRA runs on one rank. Built
        # before packing, which drops the dense weights whose shapes the adapters' stacks take.
        self.lora = LoRAManager(self.model, config.max_loras, config.max_lora_rank, device) \
            if config.max_loras and tp_group.size == 1 else None
        if prequantized:  # after the adapters' stacks, which take the dense weights' shapes
            load_prequantized(self.model)
        if config.quantization:  # before packing: the quantized weights take the slots oneDNN's copies would
            quantize_model(self.model, config.quantization)
        self.cache_dtype = cache_dtype(config.kv_cache_dtype, model_config.dtype)
        if device.type == "cpu" and config.cpu_gemm == "onednn":
            pack_model(self.model, batch_hint=min(config.max_num_seqs, 64))
        # Every rank must hold the same number of blocks: the scheduler in rank 0 hands out ids.
        self.num_kv_blocks = tp_group.all_reduce_min(config.num_kv_blocks or self._blocks_that_fit(), device)
        self._allocate_kv_cache(self.num_kv_blocks)
        if config.calculate_kv_scales and self.cache_dtype.itemsize == 1:
            # Armed only now: the profiling forward above ran on made-up tokens.
            for layer in self.model.layers:
                layer.self_attn.attn.calibrate_kv_scales = True
        self.graphs = self._decode_graphs()

    def _decode_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs for decode steps, captured per bucket on first use; eager on the CPU, with
        `enforce_eager`, and under tensor parallelism (collectives inside a graph are not tried yet)."""
        if self.device.type != "cuda" or self.config.enforce_eager or self.tp.size > 1:
            return None
        buckets = graph_buckets(self.config.max_num_seqs)
        buffers = DecodeBuffers(buckets[-1], -(-self.model_config.max_model_len // self.block_size),
                                self.model_config.max_model_len, self.device)
        return DecodeGraphs(lambda ids, pos, meta: self.model.compute_logits(self.model(ids, pos, meta)),
                            buffers, buckets, self.device)

    def _bytes_per_block(self) -> int:
        attn = self.model.layers[0].self_attn.attn
        return bytes_per_block(self.block_size, attn.num_kv_heads, attn.head_size, len(self.model.layers),
                               self.cache_dtype.itemsize)

    def _blocks_that_fit(self) -> int:
        """The cache's size from measured memory (streamer/kv_cache_sizing.py has the arithmetic)."""
        # No point holding more than every running sequence at full length could use.
        most = self.config.max_num_seqs * -(-self.model_config.max_model_len // self.block_size)
        if self.device.type == "cuda":
            return gpu_kv_blocks(self._measure_gpu_memory(), self.config.gpu_memory_utilization,
                                 self._bytes_per_block(), most, self.config.max_num_batched_tokens)
        cache = self.config.kv_cache_memory_gb * GIB if self.config.kv_cache_memory_gb else None
        return cpu_kv_blocks(cache, available_memory(), self.tp.size, self._bytes_per_block(), most)

    def _measure_gpu_memory(self) -> GpuMemory:
        peak = self.profile_forward_peak()
        # The profile's blocks and activations go back to the device, and so does what an engine built
        # before this one in the same process left to the garbage collector (its cache would otherwise
        # still be held by torch's allocator and look taken).
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return GpuMemory(free=free, total=total, forward_peak=peak)

    def profile_forward_peak(self) -> int:
        """Bytes a forward of the heaviest step (max_num_batched_tokens prompt tokens, every sequence
        sampling) takes at its peak, run over a cache just big enough for it, which is dropped after."""
        scheduled, blocks = profile_step(self.config.max_num_batched_tokens, self.config.max_num_seqs,
                                         self.model_config.max_model_len, self.block_size,
                                         self.model_config.hf_config.vocab_size)
        self._allocate_kv_cache(blocks)
        try:
            return forward_peak(self.run, scheduled, self.block_size, self.device)
        finally:
            self._allocate_kv_cache(0)

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        attn0 = self.model.layers[0].self_attn.attn
        shape = (num_blocks, self.block_size, attn0.num_kv_heads, attn0.head_size)
        self.key_caches, self.value_caches = [], []
        for layer in self.model.layers:
            attn = layer.self_attn.attn
            attn.key_cache = _zeros(shape, self.cache_dtype, self.device)
            attn.value_cache = _zeros(shape, self.cache_dtype, self.device)
            self.key_caches.append(attn.key_cache)
            self.value_caches.append(attn.value_cache)

    def shutdown(self) -> None:
        """Nothing to stop in-process; tensor-parallel executors join their ranks here."""

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Block copies (copy-on-write), then the model; logits of the sample rows (None when no
        sequence samples) and final hidden states of the pool rows (None when none pools). With
        tensor parallelism every rank runs this on the same inputs."""
        if inputs.block_copies.numel():
            self.backend.copy_blocks(self.key_caches, self.value_caches, inputs.block_copies)
        lora_step = self.lora is not None and self.lora.batch.active
        pool = inputs.pool_rows
        if self.graphs is not None and self.graphs.handles(inputs) and not lora_step and not pool.numel():
            return self.graphs.run(inputs), None  # graphs hold no adapter, and give logits only
        samples = inputs.sample_rows
        rows = torch.cat((samples, pool)) if pool.numel() else samples
        if rows.numel() < inputs.input_ids.numel() and not inputs.pool_every_row:
            # A prompt's chunk: most rows only feed the cache. (Every wanted row is its chunk's last,
            # so it may attend as a decode: a mean-pooled chunk needs its every row, computed whole.)
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta,
                                Rows(rows, sample_rows_meta(inputs.meta, rows)))
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)[rows]
        n = samples.numel()
        logits = self.model.compute_logits(hidden[:n] if pool.numel() else hidden) if n else None
        return logits, hidden[n:] if pool.numel() else None

    def sample(self, step: FlatStep, logits: torch.Tensor | None, pooled: torch.Tensor | None = None
               ) -> tuple[list[Sequence], SamplerOutput | None]:
        """The sample rows' tokens, and the pool rows' contributions to their embeddings."""
        partials = pool_partials(step, pooled)
        if logits is None:
            return [], SamplerOutput([], [], [], pooled=partials) if partials else None
        assert self.sampler is not None, "only rank 0 samples"
        if any(step.drafts):
            result = self.sampler.with_drafts(logits, step.sample_seqs, step.drafts)
        else:
            result = self.sampler(logits, step.sample_seqs)
        result.pooled = partials
        return step.sample_seqs, result

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], block_copies: list[tuple[int, int]] | None = None
                ) -> tuple[list[Sequence], SamplerOutput | None]:
        """Run one step; returns the sequences that sampled, and what they sampled (in order). Its phases'
        times are left in `phases` (on CUDA the forward pass's kernels finish inside sampling, whose
        copy to the host waits for them: there the split is where the host waited, not the GPU)."""
        t0 = time.monotonic()
        step = flatten_step(scheduled, block_copies, self.block_size)
        flat = payload_tensor(step.payload).to(self.device, non_blocking=True)
        inputs = unflatten_step(step.header, flat)
        t1 = time.monotonic()
        lora = self.lora is not None and self.lora.begin_step(step.row_loras, inputs.sample_rows)
        try:
            logits, pooled = self.run(inputs)
        finally:
            if lora:
                self.lora.end_step()
        t2 = time.monotonic()
        result = self.sample(step, logits, pooled)
        self.phases = StepPhases(prepare_s=t1 - t0, forward_s=t2 - t1, sample_s=time.monotonic() - t2)
        return result


def pool_partials(step: FlatStep, pooled: torch.Tensor | None) -> dict[int, torch.Tensor]:
    """Each pooling sequence's share of the step's pool rows, reduced on the device and copied to the
    host at once: by seq_id, what its chunk adds to its pool (streamer/pooling.py)."""
    if pooled is None or not step.pool_seqs:
        return {}
    parts, start = [], 0
    for seq, n in step.pool_seqs:
        assert seq.pooling is not None
        parts.append(chunk_partial(pooled[start:start + n], seq.pooling.params.pooling))
        start += n
    host = torch.stack(parts).cpu()
    return {seq.seq_id: host[i] for i, (seq, _) in enumerate(step.pool_seqs)}


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache tensor. On the CPU its pages come zeroed from the kernel on first touch
    (calloc'ed through numpy), instead of torch.zeros writing every byte before the worker can start:
    a 2 GiB cache cost ~1-3 s of start-up that way, and pages never used are never committed."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(nbytes + 64, dtype=np.uint8)
    start = -raw.ctypes.data % 64  # 64-byte aligned, as torch's own CPU allocations are
    return torch.from_numpy(raw[start:start + nbytes]).view(dtype).view(shape)

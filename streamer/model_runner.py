"""Turns a scheduled step into flat tensors, runs the model, and samples."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from streamer.attention import get_backend
from streamer.attention.backend import AttentionMetadata
from streamer.config import EngineConfig
from streamer.model_config import ModelConfig
from streamer.model_loader import load_weights
from streamer.models.llama import LlamaForCausalLM
from streamer.request import Sequence
from streamer.sampler import Sampler, SamplerOutput
from streamer.scheduler import ScheduledSeq

_GIB = 1 << 30


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # index into the flat tokens of each sequence's last new token
    sample_seqs: list[Sequence]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, device: torch.device,
                 sampler: Sampler) -> None:
        self.config = config
        self.model_config = model_config
        self.device = device
        self.block_size = config.block_size
        self.backend = get_backend(config.attention_backend, device)
        self.sampler = sampler
        torch.set_default_dtype(model_config.dtype)
        try:
            with torch.device(device):
                self.model = LlamaForCausalLM(model_config.hf_config, self.backend,
                                              model_config.max_model_len, device)
        finally:
            torch.set_default_dtype(torch.float32)
        load_weights(self.model, model_config.path)
        self.model.eval()
        self.num_kv_blocks = config.num_kv_blocks or self._blocks_that_fit()
        self._allocate_kv_cache()

    def _bytes_per_block(self) -> int:
        attn = self.model.layers[0].self_attn.attn
        per_layer = 2 * self.block_size * attn.num_kv_heads * attn.head_size
        return per_layer * len(self.model.layers) * self.model_config.dtype.itemsize

    def _blocks_that_fit(self) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # Leave room for activations of a full token budget (logits dominate).
            vocab = self.model_config.hf_config.vocab_size
            reserve = 4 * self.config.max_num_batched_tokens * (vocab + 16 * self.model_config.hf_config.hidden_size)
            budget = free - (1 - self.config.gpu_memory_utilization) * total - reserve
        else:
            budget = (self.config.kv_cache_memory_gb * _GIB if self.config.kv_cache_memory_gb
                      else min(4 * _GIB, _available_memory() // 4))
        blocks = int(budget // self._bytes_per_block())
        if blocks < 1:
            raise MemoryError("no memory left for the KV cache; lower max_num_batched_tokens or use a "
                              "smaller model")
        # No point holding more than every running sequence at full length could use.
        most = self.config.max_num_seqs * -(-self.model_config.max_model_len // self.block_size)
        return min(blocks, most)

    def _allocate_kv_cache(self) -> None:
        attn0 = self.model.layers[0].self_attn.attn
        shape = (self.num_kv_blocks, self.block_size, attn0.num_kv_heads, attn0.head_size)
        self.key_caches, self.value_caches = [], []
        for layer in self.model.layers:
            attn = layer.self_attn.attn
            attn.key_cache = torch.zeros(shape, dtype=self.model_config.dtype, device=self.device)
            attn.value_cache = torch.zeros(shape, dtype=self.model_config.dtype, device=self.device)
            self.key_caches.append(attn.key_cache)
            self.value_caches.append(attn.value_cache)

    def shutdown(self) -> None:
        """Nothing to stop in-process; tensor-parallel executors join their ranks here."""

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            mapping = torch.tensor(pairs, dtype=torch.long, device=self.device)
            self.backend.copy_blocks(self.key_caches, self.value_caches, mapping)

    def prepare(self, scheduled: list[ScheduledSeq]) -> StepInputs:
        """Flatten the step: decodes first, then prefill chunks, tokens concatenated, no padding."""
        batch = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            blocks = seq.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            starts.append(starts[-1] + item.num_new_tokens)
            seq_lens.append(end)
            tables.append(blocks)
            if item.samples:
                # Forked siblings (parallel samples) draw their first token from the same row.
                for sampler_seq in (item.seq, *item.forks):
                    sample_rows.append(starts[-1] - 1)
                    sample_seqs.append(sampler_seq)
        num_decodes = sum(1 for s in batch if s.num_new_tokens == 1)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        meta = AttentionMetadata(
            num_decodes=num_decodes,
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            max_query_len=max(s.num_new_tokens for s in batch),
            max_seq_len=max(seq_lens),
            max_decode_seq_len=max(seq_lens[:num_decodes], default=0),
        )
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            meta=meta,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=dev),
            sample_seqs=sample_seqs,
        )

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], block_copies: list[tuple[int, int]] | None = None
                ) -> tuple[list[Sequence], SamplerOutput | None]:
        """Run one step: first the block copies (copy-on-write) the scheduler asked for, then the
        model; returns the sequences that sampled, and what they sampled (in order)."""
        self.copy_blocks(block_copies or [])
        inputs = self.prepare(scheduled)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        if not inputs.sample_seqs:
            return [], None
        logits = self.model.compute_logits(hidden[inputs.sample_rows])
        return inputs.sample_seqs, self.sampler(logits, inputs.sample_seqs)


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

"""Turns a scheduled step into flat tensors, runs the model, and samples."""

from __future__ import annotations

import array
import os
from dataclasses import dataclass

import torch

from streamer.attention import get_backend
from streamer.attention.backend import AttentionMetadata
from streamer.config import EngineConfig
from streamer.distributed.parallel_state import SINGLE, TPGroup, building_with
from streamer.layers.cpu_gemm import pack_model
from streamer.model_config import ModelConfig
from streamer.model_loader import load_weights
from streamer.models.llama import LlamaForCausalLM
from streamer.request import Sequence
from streamer.sampler import Sampler, SamplerOutput
from streamer.scheduler import ScheduledSeq

_GIB = 1 << 30


# The header of a flattened step: sizes of the payload's sections, then the step's maxima.
HEADER = ("num_tokens", "num_seqs", "table_width", "num_samples", "num_copies", "num_decodes",
          "max_query_len", "max_seq_len", "max_decode_seq_len")
HEADER_LEN = len(HEADER)


@dataclass
class FlatStep:
    """One step as plain integers: what rank 0 sends the other tensor-parallel ranks.

    `payload` concatenates input ids, positions, slots (`num_tokens` each), query_start_loc
    (`num_seqs + 1`), seq_lens (`num_seqs`), block tables (`num_seqs x table_width`, padded with
    0), sample rows (`num_samples`) and block copies (`num_copies` (src, dst) pairs)."""

    header: list[int]
    payload: list[int]
    sample_seqs: list[Sequence]  # rank 0 only: who samples from each sample row


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # index into the flat tokens of each sequence's last new token
    block_copies: torch.Tensor  # [C, 2] (src, dst), done before the model runs


def flatten_step(scheduled: list[ScheduledSeq], block_copies: list[tuple[int, int]] | None,
                 block_size: int) -> FlatStep:
    """Flatten the step: decodes first, then prefill chunks, tokens concatenated, no padding."""
    batch = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)
    bs = block_size
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
    width = max((len(t) for t in tables), default=0)
    payload = input_ids  # extended in place: the ids are its first section
    payload += positions
    payload += slots
    payload += starts
    payload += seq_lens
    for t in tables:
        payload += t
        payload += [0] * (width - len(t))
    payload += sample_rows
    copies = block_copies or []
    for src, dst in copies:
        payload += (src, dst)
    header = [starts[-1], len(batch), width, len(sample_rows), len(copies),
              num_decodes, max((s.num_new_tokens for s in batch), default=0), max(seq_lens, default=0),
              max(seq_lens[:num_decodes], default=0)]
    return FlatStep(header, payload, sample_seqs)


def payload_tensor(payload: list[int]) -> torch.Tensor:
    """The payload as a CPU int64 tensor (through `array`: 3x faster than `torch.tensor(list)`)."""
    return torch.frombuffer(array.array("q", payload), dtype=torch.long) if payload else \
        torch.empty(0, dtype=torch.long)


def section_sizes(header: list[int]) -> list[int]:
    """Lengths of the payload's sections, in order (see FlatStep)."""
    t, b, w, s, c = header[:5]
    return [t, t, t, b + 1, b, b * w, s, 2 * c]


def unflatten_step(header: list[int], flat: torch.Tensor) -> StepInputs:
    """Tensors for the model from a flattened step (`flat`: the payload, int64, on the device)."""
    _, b, w, _, c, num_decodes, max_query_len, max_seq_len, max_decode_seq_len = header
    ids, pos, slots, starts, lens, tables, rows, copies = flat.split(section_sizes(header))
    meta = AttentionMetadata(
        num_decodes=num_decodes,
        query_start_loc=starts.to(torch.int32),
        seq_lens=lens.to(torch.int32),
        slot_mapping=slots,
        block_tables=tables.view(b, w).to(torch.int32),
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        max_decode_seq_len=max_decode_seq_len,
    )
    return StepInputs(ids, pos, meta, rows, copies.view(c, 2))


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
        self.tp = tp_group
        torch.set_default_dtype(model_config.dtype)
        try:
            with torch.device(device), building_with(tp_group):
                self.model = LlamaForCausalLM(model_config.hf_config, self.backend,
                                              model_config.max_model_len, device)
        finally:
            torch.set_default_dtype(torch.float32)
        load_weights(self.model, model_config.path)
        self.model.eval()
        if device.type == "cpu":
            pack_model(self.model, batch_hint=min(config.max_num_seqs, 64))
        # Every rank must hold the same number of blocks: the scheduler in rank 0 hands out ids.
        self.num_kv_blocks = tp_group.all_reduce_min(config.num_kv_blocks or self._blocks_that_fit(), device)
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
                      else min(2 * _GIB, _available_memory() // 4))
            budget /= self.tp.size  # CPU ranks share one machine's memory
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

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """Block copies (copy-on-write), then the model; logits of the sample rows (None when no
        sequence samples). With tensor parallelism every rank runs this on the same inputs."""
        if inputs.block_copies.numel():
            self.backend.copy_blocks(self.key_caches, self.value_caches, inputs.block_copies)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        if not inputs.sample_rows.numel():
            return None
        return self.model.compute_logits(hidden[inputs.sample_rows])

    def sample(self, step: FlatStep, logits: torch.Tensor | None) -> tuple[list[Sequence], SamplerOutput | None]:
        if logits is None:
            return [], None
        assert self.sampler is not None, "only rank 0 samples"
        return step.sample_seqs, self.sampler(logits, step.sample_seqs)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], block_copies: list[tuple[int, int]] | None = None
                ) -> tuple[list[Sequence], SamplerOutput | None]:
        """Run one step; returns the sequences that sampled, and what they sampled (in order)."""
        step = flatten_step(scheduled, block_copies, self.block_size)
        flat = payload_tensor(step.payload).to(self.device, non_blocking=True)
        return self.sample(step, self.run(unflatten_step(step.header, flat)))


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

"""Engine configuration: one plain dataclass holding every `LLM(...)` option."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from streamer.errors import ConfigError
from streamer.spec_decode.config import SpeculativeConfig


@dataclass
class EngineConfig:
    model: str = ""
    dtype: str | None = None  # float32 | bfloat16 | float16; None = checkpoint's (float32 on CPU)
    device: str | None = None  # cpu | cuda | cuda:N; None = cuda if available else cpu
    block_size: int = 16
    num_kv_blocks: int | None = None  # None = size the cache from free memory
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # auto | cpu | torch | triton
    tensor_parallel_size: int = 1
    seed: int = 0
    max_model_len: int | None = None  # None = the checkpoint's max_position_embeddings
    max_waiting_requests: int = 4096
    max_waiting_tokens: int | None = None  # None = no bound on queued prompt tokens
    kv_cache_memory_gb: float | None = None  # CPU cache size when num_kv_blocks is None (default: min(2 GiB, RAM/4))
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps (decode_graphs.py); the CPU never uses them
    cpu_gemm: str = "onednn"  # onednn (weights pre-packed once) | torch (F.linear): CPU linear layers
    # Quantized weights (docs/quantization.md): None | int8 (weight-only, per channel) | fp8 (e4m3, per channel),
    # quantized from the checkpoint's weights at load
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 (e4m3 with per-layer k/v scales, half the bytes)
    # fp8 cache: compute each layer's k/v scales from the first forward (max|k| / 200, max|v| / 100, as vLLM's
    # calculate_kv_scales); otherwise the checkpoint's k_scale/v_scale, else 1.0
    calculate_kv_scales: bool = False
    tp_timeout_s: float = 600.0  # a tensor-parallel collective's wait for a stuck rank; bounds weight loading too
    # structured_outputs work (docs/structured_outputs.md#budgets): CPU seconds one token mask and all of a
    # request's masks may take, wall seconds a compile may take, and how many compiles run at once
    grammar_mask_budget_s: float = 0.2
    grammar_request_budget_s: float = 10.0
    grammar_compile_timeout_s: float = 10.0
    grammar_compile_workers: int = 1
    # Speculative decoding (spec_decode/config.py), as vLLM's: {"method": "ngram", "num_speculative_tokens": 4,
    # "prompt_lookup_max": 4, "prompt_lookup_min": 2}; None: off.
    speculative_config: dict[str, Any] | None = None
    # Multi-LoRA (docs/lora.md): adapters held in device slots at once (least recently used evicted;
    # 0: no adapters), and the largest adapter rank accepted.
    max_loras: int = 4
    max_lora_rank: int = 16
    # Embeddings (docs/openai.md#embeddings): how a request that names no pooling pools, last | mean; None: the
    # checkpoint's sentence-transformers config (modules.json), else the last token, as vLLM's decoder models
    pooling: str | None = None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        return cls(**kwargs)

    def __post_init__(self) -> None:
        checks = [
            (self.block_size in (8, 16, 32, 64, 128), "block_size must be one of 8, 16, 32, 64, 128"),
            (self.num_kv_blocks is None or self.num_kv_blocks > 0, "num_kv_blocks must be positive"),
            (self.max_num_seqs > 0, "max_num_seqs must be positive"),
            (self.max_num_batched_tokens > 0, "max_num_batched_tokens must be positive"),
            (self.tensor_parallel_size > 0, "tensor_parallel_size must be positive"),
            (self.max_waiting_requests > 0, "max_waiting_requests must be positive"),
            (self.dtype in (None, "float32", "bfloat16", "float16", "auto"),
             "dtype must be float32, bfloat16 or float16"),
            (self.attention_backend in ("auto", "cpu", "torch", "triton"),
             "attention_backend must be auto, cpu, torch or triton"),
            (0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization must be in (0, 1]"),
            (self.cpu_gemm in ("onednn", "torch"), "cpu_gemm must be onednn or torch"),
            (self.quantization in (None, "int8", "fp8"), "quantization must be int8 or fp8"),
            (self.kv_cache_dtype in ("auto", "fp8", "fp8_e4m3"), "kv_cache_dtype must be auto, fp8 or fp8_e4m3"),
            (self.tp_timeout_s > 0, "tp_timeout_s must be positive"),
            (self.grammar_mask_budget_s > 0 and self.grammar_request_budget_s > 0
             and self.grammar_compile_timeout_s > 0, "the grammar budgets and compile timeout must be positive"),
            (self.grammar_compile_workers > 0, "grammar_compile_workers must be positive"),
            (self.max_loras >= 0, "max_loras must be 0 or more"),
            (0 < self.max_lora_rank <= 256, "max_lora_rank must be in 1..256"),
            (self.pooling in (None, "last", "mean"), "pooling must be last or mean"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        spec = SpeculativeConfig.from_dict(self.speculative_config)
        if spec is not None and spec.method == "draft_model" and self.tensor_parallel_size > 1:
            raise ConfigError("a draft model runs with tensor_parallel_size 1 only (use the ngram method with "
                              "tensor parallelism)")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.from_dict(self.speculative_config)

"""The tiny random checkpoint of each model family the parity tests hold against transformers
(beyond the Llama and Qwen2 fixtures of conftest.py): small shapes, each family's own features on."""

from __future__ import annotations

from streamer.random_checkpoint import TinyModelSpec

FAMILIES: dict[str, TinyModelSpec] = {
    # head_dim is Qwen3's own field (its default, 128, is not hidden / heads).
    "qwen3": TinyModelSpec(arch="qwen3", extra={"head_dim": 16}),
}

"""Sliding-window attention of Mistral (every layer) and of Qwen2 with use_sliding_window (the
layers from max_window_layers on): windows of 16 and 20 keys, prompts and outputs running past
them many times, token for token equal to transformers; the context is the model's whole
max_position_embeddings, not the window."""

from __future__ import annotations

from pathlib import Path

import pytest
from kernel_testing import INTERPRET
from parity import hf_greedy, parity_prompts
from test_engine_parity import reference, run_engine

from streamer import LLM, SamplingParams
from streamer.random_checkpoint import TinyModelSpec, build_checkpoint

SPECS = {
    "mistral": TinyModelSpec(arch="mistral", extra={"sliding_window": 16}),
    # Layer 0 attends to everything, layer 1 to its last 20 keys.
    "qwen2": TinyModelSpec(arch="qwen2", tie_word_embeddings=True, extra={
        "use_sliding_window": True, "sliding_window": 20, "max_window_layers": 1}),
}


@pytest.fixture(scope="module", params=sorted(SPECS))
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp(request.param), SPECS[request.param], seed=6)


def test_windowed_layers_match_transformers_far_past_the_window(ckpt: Path) -> None:
    prompts = parity_prompts(512, seed=5)  # up to 300 tokens + 30 generated: ~20 windows
    got, stats = run_engine(ckpt, prompts, block_size=8, max_num_batched_tokens=96, num_kv_blocks=512)
    assert got == reference(ckpt, prompts)
    assert stats["num_partial_prefills"] > 0
    assert LLM(str(ckpt), dtype="float32", num_kv_blocks=64).engine.max_model_len == 1024  # 64 x 16 slots


def test_reference_backend_in_a_small_cache(ckpt: Path, request: pytest.FixtureRequest) -> None:
    """96 blocks of 8 for ~900 tokens and their outputs: Qwen2 (a global layer keeps every block)
    is preempted; Mistral releases the blocks before each window and fits."""
    prompts = parity_prompts(512, seed=5)
    got, stats = run_engine(ckpt, prompts, attention_backend="torch", block_size=8, num_kv_blocks=96,
                            max_num_batched_tokens=512)
    every_layer_windowed = request.node.callspec.params["ckpt"] == "mistral"
    assert (stats["num_preemptions"] == 0) == every_layer_windowed, stats["num_preemptions"]
    assert got == reference(ckpt, prompts)


@pytest.mark.skipif(not INTERPRET, reason="CPU Triton needs TRITON_INTERPRET=1")
def test_triton_kernels_under_the_interpreter(ckpt: Path) -> None:
    prompts, budgets = parity_prompts(512, seed=5)[2:4], (4, 6)  # 17 and 40 tokens: chunked, past the window
    llm = LLM(str(ckpt), dtype="float32", attention_backend="triton", device="cpu", block_size=8,
              num_kv_blocks=64, max_num_batched_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=n) for n in budgets])
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(ckpt, tuple(map(tuple, prompts)), budgets)


def test_blocks_before_every_window_are_released(tmp_path: Path) -> None:
    """Mistral (every layer windowed, 16 keys): a 300-token prompt and 30 tokens, then two samples
    forked from a second prompt, hold at most the blocks of one window plus one step's chunk, not
    the 42 blocks of the whole sequence; the tokens still equal transformers'."""
    ckpt = build_checkpoint(tmp_path / "mistral", SPECS["mistral"], seed=6)
    llm = LLM(str(ckpt), dtype="float32", block_size=8, num_kv_blocks=64, max_num_batched_tokens=32)
    engine = llm.engine
    prompt = parity_prompts(512, seed=5)[-1]
    engine.add_request("long", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=30))
    engine.add_request("forked", {"prompt_token_ids": prompt[:100]},
                       SamplingParams(temperature=0, max_tokens=20, n=2))
    tokens: dict[str, list[list[int]]] = {"long": [[]], "forked": [[], []]}
    held = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                tokens[out.request_id][c.index] += c.token_ids
        held.append(engine.stats()["kv_blocks_used"])
    # After each step a sequence of N computed tokens holds its blocks from the one of position
    # N - 15 (the next token's window) to its last: at most 4 of 8 slots; three sequences (the two
    # samples share no block past the prompt's).
    assert max(held) <= 3 * 4 and held[-1] == 0, held
    assert max(held) < 42  # what the long sequence alone would hold without releasing
    want = hf_greedy(ckpt, (tuple(prompt), tuple(prompt[:100])), (30, 20))
    assert tokens["long"] == [want[0]] and tokens["forked"] == [want[1], want[1]]

"""Past the last layer only the sampled rows are read (the LM head takes each sequence's last new
token), so that layer computes every row's K/V but its queries, attention output and MLP only for
the sampled rows (streamer/models/llama.py, step.sample_rows_meta). These tests count the rows each
layer computes, and hold the sampled rows' logits against the whole layer's on the same step."""

from __future__ import annotations

from pathlib import Path

import torch

from streamer import EngineConfig, LLMEngine, SamplingParams
from streamer.step import StepInputs

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def _mlp_rows(engine: LLMEngine, layer: int) -> list[int]:
    rows: list[int] = []
    mlp = engine.executor.model.layers[layer].mlp
    mlp.register_forward_hook(lambda module, args, out: rows.append(len(args[0])))
    return rows


def test_the_last_layer_computes_only_the_sampled_rows(llama_ckpt: Path) -> None:
    # 16-token chunks: the long prompt's first chunks sample nothing, its last one and the short
    # prompt one row each; then two decode steps of two rows.
    engine = LLMEngine(EngineConfig(model=str(llama_ckpt), dtype="float32", num_kv_blocks=64,
                                    max_num_batched_tokens=16))
    first, last = _mlp_rows(engine, 0), _mlp_rows(engine, -1)
    engine.add_request("long", {"prompt_token_ids": [3 + i % 50 for i in range(40)]}, GREEDY)
    engine.add_request("short", {"prompt_token_ids": [7, 8, 9, 10, 11]}, GREEDY)
    generated = {"long": 0, "short": 0}
    while engine.has_unfinished_requests():
        for out in engine.step():  # deltas: this step's tokens
            generated[out.request_id] += len(out.outputs[0].token_ids)
    assert generated == {"long": 3, "short": 3}
    assert sum(first) == 45 + 2 * 2  # every prompt token, then the decodes
    assert sum(last) == 2 * 3  # one row per sampled token
    assert 0 in last  # a chunk in the middle of the prompt: no row past the K/V
    assert len(first) == len(last)


def test_the_sampled_rows_equal_the_whole_layers(llama_ckpt: Path) -> None:
    """On every step with rows left out, the logits of the sampled rows against the model run over
    all rows (which writes the same K/V again). The GEMMs' blocking differs with the number of
    rows, so equal to float32 summation order (~1e-6 relative), not bit for bit."""
    engine = LLMEngine(EngineConfig(model=str(llama_ckpt), dtype="float32", num_kv_blocks=64,
                                    max_num_batched_tokens=24))
    runner = engine.executor
    run, compared = runner.run, []  # (rows, relative error) of each step compared

    def run_both(inputs: StepInputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        logits, pooled = run(inputs)
        rows = inputs.sample_rows
        if rows.numel() and rows.numel() < inputs.input_ids.numel():
            with torch.inference_mode():
                whole = runner.model(inputs.input_ids, inputs.positions, inputs.meta)[rows]
                expected = runner.model.compute_logits(whole)
            assert logits is not None and logits.shape == expected.shape
            compared.append((rows.numel(), ((logits - expected).norm() / expected.norm()).item()))
        return logits, pooled

    runner.run = run_both
    # Decodes of different sequences next to prompt chunks (each row its own context), and two
    # forks drawing their first tokens from one row.
    prompts = {"a": [3 + i % 40 for i in range(30)], "b": [5, 6, 7], "c": [9 + i % 20 for i in range(19)],
               "d": [4 + i % 30 for i in range(60)]}
    for rid, ids in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": ids}, SamplingParams(max_tokens=6, temperature=0.0))
    engine.add_request("forks", {"prompt_token_ids": [6, 5, 4, 3]},
                       SamplingParams(max_tokens=4, temperature=1.0, n=2, seed=3))
    while engine.has_unfinished_requests():
        assert all(not out.finished or out.outputs[0].finish_reason == "length" for out in engine.step())
    # (Asserted out here: a step that raises fails its requests, it does not stop the engine.)
    assert len(compared) >= 3 and max(n for n, _ in compared) >= 3
    assert max(error for _, error in compared) < 1e-5, compared

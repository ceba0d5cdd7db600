"""CUDA graphs for decode (issue 39, part 2): buckets, padding a decode step up to its bucket, the
static buffers and their reuse, checked on the CPU by running the padded step eagerly through the
Triton backend (the GPU's, under the interpreter). Only capture and replay need a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamer import LLMEngine, SamplingParams
from streamer.attention.backend import AttentionMetadata
from streamer.config import EngineConfig
from streamer.decode_graphs import DUMMY_SLOT, DecodeBuffers, DecodeGraphs, bucket_for, graph_buckets, is_pure_decode
from streamer.step import StepInputs, flatten_step, payload_tensor, unflatten_step


def test_buckets_cover_every_batch_up_to_max_num_seqs() -> None:
    assert graph_buckets(256) == [1, 2, 4, 8, *range(16, 257, 8)]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 24]  # the last one holds max_num_seqs itself
    assert graph_buckets(8) == [1, 2, 4, 8] and graph_buckets(1) == [1]
    buckets = graph_buckets(20)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 8, 9, 17, 24)] == [1, 2, 4, 8, 8, 16, 24, 24]
    assert bucket_for(25, buckets) is None  # past the largest bucket: eager


def decode_inputs(slots: list[int], width: int, seq_lens: list[int]) -> StepInputs:
    n = len(slots)
    meta = AttentionMetadata(num_decodes=n, query_start_loc=torch.arange(n + 1, dtype=torch.int32),
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                             slot_mapping=torch.tensor(slots), max_query_len=1,
                             block_tables=torch.arange(1, n * width + 1, dtype=torch.int32).view(n, width),
                             max_seq_len=max(seq_lens), max_decode_seq_len=max(seq_lens))
    return StepInputs(torch.arange(100, 100 + n), torch.tensor(seq_lens) - 1, meta, torch.arange(n),
                      torch.empty(0, 2, dtype=torch.int64))


def test_buffers_pad_with_dummies_and_forget_the_previous_step() -> None:
    buffers = DecodeBuffers(max_batch=8, max_blocks_per_seq=4, max_model_len=64, device=torch.device("cpu"))
    buffers.fill(decode_inputs([10, 11, 12, 13], width=3, seq_lens=[5, 6, 7, 8]), bucket=4)
    buffers.fill(decode_inputs([20, 21, 22], width=2, seq_lens=[3, 4, 5]), bucket=4)  # a smaller step, same bucket
    ids, positions, meta = buffers.view(4)
    assert ids.tolist() == [100, 101, 102, 0] and positions.tolist() == [2, 3, 4, 0]
    assert meta.slot_mapping.tolist() == [20, 21, 22, DUMMY_SLOT]  # the dummy row writes nowhere
    assert meta.seq_lens.tolist() == [3, 4, 5, 1]  # and reads one position of block 0
    assert meta.block_tables.tolist() == [[1, 2, 0, 0], [3, 4, 0, 0], [5, 6, 0, 0], [0, 0, 0, 0]]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4] and meta.num_decodes == 4
    assert meta.max_seq_len == meta.max_decode_seq_len == 64  # a graph serves any step of its bucket
    # Views of one set of buffers: every bucket's graph reads the same memory.
    assert buffers.view(2)[0].data_ptr() == ids.data_ptr()


@pytest.fixture(scope="module")
def engine(llama_ckpt: Path) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=str(llama_ckpt), device="cpu", dtype="float32", attention_backend="triton",
                                    num_kv_blocks=32, max_num_seqs=8))
    yield engine
    engine.shutdown()


def next_step(engine: LLMEngine, prompts: list[list[int]]) -> StepInputs:
    """The decode step that follows these prompts' prefill (run here), not yet run."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{len(engine.scheduler.running)}-{i}", {"prompt_token_ids": p},
                           SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.step()
    step = flatten_step(engine.scheduler.schedule().scheduled, None, engine.config.block_size)
    return unflatten_step(step.header, payload_tensor(step.payload))


def test_padded_step_gives_the_unpadded_logits_and_dummies_write_no_kv(engine: LLMEngine) -> None:
    runner = engine.executor
    inputs = next_step(engine, [[5, 9, 30, 31, 32], list(range(40, 59)), [77] * 3])
    assert is_pure_decode(inputs) and inputs.input_ids.shape[0] == 3
    before = [c.clone() for c in runner.key_caches + runner.value_caches]
    eager, _ = runner.run(inputs)  # (logits, pooled hidden states)
    eager_caches = [c.clone() for c in runner.key_caches + runner.value_caches]
    for cache, saved in zip(runner.key_caches + runner.value_caches, before):
        cache.copy_(saved)
    graphs = DecodeGraphs(lambda ids, pos, meta: runner.model.compute_logits(runner.model(ids, pos, meta)),
                          DecodeBuffers(8, 8, engine.max_model_len, torch.device("cpu")), graph_buckets(8),
                          torch.device("cpu"))
    padded = graphs.run(inputs)  # 3 rows padded to the bucket of 4
    assert padded.shape == eager.shape
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(padded.argmax(-1), eager.argmax(-1))
    # The real rows wrote their K/V exactly as unpadded; the dummy row wrote nothing anywhere.
    for cache, expected in zip(runner.key_caches + runner.value_caches, eager_caches):
        assert torch.equal(cache, expected)


def test_prefill_and_mixed_steps_run_eagerly(engine: LLMEngine) -> None:
    graphs = DecodeGraphs(lambda ids, pos, meta: ids, DecodeBuffers(8, 8, 64, torch.device("cpu")), graph_buckets(2),
                          torch.device("cpu"))
    engine.add_request("prefill", {"prompt_token_ids": [3, 4, 5, 6]}, SamplingParams(max_tokens=2))
    step = flatten_step(engine.scheduler.schedule().scheduled, None, engine.config.block_size)
    mixed_or_prefill = unflatten_step(step.header, payload_tensor(step.payload))
    assert not graphs.handles(mixed_or_prefill)
    assert graphs.handles(decode_inputs([1, 2], 1, [3, 3]))
    assert not graphs.handles(decode_inputs([1, 2, 3], 1, [3, 3, 3]))  # past the largest bucket (2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture and replay need a CUDA device")
def test_captured_graph_replays_the_eager_decode(llama_ckpt: Path) -> None:
    def greedy(eager: bool) -> list[list[int]]:
        engine = LLMEngine(EngineConfig(model=str(llama_ckpt), device="cuda", dtype="float32", enforce_eager=eager,
                                        num_kv_blocks=64, max_num_seqs=8))
        prompts = [[5, 9, 30], list(range(40, 59)), [77] * 3]
        for i, p in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": p},
                               SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        graphs = engine.executor.graphs
        assert (graphs is None) == eager and (eager or 4 in graphs.graphs)  # 3 decodes ran as bucket 4's graph
        engine.shutdown()
        return [tokens[str(i)] for i in range(len(prompts))]

    assert greedy(eager=False) == greedy(eager=True)

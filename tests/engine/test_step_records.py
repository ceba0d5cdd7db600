"""What the engine reports about its own work, for metrics and slow-step traces: one record per step
(tokens, prompt tokens, where the time went) and per-request stage times."""

from __future__ import annotations

from pathlib import Path

from streamer import EngineConfig, LLMEngine, SamplingParams


def test_each_step_is_recorded_once_with_its_tokens_and_times(llama_ckpt: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(llama_ckpt), dtype="float32", num_kv_blocks=64,
                                    max_num_batched_tokens=16))
    engine.add_request("a", {"prompt_token_ids": list(range(3, 43))}, SamplingParams(max_tokens=3, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    records = engine.take_step_records()
    assert [(r.num_tokens, r.num_prefill_tokens) for r in records] == [(16, 16), (16, 16), (8, 8), (1, 0), (1, 0)]
    assert [r.index for r in records] == [1, 2, 3, 4, 5] and all(r.num_seqs == 1 for r in records)
    assert all(r.schedule_s > 0 and r.execute_s > 0 and r.process_s > 0 for r in records)
    # The in-process runner splits execute into its phases (inside execute's time).
    assert all(r.phases is not None and r.phases.forward_s > 0 and r.phases.sample_s > 0 and
               r.phases.prepare_s + r.phases.forward_s + r.phases.sample_s <= r.execute_s for r in records)
    assert all(a.started + a.total_s <= b.started for a, b in zip(records, records[1:], strict=False))
    assert engine.take_step_records() == []  # taken once
    m = outputs[-1].metrics
    assert m is not None and outputs[-1].finished
    # Queued, scheduled (3 prompt chunks), first token at the end of the third step, finished.
    assert m.arrival_time <= m.first_scheduled_time < m.first_token_time < m.finished_time
    assert m.first_scheduled_time == records[0].started + records[0].schedule_s
    assert m.first_token_time >= records[2].started + records[2].total_s - 1e-6


def test_a_reader_that_stops_taking_loses_only_the_oldest(llama_ckpt: Path) -> None:
    from streamer import llm_engine

    engine = LLMEngine(EngineConfig(model=str(llama_ckpt), dtype="float32", num_kv_blocks=64))
    engine.step_records = llm_engine.deque(maxlen=3)
    engine.add_request("b", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=6, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert [r.index for r in engine.take_step_records()] == [4, 5, 6]

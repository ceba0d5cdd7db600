"""Embeddings (streamer/pooling.py) against transformers' final hidden states pooled the same way
(float32, 1e-5), however the engine batches them: several prompts chunked over steps, next to
generation (whose greedy tokens they must not change), under preemption; their blocks freed at
once; the checkpoint's pooling config, `dimensions` and an embedding checkpoint without an LM head."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch
from parity import MAX_TOKENS, hf_greedy, parity_prompts

from streamer import LLM, SamplingParams
from streamer.pooling import PoolingParams
from streamer.random_checkpoint import TinyModelSpec, build_checkpoint

PROMPTS = parity_prompts(512)[:6]  # 1, 3, 17, 40, 64 and 129 tokens
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def qwen3_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("qwen3"), TinyModelSpec(arch="qwen3", extra={"head_dim": 16}),
                            seed=5)


def hf_pooled(ckpt: Path, prompts: list[list[int]], pooling: str, normalize: bool = True,
              dimensions: int | None = None) -> list[torch.Tensor]:
    """transformers' base model (its last_hidden_state is after the final norm), one prompt at a
    time, pooled by the mean or the last token."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            hidden = model(torch.tensor([prompt])).last_hidden_state[0]
            vector = hidden.mean(0) if pooling == "mean" else hidden[-1]
            vector = vector[:dimensions] if dimensions else vector
            out.append(torch.nn.functional.normalize(vector, dim=-1) if normalize else vector)
    return out


def assert_close(got: list[float] | None, expected: torch.Tensor) -> None:
    assert got is not None
    error = (torch.tensor(got) - expected).abs().max().item()
    assert error < TOLERANCE, error


@pytest.mark.parametrize("pooling", ["mean", "last"])
@pytest.mark.parametrize("ckpt_name", ["llama_ckpt", "qwen3_ckpt"])
def test_batched_chunked_embeddings_equal_transformers(request: pytest.FixtureRequest, ckpt_name: str,
                                                       pooling: str) -> None:
    ckpt = request.getfixturevalue(ckpt_name)
    # A 48-token budget: the long prompts run in chunks, several prompts share each step.
    llm = LLM(str(ckpt), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=48)
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], PoolingParams(pooling=pooling))
    for out, expected in zip(outs, hf_pooled(ckpt, PROMPTS, pooling), strict=True):
        assert out.finished and out.outputs == [] and out.error is None
        assert_close(out.embedding, expected)
    stats = llm.stats()
    assert stats["num_partial_prefills"] > 0 and stats["num_steps"] < len(PROMPTS) + 5
    # Prefill only: every block is free again, and none was registered in the prefix cache.
    assert stats["kv_blocks_used"] == 0 and not llm.engine.scheduler.block_manager.cached
    assert stats["generation_tokens"] == 0


def test_unnormalised_and_the_engine_default(llama_ckpt: Path) -> None:
    """`normalize=False` gives the raw pool; a request naming no pooling takes the engine's option."""
    llm = LLM(str(llama_ckpt), dtype="float32", num_kv_blocks=64, pooling="mean")
    raw = llm.embed([{"prompt_token_ids": p} for p in PROMPTS[2:4]], PoolingParams(normalize=False))
    for out, expected in zip(raw, hf_pooled(llama_ckpt, PROMPTS[2:4], "mean", normalize=False), strict=True):
        assert_close(out.embedding, expected)
    assert abs(torch.tensor(raw[0].embedding).norm().item() - 1.0) > 1e-3  # really not normalised


def test_embeddings_next_to_generation_leave_its_tokens_unchanged(qwen3_ckpt: Path) -> None:
    prompts = parity_prompts(512)
    rng = random.Random(11)
    embed_prompts = [[rng.randrange(8, 512) for _ in range(n)] for n in (5, 33, 90, 2)]
    llm = LLM(str(qwen3_ckpt), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=96)
    engine = llm.engine
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in MAX_TOKENS]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"gen-{i}", {"prompt_token_ids": p}, sp)
    tokens: dict[str, list[int]] = {f"gen-{i}": [] for i in range(len(prompts))}
    embeddings: dict[str, list[float] | None] = {}
    step = 0
    while engine.has_unfinished_requests():
        if step < len(embed_prompts):  # one more embedding arrives at each of the first steps: beside decodes
            pooling = "mean" if step % 2 else "last"
            engine.add_request(f"emb-{step}-{pooling}", {"prompt_token_ids": embed_prompts[step]},
                               PoolingParams(pooling=pooling))
        step += 1
        for out in engine.step():
            if out.request_id.startswith("gen"):
                tokens[out.request_id] += out.outputs[0].token_ids
            else:
                assert out.finished
                embeddings[out.request_id] = out.embedding
    assert engine.stats()["num_mixed_steps"] > 0
    expected = hf_greedy(qwen3_ckpt, tuple(map(tuple, prompts)), tuple(MAX_TOKENS))
    assert [tokens[f"gen-{i}"] for i in range(len(prompts))] == expected
    assert len(embeddings) == len(embed_prompts)
    for request_id, got in embeddings.items():
        _, index, pooling = request_id.split("-")
        assert_close(got, hf_pooled(qwen3_ckpt, [embed_prompts[int(index)]], pooling)[0])
    assert engine.stats()["kv_blocks_used"] == 0


def test_embeddings_recomputed_after_preemption(llama_ckpt: Path) -> None:
    """Too few blocks for all at once: preempted embeddings start their pool over and still match."""
    prompts = parity_prompts(512, seed=3)[3:]  # 40, 64, 129, 200, 300 tokens
    llm = LLM(str(llama_ckpt), dtype="float32", block_size=16, num_kv_blocks=36, max_num_batched_tokens=64)
    gen = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 3
    embed = [PoolingParams(pooling="mean")] * len(prompts)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:3] + prompts],
                        [*gen, *embed])
    assert llm.stats()["num_preemptions"] > 0
    for out, expected in zip(outs[3:], hf_pooled(llama_ckpt, prompts, "mean"), strict=True):
        assert_close(out.embedding, expected)


def test_prompt_limits(llama_ckpt: Path) -> None:
    """An embedding may fill the whole model length (nothing is generated after it); one token more,
    an empty prompt or a bad id is refused before anything is queued."""
    llm = LLM(str(llama_ckpt), dtype="float32", num_kv_blocks=16, block_size=16, max_model_len=64)
    full = [9 + i % 400 for i in range(64)]
    assert_close(llm.embed([{"prompt_token_ids": full}])[0].embedding, hf_pooled(llama_ckpt, [full], "last")[0])
    for prompt, message in (([9] * 65, "at most 64 (max_model_len 64)"), ([], "prompt is empty"),
                            ([600], "outside the vocabulary")):
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.engine.add_request("bad", {"prompt_token_ids": prompt}, PoolingParams())
    with pytest.raises(ValueError, match="one token left to generate"):  # generation keeps its rule
        llm.engine.add_request("gen", {"prompt_token_ids": full}, SamplingParams())
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="pooling must be one of"):
        PoolingParams(pooling="cls")


def test_dimensions_only_for_matryoshka_models(tmp_path: Path) -> None:
    ckpt = build_checkpoint(tmp_path / "m", TinyModelSpec(), seed=4)
    llm = LLM(str(ckpt), dtype="float32", num_kv_blocks=16)
    with pytest.raises(ValueError, match="not a matryoshka model"):
        llm.engine.add_request("d", {"prompt_token_ids": [5, 6]}, PoolingParams(dimensions=16))
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    llm = LLM(str(ckpt), dtype="float32", num_kv_blocks=16)
    with pytest.raises(ValueError, match=r"\[16, 32\]"):
        llm.engine.add_request("d", {"prompt_token_ids": [5, 6]}, PoolingParams(dimensions=24))
    got = llm.embed([{"prompt_token_ids": PROMPTS[2]}], PoolingParams(dimensions=16))[0].embedding
    assert got is not None and len(got) == 16
    assert_close(got, hf_pooled(ckpt, [PROMPTS[2]], "last", dimensions=16)[0])


def write_sentence_transformers(ckpt: Path, mode: str) -> None:
    """modules.json and the Pooling module's config, as sentence-transformers saves a model."""
    (ckpt / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (ckpt / "1_Pooling").mkdir(exist_ok=True)
    (ckpt / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": mode == "mean",
         "pooling_mode_lasttoken": mode == "last", "pooling_mode_cls_token": False}))


def test_embedding_checkpoint_without_lm_head(tmp_path: Path) -> None:
    """A Qwen3-Embedding-style checkpoint: the base model's weights only (no `model.` prefix, no LM
    head, embeddings not tied), its pooling in sentence-transformers' files. It embeds by its own
    pooling; `--pooling` overrides it; generation is refused with a clear error."""
    from transformers import AutoModel

    source = build_checkpoint(tmp_path / "full", TinyModelSpec(arch="qwen3", extra={"head_dim": 16}), seed=6)
    ckpt = tmp_path / "embedding"
    AutoModel.from_pretrained(str(source), dtype=torch.float32).save_pretrained(str(ckpt))
    for name in source.iterdir():  # the tokenizer's files
        if name.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (ckpt / name.name).write_bytes(name.read_bytes())
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    write_sentence_transformers(ckpt, "mean")
    prompts = PROMPTS[1:4]
    llm = LLM(str(ckpt), dtype="float32", num_kv_blocks=32)
    for out, expected in zip(llm.embed([{"prompt_token_ids": p} for p in prompts]),
                             hf_pooled(source, prompts, "mean"), strict=True):
        assert_close(out.embedding, expected)
    with pytest.raises(ValueError, match="no LM head"):
        llm.engine.add_request("g", {"prompt_token_ids": [5, 6]}, SamplingParams())
    llm = LLM(str(ckpt), dtype="float32", num_kv_blocks=32, pooling="last")
    assert_close(llm.embed([{"prompt_token_ids": prompts[2]}])[0].embedding,
                 hf_pooled(source, [prompts[2]], "last")[0])


def test_tensor_parallel_embeddings_next_to_generation(llama_ckpt: Path) -> None:
    """Two CPU ranks: every rank computes the pool rows' last layer (the rows are in the step every rank
    gets), rank 0 pools them; embeddings and greedy tokens as on one device."""
    prompts = PROMPTS[1:5]
    with LLM(str(llama_ckpt), dtype="float32", tensor_parallel_size=2, num_kv_blocks=64,
             max_num_batched_tokens=48) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2],
                            [*[PoolingParams(pooling="mean")] * len(prompts),
                             *[SamplingParams(temperature=0.0, max_tokens=n) for n in MAX_TOKENS[:len(prompts)]]])
    for out, expected in zip(outs[:len(prompts)], hf_pooled(llama_ckpt, prompts, "mean"), strict=True):
        assert_close(out.embedding, expected)
    expected_tokens = hf_greedy(llama_ckpt, tuple(map(tuple, prompts)), tuple(MAX_TOKENS[:len(prompts)]))
    assert [o.outputs[0].token_ids for o in outs[len(prompts):]] == expected_tokens

"""Guesses from a draft model: a smaller checkpoint of the same tokenizer, decoding greedily ahead.

The draft model runs on a model runner of its own, with a paged KV cache and block manager of its
own, on a shadow of each drafting sequence: the shadow's tokens are the sequence's, its computed
count is how far the draft's cache holds them. Each call first catches the shadows up with what
the target accepted since (one batched extend: the kept drafts' K/V are already there), then
decodes k tokens greedily, all shadows in one step each. A draft is a point guess (q = 1 on it),
so the rejection rule of rejection_sampler.py applies unchanged.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from streamer.block_manager import BlockManager
from streamer.config import EngineConfig
from streamer.errors import ConfigError
from streamer.model_config import ModelConfig
from streamer.request import Sequence
from streamer.sampler import Sampler
from streamer.sampling_params import SamplingParams
from streamer.scheduler_output import ScheduledSeq

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


class DraftModelProposer:
    def __init__(self, config: EngineConfig, draft: str, target: ModelConfig, device: torch.device,
                 num_kv_blocks: int) -> None:
        from streamer.model_runner import ModelRunner  # the runner imports the engine's layers: load lazily

        draft_config = ModelConfig.load(draft, config.dtype, device, target.max_model_len)
        if draft_config.hf_config.vocab_size != target.hf_config.vocab_size:
            raise ConfigError(f"the draft model's vocabulary ({draft_config.hf_config.vocab_size} tokens) is not "
                              f"the target's ({target.hf_config.vocab_size}): it must share the tokenizer")
        # The draft model proposes for the base model (its shadows carry no adapter): no LoRA slots.
        runner_config = replace(config, model=draft, num_kv_blocks=num_kv_blocks, tensor_parallel_size=1,
                                speculative_config=None, max_loras=0)
        self.runner = ModelRunner(runner_config, draft_config, device, Sampler(set(), config.seed))
        self.blocks = BlockManager(self.runner.num_kv_blocks, config.block_size, enable_prefix_caching=False)
        self.max_batched = config.max_num_batched_tokens
        self.shadows: dict[int, tuple[Sequence, Sequence]] = {}  # seq_id -> (sequence, shadow)

    def propose_many(self, wanted: dict[Sequence, int]) -> dict[Sequence, list[int]]:
        """Up to `wanted[seq]` guessed next tokens of each sequence."""
        self._forget_finished()
        shadows = {seq: self._shadow(seq) for seq, k in wanted.items() if k > 0}
        drafts: dict[Sequence, list[int]] = {seq: [] for seq in wanted}
        pending = self._catch_up(shadows)
        for _ in range(max(wanted.values(), default=0)):
            active = [seq for seq in pending if len(drafts[seq]) < wanted[seq]]
            if not active:
                break
            items = [ScheduledSeq(shadows[seq], shadows[seq].num_tokens - shadows[seq].num_computed_tokens)
                     for seq in active]
            if not self._allocate(items):
                break
            for item in items:
                item.block_ids = self.blocks.block_table(item.seq)
            sampled, result = self.runner.execute(items)
            assert result is not None
            for item in items:
                item.seq.num_computed_tokens += item.num_new_tokens
            for shadow, token in zip(sampled, result.token_ids):
                shadow.token_ids.append(token)
            for seq in active:
                drafts[seq].append(shadows[seq].token_ids[-1])
        for seq, shadow in shadows.items():  # the guesses stay computed in the draft cache if kept
            del shadow.token_ids[seq.num_tokens:]
        return drafts

    def _shadow(self, seq: Sequence) -> Sequence:
        """The sequence's shadow, its computed count cut back to where its tokens still agree."""
        entry = self.shadows.get(seq.seq_id)
        if entry is None:
            shadow = Sequence(request_id=seq.request_id, index=seq.index, token_ids=list(seq.token_ids),
                              num_prompt_tokens=seq.num_prompt_tokens, params=_GREEDY)
            self.shadows[seq.seq_id] = (seq, shadow)
            return shadow
        shadow = entry[1]
        agree = _common_prefix(shadow.token_ids, seq.token_ids)
        shadow.token_ids = list(seq.token_ids)
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, agree)
        return shadow

    def _catch_up(self, shadows: dict[Sequence, Sequence]) -> list[Sequence]:
        """Compute each shadow's tokens up to its last but one (its last is the next decode's input),
        in steps of at most the engine's token budget; the sequences whose shadows are ready."""
        ready = list(shadows)
        while True:
            items = [ScheduledSeq(shadows[seq], shadows[seq].num_tokens - 1 - shadows[seq].num_computed_tokens)
                     for seq in ready]
            items = [item for item in items if item.num_new_tokens > 0]
            if not items:
                return ready
            budget, chosen = self.max_batched, []
            for item in items:
                item.num_new_tokens = min(item.num_new_tokens, budget)
                budget -= item.num_new_tokens
                if item.num_new_tokens:
                    chosen.append(item)
            if not self._allocate(chosen):
                return []
            for item in chosen:
                item.block_ids = self.blocks.block_table(item.seq)
            self.runner.execute(chosen)  # none reaches its end: nothing is sampled
            for item in chosen:
                item.seq.num_computed_tokens += item.num_new_tokens

    def _allocate(self, items: list[ScheduledSeq]) -> bool:
        """Room in the draft cache for every item, dropping every shadow when it is full (they are
        computed again on their next call: a full draft cache costs time, never a wrong guess)."""
        if all(self.blocks.allocate(item.seq, item.num_new_tokens) for item in items):
            return True
        for _, shadow in self.shadows.values():
            self.blocks.free(shadow)
            shadow.num_computed_tokens = 0
        self.shadows.clear()
        return False

    def _forget_finished(self) -> None:
        for seq_id, (seq, shadow) in list(self.shadows.items()):
            if seq.is_finished:
                self.blocks.free(shadow)
                del self.shadows[seq_id]

    def shutdown(self) -> None:
        self.runner.shutdown()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n

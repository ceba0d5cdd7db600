"""Each sampling rule on its own, through `Sampler.__call__` as the engine calls it: one row per
batch, that row's rule the only one in it. `probabilities()` always penalises and a mixed batch has
some penalised row, so neither notices a rule that `__call__` skips when it is alone (`min_tokens`
banning EOS in an otherwise plain row once did exactly that in an audit's planted bug)."""

from __future__ import annotations

import pytest
import torch
from test_sampler_reference import EOS, OUTPUT, VOCAB, make_seq

from streamer.sampler import Sampler
from streamer.sampling_params import SamplingParams

SEEN = 17  # generated 3 times in OUTPUT
FRESH = 40  # never generated: the runner-up each rule must leave on top


def logits_with(top: int) -> torch.Tensor:
    """One row whose argmax is `top` (5.0), FRESH next (4.0), everything else 0."""
    row = torch.zeros(1, VOCAB)
    row[0, FRESH] = 4.0
    row[0, top] = 5.0
    return row


# (rule, the token it favours without the rule, the token with it). Each case's rule is at the
# edge where it starts or stops acting.
CASES = [
    ({"min_tokens": len(OUTPUT) + 1}, EOS, FRESH),  # one more token to go: EOS is banned
    ({"min_tokens": len(OUTPUT)}, EOS, EOS),  # reached: EOS is allowed again
    ({"min_tokens": len(OUTPUT) + 1, "stop_token_ids": [SEEN], "ignore_eos": True}, SEEN, FRESH),
    ({"min_tokens": len(OUTPUT) + 1, "ignore_eos": True}, EOS, EOS),  # ignore_eos: EOS is no stop to ban
    ({"repetition_penalty": 2.0}, SEEN, FRESH),  # 5 / 2 < 4
    ({"presence_penalty": 1.5}, SEEN, FRESH),  # 5 - 1.5 < 4
    ({"frequency_penalty": 0.5}, SEEN, FRESH),  # 5 - 3 * 0.5 < 4
    ({"frequency_penalty": 0.3}, SEEN, SEEN),  # 5 - 3 * 0.3 > 4: counts, not presence
]


@pytest.mark.parametrize("draw", [{"temperature": 0.0}, {"temperature": 1.0, "top_k": 1}], ids=["greedy", "top1"])
@pytest.mark.parametrize(("rule", "top", "want"), CASES, ids=[",".join(c[0]) + f"->{c[2]}" for c in CASES])
def test_one_rule_alone_in_a_batch(rule: dict, top: int, want: int, draw: dict) -> None:
    sampler = Sampler(eos_token_ids={EOS}, seed=0)
    seq = make_seq(SamplingParams(max_tokens=100, **draw, **rule))
    out = sampler(logits_with(top), [seq])
    assert out.token_ids == [want]
    plain = make_seq(SamplingParams(max_tokens=100, **draw))
    assert sampler(logits_with(top), [plain]).token_ids == [top]  # the rule, not the logits, moved it

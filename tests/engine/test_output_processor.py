"""The engine's output side on its own: the scheduler's updates in, `RequestOutput` deltas out.

Updates are written by hand (what `Scheduler.update_from_output` reports); the text is checked
against the tokenizer's full decode, as in test_detokenizer.py.
"""

from __future__ import annotations

import pytest
from test_detokenizer import PROMPT, TEXT

from streamer.output_processor import OutputProcessor
from streamer.random_checkpoint import build_tokenizer
from streamer.request import Request, SeqStatus, Sequence
from streamer.sampling_params import SamplingParams
from streamer.scheduler_output import BeamResult, SeqUpdate, StepUpdates


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - a transformers tokenizer
    return build_tokenizer(512, tmp_path_factory.mktemp("tok"))


def new_request(tok, n: int = 1, resumed: list[list[int]] | None = None, **params: object) -> Request:  # noqa: ANN001
    prompt = tok(PROMPT).input_ids
    p = SamplingParams(**{"max_tokens": 100, "n": n, **params})
    resumed = resumed or []
    seqs = [Sequence(request_id="r", index=i, token_ids=prompt + (resumed[i] if i < len(resumed) else []),
                     num_prompt_tokens=len(prompt), params=p) for i in range(n)]
    return Request("r", prompt, p, seqs, prompt=PROMPT)


def feed(proc: OutputProcessor, seq: Sequence, token: int, finish: tuple[str, int | str | None] | None = None,
         logprobs: dict[int, float] | None = None):  # noqa: ANN201
    """One step in which `seq` sampled `token` (appended, as the scheduler does)."""
    seq.token_ids.append(token)
    update = SeqUpdate(seq, token, logprobs, *(finish or (None, None)))
    if finish:
        seq.status = SeqStatus.FINISHED
    return proc.process(StepUpdates([update]))


def test_deltas_add_up_to_the_full_decode_and_the_last_output_is_final(tok) -> None:
    proc, request = OutputProcessor(tok), new_request(tok, n=2)
    proc.add_request(request, [])
    request.sequences[0].num_cached_tokens, request.sequences[1].num_cached_tokens = 16, 0  # the fork found none
    tokens = tok(" " + TEXT).input_ids[:12]
    outs = [feed(proc, request.sequences[0], t, ("length", None) if i == len(tokens) - 1 else None)[0]
            for i, t in enumerate(tokens)]
    assert all(len(o) == 1 for o in outs)
    assert "".join(o[0].outputs[0].text for o in outs) == tok.decode(request.prompt_token_ids + tokens)[len(PROMPT):]
    assert [o[0].finished for o in outs] == [False] * len(tokens)  # sample 1 never finished
    assert all(o[0].num_cached_tokens == 0 for o in outs)  # the request's least
    request.sequences[1].num_cached_tokens = 16
    final = feed(proc, request.sequences[1], tokens[0], ("length", None))[0][0]
    assert final.finished and final.num_cached_tokens == 16 and final.outputs[0].index == 1
    last = outs[-1][0]
    assert (last.request_id, last.prompt_token_ids, last.prompt) == ("r", request.prompt_token_ids, PROMPT)
    assert last.outputs[0].finish_reason == "length" and last.outputs[0].logprobs is None
    assert not proc.has_pending() and proc.process(StepUpdates()) == ([], [])


def test_a_stop_string_ends_the_sequence_and_is_handed_back(tok) -> None:
    proc, request = OutputProcessor(tok), new_request(tok, stop=["wörld"])
    proc.add_request(request, [])
    seq, text = request.sequences[0], ""
    for t in tok(" " + TEXT).input_ids:
        (out,), stopped = feed(proc, seq, t)
        text += out.outputs[0].text
        if stopped:
            break
    assert stopped == [seq] and out.finished
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", "wörld")
    assert text == " Héllo "


def test_a_stop_string_held_back_as_incomplete_utf8_counts_when_the_sequence_ends_otherwise(tok) -> None:
    tokens = tok(" " + TEXT).input_ids
    texts = [tok.decode(tokens[:n]) for n in range(len(tokens))]
    cut = next(n for n, text in enumerate(texts) if "日" in text and text.endswith("\ufffd"))
    proc, request = OutputProcessor(tok), new_request(tok, stop=["日"])
    proc.add_request(request, [])
    seq, text = request.sequences[0], ""
    for i, t in enumerate(tokens[:cut]):
        (out,), stopped = feed(proc, seq, t, ("length", None) if i == cut - 1 else None)
        text += out.outputs[0].text
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", "日")
    assert stopped == [] and text == texts[cut].split("日")[0]  # the scheduler had finished it already


def test_token_rules_outrank_a_stop_string_and_a_stop_string_outranks_length(tok) -> None:
    for finish, want in ((("stop", None), ("stop", None)), (("stop", 7), ("stop", 7)),
                         (("length", None), ("stop", "Hé"))):
        proc, request = OutputProcessor(tok), new_request(tok, stop=["Hé"])
        proc.add_request(request, [])
        seq = request.sequences[0]
        for t in tok(" Héllo").input_ids[:-1]:
            feed(proc, seq, t)
        (out,), stopped = feed(proc, seq, tok(" Héllo").input_ids[-1], finish)
        assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == want and stopped == []


def test_logprobs_only_when_asked_for(tok) -> None:
    proc, request = OutputProcessor(tok), new_request(tok, logprobs=1)
    proc.add_request(request, [])
    (out,), _ = feed(proc, request.sequences[0], 5, logprobs={5: -0.5, 6: -1.0})
    assert out.outputs[0].logprobs == [{5: -0.5, 6: -1.0}]
    proc, request = OutputProcessor(tok), new_request(tok)
    proc.add_request(request, [])
    (out,), _ = feed(proc, request.sequences[0], 5)
    assert out.outputs[0].logprobs is None


@pytest.mark.parametrize("logprobs", [None, 2])
def test_an_abort_hands_out_held_back_text_and_keeps_finished_samples_reasons(tok, logprobs) -> None:
    proc, request = OutputProcessor(tok), new_request(tok, n=2, stop=["zzz"], logprobs=logprobs)
    proc.add_request(request, [])
    first, second = request.sequences
    lp = None if logprobs is None else {9: -0.1}
    streamed = feed(proc, first, tok(" Hi").input_ids[-1], ("stop", 9), logprobs=lp)[0][0].outputs[0].text
    tokens = tok(" Héllo wörld").input_ids
    text = "".join(feed(proc, second, t, logprobs=lp)[0][0].outputs[0].text for t in tokens)
    assert not proc.has_pending()
    for seq in request.sequences:  # as the scheduler's abort leaves them
        seq.status = SeqStatus.FINISHED
    proc.abort(request)
    assert proc.has_pending()
    (out,), stopped = proc.process(StepUpdates())
    assert out.finished and stopped == [] and not proc.has_pending()
    a, b = out.outputs
    assert (a.index, a.finish_reason, a.stop_reason, a.text, a.token_ids) == (0, "stop", 9, "", [])
    assert (b.index, b.finish_reason, b.stop_reason, b.token_ids) == (1, "abort", None, [])
    assert text + b.text == tok.decode(request.prompt_token_ids + tokens)[len(PROMPT):]  # held back: "zz" fits
    assert streamed and all(c.logprobs == ([] if logprobs else None) for c in out.outputs)
    proc.abort(request)  # twice: nothing more
    assert not proc.has_pending()


def test_resumed_tokens_give_the_text_its_context(tok) -> None:
    """A worker died after streaming the first bytes of a character (no text yet): the resumed
    sample's next token completes the character, as in the uninterrupted run."""
    emoji = tok.backend_tokenizer.encode("🙂", add_special_tokens=False).ids
    assert len(emoji) > 1, "the test needs a character split over several tokens"
    before = tok(" ok").input_ids + emoji[:-1]
    proc, request = OutputProcessor(tok), new_request(tok, resumed=[before])
    proc.add_request(request, [before])
    (out,), _ = feed(proc, request.sequences[0], emoji[-1], ("length", None))
    assert out.outputs[0].text == "🙂"


def test_a_finished_beam_search_is_one_final_output(tok) -> None:
    proc = OutputProcessor(tok)
    request = new_request(tok, use_beam_search=True, beam_width=2)
    proc.add_request(request, [])
    ids = [tok(" Hi").input_ids + [tok.eos_token_id], tok(" Ho there").input_ids]  # EOS: not in the text
    (out,), stopped = proc.process(StepUpdates(beam_results=[BeamResult(request, ids, [True, False])]))
    assert out.finished and stopped == [] and (out.prompt, out.prompt_token_ids) == (PROMPT, request.prompt_token_ids)
    assert [(c.index, c.token_ids, c.text, c.finish_reason) for c in out.outputs] == \
        [(0, ids[0], " Hi", "stop"), (1, ids[1], " Ho there", "length")]
    proc.abort(request)  # already over: nothing to hand out
    assert not proc.has_pending()


def test_resumed_text_is_replayed_without_stop_checks(tok) -> None:
    """Stop strings are not checked before `min_tokens`: the resumed text may hold one, and must
    stay whole, so a stop string completed across the resume point is still found."""
    piece = lambda text: tok.backend_tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    before, last = piece("aa"), piece("a")  # "aa" then "a": the second "aa" starts inside the first
    assert tok.decode(before + last) == "aaa" and len(last) == 1
    proc = OutputProcessor(tok)
    request = new_request(tok, resumed=[before], stop=["aa"], min_tokens=len(before) + 1)
    proc.add_request(request, [before])
    (out,), stopped = feed(proc, request.sequences[0], last[0])
    assert stopped == [request.sequences[0]] and out.outputs[0].stop_reason == "aa"

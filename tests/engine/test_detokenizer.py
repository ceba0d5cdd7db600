"""Incremental detokenization against a full decode, stop strings against a plain string search.

The reference for any token sequence is `tokenizer.decode` of its tokens, cut at the first token
whose text, once valid UTF-8, completes a stop string (the stop string kept or dropped per
`include_stop_str_in_output`). Whatever was
streamed before the end must always be a prefix of the final text: a stop string, or a character
still incomplete in UTF-8, must never leak out and be taken back later.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamer.detokenizer import IncrementalDetokenizer
from streamer.random_checkpoint import build_tokenizer
from streamer.sampling_params import SamplingParams

TEXT = "Héllo wörld, naïve café 日本語のテキスト emoji 🙂🚀 END of the line. stop STOP st0p 0123"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - a transformers tokenizer
    return build_tokenizer(512, tmp_path_factory.mktemp("tok"))


def stream(tok, tokens: list[int], params: SamplingParams, min_tokens: int = 0) -> tuple[list[str], str | None]:
    """Feed tokens one at a time as the engine does; returns the streamed deltas and the stop hit."""
    detok = IncrementalDetokenizer(tok.backend_tokenizer, tok(PROMPT).input_ids, params)
    deltas, hit = [], None
    for i, token in enumerate(tokens, start=1):
        hit = detok.append(token, check_stop=i >= min_tokens)
        if hit is None and i == len(tokens):  # the engine's last step for a sequence that ends anyway
            hit = detok.flush(check_stop=i >= min_tokens)
        finished = hit is not None or i == len(tokens)
        deltas.append(detok.delta(finished=finished))
        if hit is not None:
            break
    return deltas, hit


def reference(tok, tokens: list[int], stops: list[str], include: bool) -> tuple[str, str | None]:
    """Text becomes visible once it is valid UTF-8 (a token that ends inside a character shows
    nothing until the character is complete), and all of it at the end. The stream stops at the
    first token whose visible text completes a stop string; of the stop strings in the text by
    then, the one that starts first is the cut."""
    for n in range(1, len(tokens) + 1):
        text = tok.decode(tokens[:n], skip_special_tokens=True)
        if text.endswith("\ufffd") and n < len(tokens):
            continue
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            index, stop = min(hits)
            return text[: index + (len(stop) if include else 0)], stop
    return tok.decode(tokens, skip_special_tokens=True), None


def assert_prefix_stream(deltas: list[str], final: str) -> None:
    streamed = ""
    for delta in deltas:
        streamed += delta
        assert final.startswith(streamed), f"streamed {streamed!r}, which the final text {final!r} takes back"
    assert streamed == final


def test_streamed_text_is_the_full_decode(tok) -> None:
    tokens = tok(TEXT).input_ids
    deltas, hit = stream(tok, tokens, SamplingParams())
    assert hit is None
    assert_prefix_stream(deltas, tok.decode(tokens, skip_special_tokens=True))


@pytest.mark.parametrize("stops", [["END"], ["wörld"], ["🚀"], ["本語"], ["ST", "stop"], ["never", "line."],
                                   ["e"], ["0123"], ["café 日"]])
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_cut_at_their_first_occurrence(tok, stops: list[str], include: bool) -> None:
    tokens = tok(TEXT).input_ids
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    deltas, hit = stream(tok, tokens, params)
    want_text, want_stop = reference(tok, tokens, stops, include)
    assert hit == want_stop
    assert_prefix_stream(deltas, want_text)


def test_stop_strings_are_not_searched_before_min_tokens(tok) -> None:
    tokens = tok("a stop b stop c").input_ids
    params = SamplingParams(stop=["stop"])
    early = len(tok("a stop").input_ids)  # the first "stop" is complete within these tokens
    deltas, hit = stream(tok, tokens, params, min_tokens=early + 1)
    assert hit == "stop"
    assert "".join(deltas) == "a stop b "


def test_no_stop_strings_means_no_hold_back(tok) -> None:
    tokens = tok("plain words here").input_ids
    deltas, _ = stream(tok, tokens, SamplingParams())
    assert all(deltas), "every token of plain ASCII text should stream its text at once"


def test_incomplete_utf8_at_the_end_becomes_a_replacement_character(tok) -> None:
    emoji = tok.backend_tokenizer.encode("🙂", add_special_tokens=False).ids
    assert len(emoji) > 1, "the test needs a character split over several tokens"
    tokens = tok("ok ").input_ids + emoji[:-1]
    deltas, _ = stream(tok, tokens, SamplingParams())
    assert "".join(deltas) == tok.decode(tokens, skip_special_tokens=True)
    assert "".join(deltas).endswith("\ufffd")


def test_a_broken_character_mid_stream_is_the_models_own(tok) -> None:
    """A sampled model may emit the first bytes of a character and then a plain word ("Bailiw\ufffd
    Coast" was seen): no valid text holds those bytes, so the full decode shows U+FFFD there too.
    The stream never emits a part of a character it could still complete, and its text is exactly
    the full decode's, replacement character included, never more of them."""
    emoji = tok.backend_tokenizer.encode("🙂", add_special_tokens=False).ids
    tokens = tok("Bailiw").input_ids + emoji[:-1] + tok(" Coast").input_ids
    deltas, _ = stream(tok, tokens, SamplingParams())
    full = tok.decode(tokens, skip_special_tokens=True)
    assert "\ufffd" in full and not full.endswith("\ufffd")
    assert_prefix_stream(deltas, full)
    detok = IncrementalDetokenizer(tok.backend_tokenizer, tok(PROMPT).input_ids, SamplingParams())
    held = ""
    for token in tok("Bailiw").input_ids + emoji[:-1]:
        detok.append(token, check_stop=False)
        held += detok.delta(finished=False)
    assert held.endswith("Bailiw")  # before the next token the character could still complete: nothing of it


def test_a_stop_string_in_text_held_back_as_incomplete_utf8_still_stops(tok) -> None:
    """"日本" only comes out with the bytes of the next character: cut there, the sequence ends with
    its text still held, and the stop string in it must count."""
    tokens = tok(TEXT).input_ids
    texts = [tok.decode(tokens[:n]) for n in range(len(tokens))]
    cut = next(n for n, text in enumerate(texts) if "日" in text and text.endswith("\ufffd"))
    deltas, hit = stream(tok, tokens[:cut], SamplingParams(stop=["日"]))
    assert hit == "日"
    assert "".join(deltas) == tok.decode(tokens[:cut]).split("日")[0]


def test_an_aborted_sequence_gets_its_held_back_text_untrimmed(tok) -> None:
    """An abort is not a stop: text still held back comes out whole, stop strings and all."""
    tokens = tok(TEXT).input_ids
    texts = [tok.decode(tokens[:n]) for n in range(len(tokens))]
    cut = next(n for n, text in enumerate(texts) if "日" in text and text.endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok.backend_tokenizer, tok(PROMPT).input_ids, SamplingParams(stop=["日"]))
    streamed = ""
    for token in tokens[:cut]:
        assert detok.append(token, check_stop=True) is None
        streamed += detok.delta(finished=False)
    assert streamed + detok.delta(finished=True) == texts[cut]


@pytest.fixture(scope="module")
def metaspace_tok():  # noqa: ANN201 - a transformers tokenizer
    """A SentencePiece-style tokenizer ("▁word" pieces): a word's leading space only shows in context."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    raw.train_from_iterator([PROMPT + " " + TEXT] * 4, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"],
                                                                          show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")


@pytest.mark.parametrize("prompt_words", [1, 3, 40])
def test_first_token_text_depends_on_the_prompt_before_it(metaspace_tok, prompt_words: int) -> None:
    """The streamed text is the output's text in context: decode(prompt + output) minus the prompt's."""
    prompt = metaspace_tok(" ".join((PROMPT.split() * 10)[:prompt_words])).input_ids
    output = metaspace_tok("quick brown fox").input_ids
    detok = IncrementalDetokenizer(metaspace_tok.backend_tokenizer, prompt, SamplingParams())
    text = ""
    for token in output:
        detok.append(token, check_stop=True)
        text += detok.delta(finished=False)
    text += detok.delta(finished=True)
    assert text == metaspace_tok.decode(prompt + output)[len(metaspace_tok.decode(prompt)):] == " quick brown fox"


def byte_fallback_tokenizer():  # noqa: ANN201 - a tokenizers.Tokenizer
    """Llama 2 / Mistral / Gemma style: every byte a token of its own (<0xNN>), decoded by ByteFallback."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "at": 257, "h": 258, "▁the": 259}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tokenizer


def test_an_invalid_byte_after_a_streamed_byte_token_does_not_fail_the_sequence() -> None:
    """`F` (0x46) streams as "F"; an invalid byte (0xF6) after it turns the pair into "��" in a full
    decode, which tokenizers' DecodeStream reports as an error. The sequence goes on: "F" stays
    streamed, the invalid byte is U+FFFD, later tokens stream as usual."""
    tokenizer = byte_fallback_tokenizer()
    detok = IncrementalDetokenizer(tokenizer, [259], SamplingParams(stop=["ath"]))
    hits = [detok.append(token, check_stop=True) for token in (1 + 0x46, 1 + 0xF6, 257, 259, 258)]
    assert tokenizer.decode([1 + 0x46, 1 + 0xF6, 257]) == "\ufffd\ufffdat"  # the case DecodeStream rejects
    assert hits == [None] * 5
    assert detok.delta(finished=True) == "F\ufffdat the" + "h"


def test_special_tokens_follow_skip_special_tokens(tok) -> None:
    tokens = tok("hi").input_ids + [tok.eos_token_id] + tok(" there").input_ids
    for skip in (True, False):
        deltas, _ = stream(tok, tokens, SamplingParams(skip_special_tokens=skip))
        assert "".join(deltas) == tok.decode(tokens, skip_special_tokens=skip)
    assert "</s>" not in tok.decode(tokens, skip_special_tokens=True)


def test_without_a_tokenizer_there_is_no_text() -> None:
    detok = IncrementalDetokenizer(None, [1, 2], SamplingParams(stop=["x"]))
    assert detok.append(5, check_stop=True) is None
    assert detok.delta(finished=True) == ""


@settings(max_examples=300, deadline=None, derandomize=True)  # the same examples in CI and mutation runs
@given(data=st.data())
def test_any_cut_of_any_text_streams_as_a_prefix_of_the_reference(tok, data: st.DataObject) -> None:
    tokens = tok(TEXT).input_ids
    n = data.draw(st.integers(1, len(tokens)), label="tokens")
    full = tok.decode(tokens[:n], skip_special_tokens=True)
    stops = data.draw(st.lists(st.one_of(
        st.builds(lambda i, k: TEXT[i:i + k], st.integers(0, len(TEXT) - 1), st.integers(1, 6)),
        st.text(alphabet="aeost🙂日", min_size=1, max_size=3)), min_size=0, max_size=3), label="stops")
    stops = [s for s in stops if s]
    include = data.draw(st.booleans(), label="include")
    deltas, hit = stream(tok, tokens[:n], SamplingParams(stop=stops, include_stop_str_in_output=include))
    want_text, want_stop = reference(tok, tokens[:n], stops, include)
    assert hit == want_stop, full
    assert_prefix_stream(deltas, want_text)

"""The routing decision and what it is made of, as pure functions (clients/routing.py,
workers/worker/accounting.py): prefix chains, matches, the policy, the advertised LRU."""

from __future__ import annotations

from clients.routing import (
    CHARS_PER_TOKEN,
    TEXT_CHUNK_CHARS,
    WorkerView,
    answer_chain,
    choose,
    matched_tokens,
    prefix_chain,
)
from workers.worker.accounting import PrefixAdvert

SYSTEM = {"role": "system", "content": "s" * 600}


def test_chains_share_exactly_the_common_prefix() -> None:
    a = prefix_chain({"messages": [SYSTEM, {"role": "user", "content": "one"}]})
    b = prefix_chain({"messages": [SYSTEM, {"role": "user", "content": "two"}]})
    assert a[0] == b[0] and a[1] != b[1]
    # Text parts are hashed as the worker renders them (joined): the same chain.
    parts = prefix_chain({"messages": [{"role": "system", "content": [{"type": "text", "text": "s" * 300}] * 2},
                                       {"role": "user", "content": "one"}]})
    assert parts == a
    # A plain prompt: whole 256-character chunks only; weights in estimated tokens.
    text = prefix_chain({"prompt": "x" * (3 * TEXT_CHUNK_CHARS + 10)})
    assert [s.tokens for s in text] == [TEXT_CHUNK_CHARS // CHARS_PER_TOKEN * i for i in (1, 2, 3)]
    ids = prefix_chain({"prompt_token_ids": list(range(130))})
    assert [s.tokens for s in ids] == [64, 128]


def test_the_next_turn_matches_the_answered_conversation() -> None:
    job = {"messages": [SYSTEM, {"role": "user", "content": "hi"}]}
    served = answer_chain(job, "hello there")
    nxt = prefix_chain({"messages": [*job["messages"], {"role": "assistant", "content": "hello there"},
                                     {"role": "user", "content": "and?"}]})
    assert served == nxt[:3]
    assert matched_tokens(nxt, [1, 1, 1, 0]) == nxt[2].tokens
    assert matched_tokens(nxt, [1, 0, 1, 1]) == nxt[0].tokens  # a gap ends the match
    assert matched_tokens(nxt, [0, 1, 1, 1]) == 0


def test_the_policy() -> None:
    a, b = WorkerView("a", 0.5, 100), WorkerView("b", 0.0, 60)
    # b scores higher (60 x 1.0 > 100 x 0.5) but holds less than the minimum: a, which has room, wins.
    assert choose("cache_load", [a, b]).worker == "a"
    assert choose("cache_load", [WorkerView("a", 0.2, 300), WorkerView("b", 0.9, 400)]).worker == "a"
    assert choose("cache_load", [WorkerView("a", 1.6, 300), b]).outcome == "fallback"
    assert choose("cache_load", [WorkerView("a", 0.1, 10), WorkerView("b", 0.0, 0)]).outcome == "miss"
    assert choose("cache_load", [a, b], session_owner="b") == choose("cache_load", [b], session_owner="b")
    assert choose("cache_load", [a, b], session_owner="b").outcome == "session"
    assert choose("cache_load", [a, WorkerView("b", 1.5, 0)], session_owner="b").outcome == "fallback"
    assert choose("cache", [WorkerView("a", 5.0, 300), b]).worker == "a"  # load ignored
    assert choose("least_loaded", [a, b]).worker == "b"
    assert choose("shared", [a, b]).worker is None


def test_the_advert_drops_a_chains_tail_before_its_root() -> None:
    advert = PrefixAdvert(lambda: 200)
    chain = prefix_chain({"messages": [SYSTEM, {"role": "user", "content": "u" * 200},
                                       {"role": "assistant", "content": "a" * 200}]})
    advert.add(chain)  # 150 + ~55 + ~55 tokens: over 200, the last segment goes first
    assert chain[0].digest in advert.digests and chain[-1].digest not in advert.digests
    other = prefix_chain({"messages": [{"role": "system", "content": "t" * 600}]})
    advert.add(other)  # the least recently used chain goes
    assert advert.digests[-1] == other[0].digest and chain[0].digest not in advert.digests
    assert advert.removed >= {chain[0].digest, chain[-1].digest}

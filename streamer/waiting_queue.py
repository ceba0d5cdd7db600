"""The queue of sequences waiting for admission, and the per-session service that orders it.

Order: (priority, attained-service rank, arrival). The rank is the program-level least attained
service of Autellix: a session (a conversation, an agent) that has already had many tokens computed
waits behind fresh ones, so short interactive calls overtake long agent or batch work. Ranks are
log2 buckets, so sessions of similar service stay first come, first served, and a sequence that
waited longer than a bound is ranked 0 again, so a heavy session is delayed, never starved.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator

from streamer.request import Sequence

# (priority, rank, order, seq_id, seq): the order breaks ties by arrival (negative for preempted
# sequences, which go back ahead of their priority); seq_id keeps the tuples comparable.
Entry = tuple[int, int, int, int, Sequence]


class AttainedService:
    """Tokens computed per session (prompt tokens computed + tokens generated). Only the most
    recently served `max_sessions` are kept: a forgotten session ranks like a new one, which is
    the right mistake to make for a session that has gone quiet."""

    def __init__(self, max_sessions: int = 4096, unit: int = 16) -> None:
        self.max_sessions = max_sessions
        self.unit = unit  # tokens per rank step: a block, so a few tokens never reorder anyone
        self._tokens: OrderedDict[str, int] = OrderedDict()

    def add(self, session: str | None, num_tokens: int) -> None:
        if session is None or num_tokens <= 0:
            return
        self._tokens[session] = self._tokens.pop(session, 0) + num_tokens  # now the most recent
        if len(self._tokens) > self.max_sessions:
            self._tokens.popitem(last=False)

    def tokens(self, session: str | None) -> int:
        return 0 if session is None else self._tokens.get(session, 0)

    def rank(self, session: str | None) -> int:
        """0 below one unit of service (and without a session), then one more per doubling."""
        return (self.tokens(session) // self.unit).bit_length()

    def __len__(self) -> int:
        return len(self._tokens)


class WaitingQueue:
    """By (priority, attained-service rank, arrival); lower values run first. Without `service`
    every rank is 0: FCFS within a priority. Preempted sequences go back ahead of everything of
    their priority, whatever their session's service."""

    def __init__(self, service: AttainedService | None = None, max_wait_rank_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._heap: list[Entry] = []
        self._order = itertools.count()
        self._front = itertools.count(-1, -1)
        self.service = service
        self.max_wait_rank_s = max_wait_rank_s  # None: a rank never expires
        self.clock = clock
        self._aging: deque[tuple[float, int]] = deque()  # (when its rank expires, order), in push order
        self.num_tokens = 0  # tokens of the queued sequences, for the `max_waiting_tokens` bound

    def push(self, seq: Sequence, front: bool = False) -> None:
        order = next(self._front) if front else next(self._order)
        rank = 0 if front or self.service is None else self.service.rank(seq.session)
        if rank and self.max_wait_rank_s is not None:
            self._aging.append((self.clock() + self.max_wait_rank_s, order))
        self.push_entry((seq.priority, rank, order, seq.seq_id, seq))

    def promote_aged(self) -> int:
        """Rank 0 for the sequences that have waited `max_wait_rank_s` with a higher rank; they
        keep their arrival order, so they go ahead of fresh sessions that came later. Returns how
        many were still waiting."""
        now, due = self.clock(), set()
        while self._aging and self._aging[0][0] <= now:
            due.add(self._aging.popleft()[1])  # it may have been admitted since: then nothing to do
        if not due:
            return 0
        promoted = [(p, 0, o, i, s) for p, r, o, i, s in self._heap if o in due and r]
        if promoted:
            self._heap = [e for e in self._heap if not (e[2] in due and e[1])] + promoted
            heapq.heapify(self._heap)
        return len(promoted)

    def peek(self) -> Sequence:
        return self._heap[0][4]

    def in_order(self) -> Iterator[Sequence]:
        """The waiting sequences in the order they are admitted, lazily: a caller that stops after a few
        pays for those few (the heap is copied once it reads past the head)."""
        if not self._heap:
            return
        yield self._heap[0][4]
        rest = list(self._heap)
        heapq.heappop(rest)
        while rest:
            yield heapq.heappop(rest)[4]

    def pop(self) -> Sequence:
        return self.pop_entry()[4]

    def pop_entry(self) -> Entry:
        """Take the head out with its place in line, to `push_entry` it back unchanged."""
        entry = heapq.heappop(self._heap)
        self.num_tokens -= entry[4].num_tokens
        return entry

    def push_entry(self, entry: Entry) -> None:
        heapq.heappush(self._heap, entry)
        self.num_tokens += entry[4].num_tokens

    def remove(self, seq: Sequence) -> bool:
        for i, item in enumerate(self._heap):
            if item[4] is seq:
                self._heap.pop(i)
                heapq.heapify(self._heap)
                self.num_tokens -= seq.num_tokens
                return True
        return False

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Sequence]:
        return (item[4] for item in self._heap)

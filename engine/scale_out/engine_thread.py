"""`EngineThread`: one `LLM` stepped by a thread of its own, fed by any number of callers.

A caller submits requests with a callback; the thread admits them as the waiting queue has room
(as `LLM.stream` does), steps while anything is unfinished, sleeps when nothing is, and hands each
finished request to its caller's callback, on the engine thread. A scaled-out replica
(`engine.ray_data`) runs its engine this way, so that several batches share one running batch.

The engine is touched by this thread only; `snapshot` is what others read, refreshed at most every
`snapshot_every_s`. A failure the engine does not contain (one that would end `LLM.stream`) is
fatal to the process that owns the thread: `on_fatal` is called with it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..llm import LLM, PromptInput
from ..outputs import RequestOutput

Deliver = Callable[[RequestOutput], None]


class EngineThread:
    def __init__(
        self,
        llm: LLM,
        on_fatal: Callable[[BaseException], None],
        snapshot_every_s: float = 0.5,
    ) -> None:
        self.llm = llm
        self._on_fatal = on_fatal
        self._every = snapshot_every_s
        self._cond = threading.Condition()
        self._incoming: deque[tuple[int, PromptInput, Deliver]] = deque()
        self._sinks: dict[int, Deliver] = {}
        self._index = itertools.count()
        self._closed = False
        self._snapshot = llm.snapshot()
        self._snapshot_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="pagedctl-engine", daemon=True)
        self._thread.start()

    @property
    def snapshot(self) -> dict[str, Any]:
        return self._snapshot

    def submit(self, prompts: list[PromptInput], deliver: Deliver) -> None:
        """Queue `prompts` (dicts with their own `sampling_params`); `deliver` gets each one's
        output, on the engine thread, as it finishes."""
        with self._cond:
            for prompt in prompts:
                self._incoming.append((next(self._index), prompt, deliver))
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # the process owning the thread decides
            self._on_fatal(exc)

    def _loop(self) -> None:
        llm = self.llm
        room = llm.scheduler.config.max_num_seqs
        while True:
            with self._cond:
                while not self._closed and not self._incoming and not llm.has_unfinished():
                    self._cond.wait(timeout=self._every)
                    self._refresh()
                if self._closed:
                    return
                admitted = []
                while self._incoming and len(llm.scheduler.waiting) + len(admitted) < room:
                    admitted.append(self._incoming.popleft())
                for index, _, deliver in admitted:
                    self._sinks[index] = deliver
            for index, prompt, _ in admitted:
                self._hand_back(llm.add_request(index, prompt))
            if llm.has_unfinished():
                self._hand_back(llm.step())
            self._refresh()

    def _hand_back(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._cond:
                deliver = self._sinks.pop(out.index)
            deliver(out)

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._snapshot_at >= self._every or not self._sinks:
            self._snapshot = self.llm.snapshot()
            self._snapshot_at = now

"""What torchrun ranks tell each other, through the torchrun store.

A ``PrefixStore`` on the default group's store, one per launch attempt. Store operations time out where a
collective could hang, so a rank that went missing costs a deadline, not the session: ``gather`` returns who posted,
who did not, and the stacks the missing ranks' watchdogs posted.
"""

from __future__ import annotations

import json
import time


class Exchange:
    def __init__(self, store, rank: int, world_size: int):
        self.store, self.rank, self.world_size = store, rank, world_size

    def post(self, key: str, payload: dict) -> None:
        self.store.set(f"{key}/{self.rank}", json.dumps(payload, default=repr))

    def post_stack(self, key: str, stack: str) -> None:
        """This rank's stacks at an item's timeout (never raises: the store may be gone)."""
        try:
            self.store.set(f"{key}/stack/{self.rank}", stack)
        except Exception:
            pass

    def stack_of(self, key: str, rank: int) -> str:
        """The stacks `rank` posted at an item's timeout, or why there are none."""
        try:
            if self.store.check([f"{key}/stack/{rank}"]):
                return self.store.get(f"{key}/stack/{rank}").decode()
            return "(finished the test, or posted no stack)"
        except Exception as exc:
            return f"(the torchrun store failed: {exc})"

    def gather(self, key: str, deadline: float, stack_prefix: str | None = None):
        """Every rank's post under key: (posts by rank, missing ranks, stacks the missing ranks posted).

        Polls with ``check`` rather than blocking in ``wait``: a timed-out wait logs a C++ warning, and a missing
        rank that posted its stack ends the wait early.
        """
        pending = [r for r in range(self.world_size)]
        posts: dict[int, dict] = {}
        stacks: dict[int, str] = {}
        delay, detailed_at = 0.0002, time.monotonic() + 0.5
        while True:
            now = time.monotonic()
            keys = [f"{key}/{r}" for r in pending]
            try:
                if self.store.check(keys):
                    for r, raw in zip(pending, self.store.multi_get(keys)):
                        posts[r] = json.loads(raw)
                    return posts, [], {}
                if now < deadline and now < detailed_at:
                    time.sleep(delay)
                    delay = min(delay * 2, 0.02)
                    continue
                detailed_at = now + 0.5
                for r in list(pending):
                    if self.store.check([f"{key}/{r}"]):
                        posts[r] = json.loads(self.store.get(f"{key}/{r}"))
                        pending.remove(r)
                    elif stack_prefix and r not in stacks and self.store.check([f"{stack_prefix}/{r}"]):
                        stacks[r] = self.store.get(f"{stack_prefix}/{r}").decode()
            except Exception as exc:  # the store itself is gone: every rank still pending is lost
                stacks.update({r: f"(the torchrun store failed: {exc})" for r in pending})
                return posts, pending, stacks
            if not pending:
                return posts, [], {}
            if now >= deadline or (stack_prefix and all(r in stacks for r in pending)):
                return posts, pending, stacks

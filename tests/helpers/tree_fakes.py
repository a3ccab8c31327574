"""Stand-ins for the tree schedules' tests: a peer that replays messages, a verification that
accepts a fixed path."""

from __future__ import annotations

from typing import Any

from real.runtime.links import Message


class Replay:
    """A peer that hands out the given messages and keeps what it is sent."""

    def __init__(self, msgs: list[Message]) -> None:
        self.msgs, self.sent = list(msgs), []

    def send(self, msg: Message) -> None:
        self.sent.append(msg)

    def recv(self) -> Message:
        return self.msgs.pop(0)


def forced_path(batch: Any, p: Any, greedy: Any, generator: Any = None) -> Any:
    """A verification that accepts the first-drawn child twice (a random head's guesses would
    all be rejected), then the target's own token: re-roots that move drafted pairs into the prefix."""
    from testbed.spec.tree_verify import TreeVerifyResult

    path, row = [], 0
    while len(path) < 2 and batch.children[row]:
        row = batch.children[row][0]
        path.append(row)
    return TreeVerifyResult([batch.node_ids[r] for r in path], [batch.tokens[r] for r in path]
                            + [int(p[row].argmax())], len(path))

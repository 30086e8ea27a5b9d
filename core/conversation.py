"""A chat's branches, Qt-free (issue #36): editing an earlier message forks the chat
instead of discarding what followed, as in LM Studio and ChatGPT.

The conversation's ``messages`` list is always the path being shown: what the
transcript draws and what the engine is sent, so nothing that reads a chat needs to
know about branches. A user message where the chat forked carries the other paths:

    {"role": "user", "content": "Hi there",
     "branches": [[{"role": "user", "content": "Hello"}, {...reply...}, ...], None],
     "branch": 1}

``branches`` holds every continuation from that point (each a user message and all
that followed it); the shown one is ``None`` there, because it *is* the rest of
``messages`` (kept once, so it can never drift from what is shown). Switching swaps
the tail of ``messages`` with a stored one and hands the ``branches`` list to the
first message of the new tail. Forks further down live inside their own tails, so
every branch keeps its own sub-branches and its replies' versions. Nothing is ever
dropped: a fork only stores, a switch only swaps.
"""

from __future__ import annotations

from collections.abc import Iterator


def branch_of(m: dict) -> tuple[int, int]:
    """(shown branch, number of branches) at this message: (0, 1) when it never forked."""
    branches = m.get("branches") or []
    if len(branches) < 2:
        return 0, 1
    return min(max(int(m.get("branch", 0)), 0), len(branches) - 1), len(branches)


def fork(msgs: list[dict], i: int, message: dict) -> dict:
    """A new branch at ``i``: ``msgs[i:]`` is kept as another branch and ``message``
    (the edited user message) starts the shown one. Returns the message as stored."""
    old = msgs[i:]
    branches = old[0].pop("branches", None) or [None]
    k = old[0].pop("branch", 0)
    branches[min(max(int(k), 0), len(branches) - 1)] = old
    branches.append(None)
    new = {**message, "branches": branches, "branch": len(branches) - 1}
    del msgs[i:]
    msgs.append(new)
    return new


def switch(msgs: list[dict], i: int, step: int) -> bool:
    """Show the branch ``step`` away at message ``i`` (‹ is -1, › is +1): the shown
    tail is stored and the chosen one becomes the rest of ``msgs``."""
    if not 0 <= i < len(msgs):
        return False
    k, n = branch_of(msgs[i])
    j = k + step
    if n < 2 or not 0 <= j < n:
        return False
    branches = msgs[i].pop("branches")
    msgs[i].pop("branch", None)
    branches[k] = msgs[i:]
    tail, branches[j] = branches[j], None
    tail[0]["branches"], tail[0]["branch"] = branches, j
    del msgs[i:]
    msgs.extend(tail)
    return True


def every_message(msgs: list[dict]) -> Iterator[dict]:
    """Every message of every branch (the shown path first, then the stored ones), for
    searching a chat's text."""
    for m in msgs:
        yield m
        for tail in m.get("branches") or []:
            if tail:
                yield from every_message(tail)

"""Routing policies: which P (and dp rank) and which D serve a request."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from appliance.proxy.backends import Backend

B = TypeVar("B", bound=Backend)


class Policy(Protocol):
    def pick(self, candidates: Sequence[B]) -> B: ...


class RoundRobin:
    """In turn over the nodes in rotation now; a node leaving the rotation shifts the turn."""

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, candidates: Sequence[B]) -> B:
        b = candidates[self._turn % len(candidates)]
        self._turn += 1
        return b


class LeastOutstanding:
    """Fewest requests in flight; ties go to the node picked least often, so an idle
    cluster is still used in turn."""

    def pick(self, candidates: Sequence[B]) -> B:
        return min(candidates, key=lambda b: (b.in_flight, b.picked))


def make_policy(name: str) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_outstanding":
        return LeastOutstanding()
    raise ValueError(f"unknown routing policy {name!r}")


class Router:
    """One policy instance per role, so P's and D's turns do not interfere."""

    def __init__(self, policy: str) -> None:
        self._prefill = make_policy(policy)
        self._decode = make_policy(policy)

    def pick_prefill(self, candidates: Sequence[B]) -> B:
        b = self._prefill.pick(candidates)
        b.picked += 1
        return b

    def pick_decode(self, candidates: Sequence[B]) -> B:
        b = self._decode.pick(candidates)
        b.picked += 1
        return b

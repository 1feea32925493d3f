"""Which engine replica a rollout's next segment goes to.

A rollout's warm state is the prefix its replica's KV cache holds, so it stays where it began
(affinity); a new rollout goes where the load is lowest (the tokens its rollouts hold, as a share
of its KV capacity when the capacities are known; then the fewest rollouts; then the lowest
index, so that the choice is reproducible). A replica that goes down loses its rollouts'
placements lazily: each learns at its next `place` that it moved (and must be prefilled again
on its new replica), even if its replica is back by then (a restarted engine's cache is empty),
and a replica that comes back is given new work at once (it holds the least).

Sans-IO, like `core/scheduler.py`: the engine side (`engine/replicas.py`) says what it saw
(a replica failing, answering again) and asks before each segment.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

import attrs

#: Rollout ids whose replica the router remembers, the least recently placed forgotten first
#: (one forgotten goes where the load is lowest, as a new rollout does).
AFFINITIES = 65_536


class NoReplicaUp(Exception):
    """Every replica is down: nothing can serve a segment now."""


@attrs.frozen
class Placement:
    """Where a segment goes, and where the rollout was before if it moved (its old replica
    went down): a moved rollout's prefix is not cached on its new replica."""

    replica: int
    moved_from: int | None = None


@attrs.define
class _Held:
    replica: int
    tokens: int
    #: The replica's `down` count when the rollout was placed: a later one lost its prefix.
    epoch: int


class Router:
    """Rollouts by key (any hashable) over `replicas` replicas, all up at first."""

    def __init__(self, replicas: int, *, capacities: Sequence[int] | None = None) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {replicas}")
        if capacities is not None and (
            len(capacities) != replicas or any(c < 1 for c in capacities)
        ):
            raise ValueError(
                f"capacities must be {replicas} positive token counts, got {capacities}"
            )
        self.replicas = replicas
        self._capacities = tuple(capacities) if capacities is not None else (1,) * replicas
        self._up = [True] * replicas
        self._epochs = [0] * replicas
        self._held: dict[Hashable, _Held] = {}
        #: Per replica: the tokens and the number of rollouts placed on it.
        self.tokens = [0] * replicas
        self.rollouts = [0] * replicas
        #: Rollouts moved off a replica that went down, since the start.
        self.moves = 0
        #: Per client-named rollout id: the replica its last segment went to.
        self._affinities: OrderedDict[Hashable, int] = OrderedDict()

    # -- what the engine side tells it ---------------------------------------------------------

    def place(self, key: Hashable, tokens: int, *, affinity: Hashable = None) -> Placement:
        """Where `key`'s next segment goes, holding `tokens`: its replica while that is up,
        else, for a new `key`, the replica its `affinity` (a rollout id the client named) last
        went to while that is up, else the least loaded one that is. Raises `NoReplicaUp`."""
        held = self._held.get(key)
        if held is not None and self._holds(held):
            self._resize(held, tokens)
            self._remember(affinity, held.replica)
            return Placement(held.replica)
        candidates = self._up_replicas()  # before anything changes: it may raise
        moved_from = None
        if held is not None:  # its old place counts no more, even if that replica is back
            moved_from = held.replica
            self._unplace(held)
            self.moves += 1
        replica = min(candidates, key=lambda r: (self.load(r), self.rollouts[r], r))
        last = self._affinities.get(affinity) if affinity is not None else None
        if held is None and last is not None and self._up[last]:
            replica = last
        self._remember(affinity, replica)
        held = self._held[key] = _Held(replica, 0, self._epochs[replica])
        self.rollouts[replica] += 1
        self._resize(held, tokens)
        return Placement(replica, moved_from)

    def release(self, key: Hashable) -> None:
        """`key` is gone: its replica holds nothing of it the server will ask for again."""
        held = self._held.pop(key, None)
        if held is not None:
            self._unplace(held)

    def down(self, replica: int) -> None:
        """`replica` failed: nothing new goes there, and its rollouts move when they next ask."""
        if self._up[replica]:
            self._up[replica] = False
            self._epochs[replica] += 1

    def up(self, replica: int) -> None:
        """`replica` answers again (with an empty cache, as far as the server knows)."""
        self._up[replica] = True

    # -- what it tells the engine side ---------------------------------------------------------

    def is_up(self, replica: int) -> bool:
        return self._up[replica]

    def up_share(self) -> float:
        """The share of all the replicas' KV capacity on those that answer now (by count,
        without capacities)."""
        up = sum(c for c, answers in zip(self._capacities, self._up, strict=True) if answers)
        return up / sum(self._capacities)

    def replica_of(self, key: Hashable) -> int | None:
        held = self._held.get(key)
        return None if held is None else held.replica

    def load(self, replica: int) -> float:
        """The share of `replica`'s capacity its rollouts hold (tokens, without capacities)."""
        return self.tokens[replica] / self._capacities[replica]

    # -- inside --------------------------------------------------------------------------------

    def _remember(self, affinity: Hashable, replica: int) -> None:
        if affinity is None:
            return
        self._affinities[affinity] = replica
        self._affinities.move_to_end(affinity)
        if len(self._affinities) > AFFINITIES:
            self._affinities.popitem(last=False)

    def _holds(self, held: _Held) -> bool:
        """Whether `held`'s replica is up and has not been down since it was placed there."""
        return self._up[held.replica] and self._epochs[held.replica] == held.epoch

    def _up_replicas(self) -> list[int]:
        candidates = [r for r in range(self.replicas) if self._up[r]]
        if not candidates:
            raise NoReplicaUp(f"all {self.replicas} engine replicas are down")
        return candidates

    def _resize(self, held: _Held, tokens: int) -> None:
        self.tokens[held.replica] += tokens - held.tokens
        held.tokens = tokens

    def _unplace(self, held: _Held) -> None:
        self.tokens[held.replica] -= held.tokens
        self.rollouts[held.replica] -= 1

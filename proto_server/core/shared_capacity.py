"""Several server processes admitting against the same engines: each one's part of the room.

Every process (a `--workers` worker, a host behind HAProxy) admits its own rollouts
(`core/scheduler.py`), but the engines' KV cache is one. So each publishes what it holds and
what its waiting rollouts want (`Load`) where the others read it (the store they share), and
admits against what it holds plus its part of the room nobody holds (`capacity_for`): when some
wait, first the rollout each process admits next (its head), the smallest first, while they
fit; then the rest max-min fair by what each still waits for (water-filling: nobody gets more
than it waits for, and what one does not need goes to the others in equal parts); when nobody
waits, in equal parts, so a rollout that comes to any process is admitted at once if it fits
that part.

Every process that computes its part from the same loads gets parts that add up to at most
the room, so together they never admit past the capacity. Between two looks, what a process
knows of the others is up to one interval old; that is the whole of the overcommit they can
make: what the others admitted since it last looked (a rollout larger than the room among it,
which a process runs alone while it believes the others hold nothing).

Sans-IO: the trio side (`server/rollouts/admission.py`) publishes, reads and sets the capacity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs


@attrs.frozen
class Load:
    """What one server process holds on the engines and wants more of, in tokens."""

    #: Its admitted rollouts' tokens (the scheduler's `reserved`).
    reserved: int
    #: Its waiting rollouts' tokens (what it would admit if it had the room).
    waiting: int
    #: The tokens of the waiting rollout it admits next (0: none waits); it admits nobody
    #: behind that one until it fits.
    head: int = 0
    #: Who it is: between equal heads, the room goes by it, the same way in every process.
    peer: str = ""


def capacity_for(capacity: int, mine: Load, others: Sequence[Load]) -> int:
    """What a process holding `mine` may admit against, beside `others`, out of `capacity`:
    what it holds and its part of the room; but never more than the others leave, even when
    it holds more than that (a rollout that grew, or one larger than the room running alone:
    what is admitted keeps its place, and what it frees is not room for more)."""
    left = capacity - sum(load.reserved for load in others)
    return max(0, min(mine.reserved + part_of_room(capacity, mine, others), left))


def part_of_room(capacity: int, mine: Load, others: Sequence[Load]) -> int:
    """The part of the room nobody holds that a process holding `mine` may admit into."""
    loads = [mine, *others]
    room = capacity - sum(load.reserved for load in loads)
    if room <= 0:
        return 0
    if not any(load.waiting for load in loads):
        return room // len(loads)
    return share_room(room, loads)[0]


def share_room(room: int, loads: Sequence[Load]) -> list[int]:
    """`room` between processes some of which wait: first each one's head, the smallest first
    (a process admits nobody until its head fits, so a part smaller than its head would be
    lost), while they fit; then what is left max-min fair by what each still waits for."""
    parts = [0] * len(loads)
    left = room
    heads = sorted((load.head, load.peer, i) for i, load in enumerate(loads) if load.head)
    for head, _, index in heads:
        if head > left:
            break
        parts[index] = head
        left -= head
    still = [max(0, load.waiting - part) for load, part in zip(loads, parts, strict=True)]
    return [part + more for part, more in zip(parts, water_fill(left, still), strict=True)]


def water_fill(room: int, demands: Sequence[int]) -> list[int]:
    """`room` shared max-min fair by `demands`: the smallest demand is met first, or given an
    equal part of what is left if it is larger; so no part is larger than its demand, and the
    parts add up to at most `room`."""
    parts = [0] * len(demands)
    wanting = sorted((d, i) for i, d in enumerate(demands) if d > 0)
    left = room
    for n, (demand, index) in enumerate(wanting):
        part = min(demand, left // (len(wanting) - n))
        parts[index] = part
        left -= part
    return parts


def water_level(room: float, demands: Sequence[float], weights: Sequence[float]) -> float:
    """The level of `water_fill`, weighted: `room` shared max-min fair by `demands` gives each
    demand `d` of weight `w` the part `min(d, w x level)`, the parts adding up to `room`
    (inf: every demand fits). Unrounded, as admission's fair share between keys compares
    tokens per unit of weight with it (core/scheduler.py); `water_fill` gives whole parts."""
    if sum(demands) <= room:
        return math.inf
    wanting = sorted(zip(demands, weights, strict=True), key=lambda dw: dw[0] / dw[1])
    left, weight = float(room), float(sum(weights))
    for demand, w in wanting:
        if demand * weight > left * w:  # more than its part at the level the rest gives
            return left / weight
        left -= demand
        weight -= w
    return math.inf  # not reached: the demands add up to more than the room

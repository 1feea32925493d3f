"""What every store keeps and how long a call may wait on it: one declaration for both
backends and their flags."""

from __future__ import annotations

import attrs

from proto_server.core.ranges import at_least, positive, positive_finite
from proto_server.core.settings import setting

DAY_S = 24 * 3600.0


@attrs.frozen(kw_only=True)
class StoreRetention:
    """What every store keeps, and how long a call may wait on it (both stores, every flag)."""

    # zero or less would delete each response in the transaction that writes it
    max_responses: int = setting(
        100_000,
        at_least(1),
        flag="--store-max-responses",
        help="retention: the newest this many stored responses are kept",
    )
    max_age_s: float = setting(
        30 * DAY_S,
        positive,
        flag="--store-max-age",
        metavar="DAYS",
        unit=DAY_S,
        help="retention: stored responses older than this many days are deleted",
    )
    timeout_s: float = setting(
        5.0,
        positive_finite,
        flag="--store-timeout",
        help="longest wait for the store (a lock held elsewhere, a slow disk); then the "
        "Response fails (store_unavailable) or the lookup is refused (503), the connection lives",
    )


DEFAULT_RETENTION = StoreRetention()

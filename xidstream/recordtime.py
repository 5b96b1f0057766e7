"""A record's time as read back from a topic: `xidstream incident` and its HTML report both read
records as published, where a node can write any value. One module of its own so that neither
command imports the other (tests/test_layers.py: no import cycles)."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

__all__ = ["record_time"]

_MAX_TS = 253402300799.0  # 9999-12-31T23:59:59Z: what a datetime can show


def record_time(value: Any) -> float:
    """Seconds since the epoch of a record's time; 0 for anything that is not one (a record is
    read as published: a node can write any value)."""
    if isinstance(value, bool):
        return 0.0
    if isinstance(value, (int, float)):
        t = float(value)
    else:
        try:
            t = datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
        except (ValueError, OverflowError):
            return 0.0
    return t if math.isfinite(t) and 0 <= t <= _MAX_TS else 0.0

"""One hash of a resolved config (and what goes with it) for the caches keyed by it: the WAN meter's loss runs and
the model clock's plans."""
from __future__ import annotations

import hashlib
import json
from typing import Any


def digest(obj: Any, length: int) -> str:
    """A hash of a resolved config (and what goes with it) that a number's spelling does not change: 4 and 4.0 are
    one value (a default that moved from 4 to 4.0 must not orphan the runs trained with it)."""
    def plain(o: Any) -> Any:
        if isinstance(o, float) and o.is_integer():
            return int(o)
        if isinstance(o, dict):
            return {k: plain(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [plain(v) for v in o]
        return o

    blob = json.dumps(plain(obj), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:length]

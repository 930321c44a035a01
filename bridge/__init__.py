"""kv-event-bridge: KV-cache events from inference engines to streaming platforms."""

from __future__ import annotations

__version__ = "0.1.0"

"""kv-event-consumer: keep a correct KV block index from kv-event-bridge's output.

The core (this package's top level) is pure Python; the bootstrap readers are in
:mod:`kv_consumer.redis`, :mod:`kv_consumer.kafka` and :mod:`kv_consumer.nats`, each needing only
its broker client (the distribution's extras ``redis``, ``kafka``, ``nats``).
"""

from __future__ import annotations

from .index import Hash, KvIndex, Stream, decode
from .state import LAST, NO_HEAD, StreamState, block_id, is_head, parse, position

__all__ = ["LAST", "NO_HEAD", "Hash", "KvIndex", "Stream", "StreamState", "block_id", "decode", "is_head", "parse", "position"]

"""Keep a KV block index from the bridge's Kafka topic (aiokafka).

    python examples/consumers/consume_kafka.py --bootstrap-servers localhost:9092 --topic kv-events

The sink: ``format: json`` (event or batch granularity), a topic template without ``{type}`` or
``{epoch}`` (so each stream stays in one partition, in order). The consumer reads every partition
from the beginning without a consumer group: the index is rebuilt from what the topic holds.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer
from kv_index import KvIndex, decode, main


async def consume(index: KvIndex, bootstrap_servers: str, topic: str, stop: Callable[[], bool], poll_ms: int = 200) -> None:
    """Apply every record of ``topic`` to ``index`` until ``stop()`` is true (checked after each poll)."""
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap_servers,
        group_id=None,  # no group: every partition is ours, nothing committed
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        metadata_max_age_ms=5000,  # partitions added to the topic are seen soon
    )
    await consumer.start()
    try:
        while not stop():
            batches = await consumer.getmany(timeout_ms=poll_ms, max_records=5000)
            for records in batches.values():  # per partition, in order
                for message in records:
                    if message.value is not None:
                        index.apply(decode(message.value))
    finally:
        await consumer.stop()


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--bootstrap-servers", default="localhost:9092")
    cli.add_argument("--topic", default="kv-events")
    main(cli, lambda index, args, stop: consume(index, args.bootstrap_servers, args.topic, stop))

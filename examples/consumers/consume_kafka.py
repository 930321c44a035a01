"""Keep a KV block index from the bridge's Kafka topic (aiokafka).

    python examples/consumers/consume_kafka.py --bootstrap-servers localhost:9092 --topic kv-events [--bootstrap]

The sink: ``format: json`` (event or batch granularity), a topic template without ``{type}`` or
``{epoch}`` (so each stream stays in one partition, in order). The consumer reads every partition
from the beginning without a consumer group: the index is rebuilt from what the topic holds.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from common import main

from kv_consumer import KvIndex, decode
from kv_consumer.kafka import bootstrap as read_state
from kv_consumer.kafka import topic_partitions


async def seed(
    index: KvIndex, consumer: AIOKafkaConsumer, bootstrap_servers: str, topic: str, state_topic: str
) -> dict[TopicPartition, int | None]:
    """Seed ``index`` with every engine stream that has a head in ``state_topic``; per partition of
    ``topic``, the lowest offset one of its streams continues from (None: from its beginning)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await admin.start()
    try:
        parts = await topic_partitions(admin, [state_topic, topic])  # {topic: partition ids}
    finally:
        await admin.close()
    if state_topic not in parts:
        return {}
    tps = [TopicPartition(state_topic, p) for p in parts[state_topic]]
    consumer.assign(tps)
    await consumer.seek_to_beginning(*tps)
    ends, heads = await consumer.end_offsets(tps), set[bytes]()
    while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:  # the streams: keys source/dp_rank/_head
        for records in (await consumer.getmany(timeout_ms=200, max_records=5000)).values():
            heads.update(r.key[: -len(b"/_head")] for r in records if r.key and r.key.endswith(b"/_head"))
    starts: dict[TopicPartition, int | None] = {TopicPartition(topic, p): None for p in parts.get(topic, ())}
    for key in heads:
        source, rank = key.decode().rsplit("/", 1)
        state, tp, start = await read_state(consumer, source, int(rank), topic=topic, state_topic=state_topic, partitions=parts)
        if "source" in state.head:  # else no head after all (start: the partition's beginning)
            index.seed((source, int(rank)), state)
        known = starts.get(tp)
        starts[tp] = start if known is None else min(known, start)
    return starts


async def consume(
    index: KvIndex, bootstrap_servers: str, topic: str, stop: Callable[[], bool], poll_ms: int = 200, bootstrap: str | None = None
) -> None:
    """Apply every record of ``topic`` to ``index`` until ``stop()`` is true (checked after each poll).

    ``bootstrap``: the sink's state topic (``state.topic``, e.g. ``kv-state``): each engine stream
    with a head there starts from its state, and each partition is read from the lowest position
    its streams continue from (README "State bootstrap"); older records are skipped as duplicates.
    """
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap_servers,
        group_id=None,  # no group: every partition is ours, nothing committed
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        metadata_max_age_ms=5000,  # partitions added to the topic are seen soon
    )
    await consumer.start()
    try:
        starts = await seed(index, consumer, bootstrap_servers, topic, bootstrap) if bootstrap else {}
        if starts:  # the topic's partitions as they are now, each from where its streams continue
            consumer.assign(list(starts))
            for tp, start in starts.items():
                if start is None:
                    await consumer.seek_to_beginning(tp)
                else:
                    consumer.seek(tp, start)
        else:
            consumer.unsubscribe()  # seed() may have assigned the state topic
            consumer.subscribe([topic])
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
    cli.add_argument(
        "--bootstrap",
        nargs="?",
        const="kv-state",
        default=None,
        metavar="STATE_TOPIC",
        help="start each stream from its state (the sink's state.enabled; its state.topic, default kv-state)",
    )
    main(cli, lambda index, args, stop: consume(index, args.bootstrap_servers, args.topic, stop, bootstrap=args.bootstrap))

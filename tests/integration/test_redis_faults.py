"""The Redis sink under an ACL that refuses part of its write script, and under key templates that
render one key for two engine streams, through the runtime's delivery loop on a real redis-server.

Found by an invariant breaker (``r1_index_acl``, ``r2_noperm_resend``, ``r4_key_collision``); each
test checks the delivery contract (bridge/connector.py) precisely:

- nothing is dead-lettered: no message here is refused for itself;
- every acknowledged record's entries are in Redis at the moment of the acknowledgement;
- each engine stream reads back once, in seq order, from its own key;
- the block index holds exactly the blocks of the stored entries, applied in order.

ACL refusals: redis-py strips the ``ERR`` code from an error that aborts a script ("The user
executing the script can't run this command or subcommand script: ..." on Redis 7.0), which the
connector used to call ``Permanent``: stored entries were dead-lettered, unstored ones lost. An
aborted script keeps what it did before the error: an entry stored before its set change failed
was found "already there" by the retry, which then never applied that set change.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from bridge.config import SinkConfig, convert_options
from bridge.errors import ConfigError, ConnectorError, NotConnected, Retriable
from bridge.formats import Renderer
from bridge.records import Record, Stream, source_reset
from connectors.redis import RedisConnector, RedisOptions, entry_id, message_position
from tests.infra.servers import RedisServer
from tests.integration.conftest import own_server
from tests.support.records import CacheModel, batch, block_stored
from tests.support.redis_sink import RedisDelivery
from tests.support.schema import check_entry

pytestmark = pytest.mark.integration

USER, PASSWORD = "bridge", "faults-pw"


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server of this module's own: the tests change its ACL user."""
    with own_server("redis (ACL faults)", RedisServer(tmp_path_factory.mktemp("redis-faults"), persistent=False)) as server:
        yield server


@pytest.fixture
async def admin(acl_redis: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(acl_redis.url)
    await client.flushall()
    await allow(client)
    yield client
    await client.execute_command("ACL", "DELUSER", USER)
    await client.aclose()


async def allow(admin: aioredis.Redis, *denied: str) -> None:
    """The bridge's ACL user: every command and key, except ``denied`` commands."""
    await admin.execute_command(
        "ACL", "SETUSER", USER, "reset", "on", f">{PASSWORD}", "~*", "&*", "+@all", *(f"-{c}" for c in denied)
    )


def delivery(tmp: Path, url: str, options: dict[str, Any], *, user: str | None = USER) -> RedisDelivery:
    """The Redis sink at batch granularity as ``user`` (None: the default user), each
    acknowledged entry's body checked too."""
    credentials = {"username": user, "password": PASSWORD} if user else {}
    retry = {"initial_backoff": "20ms", "max_backoff": "100ms", "write_timeout": "5s"}
    return RedisDelivery(tmp, url, {**credentials, **options}, granularity="batch", retry=retry, check_values=True)


async def until(condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def started(d: RedisDelivery) -> RedisDelivery:
    d.worker.start()
    await until(lambda: d.worker.connected, "the sink to connect")
    return d


async def assert_stored_in_order(d: RedisDelivery, admin: aioredis.Redis, stream: Stream, records: list[Record]) -> None:
    """The stream's entries are exactly the messages of ``records``, once each, in order."""
    expected = [m for r in records for m in d.renderer.render(r)]
    keys = {d.key(m) for m in expected}
    assert len(keys) == 1, keys
    (key,) = keys
    stored = [(ident.decode(), fields) for ident, fields in await admin.xrange(key)]
    for _ident, fields in stored:
        check_entry(fields)
    assert [i for i, _ in stored] == [entry_id(message_position(m)) for m in expected], (
        f"{stream.key}: missing, repeated or out of order"
    )
    for (_, fields), m in zip(stored, expected, strict=True):
        assert fields[b"data"] == m.value
        assert (fields[b"source"].decode(), int(fields[b"dp_rank"])) == (stream.source, stream.dp_rank)


def index_of(records: list[Record]) -> set[str]:
    """The block set after ``records``, applied one by one (integer hashes as decimal text)."""
    model = CacheModel(str)
    for r in records:
        model.apply(r)
    return model.blocks


# -- ACL refusals: retried, never dead-lettered; a message's set change goes with its entry ------


@pytest.mark.parametrize("denied", ["sadd", "srem", "del", "xadd", "hset"])
async def test_an_acl_refusal_in_the_index_mode_script_is_retried_and_the_index_matches_the_entries(
    acl_redis: RedisServer, admin: aioredis.Redis, tmp_path: Path, denied: str
) -> None:
    """Index mode, the bridge's user may not run ``denied`` (SADD / SREM: the set change of every
    batch; HSET: its counts; DEL: the clear of the SourceReset; XADD: every entry) until an operator fixes the ACL
    1.5 s into the refusals. Nothing is dead-lettered, nothing acknowledged before the fix; after
    it every entry is stored once, in order, and the set holds exactly the blocks of the entries."""
    stream = Stream("eng", 0)
    records = [batch(stream, q, epoch=1) for q in range(3)]
    records += [source_reset(stream, 2, "publisher_restart", 0.0), *(batch(stream, q, epoch=2) for q in range(2))]
    d = await started(delivery(tmp_path, acl_redis.url, {"index": {"enabled": True}}))
    await allow(admin, denied)  # after connect, which refuses a user that may not run it (below)
    try:
        await d.feed(records)
        await until(lambda: bool(d.errors()), "the write to meet the ACL")
        await asyncio.sleep(1.5)
        assert d.errors().keys() == {"no_permission"}, d.errors()
        assert d.dead_letters() == []
        # A new epoch starts a write of its own (bridge.sink): epoch 1's needs no DEL, and goes through.
        held = records[:3] if denied == "del" else []
        assert d.acked == held, "acknowledged while the ACL refuses part of every write (a set change skipped)"
        assert not d.worker.connected and "no_permission" in str(d.worker.last_error)
        await allow(admin)  # the operator fixes the ACL
        assert await d.worker.flush(30), "not delivered within 30 s of the fix"
        assert d.acked == records
        assert not d.unbacked, d.unbacked
        assert d.dead_letters() == []
        assert d.errors().keys() == {"no_permission"}, d.errors()
    finally:
        await d.close()
    await assert_stored_in_order(d, admin, stream, records)
    assert {m.decode() for m in await admin.smembers("kv:eng:0:blocks")} == index_of(records)


async def test_an_acl_refusal_of_the_duplicate_check_on_a_resend_is_retried_not_dead_lettered(
    acl_redis: RedisServer, admin: aioredis.Redis, tmp_path: Path
) -> None:
    """Seqs 0-2 stored; then the user may no longer run XREVRANGE (the check that tells a re-sent
    entry from an out-of-order one) and a restarted bridge sends seqs 0-4 again, as it does after
    resuming from an older checkpoint. The refusal is retried (no_permission), never
    dead-lettered; after the fix seqs 0-2 count as delivered and 3-4 are stored, each once."""
    stream = Stream("eng", 0)
    records = [batch(stream, q, epoch=1) for q in range(5)]
    first = await started(delivery(tmp_path, acl_redis.url, {}))
    try:
        await first.feed(records[:3])
        assert await first.worker.flush(10)
    finally:
        await first.close()
    d = await started(delivery(tmp_path, acl_redis.url, {}))
    await allow(admin, "xrevrange")  # after connect, which refuses a user that may not run it (below)
    try:
        await d.feed(records)
        await until(lambda: bool(d.errors()), "the write to meet the ACL")
        await asyncio.sleep(1.0)
        assert d.errors().keys() == {"no_permission"}, d.errors()
        assert d.dead_letters() == [] and d.acked == []
        assert await admin.xlen("kv:eng:0") == 3
        await allow(admin)
        assert await d.worker.flush(30), "not delivered within 30 s of the fix"
        assert d.acked == records and not d.unbacked, d.unbacked
        assert d.dead_letters() == []
    finally:
        await d.close()
    await assert_stored_in_order(d, admin, stream, records)


# The commands docs/sinks/redis.md "Required permissions" listed before breaker30r A1 (without
# the state's).
DOCS_BEFORE = ("+ping", "+client|setname", "+eval", "+xadd", "+xrevrange", "+type", "+del")


def documented_commands() -> tuple[str, ...]:
    """The commands of the ``ACL SETUSER`` docs/sinks/redis.md gives (held to what the sink runs)."""
    text = (Path(__file__).parents[2] / "docs" / "sinks" / "redis.md").read_text()
    line = re.search(r"^ACL SETUSER kv-bridge (.*?)\n```", text, re.M | re.S)
    assert line is not None, "docs/sinks/redis.md: no ACL SETUSER kv-bridge example"
    return tuple(w for w in line.group(1).split() if w.startswith("+"))


async def test_connect_and_check_refuse_a_user_that_may_not_run_what_the_writes_run(
    acl_redis: RedisServer, admin: aioredis.Redis, tmp_path: Path
) -> None:
    """breaker30r A1: connect (and so --check and /readyz) ran an empty script, which touches no
    command and no key: a user the writes are refused for passed ("config ok", ready), then every
    write failed NOPERM for ever. The user's permissions are asked now (redis.acl_check_cmd): a
    command the sink runs that the user may not is refused at connect, reason no_permission,
    naming the commands and the ACL to grant; --check (which knows the configured streams) also
    checks each command on the keys they write. The docs' permission lists are enough."""
    user = "a1-user"

    async def connect(rules: tuple[str, ...], *, streams: list[Stream] | None = None, **values: Any) -> NotConnected | None:
        await admin.execute_command("ACL", "SETUSER", user, "reset", "on", f">{PASSWORD}", *rules)
        options = convert_options({"url": acl_redis.url, "username": user, "password": PASSWORD, **values}, RedisOptions, "s")
        conn = RedisConnector("r", options, SinkConfig(type="redis", name="r"))
        conn.configured_streams = streams or []
        try:
            await conn.connect()
        except NotConnected as exc:
            return exc
        finally:
            await conn.close()
        return None

    try:
        # The docs' list before the fix, with the state: its commands are refused, named, with the fix.
        refused = await connect(("~kv:*", *DOCS_BEFORE), state={"enabled": True})
        assert refused is not None and refused.reason == "no_permission", refused
        assert "may not run HMGET, HSET, HDEL, UNLINK, HGET, HSCAN" in str(refused), refused
        assert f"ACL SETUSER {user} +hmget +hset +hdel +unlink +hget +hscan" in str(refused), refused
        # The same without the state, and the docs' list now with the state and the index: connected.
        assert await connect(("~kv:*", *DOCS_BEFORE)) is None
        documented = documented_commands()
        assert await connect(("~kv:*", *documented), state={"enabled": True}, index={"enabled": True}) is None
        for command in documented[3:]:  # each one the script runs is needed
            rules = ("~kv:*", *(c for c in documented if c != command))
            refused = await connect(rules, state={"enabled": True}, index={"enabled": True})
            assert refused is not None and f"+{command[1:]}" in str(refused), (command, refused)
        # The docs' example user with a stream template outside its keys: --check names the keys.
        streams = [Stream("eng", 0), Stream("eng", 1)]
        values = {"stream": "events:{source}:{dp_rank}", "state": {"enabled": True}}
        refused = await connect(("~kv:*", "+@all", "-@dangerous"), streams=streams, **values)
        assert refused is not None and refused.reason == "no_permission", refused
        assert "TYPE, XREVRANGE, XADD on key 'events:eng:0'" in str(refused), refused
        assert "'events:eng:1'" in str(refused) and "kv:state" not in str(refused), refused
        assert "~events:eng:0 ~events:eng:1" in str(refused), refused
        # A run's connect does not know the streams yet: its first write names the key.
        assert await connect(("~kv:*", "+@all", "-@dangerous"), **values) is None
        assert await connect(("~kv:*", "~events:*", "+@all", "-@dangerous"), streams=streams, **values) is None
        # Every configured stream's keys, not the first 32 (breaker115 3: rank 35 of a 40-rank engine
        # refused at its first write after "config ok"); the error names ten keys and counts the rest.
        ranks = [Stream("m", r) for r in range(40)]
        allowed = [f"~kv:m:{r}" for r in range(32)]
        refused = await connect((*allowed, "+@all", "-@dangerous"), streams=ranks)
        assert refused is not None and refused.reason == "no_permission", refused
        assert "'kv:m:35'" in str(refused) and "'kv:m:31'" not in str(refused), refused
        refused = await connect(("+@all", "-@dangerous"), streams=ranks)
        assert refused is not None and "'kv:m:9'" in str(refused) and "and 30 more keys" in str(refused), refused
        assert await connect(("~kv:m:*", "+@all", "-@dangerous"), streams=ranks) is None
    finally:
        await admin.execute_command("ACL", "DELUSER", user)


# -- key collisions: two engine streams never share a key ---------------------------------------

# Two engine streams whose keys coincide under a template with nothing between source and rank:
# "llama1" + "2" and "llama" + "12". The label ``sep`` (empty) keeps the template past the config
# check (which refuses {source}{dp_rank}), as any ambiguous template the check cannot see would.
X = Stream("llama1", 2, {"sep": ""})
Y = Stream("llama", 12, {"sep": ""})
AMBIGUOUS = "kv:{source}{sep}{dp_rank}"


def both(n: int) -> list[Record]:
    """Seqs 0..n-1 of X and Y, interleaved; the same ids on both streams."""
    return [batch(s, q, epoch=1) for q in range(n) for s in (X, Y)]


async def test_two_engine_streams_rendering_one_stream_key_is_a_transient_key_collision(
    acl_redis: RedisServer, admin: aioredis.Redis, tmp_path: Path
) -> None:
    """X and Y render kv:llama12 with the same entry ids: Y's entries used to be taken as "already
    there" and acknowledged without being stored. Now the second stream's messages fail with
    key_collision (retried, the sink not ready, nothing acknowledged, nothing dead-lettered) and
    the key holds X's entries only."""
    records = both(5)
    d = await started(delivery(tmp_path, acl_redis.url, {"stream": AMBIGUOUS}, user=None))
    try:
        await d.feed(records)
        await until(lambda: bool(d.errors() or d.acked), "the key collision")
        await asyncio.sleep(0.5)
        assert d.errors().keys() == {"key_collision"}, d.errors()
        assert d.acked == [] and d.dead_letters() == []
        assert not d.worker.connected
        problem = str(d.worker.last_error)
        for part in ("llama1/2", "llama/12", "kv:llama12", "kv:{source}:{dp_rank}"):
            assert part in problem, problem
    finally:
        await d.close()
    assert await admin.keys("kv:*") == [b"kv:llama12"]
    await assert_stored_in_order(d, admin, X, [r for r in records if r.stream == X])


async def test_two_engine_streams_rendering_one_index_key_is_a_transient_key_collision(
    acl_redis: RedisServer, admin: aioredis.Redis, tmp_path: Path
) -> None:
    """Distinct stream keys, one index set for both engines (a SourceReset of one would empty the
    other's blocks): the second stream is not written (neither its entries nor its blocks)."""
    records = both(3)
    options = {"stream": "kv:{source}:{dp_rank}", "index": {"enabled": True, "key": AMBIGUOUS + ":blocks"}}
    d = await started(delivery(tmp_path, acl_redis.url, options, user=None))
    try:
        await d.feed(records)
        await until(lambda: bool(d.errors() or d.acked), "the key collision")
        await asyncio.sleep(0.5)
        assert d.errors().keys() == {"key_collision"}, d.errors()
        assert d.acked == [] and d.dead_letters() == []
        assert "kv:llama12:blocks" in str(d.worker.last_error)
    finally:
        await d.close()
    assert await admin.exists("kv:llama:12") == 0
    x = [r for r in records if r.stream == X]
    await assert_stored_in_order(d, admin, X, x)
    assert {m.decode() for m in await admin.smembers("kv:llama12:blocks")} == index_of(x)


async def test_a_label_that_makes_a_stream_key_its_own_index_counts_hash_is_a_key_collision(
    acl_redis: RedisServer, admin: aioredis.Redis, tmp_path: Path
) -> None:
    """breaker103 C3: a discovered source's label (role: counts) renders the stream key
    'x:a:0:counts', the index's counts hash: --check ok (it sees configured sources only), then
    WRONGTYPE, 0 of 12 batches stored, 3 dead letters. Every key a stream's templates render is
    claimed before anything is written: a key two templates render is a key collision."""
    labelled = Stream("a", 0, {"role": "counts"})
    records = [batch(labelled, q, epoch=1) for q in range(3)]
    options = {"stream": "x:{source}:{dp_rank}:{role}", "index": {"enabled": True, "key": "x:{source}:{dp_rank}"}}
    d = await started(delivery(tmp_path, acl_redis.url, options, user=None))
    try:
        await d.feed(records)
        await until(lambda: bool(d.errors() or d.acked), "the key collision")
        await asyncio.sleep(0.5)
        assert d.errors().keys() == {"key_collision"}, d.errors()
        assert d.acked == [] and d.dead_letters() == []
        assert "'x:a:0:counts'" in str(d.worker.last_error), d.worker.last_error
    finally:
        await d.close()
    assert await admin.keys("x:*") == []


async def test_a_key_holding_another_engine_streams_entries_is_a_key_collision_after_a_restart(
    acl_redis: RedisServer, admin: aioredis.Redis
) -> None:
    """A connector that never saw X (a bridge restarted, or another instance) writes Y to the key
    where X's entries are: the script reads the top entry's engine stream and refuses (retried,
    key_collision) instead of taking Y's entries as already there."""
    s = SinkConfig(type="redis", name="redis", format="json", granularity="batch")
    renderer = Renderer(s.format, s.granularity)
    records = both(3)
    for stream in (X, Y):
        conn = RedisConnector(s.name, convert_options({"url": acl_redis.url, "stream": AMBIGUOUS}, RedisOptions, "sinks[0]"), s)
        try:
            messages = [m for r in records if r.stream == stream for m in renderer.render(r)]
            if stream == X:
                await conn.write(messages)
            else:
                with pytest.raises(Retriable) as info:
                    await conn.write(messages)
                assert info.value.reason == "key_collision"
                for part in ("llama1/2", "llama/12", "kv:llama12", "kv:{source}:{dp_rank}"):
                    assert part in str(info.value), info.value
        finally:
            await conn.close()
    entries = await admin.xrange("kv:llama12")
    assert [(f[b"source"], f[b"seq"]) for _, f in entries] == [(b"llama1", str(q).encode()) for q in range(3)]


@pytest.mark.parametrize(
    ("keys", "field"),
    [
        ({"stream": "kv:{source}{dp_rank}"}, "stream"),
        ({"stream": "kv:{dp_rank}{source}"}, "stream"),
        ({"cluster": True, "stream": "kv:{{source}{dp_rank}}"}, "stream"),
        ({"index": {"enabled": True, "key": "kv:{source}{dp_rank}:blocks"}}, "index.key"),
    ],
)
def test_a_template_with_source_and_rank_side_by_side_is_refused(keys: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        convert_options({"url": "redis://x", **keys}, RedisOptions, "sinks[0]")
    text = str(info.value)
    assert text.startswith(f"sinks[0].{field}: "), text
    assert "separator" in text and "kv:{source}:{dp_rank}" in text, text


# -- the set change first, and still refused near maxmemory -------------------------------------


@pytest.mark.parametrize("first", ["SourceReset", "BlockRemoved"])
async def test_a_write_starting_with_a_clear_or_a_removal_is_still_refused_at_maxmemory(
    acl_redis: RedisServer, admin: aioredis.Redis, first: str
) -> None:
    """The set change now comes before the entry, and Redis checks maxmemory at a script's first
    write only, for commands that may grow memory (not DEL or SREM). A write whose first message
    empties the set (SourceReset) or only removes blocks (a BlockRemoved event) must still be
    refused as a whole (oom, retried), leaving the set and the stream untouched."""
    s = SinkConfig(type="redis", name="redis", format="json", granularity="event")
    renderer = Renderer(s.format, s.granularity)
    stream = Stream("eng", 0)
    if first == "SourceReset":
        records = [source_reset(stream, 2, "publisher_restart", 0.0), batch(stream, 0, epoch=2)]
    else:
        records = [batch(stream, 0, epoch=1)]
    messages = [m for r in records for m in renderer.render(r)]
    if first == "BlockRemoved":
        messages = [m for m in messages if m.type == "BlockRemoved"] + [m for m in messages if m.type != "BlockRemoved"]
        messages = messages[:1]
    removed = [str(h) for r in records for e in r.events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    await admin.sadd("kv:eng:0:blocks", *removed, "12345")
    before = await admin.smembers("kv:eng:0:blocks")
    options = convert_options({"url": acl_redis.url, "index": {"enabled": True}}, RedisOptions, "sinks[0]")
    conn = RedisConnector(s.name, options, s)
    await conn.connect()
    try:
        await admin.config_set("maxmemory", 1)
        with pytest.raises(Retriable) as info:
            await conn.write(messages)
        assert info.value.reason == "oom", info.value
    finally:
        await admin.config_set("maxmemory", 0)
        await conn.close()
    assert await admin.smembers("kv:eng:0:blocks") == before
    assert await admin.exists("kv:eng:0") == 0


# -- MISCONF: persistence failing is an operator's fix, not a refusal of the entries ------------


async def bgsave_status(admin: aioredis.Redis) -> str:
    """``rdb_last_bgsave_status`` once no BGSAVE runs (each wait bounded)."""
    deadline = time.monotonic() + 15
    while (info := await admin.info("persistence"))["rdb_bgsave_in_progress"]:
        assert time.monotonic() < deadline, "BGSAVE still running after 15 s"
        await asyncio.sleep(0.02)
    return str(info["rdb_last_bgsave_status"])


@pytest.fixture
def snapshotting_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server that snapshots (save 3600 1, stop-writes-on-bgsave-error yes, its default)
    and lets a test move its dir (CONFIG SET dir is a protected config)."""
    extra = {"save": "3600 1", "enable-protected-configs": "yes"}
    server = RedisServer(tmp_path_factory.mktemp("redis-misconf"), persistent=False, extra_config=extra)
    with own_server("redis (MISCONF)", server) as started:
        yield started


async def test_misconf_is_retried_not_ready_and_nothing_is_dead_lettered(snapshotting_redis: RedisServer, tmp_path: Path) -> None:
    """The server's RDB snapshots fail (its dir removed under it): with
    ``stop-writes-on-bgsave-error yes`` Redis refuses every write with MISCONF until an operator
    fixes the disk. The bridge dead-lettered each batch while ready. Now the batches are retried
    (reason ``misconf``), the sink is not ready (health() names the cause), nothing is
    dead-lettered or acknowledged; once the disk is fixed every batch is stored once, in order."""
    stream = Stream("eng", 0)
    records = [batch(stream, q, epoch=1) for q in range(6)]
    admin = aioredis.Redis.from_url(snapshotting_redis.url)
    good = (await admin.config_get("dir"))["dir"]
    gone = tmp_path / "gone"
    gone.mkdir()
    d = await started(delivery(tmp_path, snapshotting_redis.url, {}, user=None))
    try:
        await d.feed(records[:2])
        assert await d.worker.flush(10)
        await admin.config_set("dir", str(gone))
        gone.rmdir()  # the snapshot's temporary file can no longer be created (even by root)
        await admin.bgsave()
        assert await bgsave_status(admin) == "err"
        await d.feed(records[2:])
        await until(lambda: bool(d.errors()), "the write to meet MISCONF")
        await asyncio.sleep(1.0)
        assert d.errors().keys() == {"misconf"}, d.errors()
        assert d.dead_letters() == [], "a batch dead-lettered while the server cannot persist"
        assert d.acked == records[:2]
        problem = await d.worker.connector.health()
        assert problem is not None and "refuses PING: MISCONF" in problem, problem
        assert not d.worker.connected and "misconf" in str(d.worker.last_error).lower()
        await admin.config_set("dir", good)  # the operator fixes the disk; the next snapshot succeeds
        await admin.bgsave()
        assert await bgsave_status(admin) == "ok"
        assert await d.worker.flush(30), "not delivered within 30 s of the fix"
        assert d.acked == records and not d.unbacked, d.unbacked
        assert d.dead_letters() == []
        await assert_stored_in_order(d, admin, stream, records)
    finally:
        await d.close()
        await admin.aclose()


# -- a command the sink needs renamed or disabled (rename-command, a managed service) ----------


def connector_for(url: str) -> RedisConnector:
    s = SinkConfig(type="redis", name="redis", format="json", granularity="batch")
    return RedisConnector(s.name, convert_options({"url": url}, RedisOptions, "sinks[0]"), s)


async def refused_at_connect(url: str, match: str) -> NotConnected:
    """The NotConnected a connector to ``url`` raises at connect (matching ``match``)."""
    connector = connector_for(url)
    try:
        with pytest.raises(NotConnected, match=match) as refused:
            await connector.connect()
    finally:
        await connector.close()
    return refused.value


@pytest.fixture(params=["EVAL", "XADD"])
def renamed_redis(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, str]]:
    server = RedisServer(tmp_path_factory.mktemp("redis-renamed"), extra_config={"rename-command": f'{request.param} ""'})
    with own_server(f"redis ({request.param} renamed)", server) as started_server:
        yield started_server, request.param


async def test_a_command_the_sink_needs_renamed_is_not_ready_and_nothing_is_dead_lettered(
    renamed_redis: tuple[RedisServer, str], tmp_path: Path
) -> None:
    """Some hardening guides and managed services rename or disable commands. EVAL gone: the sink
    does not connect (so ``--check`` says so) and names the fix. XADD gone (found at connect
    since breaker30r A1, inside the script at the first write before): the sink does not connect
    either, every batch is retried with the sink not ready (reason ``unknown_command``). Before,
    each batch was dead-lettered with the sink ready, and nothing announced (breaker29e R1:
    207-276 batches in 10 s)."""
    server, command = renamed_redis
    if command == "EVAL":
        refused = await refused_at_connect(server.url, "unknown command")
        assert refused.reason == "unknown_command" and "allow EVAL" in str(refused)
        return
    refused = await refused_at_connect(server.url, "does not run XADD")
    assert refused.reason == "unknown_command" and "allow it" in str(refused)
    stream = Stream("eng", 0)
    d = delivery(tmp_path, server.url, {}, user=None)
    d.worker.start()
    try:
        await d.feed([batch(stream, q, epoch=1) for q in range(4)])
        await until(lambda: bool(d.errors()), "the write to meet the renamed command")
        await asyncio.sleep(1.0)
        assert d.errors().keys() == {"unknown_command"}, d.errors()
        assert d.dead_letters() == [] and d.acked == []
        assert not d.worker.connected
    finally:
        await d.close()


# -- a replica given as the sink's server --------------------------------------------------------


async def test_a_replica_is_refused_at_connect_naming_the_primary(
    acl_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A url pointing at a replica (a read-only service endpoint, a failover's old primary): it
    answers PING and runs a script that does not write, so ``--check`` said ok and every write was
    then refused (READONLY) with the sink not ready. Now connect refuses it and names the fix."""
    primary = acl_redis.url.split("//")[1].split("/")[0].replace(":", " ")
    replica = RedisServer(tmp_path_factory.mktemp("redis-replica"), persistent=False, extra_config={"replicaof": primary})
    with own_server("redis (replica)", replica) as server:
        refused = await refused_at_connect(server.url, "not a primary")
        assert refused.reason == "replica" and "point url at the primary" in str(refused)
        # breaker75 B1: with the ACL the docs give first (-@dangerous: no ROLE, no INFO) it passed
        # ("config ok", ready); a script that may write, which a read-only replica refuses, tells.
        client = aioredis.Redis.from_url(server.url)
        try:
            await client.execute_command("ACL", "SETUSER", "kv-bridge", "on", f">{PASSWORD}", "~kv:*", "+@all", "-@dangerous")
        finally:
            await client.aclose()
        options = convert_options({"url": server.url, "username": "kv-bridge", "password": PASSWORD}, RedisOptions, "s")
        connector = RedisConnector("r", options, SinkConfig(type="redis", name="r"))
        with pytest.raises(NotConnected, match="is a read-only replica") as info:
            await connector.connect()
        assert info.value.reason == "replica" and "point url at the primary" in str(info.value)
        await connector.close()
    connector = connector_for(acl_redis.url)
    await connector.connect()  # the primary itself
    await connector.close()


async def test_a_primary_demoted_or_a_user_revoked_during_the_run_is_unhealthy_while_idle(
    tmp_path_factory: pytest.TempPathFactory, acl_redis: RedisServer, admin: aioredis.Redis
) -> None:
    """Connect refuses a replica and a user the writes would be refused for, but an idle sink
    connected before a failover demoted its server (REPLICAOF), or before an operator revoked a
    command of its user, stayed ready until its first write (breaker30z2 R2: 20 s of /readyz 200,
    then 0 of 5 stored). The health check asks both again."""
    other = RedisServer(tmp_path_factory.mktemp("redis-demoting"), persistent=False)
    with own_server("redis (demoted during the run)", other) as server:
        connector = connector_for(server.url)
        await connector.connect()
        client = aioredis.Redis.from_url(server.url)
        try:
            assert await connector.health() is None
            primary = acl_redis.url.split("//")[1].split("/")[0].split(":")
            await client.execute_command("REPLICAOF", primary[0], primary[1])
            said = await connector.health()
            assert said is not None and said.startswith("replica: ") and "not a primary" in said, said
            await client.execute_command("REPLICAOF", "NO", "ONE")
            assert await connector.health() is None
        finally:
            await client.aclose()
            await connector.close()
    user = "revoked-user"
    await admin.execute_command("ACL", "SETUSER", user, "reset", "on", f">{PASSWORD}", "~kv:*", *documented_commands())
    options = convert_options({"url": acl_redis.url, "username": user, "password": PASSWORD}, RedisOptions, "s")
    connector = RedisConnector("r", options, SinkConfig(type="redis", name="r"))
    await connector.connect()
    try:
        assert await connector.health() is None
        await admin.execute_command("ACL", "SETUSER", user, "-xadd")
        said = await connector.health()
        assert said is not None and said.startswith("no_permission: ") and "XADD" in said, said
    finally:
        await connector.close()
        await admin.execute_command("ACL", "DELUSER", user)


# -- a primary short of the replicas its min-replicas-to-write asks for ----------------------------


async def test_a_primary_short_of_its_min_replicas_is_refused_at_connect_and_unhealthy_while_idle(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Breaker30h R1: with ``min-replicas-to-write 1`` and no replica in sync, every write gets
    NOREPLICAS, yet ``--check`` said ok and an idle sink was ready until its first write. Connect
    (and so ``--check``) now refuses it, naming the fix; a sink connected while its replica was in
    sync says so in its health check once the replica goes, before any write. A server whose
    CONFIG is renamed cannot tell: nothing is said."""
    settings = {"min-replicas-to-write": "1", "min-replicas-max-lag": "1"}
    primary = RedisServer(tmp_path_factory.mktemp("redis-min-replicas"), persistent=False, extra_config=settings)
    with own_server("redis (min-replicas-to-write 1)", primary) as server:
        refused = await refused_at_connect(server.url, "NOREPLICAS")
        assert refused.reason == "noreplicas", refused
        assert "min-replicas-to-write is 1 and 0 replica(s)" in str(refused) and "attach or repair a replica" in str(refused)
        address = server.url.split("//")[1].split("/")[0].replace(":", " ")
        replica = RedisServer(tmp_path_factory.mktemp("redis-min-replica"), persistent=False, extra_config={"replicaof": address})
        connector = connector_for(server.url)
        try:
            with own_server("redis (its replica)", replica):
                connected = False
                for _ in range(150):  # until the replica is in sync and acknowledged
                    try:
                        await connector.connect()
                        connected = True
                        break
                    except NotConnected:
                        await asyncio.sleep(0.1)
                assert connected, "the primary never counted its replica in sync"
                assert await connector.health() is None
            said = None
            for _ in range(100):  # the primary counts it gone once its last ack is older than min-replicas-max-lag
                said = await connector.health()
                if said is not None:
                    break
                await asyncio.sleep(0.1)
            assert said is not None and said.startswith("noreplicas: sinks[redis]: "), said
            assert "min-replicas-to-write is 1 and 0 replica(s)" in said, said
        finally:
            await connector.close()
    # Set during the run (breaker30h2 B2: 20 s ready while every write would get NOREPLICAS): the
    # health check reads the setting again.
    later = RedisServer(tmp_path_factory.mktemp("redis-min-replicas-later"), persistent=False)
    with own_server("redis (min-replicas-to-write set later)", later) as server:
        connector = connector_for(server.url)
        try:
            await connector.connect()
            assert await connector.health() is None
            admin = aioredis.Redis.from_url(server.url)
            try:
                await admin.config_set("min-replicas-to-write", 1)
                said = await connector.health()
                assert said is not None and said.startswith("noreplicas: "), said
                await admin.config_set("min-replicas-to-write", 0)
                assert await connector.health() is None
            finally:
                await admin.aclose()
        finally:
            await connector.close()
    renamed = RedisServer(
        tmp_path_factory.mktemp("redis-min-replicas-no-config"),
        persistent=False,
        extra_config={**settings, "rename-command": 'CONFIG ""'},
    )
    with own_server("redis (min-replicas-to-write 1, CONFIG renamed)", renamed) as server:
        connector = connector_for(server.url)
        try:
            await connector.connect()  # it cannot tell: its first write will
            assert await connector.health() is None
        finally:
            await connector.close()


# -- a refusal of a whole script call: only an entry refused for itself is dead-lettered --------


def huge(stream: Stream, seq: int) -> Record:
    """A batch whose JSON message is over 1 MiB (one BlockStored of 20,000 blocks)."""
    events = [block_stored(seq, n_blocks=20_000)]
    payload = msgspec.msgpack.encode([0.0, events, stream.dp_rank])
    return Record(stream=stream, epoch=1, seq=seq, ts=0.0, payload=payload, events=events, received=0.0)


@pytest.mark.parametrize("limit", ["proto-max-bulk-len", "client-query-buffer-limit"])
@pytest.mark.parametrize("lowered", ["before connect", "after connect"])
async def test_an_entry_over_the_longest_argument_alone_is_dead_lettered(
    acl_redis: RedisServer, admin: aioredis.Redis, tmp_path: Path, lowered: str, limit: str
) -> None:
    """proto-max-bulk-len 1 MiB and seq 2's message over it, in one write with seqs 0-4: the server
    refuses the whole script call, which dead-lettered seqs 0-4. Now seq 2 alone is refused for
    itself (reason too_large, dead-lettered, announced to the sink's consumers by the runtime); the
    others are stored once, in order. A limit lowered after connect costs one retried write (the
    protocol error, or the connection closed, makes the connector read it again). breaker57 B2: client-query-buffer-limit
    (1 MiB at least) makes the server close the connection at such an entry instead, and the same
    write was retried for ever, the sink stopped (I5, I6): it is read with the other."""
    default = {"proto-max-bulk-len": 512 * 1024 * 1024, "client-query-buffer-limit": 1024 * 1024 * 1024}[limit]
    stream = Stream("eng", 0)
    records = [batch(stream, q, epoch=1) for q in range(5)]
    records[2] = huge(stream, 2)
    d = delivery(tmp_path, acl_redis.url, {})
    assert len(d.renderer.render(records[2])[0].value) > 1024 * 1024
    try:
        if lowered == "after connect":
            await started(d)
        await admin.config_set(limit, 1024 * 1024)
        await d.feed(records)  # before connect: queued before the worker starts, one write holds them all
        if lowered == "before connect":
            await started(d)
        assert await d.worker.flush(30), "not delivered within 30 s"
        dead = d.dead_letters()
        assert [(x["seq"], x["detail"]) for x in dead] == [(2, dead[0]["detail"])], [x["seq"] for x in dead]
        assert limit in str(dead[0]["detail"]), dead[0]["detail"]
        errors = d.errors()
        assert "too_large" in errors and errors.keys() <= {"too_large", "protocol", "not_connected"}, errors
        # (the server answers "Protocol error" and closes the connection, or closes it at once: the
        # client then meets the closed connection before the answer). Lowered after connect, the
        # health check right after it may read the new limit first: then no write fails.
        if lowered == "before connect":
            assert not errors.keys() & {"protocol", "not_connected"}, errors
        assert d.acked == records
    finally:
        await admin.config_set(limit, default)
        await d.close()
    entries = await admin.xrange("kv:eng:0")
    assert [int(f[b"seq"]) for _, f in entries if f[b"type"] != b"EventsLost"] == [0, 1, 3, 4]
    announced = [json.loads(f[b"data"]) for _, f in entries if f[b"type"] == b"EventsLost"]
    assert [(x["from_seq"], x["to_seq"], x["reason"]) for x in announced] == [(2, 2, "sink_refused:redis")]


async def test_a_script_killed_by_an_operator_is_retried_not_dead_lettered(acl_redis: RedisServer, admin: aioredis.Redis) -> None:
    """An operator's SCRIPT KILL aborts the write script (before its first write: a long re-send
    of stored entries, which only reads). The call's entries were all refused as Permanent (dead
    letters); now the write fails as Retriable (script_killed), and the next one stores them."""
    s = SinkConfig(type="redis", name="redis", format="json", granularity="batch")
    renderer = Renderer(s.format, s.granularity)
    stream = Stream("eng", 0)
    records = [batch(stream, q, epoch=1, n_events=1) for q in range(20_003)]
    messages = [m for r in records for m in renderer.render(r)]
    conn = RedisConnector(s.name, convert_options({"url": acl_redis.url}, RedisOptions, "sinks[0]"), s)
    await conn.connect()
    killer = aioredis.Redis.from_url(acl_redis.url)
    await admin.config_set("busy-reply-threshold", 1)  # ms: SCRIPT KILL is accepted once a script ran this long
    try:
        await conn.write(messages[:-3])

        async def kill() -> None:
            while True:  # until the script runs (NOTBUSY before); each attempt answered at once
                try:
                    await killer.script_kill()
                    return
                except ResponseError as exc:
                    assert "NOTBUSY" in str(exc), exc
                await asyncio.sleep(0)

        task = asyncio.create_task(kill())
        with pytest.raises(ConnectorError) as info:  # the re-send of 20,000 entries, then 3 new ones
            await conn.write(messages)
        await asyncio.wait_for(task, 10)
        assert isinstance(info.value, Retriable) and info.value.reason == "script_killed", info.value
        assert await admin.xlen("kv:eng:0") == 20_000
        await conn.write(messages)
    finally:
        await admin.config_set("busy-reply-threshold", 5000)
        await killer.aclose()
        await conn.close()
    assert await admin.xlen("kv:eng:0") == 20_003


# -- an announcement refused for itself: kept, not dead-lettered -----------------------------------


async def test_an_announcement_refused_by_a_key_of_another_type_is_kept_until_the_key_is_fixed(
    acl_redis: RedisServer, admin: aioredis.Redis, tmp_path: Path
) -> None:
    """Issue 29 (breaker29h W1): seqs 0-4 stored; an operator turns the stream key into a string
    (WRONGTYPE); seqs 5-9, written meanwhile, are refused for themselves and dead-lettered, and the
    EventsLost announcing them is refused for the same cause. It used to be dead-lettered too (the
    consumers never learnt of 5-9) while the sink stayed ready. Now it is kept: the sink is not
    ready and says why, nothing later of the stream is acknowledged, and once the key is deleted
    the announcement is written, before seqs 10-11."""
    stream = Stream("eng", 0)
    records = [batch(stream, q, epoch=1) for q in range(12)]
    renderer = Renderer("json", "batch")
    refused = {m.msg_id for r in records[5:10] for m in renderer.render(r)}
    d = delivery(tmp_path, acl_redis.url, {})
    d.refused = refused
    try:
        await started(d)
        await d.feed(records[:5])
        assert await d.worker.flush(15)
        await admin.delete("kv:eng:0")
        await admin.set("kv:eng:0", "not a stream")
        await d.feed(records[5:10])  # one write: queued at once while the worker waits for work
        await until(lambda: not d.worker.connected, "the sink to report the refused announcement")
        await until(lambda: len(d.dead_letters()) == 5, "seqs 5-9 dead-lettered")
        await d.feed(records[10:])
        await asyncio.sleep(0.5)  # a few retries of the announcement (backoff 20-100 ms)
        why = str(d.worker.last_error)
        assert "WRONGTYPE" in why and "announcement" in why, why
        assert not d.worker.connected
        assert d.acked == records[:5], "acknowledged past an announcement not written"
        await admin.delete("kv:eng:0")  # the operator fixes the key
        assert await d.worker.flush(30), "not delivered within 30 s of the fix"
        assert d.worker.connected
        assert d.acked == records
        assert not d.unbacked, d.unbacked
    finally:
        await d.close()
    dead = d.dead_letters()
    assert [x["seq"] for x in dead] == [5, 6, 7, 8, 9]
    assert all(json.loads(bytes.fromhex(str(x["payload_hex"])))["type"] == "EventBatch" for x in dead), dead
    entries = [json.loads(f[b"data"]) for _, f in await admin.xrange("kv:eng:0")]
    refusals = [(x["from_seq"], x["to_seq"]) for x in entries if x.get("reason") == "sink_refused:redis"]
    assert refusals == [(5, 9)], entries
    after = [x["seq"] if x["type"] == "EventBatch" else x["type"] for x in entries]
    # the refusal (and the announcement of 0-4, deleted with the key) before what came later
    assert after[-2:] == [10, 11] and "EventBatch" not in {x["type"] for x in entries[:-2]}, after


@pytest.mark.parametrize("case", ["cluster node", "over maxmemory", "over maxmemory, volatile"])
async def test_connect_refuses_a_server_every_write_would_be_refused_by(tmp_path: Path, case: str) -> None:
    """breaker70 B1, B2: ``--check`` said ok for a Redis Cluster node with ``cluster: false`` (each
    write with state got CROSSSLOT, and every batch was dead-lettered) and for a server over its
    maxmemory that evicts nothing (every write OOM). Connect (and so ``--check``) refuses both,
    naming the fix; the second passes again once there is room."""
    extra = {"cluster-enabled": "yes", "cluster-config-file": str(tmp_path / "nodes.conf")} if case == "cluster node" else {}
    server = RedisServer(tmp_path / "redis", extra_config=extra)
    await asyncio.to_thread(server.start)
    admin = aioredis.Redis.from_url(server.url)
    try:
        if case == "cluster node":
            await admin.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        else:
            used = int((await admin.info("memory"))["used_memory"])
            await admin.config_set("maxmemory-policy", "volatile-lru" if "volatile" in case else "noeviction")
            await admin.config_set("maxmemory", str(used // 2))
        s = SinkConfig(type="redis", name="r")
        conn = RedisConnector(
            s.name, convert_options({"url": server.url, "state": {"enabled": True}}, RedisOptions, "sinks[0]"), s
        )
        with pytest.raises(NotConnected) as refused:
            await conn.connect()
        said = str(refused.value)
        if case == "cluster node":
            assert refused.value.reason == "cluster" and "set cluster: true" in said, said
        else:
            assert refused.value.reason == "oom" and "over its maxmemory" in said, said
            await admin.config_set("maxmemory", "0")
            await conn.connect()
        await conn.close()
    finally:
        await admin.aclose()
        await asyncio.to_thread(server.stop)

"""What the Redis connector takes from redis-py past its public API (``connectors/_redis_internals.py``),
checked against the installed redis-py so that an upgrade that changes it fails here, loudly.

- the version is the tested minor (``pyproject.toml`` pins the same upper bound);
- the asyncio connection still packs through ``pack_command(*args)`` / ``pack_commands(commands)``,
  and the one-pass packer sends exactly the bytes redis-py's own would, for arbitrary commands;
- ``from_url`` still builds a pool whose ``connection_class`` it reads when opening a connection,
  for both URL schemes, and the connector's client gets the one-pass class (one per base class);
- ``redis.crc.key_slot`` still computes Redis Cluster hash slots (hash tags included).
"""

from __future__ import annotations

import inspect

import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio.connection import AbstractConnection, Connection, SSLConnection

from bridge.config import from_data
from bridge.connector import Registry
from connectors import _redis_internals as internals
from connectors.redis import RedisConnector, _server_place, _slot
from tests.support.strategies import examples

ARG = st.one_of(
    st.text(max_size=30),
    st.binary(max_size=7000),  # past redis-py's 6000-byte chunking
    st.integers(min_value=-(2**63), max_value=2**63),  # not ours: redis-py's packer takes these
    st.floats(allow_nan=False, allow_infinity=False),
)
NAME = st.sampled_from(["XADD", "EVAL", b"XREVRANGE", "CONFIG GET", b"CLIENT SETNAME"])  # redis-py splits two-word names
COMMAND = st.tuples(NAME, st.lists(ARG, max_size=20)).map(lambda c: (c[0], *c[1]))


def test_the_installed_redis_py_is_the_tested_minor() -> None:
    minor = ".".join(redis.__version__.split(".")[:2])
    assert minor == internals.TESTED, (
        f"redis-py {redis.__version__} is installed, connectors/_redis_internals.py was tested with "
        f"{internals.TESTED}.x: check each function there against the new version, then update TESTED "
        "and the upper bound in pyproject.toml"
    )


def test_connections_still_pack_through_the_overridden_methods() -> None:
    assert list(inspect.signature(AbstractConnection.pack_command).parameters) == ["self", "args"]
    assert inspect.signature(AbstractConnection.pack_command).parameters["args"].kind is inspect.Parameter.VAR_POSITIONAL
    assert list(inspect.signature(AbstractConnection.pack_commands).parameters) == ["self", "commands"]
    for base in (Connection, SSLConnection):
        assert internals.one_pass_packing(base).pack_commands is not base.pack_commands


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(COMMAND, min_size=1, max_size=12))
def test_pipeline_bytes_equal_redis_py(commands: list[tuple[object, ...]]) -> None:
    stock = Connection()
    fast = internals.one_pass_packing(Connection)()
    assert b"".join(fast.pack_commands(commands)) == b"".join(stock.pack_commands(commands))


def test_resp_command_layout_and_refusals() -> None:
    resp = internals.resp_command
    assert resp(["XADD", b"k", "é", -12]) == b"*4\r\n$4\r\nXADD\r\n$1\r\nk\r\n$2\r\n\xc3\xa9\r\n$3\r\n-12\r\n"
    for bad in (True, 1.5, memoryview(b"x"), bytearray(b"x"), None):
        with pytest.raises(TypeError):
            resp(["XADD", bad])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("redis://127.0.0.1:6379/0", Connection),
        ("rediss://127.0.0.1:6380/0", SSLConnection),
    ],
)
def test_the_pool_opens_one_pass_connections_for_both_schemes(url: str, base: type) -> None:
    client = aioredis.Redis.from_url(url)
    assert client.connection_pool.connection_class is base, "from_url no longer picks the class from the scheme"
    internals.pack_in_one_pass(client)
    assert type(client.connection_pool.make_connection()) is internals.one_pass_packing(base)
    # And the connector's own client, built from a config as the bridge does:
    config = from_data({"sources": [{"name": "a", "endpoint": "tcp://127.0.0.1:5557"}], "sinks": [{"type": "redis", "url": url}]})
    connector = Registry().build(config.sinks[0], 0)
    assert isinstance(connector, RedisConnector)
    client = connector._connection()
    assert isinstance(client, aioredis.Redis)
    assert client.connection_pool.connection_class is internals.one_pass_packing(base)  # one class per base


def test_key_slot_is_the_cluster_hash_slot() -> None:
    # Values from the Redis Cluster specification and CLUSTER KEYSLOT.
    assert internals.key_slot("foo") == 12182
    assert internals.key_slot("somekey") == 11058
    tagged = internals.key_slot("user1000")
    assert internals.key_slot("{user1000}.following") == internals.key_slot("{user1000}.followers") == tagged
    assert internals.key_slot("kv:{llama-a:0}") == internals.key_slot("kv:{llama-a:0}:blocks")
    assert internals.key_slot("foo{}{bar}") != internals.key_slot("bar")  # an empty first tag hashes the whole key
    assert _slot("foo") == 12182 and _slot("{user1000}.following") == tagged  # (the connector's, cached)


@pytest.mark.parametrize(
    ("url", "place"),
    [
        ("redis://h:1", "h:1/0"),
        ("redis://h:1/3", "h:1/3"),
        ("redis://h:1/0?db=1", "h:1/1"),  # breaker89 B3: redis-py lets the query win over the path
        ("redis://h:1/%32", "h:1/2"),  # ... and unquotes the path
        ("rediss://h/5", "h:6379/5"),
    ],
)
def test_a_marks_place_is_the_database_redis_py_writes(url: str, place: str) -> None:
    """breaker89 B3: the place a checkpoint's mark names read the path before ``?db=``, redis-py the
    query: a URL changed from ``/0`` to ``/0?db=1`` had db 1 told db 0's entries were lost."""
    assert _server_place(url) == place
    pool_db = aioredis.Redis.from_url(url).connection_pool.connection_kwargs.get("db", 0)
    assert place.endswith(f"/{pool_db}")

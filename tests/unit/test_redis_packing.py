"""The Redis connector's one-pass pipeline packing sends exactly the bytes redis-py would.

Every Redis integration test writes through it; here the bytes themselves are compared with
redis-py's own asyncio packer for arbitrary commands, and the connector is checked to use it
for both URL schemes (redis://, rediss://); cluster clients keep redis-py's packer.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio.connection import Connection, SSLConnection

from bridge.config import from_data
from bridge.connector import Registry
from connectors.redis import RedisConnector, one_pass_packing, resp_command

ARG = st.one_of(
    st.text(max_size=30),
    st.binary(max_size=7000),  # past redis-py's 6000-byte chunking
    st.integers(min_value=-(2**63), max_value=2**63),  # not ours: redis-py's packer takes these
    st.floats(allow_nan=False, allow_infinity=False),
)
NAME = st.sampled_from(["XADD", "EVALSHA", b"XREVRANGE", "CONFIG GET", b"CLIENT SETNAME"])  # redis-py splits two-word names
COMMAND = st.tuples(NAME, st.lists(ARG, max_size=20)).map(lambda c: (c[0], *c[1]))


@settings(max_examples=300, deadline=None)
@given(st.lists(COMMAND, min_size=1, max_size=12))
def test_pipeline_bytes_equal_redis_py(commands: list[tuple[object, ...]]) -> None:
    stock = Connection()
    fast = one_pass_packing(Connection)()
    assert b"".join(fast.pack_commands(commands)) == b"".join(stock.pack_commands(commands))


def test_resp_command_layout_and_refusals() -> None:
    assert resp_command(["XADD", b"k", "é", -12]) == b"*4\r\n$4\r\nXADD\r\n$1\r\nk\r\n$2\r\n\xc3\xa9\r\n$3\r\n-12\r\n"
    for bad in (True, 1.5, memoryview(b"x"), bytearray(b"x"), None):
        with pytest.raises(TypeError):
            resp_command(["XADD", bad])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("redis://127.0.0.1:6379/0", Connection),
        ("rediss://127.0.0.1:6380/0", SSLConnection),
    ],
)
def test_the_connector_packs_in_one_pass_for_both_schemes(url: str, base: type) -> None:
    config = from_data({"sources": [{"name": "a", "endpoint": "tcp://127.0.0.1:5557"}], "sinks": [{"type": "redis", "url": url}]})
    connector = Registry().build(config.sinks[0], 0)
    assert isinstance(connector, RedisConnector)
    pool = connector._connection().connection_pool
    assert issubclass(pool.connection_class, base)
    assert pool.connection_class is one_pass_packing(base)  # one class per base, not one per client

"""How the Redis connector classifies server errors, as redis-py hands them over.

redis-py strips the code from an error reply it knows ("ERR ", "NOPERM ", "OOM ", ...), so an ACL
refusal inside the write script reaches the connector as bare text, worded differently by each
Redis version. Every wording is an ACL mistake an operator fixes: retried, never dead-lettered.
The real server's wording (7.0) is covered end to end by tests/integration/test_redis_faults.py.
"""

from __future__ import annotations

import pytest
from redis.connection import BaseParser
from redis.exceptions import NoPermissionError, ResponseError

from bridge.config import SinkConfig, convert_options
from bridge.errors import Permanent, Retriable
from bridge.records import Stream
from connectors.redis import RedisConnector, RedisOptions


def connector() -> RedisConnector:
    options = convert_options({"url": "redis://127.0.0.1:1/0"}, RedisOptions, "sinks[0]")
    return RedisConnector("r", options, SinkConfig(type="redis", name="r"))


def parsed(reply: str) -> BaseException:
    """The exception redis-py raises for the error reply ``reply`` (its own parser strips the code)."""
    return BaseParser.parse_error(reply)


ACL_REPLIES = [
    # Redis 7.0 (and 6.2), a command inside a script; with and without the rest of the line
    "ERR The user executing the script can't run this command or subcommand script: 37ab, on @user_script:37.",
    "ERR The user executing the script can't run this command or subcommand",
    "ERR The user executing the script can't access at least one of the keys mentioned in the command script: 1f",
    # Redis 7.2 and later, inside a script
    "NOPERM User bridge has no permissions to run the 'sadd' command script: 37ab, on @user_script:37.",
    "NOPERM No permissions to access a key script: 37ab, on @user_script:12.",
    # a command outside a script (EVAL's declared keys)
    "NOPERM this user has no permissions to run the 'eval' command",
    "NOPERM this user has no permissions to access one of the keys used as arguments",
]


@pytest.mark.parametrize("reply", ACL_REPLIES)
def test_an_acl_refusal_is_retried_however_it_is_worded(reply: str) -> None:
    exc = parsed(reply)
    assert isinstance(exc, ResponseError)
    if reply.startswith("ERR "):
        assert not str(exc).startswith("ERR"), "redis-py no longer strips ERR: the stripped case is untested"
    error = connector()._classify(exc)
    assert isinstance(error, Retriable) and error.reason == "no_permission", error
    # the same line as a per-entry result of the script (redis.pcall keeps the code)
    line = connector()._refused(reply)
    assert isinstance(line, Retriable) and line.reason == "no_permission", line


def test_noperm_is_still_its_own_exception_class() -> None:
    assert isinstance(parsed("NOPERM this user has no permissions to run the 'xadd' command"), NoPermissionError)


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        ("WRONGTYPE Operation against a key holding the wrong kind of value", "rejected"),
        ("ERR syntax error", "rejected"),
        ("OUT_OF_ORDER entry 1-1 is below the top of k but not in it", "out_of_order"),
    ],
)
def test_other_refusals_stay_permanent(reply: str, reason: str) -> None:
    error = connector()._refused(reply)
    assert isinstance(error, Permanent) and error.reason == reason


def test_a_key_collision_reported_by_the_script_is_retried_and_says_how_to_fix_it() -> None:
    error = connector()._refused(
        "KEY_COLLISION the stream key kv:llama12 of engine stream llama/12 holds entries of engine stream llama1/2"
    )
    assert isinstance(error, Retriable) and error.reason == "key_collision"
    assert "separator" in str(error) and "kv:{source}:{dp_rank}" in str(error)


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        ("ERR Script killed by user with SCRIPT KILL... script: b0eb, on @user_script:137.", "script_killed"),
        ("ERR Protocol error: invalid bulk length", "protocol"),
        ("MISCONF Errors writing to the AOF file: No space left on device", "misconf"),
        # a Redis Cluster node written as a single server (breaker70 B1: it dead-lettered every batch)
        ("CROSSSLOT Keys in request don't hash to the same slot", "cluster"),
        # a command renamed or disabled (rename-command, a managed service): the sink's, not an entry's
        ("ERR unknown command 'EVAL', with args beginning with: ", "unknown_command"),
        ("ERR Error running script @user_script:12: Unknown Redis command called from script", "unknown_command"),
    ],
)
def test_a_refusal_of_the_whole_call_or_of_persistence_is_retried(reply: str, reason: str) -> None:
    error = connector()._classify(parsed(reply))
    assert isinstance(error, Retriable) and error.reason == reason, error


def test_the_key_type_check_covers_every_known_stream() -> None:
    """breaker53 B2: only the first 32 configured streams' keys were asked their TYPE: a string at
    the 36th stream's key passed --check, and at the run its stream's first announcement met
    WRONGTYPE, kept and retried ahead of every other stream (the whole sink stopped)."""
    from bridge.records import Stream

    conn = connector()
    conn.known_streams = [Stream("e", rank) for rank in range(40)]
    keys = conn._typed_keys()
    assert keys["kv:e:35"] == ("stream", "stream") and keys["kv:e:39"] == ("stream", "stream")


@pytest.mark.parametrize(
    ("options", "granularity"),
    [
        (
            {"stream": "{labels.ev}:{source}:{dp_rank}", "state": {"enabled": True, "key": "{labels.st}:{source}:{dp_rank}"}},
            "event",
        ),
        (
            {"stream": "{labels.ev}:{source}:{dp_rank}", "index": {"enabled": True, "key": "{labels.st}:{source}:{dp_rank}"}},
            "event",
        ),
        (
            {"stream": "kv:{source}:{dp_rank}:{type}", "index": {"enabled": True, "key": "kv:{source}:{dp_rank}:BlockStored"}},
            "batch",
        ),
    ],
    ids=["state-by-label", "index-by-label", "type-never-rendered-at-batch-granularity"],
)
def test_keys_that_differ_for_every_configured_stream_are_not_refused(options: dict[str, object], granularity: str) -> None:
    """breaker95 B2: the check that one key is not both a stream and a set or hash rendered sample
    streams without labels ('unknown:a:0' for both) and every message type, refusing valid
    configs (exit 2 at --check and at start). It renders the configured streams, labels included,
    and the types of the sink's granularity."""
    opts = convert_options({"url": "redis://127.0.0.1:1/0", **options}, RedisOptions, "sinks[0]")
    conn = RedisConnector("r", opts, SinkConfig(type="redis", name="r", granularity=granularity))  # type: ignore[arg-type]
    streams = [Stream("llama-a", r, {"ev": "kvev", "st": "kvst"}) for r in range(2)]
    assert conn.conflicts(streams) == []
    clash = Stream("llama-b", 0, {"ev": "kvev", "st": "kvev"})  # (a stream's labels are fixed: renders are kept)
    assert conn.conflicts([clash]) != [] or granularity == "batch"

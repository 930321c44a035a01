"""The parts of redis-py past its public API that the Redis connector uses, and nothing else.

Each reach is one small function here that says why it is needed;
``tests/unit/test_redis_internals.py`` checks each against the installed redis-py (names,
signatures, the exact bytes sent), so an upgrade that changes them fails there, loudly.
``pyproject.toml`` pins redis-py below the next minor version for the same reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.crc import key_slot as _key_slot

TESTED = "8.1"  # the redis-py minor version these functions were written and tested against


def resp_command(args: Sequence[str | bytes | int]) -> bytes:
    """``args`` as one Redis protocol command (an array of bulk strings), the bytes redis-py sends.

    Takes ``str`` (UTF-8, redis-py's default encoding), ``bytes`` and ``int``; raises TypeError
    for anything else (redis-py's own packer handles those).
    """
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        if type(a) is str:
            b = a.encode()
        elif type(a) is bytes:
            b = a
        elif type(a) is int:
            b = b"%d" % a
        else:
            raise TypeError(f"not str, bytes or int: {type(a).__name__}")
        out.append(b"$%d\r\n%b\r\n" % (len(b), b))
    return b"".join(out)


_ONE_PASS: dict[type[Any], type[Any]] = {}


def one_pass_packing(base: type[Any]) -> type[Any]:
    """``base`` (a redis-py asyncio connection class) packing its pipelines in one pass.

    Overrides the connection's ``pack_commands``: redis-py's asyncio connections pack every
    argument through the encoder in Python, about 30 us per 20-argument command (its sync client
    uses hiredis, the async one does not); :func:`resp_command` takes 6 us for the same bytes, half
    the CPU of a raw batch written to Redis (``benchmarks/redis_client_bench.py``). Commands with
    other argument types, or a multi-word name, go through redis-py's ``pack_command``.
    """
    fast = _ONE_PASS.get(base)
    if fast is None:

        def pack_commands(self: Any, commands: Iterable[Iterable[Any]]) -> list[bytes]:
            out: list[bytes] = []
            for command in commands:
                args = tuple(command)
                first = args[0] if args else None
                if (type(first) is str and " " in first) or (type(first) is bytes and b" " in first):
                    out.extend(base.pack_command(self, *args))  # redis-py splits those names
                    continue
                try:
                    out.append(resp_command(args))
                except TypeError:
                    out.extend(base.pack_command(self, *args))
            return [b"".join(out)]

        fast = _ONE_PASS[base] = type(f"OnePass{base.__name__}", (base,), {"pack_commands": pack_commands})
    return fast


def pack_in_one_pass(client: aioredis.Redis) -> None:
    """Make the connections ``client`` opens from now on use :func:`one_pass_packing`.

    ``from_url`` picks the connection class from the URL scheme (``rediss://``: SSLConnection) and
    ignores a ``connection_class`` argument, so the pool's class is wrapped after the fact; the
    pool reads it each time it opens a connection.
    """
    pool = client.connection_pool
    pool.connection_class = one_pass_packing(pool.connection_class)


def key_slot(key: str) -> int:
    """The Redis Cluster hash slot of ``key`` (hash tags honoured), as redis-py computes it."""
    return int(_key_slot(key.encode()))


__all__ = ["TESTED", "key_slot", "one_pass_packing", "pack_in_one_pass", "resp_command"]

"""Secrets in configuration: one type, one redaction, applied wherever text leaves the process.

A password or token is a :class:`Secret` in an Options struct (``password: Secret | None``). Its
``repr``/``str`` is ``***``; the value is read with :meth:`Secret.reveal`, only where a client
needs it. Every secret created (and every password found in a URL by :func:`redact_url`) is
remembered, and :func:`redact` removes all of them from a text: the log formatters, the dead-letter
writer, ``/readyz`` and ``--check`` pass their text through it, so a client library that quotes a
password in an error message does not leak it either.
"""

from __future__ import annotations

import re
import threading
from urllib.parse import parse_qsl, quote, unquote, urlsplit, urlunsplit

MASK = "***"
# Query parameters that carry credentials in the URLs clients accept (redis-py: password=).
_SECRET_PARAMS = frozenset({"password", "pass", "passwd", "token", "secret", "auth", "access_token"})
_KNOWN: set[str] = set()
_LOCK = threading.Lock()
_pattern: re.Pattern[str] | None = None


def remember(value: str) -> None:
    """Redact ``value`` from every text from now on (values under 4 characters are masked in URLs
    and reprs only: replacing them everywhere would mangle ordinary text)."""
    global _pattern
    if len(value) < 4 or value in _KNOWN:
        return
    with _LOCK:
        _KNOWN.add(value)
        forms = {value, quote(value, safe=""), quote(value)}
        _KNOWN.update(f for f in forms if len(f) >= 4)
        _pattern = re.compile("|".join(re.escape(s) for s in sorted(_KNOWN, key=len, reverse=True)))


def redact(text: str) -> str:
    """``text`` with every known secret replaced by ``***``."""
    pattern = _pattern
    return pattern.sub(MASK, text) if pattern is not None and text else text


class Secret:
    """A password or token: shown as ``***`` everywhere, revealed only on purpose."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value
        remember(value)

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return f"Secret({MASK!r})"

    def __str__(self) -> str:
        return MASK

    def __bool__(self) -> bool:
        return bool(self._value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash((Secret, self._value))


def reveal(secret: Secret | None) -> str | None:
    """The value of an optional secret (None and empty stay None)."""
    return secret.reveal() or None if secret is not None else None


def redact_url(url: str, *, token_user: bool = False) -> str:
    """``url`` with the password of its user part and credential query parameters masked; both
    are remembered, so :func:`redact` masks them in any other text too. ``token_user``: a user part
    without a password is a credential as well (NATS's ``nats://TOKEN@host``)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return redact(url)
    netloc = parts.netloc
    if parts.password:
        remember(unquote(parts.password))
        userinfo, _, host = netloc.rpartition("@")
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:{MASK}@{host}"
    elif token_user and "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        if userinfo:
            remember(unquote(userinfo))
            netloc = f"{MASK}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(k.lower() in _SECRET_PARAMS for k, _ in pairs):
            for k, v in pairs:
                if k.lower() in _SECRET_PARAMS and v:
                    remember(v)
            query = "&".join(f"{k}={MASK if k.lower() in _SECRET_PARAMS and v else quote(v, safe='')}" for k, v in pairs)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


__all__ = ["MASK", "Secret", "redact", "redact_url", "remember", "reveal"]

"""NATS connector without a server: registration, subjects, the wire encoding, options and secrets,
and which refused messages a write sends again in turn."""

from __future__ import annotations

import base64
import json
import zlib
from typing import Any

import pytest

from bridge.config import SinkConfig, convert_options
from bridge.connector import Registry, Secret
from bridge.errors import EPOCHS_REMEMBERED, ConfigError, ConnectorError, NotConnected, Permanent, Retriable, StreamRefused
from bridge.formats import Message, Renderer, sample_message
from bridge.records import Stream, events_lost, source_reset
from bridge.secret import redact
from connectors.nats import (
    NatsConnector,
    NatsOptions,
    StreamOptions,
    _Held,
    _login,
    _refused_for_turn,
    _Subjects,
    header_block,
    hpub,
    subject_filter,
    subject_problem,
    subject_token,
)
from tests.support.records import stream_records


def test_registered_under_its_entry_point() -> None:
    assert Registry().get("nats") is NatsConnector


def test_subject_tokens_and_filter() -> None:
    assert subject_token("llama-3.1 8b*>") == "llama-3_1_8b__"
    assert subject_token("") == "_"
    assert subject_filter("kv.{source}.{dp_rank}") == "kv.*.*"
    # breaker105 E2: a label placeholder is one token ('kv.*.zone}.*.*' captured nothing)
    assert subject_filter("kv.{labels.zone}.{source}.{dp_rank}") == "kv.*.*.*"


def test_header_block_and_hpub_are_the_wire_format() -> None:
    hdr = header_block({"source": "a", "type": "Evil\r\nPUB x 1\r\n"}, "a/0/1/2")
    assert hdr == b"NATS/1.0\r\nsource: a\r\ntype: Evil  PUB x 1\r\nNats-Msg-Id: a/0/1/2\r\n\r\n"
    assert hpub("kv.a.0", "", hdr, b"xy") == f"HPUB kv.a.0 {len(hdr)} {len(hdr) + 2}\r\n".encode() + hdr + b"xy\r\n"
    assert hpub("kv.a.0", "_INBOX.1", b"H", b"") == b"HPUB kv.a.0 _INBOX.1 1 1\r\nH\r\n"


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"subject": "kv..{source}"}, "empty token"),
        ({"subject": "kv.*.{source}"}, "wildcard"),
        ({"subject": "kv.{}"}, "sinks[2].subject: bad placeholder {} in 'kv.{}'"),
        ({"user": "u"}, "user and password"),
        ({"token": "t", "credentials": "/c"}, "one way to authenticate"),
        ({"mode": "fast"}, "mode"),
        ({"subjekt": "x"}, "did you mean subject"),
        ({"stream": {"name": "a.b"}}, "stream name"),
        ({"stream": {"subjects": ["kv.>.x"]}}, "wildcard must be a whole token"),
        ({"max_pending": 10}, "max_pending"),  # removed: the runtime bounds a write (issue 16)
        ({"ack_timeout": "5s"}, "ack_timeout"),
        ({"password": 3, "user": "u"}, "password"),
        ({"tls": {"key_file": "k.pem"}}, "tls.key_file needs tls.cert_file"),
    ],
)
def test_options_are_validated_with_their_path(options: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        convert_options(options, NatsOptions, "sinks[2]")
    text = str(info.value)
    assert text.startswith("sinks[2]") and problem in text, text


def test_a_credentials_or_seed_file_the_client_could_not_use_is_a_config_problem(tmp_path: Any) -> None:
    """breaker46 B1: a missing credentials file was found at connect, reason ``auth``, which
    ``--check`` took for a server's refusal where nothing listened. The registry refuses it now,
    and a file that does not hold what nats-py reads from it too."""
    jwt, seed = "eyJ0eXAiOiJKV1QifQ.e30.c2ln", "SUAIBDPBAUTWCWBKIO6XHQNINK5FWJW4OHLXC3HQ2KFE4PEJUA44CNHTC4"
    files = {
        "good.creds": f"-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n",
        "no-seed.creds": f"-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n",
        "seed.nk": seed + "\n",
        "garbage": "not a credential\n",
        # breaker53 B1: nats-py reads these with nkeys (missing: every login failed at connect);
        # a seed that only starts like one, and a credentials file with Windows line ends
        # (nats-py keeps the carriage return of its seed line), are refused here now.
        "bad-seed.nk": "SUNOTASEED\n",
        "crlf.creds": f"-----BEGIN NATS USER JWT-----\r\n{jwt}\r\n------END NATS USER JWT------\r\n\r\n"
        f"-----BEGIN USER NKEY SEED-----\r\n{seed}\r\n------END USER NKEY SEED------\r\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    cases = [
        ({"credentials": str(tmp_path / "nope.creds")}, "sinks[1].credentials: {}/nope.creds: no such file (give the path of"),
        ({"credentials": str(tmp_path / "garbage")}, "sinks[1].credentials: {}/garbage: holds no user JWT ("),
        ({"credentials": str(tmp_path / "no-seed.creds")}, "sinks[1].credentials: {}/no-seed.creds: holds no user nkey seed"),
        ({"nkey_seed": str(tmp_path / "garbage")}, "sinks[1].nkey_seed: {}/garbage: holds no user nkey seed"),
        ({"nkey_seed": str(tmp_path)}, "sinks[1].nkey_seed: {}: is a directory (give the path of an nkey seed file"),
        ({"nkey_seed": str(tmp_path / "bad-seed.nk")}, "sinks[1].nkey_seed: {}/bad-seed.nk: holds no user nkey seed nkeys"),
        (
            {"credentials": str(tmp_path / "crlf.creds")},
            "sinks[1].credentials: {}/crlf.creds: holds no user nkey seed nkeys can read (a carriage return",
        ),
    ]
    for options, problem in cases:
        with pytest.raises(ConfigError) as info:
            Registry().build(SinkConfig(type="nats", options=options), 1)
        assert len(info.value.problems) == 1, info.value.problems
        assert info.value.problems[0].startswith(problem.format(tmp_path)), info.value.problems
    for options in ({"credentials": str(tmp_path / "good.creds")}, {"nkey_seed": str(tmp_path / "seed.nk")}):
        Registry().build(SinkConfig(type="nats", options=options), 1)


def test_options_defaults_and_secrets() -> None:
    options = convert_options(
        {"servers": ["nats://a:1", "nats://b:2"], "user": "u", "password": "pw-123456"}, NatsOptions, "sinks[0]"
    )
    assert options.mode == "jetstream" and options.stream == StreamOptions()
    assert isinstance(options.password, Secret) and options.password.reveal() == "pw-123456"
    assert "pw-123456" not in repr(options) and "pw-123456" not in str(options)
    assert redact("auth failed for pw-123456") == "auth failed for ***"
    token = convert_options({"token": "tok-456789"}, NatsOptions, "sinks[0]")
    assert "tok-456789" not in repr(token) and isinstance(token.token, Secret)


@pytest.mark.parametrize(
    ("stream", "window"),
    [
        ({"create": True, "max_age": "1m"}, 60.0),  # the default 2m would be refused: the server's own choice
        ({"create": True, "max_age": "1h"}, 120.0),
        ({"create": True}, 120.0),
        ({"create": True, "max_age": "1m", "duplicate_window": "30s"}, 30.0),
        ({"create": True, "max_age": "1m", "duplicate_window": "1m"}, 60.0),
        ({"create": True, "max_age": "10m", "duplicate_window": "5m"}, 300.0),
    ],
)
def test_the_duplicate_window_a_stream_is_created_with_never_exceeds_max_age(stream: dict[str, Any], window: float) -> None:
    """breaker31h C2: max_age 1m with the default 2-minute window passed --check, and the server
    refused to create the stream (10052), so nothing was ever stored. Left out, the window is the
    server's own choice (2m, or max_age when shorter)."""
    options = convert_options({"stream": stream}, NatsOptions, "sinks[0]")
    assert options.stream.window == window


def test_a_duplicate_window_above_max_age_is_refused_before_a_run_naming_both_and_the_fix() -> None:
    with pytest.raises(ConfigError) as info:
        convert_options({"stream": {"create": True, "max_age": "1m", "duplicate_window": "2m"}}, NatsOptions, "sinks[0]")
    text = str(info.value)
    assert text.startswith("sinks[0]") and "stream.duplicate_window (120s) must not exceed stream.max_age (60s)" in text
    assert "lower duplicate_window to at most 60s" in text, text
    # (an existing stream is used as it is: stream options are only what the bridge would create)
    convert_options({"stream": {"max_age": "1m", "duplicate_window": "2m"}}, NatsOptions, "sinks[0]")


def test_password_in_a_server_url_is_hidden() -> None:
    options = convert_options({"servers": "nats://bridge:url-pw-9876@h:4222"}, NatsOptions, "sinks[0]")
    assert redact(repr(options)).count("url-pw-9876") == 0  # remembered when the options were read
    conn = NatsConnector("n", options, None)  # type: ignore[arg-type]  # the sink config is not read here
    assert "url-pw-9876" not in conn._where and "bridge" in conn._where
    assert (
        redact("nats: could not connect to nats://bridge:url-pw-9876@h:4222")
        == "nats: could not connect to nats://bridge:***@h:4222"
    )


def test_refused_for_turn_resends_what_only_the_chain_refused() -> None:
    a, b, c = Stream("a", 0), Stream("b", 0), Stream("c", 0)
    renderer = Renderer("raw")
    order = [a, b, a, c, b, a, c, b]
    messages: list[Message] = []
    for n, s in enumerate(order):
        messages.extend(renderer.render(stream_records(s, 1, start=n)[0]))
    turn = Retriable("wrong last msg ID", reason="out_of_turn")
    full = Retriable("maximum bytes exceeded", reason="stream_full")
    big = Permanent("too large", reason="too_large")
    lost = NotConnected("gone")
    errors: dict[int, ConnectorError] = {0: full, 1: big, 2: turn, 3: turn, 4: turn, 5: turn, 6: lost, 7: turn}
    again = _refused_for_turn(messages, errors)
    # a failed at 0: its later ones stay failed; b's refusal for itself stays, and b's later
    # records wait for its announcement (stay failed); c goes on until its own failure at 6.
    assert again == [3]
    assert errors == {0: full, 1: big, 2: turn, 4: turn, 5: turn, 6: lost, 7: turn}


def test_what_a_lost_stream_held_per_bridge_stream() -> None:
    """The spans SinkLost carries: per bridge stream, its two newest epochs, from 0 (the stream may hold
    earlier seqs) or, in a stream this process created, from the first seq stored, to the last."""
    a, b = Stream("a", 0), Stream("b", 1)
    held = _Held()
    for r in [source_reset(a, 1, "publisher_restart", 0.0), *stream_records(a, 3, epoch=1, start=5)]:
        held.note(r)
    held.note(events_lost(b, 2, 3, 7, "replay_unavailable", 0.0))
    held.note(stream_records(b, 1, epoch=2, start=8)[0])
    held.note(stream_records(b, 1, epoch=2, start=4)[0])  # an older seq changes nothing
    assert sorted((s.key, e, f, t) for s, e, f, t in held.take()) == [("a/0", 1, 0, 7), ("b/1", 2, 0, 8)]
    assert held.take() == []  # forgotten once taken

    held.fresh = True  # a stream created empty by this process
    held.note(source_reset(a, 3, "publisher_restart", 0.0))  # no seq of its own: nothing to announce
    assert held.take() == []
    held.note(stream_records(a, 1, epoch=3, start=4)[0])
    held.note(stream_records(a, 1, epoch=4, start=2)[0])  # a newer epoch: the older one's span is kept too
    held.note(events_lost(b, 2, 3, 7, "replay_unavailable", 0.0))
    assert sorted((s.key, e, f, t) for s, e, f, t in held.take()) == [("a/0", 3, 4, 4), ("a/0", 4, 2, 2), ("b/1", 2, 3, 7)]


def test_a_loss_reaching_back_past_an_engine_restart_is_announced_in_both_epochs() -> None:
    """Found by the invariant breaker (B5): epoch 1's seqs 0-4 acknowledged, then epoch 2's 0-2, then
    the stream lost: both epochs' spans are announced, the older first; only the newest
    EPOCHS_REMEMBERED epochs are kept (a crash loop opens many)."""
    a = Stream("a", 0)
    held = _Held()
    for r in [*stream_records(a, 5, epoch=1), source_reset(a, 2, "publisher_restart", 0.0), *stream_records(a, 3, epoch=2)]:
        held.note(r)
    assert [(e, f, t) for _s, e, f, t in held.take()] == [(1, 0, 4), (2, 0, 2)]
    for epoch in range(1, EPOCHS_REMEMBERED + 2):
        held.note(stream_records(a, 1, epoch=epoch)[0])
    assert [e for _s, e, _f, _t in held.take()] == list(range(2, EPOCHS_REMEMBERED + 2))


def test_a_wildcard_is_a_whole_token_and_the_full_wildcard_only_the_last() -> None:
    for ok in ("kv.*", "kv.*.b", "kv.>", "*.a.>", "kv.a"):
        assert subject_problem(ok, wildcards=True) is None, ok
    for bad in ("kv.a*", "kv.>.b", "kv.>>", "kv.*x.b"):
        assert subject_problem(bad, wildcards=True) == "a wildcard must be a whole token ('>' only the last)", bad
    assert subject_problem("kv.>", wildcards=False) == "it contains a wildcard (* or >), which cannot be published to"


def test_a_subject_is_rendered_from_values_made_into_one_token_each() -> None:
    stream = Stream("llama 3.1", 2, {"zone": "eu.west"})
    subjects = _Subjects("kv.{source}.{dp_rank}.{zone}.{type}.{epoch}")
    message = sample_message(stream, "Block*Stored", epoch=7)
    assert subjects.render(message) == "kv.llama_3_1.2.eu_west.Block_Stored.7"
    assert subjects.render(sample_message(stream, "Block*Stored", epoch=8)) == "kv.llama_3_1.2.eu_west.Block_Stored.8"
    assert subjects.render(message) == "kv.llama_3_1.2.eu_west.Block_Stored.7"  # (from the cache: the same)
    assert subjects.render(sample_message(Stream("b", 0), "EventBatch", epoch=7)) == "kv.b.0.unknown.EventBatch.7"
    assert _Subjects("kv.static").render(message) == "kv.static"


def test_two_streams_whose_names_become_one_subject_token_never_share_a_subject() -> None:
    # '.' becomes '_' in a subject token: llama.a and llama_a would write one subject, and a
    # consumer following one stream's subject would apply the other's records as its own.
    subjects = _Subjects("kv.{source}.{dp_rank}")
    first, second = Stream("llama_a", 0), Stream("llama.a", 0)
    owned = sample_message(first, "EventBatch", epoch=3)
    clash = sample_message(second, "SourceReset", epoch=9)
    assert subjects.render(owned) == subjects.render(clash) == "kv.llama_a.0"
    assert subjects.taken(owned, "sinks[n]") is None  # the first stream to write it owns it
    refused = subjects.taken(clash, "sinks[n]")
    assert isinstance(refused, StreamRefused) and refused.reason == "subject_taken"
    assert "'kv.llama_a.0' is written by stream 'llama_a/0' already" in str(refused) and "'llama.a'" in str(refused)
    assert subjects.taken(sample_message(second, "EventBatch", epoch=10), "sinks[n]") is not None  # every type, epoch
    assert subjects.taken(sample_message(Stream("llama.a", 1), "EventBatch"), "sinks[n]") is None  # another rank
    # A template that does not give each stream subjects of its own shares them by design.
    shared = _Subjects("kv.{dp_rank}")
    shared.render(owned), shared.render(clash)
    assert shared.taken(clash, "sinks[n]") is None and shared.base(second) is None


def test_the_subjects_owner_the_server_names_wins_over_the_one_this_process_met_first() -> None:
    """The JetStream stream's word on a subject (its last message: see NatsConnector._claim) is
    another bridge's, which this process cannot have seen: it decides even when this process
    rendered the subject for its own stream before (positions() renders every stream at start with
    checkpoint.from_sinks, which made the claim keep the subject for this process's stream)."""
    subjects = _Subjects("kv.{source}.{dp_rank}")
    mine = Stream("llama.a", 0)
    subjects.render(sample_message(mine))  # (as positions() does)
    assert subjects.claim(mine, "llama_a/0") == "llama_a/0"
    refused = subjects.taken(sample_message(mine, "EventBatch", epoch=2), "sinks[n]")
    assert isinstance(refused, Permanent) and "'llama_a/0'" in str(refused)
    assert subjects.claim(mine, None) is None  # (refused for good: a later look does not undo it)
    own = _Subjects("kv.{source}.{dp_rank}")
    for holder in (None, "llama.a/0"):  # an empty subject, or its own message: it stays the stream's
        assert own.claim(mine, holder) is None and own.taken(sample_message(mine), "sinks[n]") is None


def test_configured_sources_that_would_share_a_subject_are_refused_before_a_run(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from bridge.cli import check

    p = tmp_path / "c.yaml"
    sources = "sources:\n  - {name: llama_a, endpoint: 'tcp://h:1'}\n  - {name: llama.a, endpoint: 'tcp://h:9', dp_ranks: 2}\n"
    p.write_text(sources + "sinks:\n  - {type: nats, name: n, subject: 'kv.{source}.{dp_rank}'}\n")
    assert check(str(p), offline=True) == 2
    err = capsys.readouterr().err
    assert "sinks[0] (n): streams 'llama_a/0' and 'llama.a/0' would both be written to 'kv.llama_a.0'" in err
    assert "llama.a/1" not in err  # (rank 1 has a subject of its own)
    p.write_text(sources + "sinks:\n  - {type: nats, name: n, subject: 'kv.{dp_rank}'}\n")
    assert check(str(p), offline=True) == 0  # one subject per rank, shared by design


def test_a_header_value_goes_out_as_it_is_unless_a_cr_or_lf_would_end_its_line() -> None:
    assert header_block({"type": " spaced  out "}) == b"NATS/1.0\r\ntype:  spaced  out \r\n\r\n"
    for value in ("a\nb", "a\rb", "a\r\nb"):
        assert (
            header_block({"type": value, "source": "s"})
            == b"NATS/1.0\r\ntype: a" + b" " * len(value[1:-1]) + b"b\r\nsource: s\r\n\r\n"
        )
    assert header_block({"source": "s"}, "s/0/1/2", "s/0/1/1") == (
        b"NATS/1.0\r\nsource: s\r\nNats-Msg-Id: s/0/1/2\r\nNats-Expected-Last-Msg-Id: s/0/1/1\r\n\r\n"
    )
    assert header_block({}, expected_last="x") == b"NATS/1.0\r\nNats-Expected-Last-Msg-Id: x\r\n\r\n"


def test_hpub_with_a_reply_counts_the_headers_and_the_payload() -> None:
    assert hpub("kv.a.0", "_INBOX.1", b"HDR", b"xy") == b"HPUB kv.a.0 _INBOX.1 3 5\r\nHDRxy\r\n"


async def test_a_refusal_is_kept_over_the_socket_closing_after_it_not_over_later_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server closes the socket right after refusing the credentials: the broken pipe that
    follows must not hide the refusal. But a server stopped later is not refusing anything: the
    refusal was kept over every later error, and /readyz named the credentials while nothing
    listened (breaker30z3 Break 2). Nor is the server's authentication timeout a refusal."""
    import nats.errors

    import connectors.nats as module

    conn = NatsConnector("n", convert_options({}, NatsOptions, "s"), SinkConfig(type="nats", name="n"))
    now = [100.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: now[0])
    await conn._on_error(nats.errors.Error("nats: 'Authorization Violation'"))
    assert conn._refusal == "auth"
    await conn._on_error(BrokenPipeError(32, "Broken pipe"))
    assert conn._refusal == "auth" and "Authorization Violation" in (conn._last_error or "")
    now[0] += 5
    await conn._on_error(ConnectionRefusedError(111, "Connect call failed"))
    assert conn._refusal is None and "Connect call failed" in (conn._last_error or "")
    await conn._on_error(nats.errors.Error("nats: 'Authentication Timeout'"))
    assert conn._refusal is None


async def test_a_client_failure_at_connect_is_the_sinks_not_the_bridges(monkeypatch: pytest.MonkeyPatch) -> None:
    """breaker53 B1: nats-py could not set up a credentials login (its nkeys module was missing) and
    raised ModuleNotFoundError out of connect: the sink's task failed and the bridge exited. Any
    failure of the client's own is now the sink's: not connected (reason auth), named, retried."""
    import nats.aio.client

    async def failing(self: Any, **options: Any) -> None:
        raise ModuleNotFoundError("No module named 'nkeys'")

    monkeypatch.setattr(nats.aio.client.Client, "connect", failing)
    conn = NatsConnector("n", convert_options({}, NatsOptions, "s"), SinkConfig(type="nats", name="n"))
    with pytest.raises(NotConnected) as info:
        await conn.connect()
    assert info.value.reason == "auth" and "ModuleNotFoundError: No module named 'nkeys'" in str(info.value)


def _jwt(claims: dict[str, Any]) -> str:
    body = base64.urlsafe_b64encode(json.dumps(claims).encode()).decode().rstrip("=")
    return f"eyJhbGciOiJlZDI1NTE5LW5rZXkifQ.{body}.c2ln"


@pytest.mark.parametrize(
    ("options", "login"),
    [
        ({"servers": "nats://h:4222"}, ""),
        ({"servers": "nats://h:4222", "user": "ua", "password": "pa"}, "user:ua"),
        ({"servers": "nats://ua:pa@h:4222"}, "user:ua"),
        ({"servers": "nats://al%40ice:pa@h:4222"}, "user:al%40ice"),  # (nats-py sends it as written)
        ({"servers": "nats://T0KEN@h:4222"}, f"token:{zlib.crc32(b'T0KEN'):08x}"),
        ({"servers": "h:4222", "token": "T0KEN"}, f"token:{zlib.crc32(b'T0KEN'):08x}"),
        ({"servers": "nats://h", "credentials": "{creds}"}, "account:ACCOUNT_OF_THE_SIGNING_KEY"),
        ({"servers": "nats://h", "credentials": "{plain}"}, "account:AISSUER"),
        ({"servers": "nats://h", "credentials": "/no/such.creds"}, "creds:/no/such.creds"),
    ],
)
def test_a_mark_names_the_login_of_its_sink(tmp_path: Any, options: dict[str, Any], login: str) -> None:
    """breaker89 B2: each JetStream account has streams of its own, so a mark names who the sink
    logs in as (a creds file's account; else the user, nkey or token): a mark taken in another
    account is not checked against this one's stream of that name. The token is never in it."""
    seed = "-----BEGIN USER NKEY SEED-----\nSU(not read)\n------END USER NKEY SEED------\n"
    for name, claims in (("creds", {"iss": "ASIGNER", "nats": {"issuer_account": "ACCOUNT_OF_THE_SIGNING_KEY"}}),
                         ("plain", {"iss": "AISSUER", "nats": {}})):  # fmt: skip
        path = tmp_path / f"{name}.creds"
        path.write_text(f"-----BEGIN NATS USER JWT-----\n{_jwt(claims)}\n------END NATS USER JWT------\n\n{seed}")
        options = {k: (str(path) if v == "{" + name + "}" else v) for k, v in options.items()}
    assert _login(convert_options(options, NatsOptions, "sinks[0]")) == login
    assert "T0KEN" not in login

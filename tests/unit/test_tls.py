"""The one ``tls`` block of the Kafka, Redis and NATS sinks: its checks (with their config path) and
the client context it builds, proven by TLS handshakes in memory (no sockets) with the test CA."""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Any

import msgspec
import pytest

from bridge.config import convert_options
from bridge.connector import TlsOptions
from bridge.errors import ConfigError
from connectors import kafka, nats, redis
from tests.support.tls import Certificates, available, make_certificates

# The smallest valid options of each connector that takes a tls block.
CONNECTORS: dict[str, tuple[type[msgspec.Struct], dict[str, Any]]] = {
    "kafka": (kafka.KafkaOptions, {"bootstrap_servers": "k1:9093", "security_protocol": "SSL"}),
    "redis": (redis.RedisOptions, {"url": "rediss://r1:6380/0"}),
    "nats": (nats.NatsOptions, {"servers": "tls://n1:4222"}),
}


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    if not available():
        pytest.skip("openssl is not installed")
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.mark.parametrize("name", list(CONNECTORS))
def test_every_connector_uses_the_one_struct(name: str) -> None:
    module = {"kafka": kafka, "redis": redis, "nats": nats}[name]
    assert module.TlsOptions is TlsOptions
    options_type, base = CONNECTORS[name]
    options = convert_options({**base, "tls": {"ca_file": "/ca.pem"}}, options_type, "sinks[0]")
    assert options.tls == TlsOptions(ca_file="/ca.pem")  # type: ignore[attr-defined]
    assert TlsOptions() == TlsOptions(ca_file=None, cert_file=None, key_file=None, check_hostname=True)


@pytest.mark.parametrize("name", list(CONNECTORS))
@pytest.mark.parametrize(
    ("tls", "problem"),
    [
        ({"key_file": "/k.pem"}, "sinks[3].tls: tls.key_file needs tls.cert_file"),
        ({"key_file": "/k.pem", "cert_file": ""}, "sinks[3].tls: tls.key_file needs tls.cert_file"),
        ({"cafile": "/ca.pem"}, "sinks[3].tls.cafile: unknown key (did you mean ca_file?)"),
        ({"check_hostname": "maybe"}, 'sinks[3].tls.check_hostname: expected bool, got "maybe"'),
        ({"ca_file": 3}, "sinks[3].tls.ca_file: expected str | null, got 3"),
    ],
)
def test_problems_name_their_full_path(name: str, tls: dict[str, Any], problem: str) -> None:
    options_type, base = CONNECTORS[name]
    with pytest.raises(ConfigError) as info:
        convert_options({**base, "tls": tls}, options_type, "sinks[3]")
    assert info.value.problems == [problem]


def test_struct_checks_itself() -> None:
    with pytest.raises(ValueError, match=r"tls\.key_file needs tls\.cert_file"):
        TlsOptions(key_file="/k.pem")
    # An unset ${VAR:-} leaves an empty string: absent, like null.
    assert TlsOptions(key_file="").key_file == ""
    TlsOptions(cert_file="/c.pem", key_file="/k.pem")
    TlsOptions(cert_file="/both.pem")


# -- the client context ------------------------------------------------------------------------


def _server_context(certs: Certificates, *, require_client: bool) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs.server_cert, certs.server_key)
    if require_client:
        context.load_verify_locations(certs.ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def _handshake(client_context: ssl.SSLContext, server_context: ssl.SSLContext, hostname: str) -> dict[str, Any]:
    """Run a TLS handshake between the two contexts over memory buffers; the client certificate the
    server saw (empty without one). Raises the ssl error of whichever side refuses."""
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    server_in, server_out = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_context.wrap_bio(to_client, to_server, server_hostname=hostname)
    server = server_context.wrap_bio(server_in, server_out, server_side=True)
    pending = {"client", "server"}
    for _ in range(20):
        for side, obj in (("client", client), ("server", server)):
            if side in pending:
                try:
                    obj.do_handshake()
                    pending.discard(side)
                except ssl.SSLWantReadError:
                    pass
        server_in.write(to_server.read())
        to_client.write(server_out.read())
        if not pending:
            return server.getpeercert() or {}
    raise AssertionError(f"handshake did not finish: {pending} pending")


def test_context_verifies_the_server_with_ca_file(certs: Certificates) -> None:
    tls = TlsOptions(ca_file=str(certs.ca))
    context = tls.ssl_context()
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname is True
    assert context.cert_store_stats()["x509_ca"] == 1  # the given CA only, not the system's
    assert _handshake(context, _server_context(certs, require_client=False), "localhost") == {}
    _handshake(context, _server_context(certs, require_client=False), "127.0.0.1")


def test_context_checks_the_hostname_unless_told_not_to(certs: Certificates) -> None:
    server = _server_context(certs, require_client=False)
    with pytest.raises(ssl.SSLCertVerificationError, match="match"):
        _handshake(TlsOptions(ca_file=str(certs.ca)).ssl_context(), server, "kafka.example.com")
    lenient = TlsOptions(ca_file=str(certs.ca), check_hostname=False).ssl_context()
    assert lenient.verify_mode == ssl.CERT_REQUIRED  # the chain is still verified
    _handshake(lenient, server, "kafka.example.com")


def test_context_without_ca_file_trusts_only_the_system_cas(certs: Certificates) -> None:
    server = _server_context(certs, require_client=False)
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(TlsOptions().ssl_context(), server, "localhost")
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(TlsOptions(check_hostname=False).ssl_context(), server, "localhost")


def test_context_presents_the_client_certificate(certs: Certificates, tmp_path: Path) -> None:
    server = _server_context(certs, require_client=True)
    mutual = TlsOptions(ca_file=str(certs.ca), cert_file=str(certs.client_cert), key_file=str(certs.client_key))
    seen = _handshake(mutual.ssl_context(), server, "localhost")
    assert seen["subject"] == ((("commonName", "kvb-test-client"),),)
    both = tmp_path / "client-and-key.pem"
    both.write_text(certs.client_cert.read_text() + certs.client_key.read_text())
    seen = _handshake(TlsOptions(ca_file=str(certs.ca), cert_file=str(both), key_file="").ssl_context(), server, "localhost")
    assert seen["subject"] == ((("commonName", "kvb-test-client"),),)
    with pytest.raises(ssl.SSLError):  # no client certificate: the server refuses
        _handshake(TlsOptions(ca_file=str(certs.ca)).ssl_context(), server, "localhost")


def test_context_reports_unusable_files(certs: Certificates, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        TlsOptions(ca_file=str(tmp_path / "missing.pem")).ssl_context()
    with pytest.raises(FileNotFoundError):
        TlsOptions(cert_file=str(tmp_path / "missing.pem")).ssl_context()
    with pytest.raises(ssl.SSLError):  # the server's key does not belong to the client certificate
        TlsOptions(cert_file=str(certs.client_cert), key_file=str(certs.server_key)).ssl_context()


def test_validation_names_each_unusable_file_by_its_key(certs: Certificates, tmp_path: Path) -> None:
    """breaker46 B1: a missing or unusable TLS file was found only at connect, where ``--check``
    took it for a server's refusal ("reachable, not usable as configured" where nothing listened)
    and ``--check --offline`` said ok. The registry refuses it now, naming the key and the fix."""
    from bridge.connector import Registry, SinkConfig

    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    fifo = tmp_path / "fifo.pem"
    os.mkfifo(fifo)  # (breaker53: opened, a FIFO with no writer blocked --check --offline and a run's start)
    cases = [
        ({"ca_file": str(fifo)}, f"sinks[0].tls.ca_file: {fifo}: is not a regular file (give the path of a PEM file"),
        ({"ca_file": str(tmp_path / "no.pem")}, f"sinks[0].tls.ca_file: {tmp_path / 'no.pem'}: no such file (give the path"),
        ({"ca_file": str(tmp_path)}, f"sinks[0].tls.ca_file: {tmp_path}: is a directory (give the path of a PEM file"),
        ({"ca_file": str(garbage)}, f"sinks[0].tls.ca_file: {garbage}: holds no PEM certificate (no certificate or crl"),
        ({"cert_file": str(garbage)}, f"sinks[0].tls.cert_file: {garbage}: holds no PEM client certificate and its"),
        (
            {"cert_file": str(certs.client_cert), "key_file": str(certs.server_key)},
            f"sinks[0].tls.key_file: {certs.server_key}: not the unencrypted PEM private key of tls.cert_file (",
        ),
        ({"cert_file": str(certs.client_cert), "key_file": str(garbage)}, f"sinks[0].tls.key_file: {garbage}: not the"),
    ]
    for name, (_, base) in CONNECTORS.items():
        for tls, problem in cases:
            sink = SinkConfig(type=name, options={**base, "tls": tls})
            with pytest.raises(ConfigError) as info:
                Registry().build(sink, 0)
            assert len(info.value.problems) == 1 and info.value.problems[0].startswith(problem), (name, info.value.problems)
        good = {"ca_file": str(certs.ca), "cert_file": str(certs.client_cert), "key_file": str(certs.client_key)}
        Registry().build(SinkConfig(type=name, options={**base, "tls": good}), 0)

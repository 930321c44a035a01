"""The Kafka sink's options and their mapping to aiokafka, without a broker."""

from __future__ import annotations

from typing import Any

import pytest
from aiokafka import errors as kafka_errors

from bridge.config import SinkConfig, convert_options
from bridge.connector import Registry
from bridge.errors import ConfigError, NotConnected, Retriable, StreamRefused
from bridge.records import Stream
from connectors._aiokafka_internals import InvalidRecordError
from connectors.kafka import KafkaConnector, KafkaOptions, client_settings, producer_settings, ssl_context

SECRET = "s3cr3t-Pa55w0rd-never-logged"


def options(**values: Any) -> KafkaOptions:
    return convert_options({"bootstrap_servers": "k1:9092", **values}, KafkaOptions, "sinks[0]")


def test_defaults_map_to_an_idempotent_acks_all_producer() -> None:
    settings = producer_settings(options(), "kafka-main")
    assert settings == {
        "bootstrap_servers": ["k1:9092"],
        "client_id": "kv-event-bridge-kafka-main",
        "request_timeout_ms": 10000,
        "security_protocol": "PLAINTEXT",
        "acks": "all",
        "enable_idempotence": True,
        "compression_type": None,
        "linger_ms": 0,
        "max_batch_size": 2**20,
        "max_request_size": 2**20,
    }
    assert ssl_context(options()) is None


def test_sasl_ssl_scram_maps_to_aiokafka_arguments() -> None:
    opts = options(
        bootstrap_servers=["k1:9093", "k2:9093, k3:9093"],
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="bridge",
        sasl_password=SECRET,
        tls={"check_hostname": False},
        client_id="kvb",
        compression="gzip",
        linger_ms=5,
        max_batch_bytes="512KiB",
        request_timeout="2.5s",
    )
    settings = producer_settings(opts, "kafka-main")
    assert settings["bootstrap_servers"] == ["k1:9093", "k2:9093", "k3:9093"]
    assert settings["security_protocol"] == "SASL_SSL"
    assert settings["sasl_mechanism"] == "SCRAM-SHA-512"
    assert settings["sasl_plain_username"] == "bridge"
    assert settings["sasl_plain_password"] == SECRET
    assert (settings["client_id"], settings["compression_type"], settings["linger_ms"]) == ("kvb", "gzip", 5)
    assert (settings["max_batch_size"], settings["request_timeout_ms"]) == (512 * 1024, 2500)
    assert client_settings(opts, "x")["sasl_plain_password"] == SECRET  # the admin client too
    context = ssl_context(opts)
    assert context is not None and context.check_hostname is False


def test_ssl_maps_tls_files_and_hostname_check(tmp_path: Any) -> None:
    opts = options(security_protocol="SSL")
    context = ssl_context(opts)
    assert context is not None and context.check_hostname is True
    assert "sasl_mechanism" not in producer_settings(opts, "k")
    missing = options(security_protocol="SSL", tls={"ca_file": str(tmp_path / "nope.pem")})
    with pytest.raises(FileNotFoundError):
        ssl_context(missing)


async def test_missing_tls_file_is_not_connected_without_network(tmp_path: Any) -> None:
    connector = KafkaConnector(
        "kafka-main",
        options(security_protocol="SSL", tls={"ca_file": str(tmp_path / "ca.pem")}),
        SinkConfig(type="kafka"),
    )
    with pytest.raises(NotConnected, match=r"sinks\[kafka-main\]: TLS setup failed"):
        await connector.connect()
    assert "TLS setup failed" in (await connector.health() or "")
    await connector.close()


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ({"security_protocol": "SASL_SSL", "sasl_username": "u"}, "sasl_username and sasl_password are required"),
        ({"sasl_username": "u", "sasl_password": "p"}, "security_protocol is PLAINTEXT"),
        ({"acks": 1}, 'acks must be "all" while enable_idempotence is true'),
        # (breaker31k: with acks 0 every send resolves to None, the first batch was announced lost
        # though stored, and the sink stopped for ever, after "config ok")
        ({"acks": 0, "enable_idempotence": False}, "acks: 0 is not supported"),
        ({"tls": {"ca_file": "/ca.pem"}}, "tls is set but security_protocol is PLAINTEXT"),
        ({"security_protocol": "SSL", "tls": {"key_file": "/k.pem"}}, "tls.key_file needs tls.cert_file"),
        ({"bootstrap_servers": " , "}, "bootstrap_servers: at least one host:port"),
        ({"request_timeout": "0s"}, "request_timeout must be positive"),
        ({"sasl_mechanism": "GSSAPI"}, "sasl_mechanism"),
        ({"topics": "x"}, "sinks[0].topics: unknown key (did you mean topic?)"),
        ({"partition": -1}, "sinks[0].partition"),
        (
            {"partition": 3, "create_topics": {"enabled": True, "partitions": 2}},
            "partition: 3 does not exist in a topic create_topics makes (create_topics.partitions: 2, numbered from 0); "
            "set create_topics.partitions to at least 4, or a lower partition",
        ),
        # (breaker57 B3: the key is the stream, so a compacted events topic keeps each stream's
        # last message only, and deleted 69 of 75 acknowledged seqs unannounced)
        (
            {"create_topics": {"configs": {"cleanup.policy": "compact"}}},
            "create_topics.configs: cleanup.policy 'compact' would log-compact the events topics it creates",
        ),
        ({"create_topics": {"configs": {"cleanup.policy": "delete, Compact"}}}, "remove it or use delete"),
    ],
)
def test_config_problems_are_reported_with_their_path(values: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        options(**values)
    assert problem in str(info.value)
    assert str(info.value).startswith("sinks[0]")


def test_acks_1_allowed_without_idempotence() -> None:
    assert producer_settings(options(acks=1, enable_idempotence=False), "k")["acks"] == 1


def test_compression_without_its_library_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import connectors.kafka

    monkeypatch.setitem(connectors.kafka._CODECS, "zstd", lambda: False)  # as if cramjam were not installed
    with pytest.raises(ConfigError, match=r"compression zstd needs the cramjam package \(pip install cramjam\)"):
        options(compression="zstd")


def test_bad_topic_names_are_config_errors() -> None:
    sink = SinkConfig(type="kafka", name="kafka-main", options={"bootstrap_servers": "k:9092", "topic": "a topic"})
    with pytest.raises(ConfigError, match=r"sinks\[kafka-main\]\.topic: 'a topic' is not a valid Kafka topic name"):
        Registry({"kafka": KafkaConnector}, entry_points=False).build(sink, 0)
    sink.options["topic"] = "kv.{source"
    with pytest.raises(ConfigError):
        Registry({"kafka": KafkaConnector}, entry_points=False).build(sink, 0)


def test_secrets_never_in_repr_or_config_errors() -> None:
    opts = options(security_protocol="SASL_SSL", sasl_username="bridge", sasl_password=SECRET)
    connector = KafkaConnector("kafka-main", opts, SinkConfig(type="kafka"))
    assert SECRET not in repr(opts) and SECRET not in str(opts) and SECRET not in repr(connector)
    assert "sasl_password=Secret('***')" in repr(opts)
    with pytest.raises(ConfigError) as info:
        options(security_protocol="SASL_SSL", sasl_password=SECRET)  # no user: invalid
    assert SECRET not in str(info.value)


def test_a_broker_that_refuses_everything_is_transient_a_refused_record_is_not() -> None:
    # aiokafka raises UnknownError for -1 (UNKNOWN_SERVER_ERROR) and for codes it does not know;
    # 87 (INVALID_RECORD, a record's own fault) is registered apart.
    assert kafka_errors.for_code(87) is InvalidRecordError and issubclass(InvalidRecordError, kafka_errors.UnknownError)
    connector = KafkaConnector("k", options(), SinkConfig(type="kafka", name="k"))
    refusals = (
        kafka_errors.UnknownError(),
        kafka_errors.InvalidTimestampError(),
        kafka_errors.UnsupportedForMessageFormatError(),
    )
    for exc in refusals:
        error = connector._error(exc, "t")
        assert isinstance(error, Retriable) and error.reason == "broker_refuses", exc
        assert connector._denied is not None and "'t'" in connector._denied
    assert connector._error(InvalidRecordError(), "t") is None  # the records' own fault (_refused_batch)
    assert connector._error(kafka_errors.MessageSizeTooLargeError(), "t") is None


async def test_an_events_topic_that_is_the_state_topic_or_collides_with_one_is_refused_for_its_stream() -> None:
    """breaker93 B1/B2: a topic template rendering the sink's compacted state topic (events there
    were deleted by compaction, /readyz 200, 4 of 4), or two topics that differ only by '.' and
    '_' (Kafka refuses the second: neither stream was delivered, the sink never ready, 3 of 3),
    passed --check. The configured streams are refused by the config check; one found at run
    time (discovery) is refused for itself, and the sink's other streams go on."""
    state = {"enabled": True, "topic": "kv.b"}
    conn = KafkaConnector("k", options(topic="kv.{source}", state=state), SinkConfig(type="kafka", name="k"))
    streams = [Stream("llama.a", 0), Stream("llama_a", 0), Stream("b", 0), Stream("c", 0)]
    assert conn.conflicts(streams) == [
        "the topic template 'kv.{source}' renders 'kv.b', the sink's state topic, which is compacted and would delete "
        "events; change topic or state.topic",
        "topics 'kv.llama.a' and 'kv.llama_a' differ only by '.' and '_', which Kafka refuses as colliding names: "
        "rename one of the two sources, or change the topic template",
    ]
    assert conn.conflicts([Stream("llama.a", 0), Stream("c", 0)]) == []
    conn._partitions["kv.llama.a"] = [0]  # (a topic this run writes)
    for topic, names in (("kv.llama_a", "'kv.llama.a' and 'kv.llama_a'"), ("kv.b", "renders 'kv.b'"), ("kv_b", "'kv_b'")):
        refused = await conn._check_topic(None, topic)
        assert isinstance(refused, StreamRefused) and refused.reason == "topic_clash" and names in str(refused), refused

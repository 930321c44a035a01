"""What a user meets on a mistake: every command, on broken configs and bad invocations, ends with
one line per problem naming the thing and the fix, the documented exit code, and never a traceback;
``--check`` creates no file (issue 30)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.js.errors
import pytest
import redis.asyncio as aioredis
import zmq
from aiokafka.admin import AIOKafkaAdminClient

from bridge.simulator import Simulator, SimulatorOptions
from tests.infra.servers import KafkaServer, NatsServer, RedisServer
from tests.support.harness import free_ports
from tests.support.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

SOURCE = "sources:\n  - {name: a, endpoint: 'tcp://127.0.0.1:5557'}\n"
FILE_SINK = "sinks:\n  - {type: file, path: '{tmp}/out/o.jsonl'}\n"
OFFLINE = ["--config", "{cfg}", "--check", "--offline"]
CHECK = ["--config", "{cfg}", "--check"]
RUN = ["--config", "{cfg}"]


@dataclass
class Case:
    id: str
    args: list[str]
    exit: int
    lines: list[str]  # each appears in exactly one line of stderr (the problem and its fix)
    config: str | None = None
    env: dict[str, str] = field(default_factory=dict)


CASES = [
    # -- sources and listen addresses: refused at config time, with the fix
    Case("endpoint-without-transport", OFFLINE, 2,
         ["sources[0].endpoint: 'vllm-host:5557' has no transport: write tcp://vllm-host:5557"],
         "sources:\n  - {name: a, endpoint: 'vllm-host:5557'}\n" + FILE_SINK),
    Case("endpoint-without-port", OFFLINE, 2, ["sources[0].endpoint: 'tcp://vllm-host' has no port: write tcp://vllm-host:PORT"],
         "sources:\n  - {name: a, endpoint: 'tcp://vllm-host'}\n" + FILE_SINK),
    Case("endpoint-without-host", OFFLINE, 2, ["sources[0].endpoint: 'tcp://:5557' has no host: write tcp://HOST:5557"],
         "sources:\n  - {name: a, endpoint: 'tcp://:5557'}\n" + FILE_SINK),
    # Three addresses of one config that the run could not all bind: refused before anything runs.
    Case("check-bind-port-twice-wildcard-and-loopback", OFFLINE, 2,
         ["sources[1].endpoint: rank 0 uses live port {dead} on 127.0.0.1, which overlaps the live port {dead} of "
          "sources[0] (a); a port can be bound once"],
         "sources:\n  - {name: a, endpoint: 'tcp://*:{dead}', bind: true}\n"
         "  - {name: b, endpoint: 'tcp://127.0.0.1:{dead}', bind: true}\n" + FILE_SINK),
    Case("check-bind-port-is-the-metrics-port", OFFLINE, 2,
         ["sources[0].endpoint: rank 0 uses live port {dead} on 127.0.0.1, which overlaps metrics.listen "
          "(127.0.0.1:{dead}); a port can be bound once"],
         "sources:\n  - {name: a, endpoint: 'tcp://127.0.0.1:{dead}', bind: true}\n" + FILE_SINK
         + "metrics: {listen: '127.0.0.1:{dead}'}\n"),
    Case("replay-endpoint-without-transport", OFFLINE, 2,
         ["sources[0].replay_endpoint: 'vllm-host:5558' has no transport: write tcp://vllm-host:5558"],
         "sources:\n  - {name: a, endpoint: 'tcp://h:5557', replay_endpoint: 'vllm-host:5558'}\n" + FILE_SINK),
    Case("endpoint-unknown-transport", OFFLINE, 2, ["transport udp:// is not supported; use tcp://HOST:PORT"],
         "sources:\n  - {name: a, endpoint: 'udp://h:5557'}\n" + FILE_SINK),
    Case("metrics-listen-without-port", OFFLINE, 2,
         ["metrics.listen: 'localhost' is not host:port; give e.g. 0.0.0.0:9300"],
         SOURCE + FILE_SINK + "metrics: {listen: localhost}\n"),
    Case("metrics-listen-port-out-of-range", OFFLINE, 2, ["metrics.listen: '0.0.0.0:99999' is not host:port"],
         SOURCE + FILE_SINK + "metrics: {listen: '0.0.0.0:99999'}\n"),
    # -- bounds worded as bounds
    Case("dp-ranks-zero", OFFLINE, 2, ["sources[0].dp_ranks: must be at least 1, got 0"],
         "sources:\n  - {name: a, endpoint: 'tcp://h:5557', dp_ranks: 0}\n" + FILE_SINK),
    Case("retry-multiplier-below-1", OFFLINE, 2, ["sinks[0].retry.multiplier: must be at least 1, got 0.5"],
         SOURCE + "sinks:\n  - {type: file, path: '-', retry: {multiplier: 0.5}}\n"),
    Case("section-given-a-scalar", OFFLINE, 2, ["sinks[0].create_topics: expected a mapping, got true"],
         SOURCE + "sinks:\n  - {type: kafka, bootstrap_servers: 'k:9092', create_topics: true}\n"),
    Case("top-section-given-a-scalar", OFFLINE, 2, ["checkpoint: expected a mapping, got true"],
         SOURCE + FILE_SINK + "checkpoint: true\n"),
    # -- values that make the bridge do nothing or drop its bounds
    Case("write-timeout-zero", OFFLINE, 2, ["sinks[0].retry.write_timeout: must be greater than 0, got 0 (give a duration"],
         SOURCE + "sinks:\n  - {type: file, path: '-', retry: {write_timeout: 0}}\n"),
    Case("replay-timeout-zero", OFFLINE, 2, ["replay.timeout: must be greater than 0, got \"0s\""],
         SOURCE + FILE_SINK + "replay: {timeout: 0s}\n"),
    Case("checkpoint-interval-zero", OFFLINE, 2, ["checkpoint.interval: must be greater than 0, got 0"],
         SOURCE + FILE_SINK + "checkpoint: {interval: 0}\n"),
    Case("receive-hwm-zero", OFFLINE, 2, ["ingest.receive_hwm: must be at least 1, got 0"],
         SOURCE + FILE_SINK + "ingest: {receive_hwm: 0}\n"),
    Case("max-frame-bytes-zero", OFFLINE, 2, ["ingest.max_frame_bytes: must be at least 1 byte, got 0"],
         SOURCE + FILE_SINK + "ingest: {max_frame_bytes: 0}\n"),
    Case("queue-bytes-zero", OFFLINE, 2, ["sinks[0].queue.max_bytes: must be at least 1 byte, got 0"],
         SOURCE + "sinks:\n  - {type: file, path: '-', queue: {max_bytes: 0}}\n"),
    Case("shutdown-timeout-zero", OFFLINE, 2, ["shutdown_timeout: must be greater than 0, got 0"],
         SOURCE + FILE_SINK + "shutdown_timeout: 0\n"),
    Case("backoff-initial-above-max", OFFLINE, 2,
         ["sinks[0].retry.initial_backoff: 20s is above max_backoff 1s: the first pause would already be the longest; "
          "lower initial_backoff or raise max_backoff"],
         SOURCE + "sinks:\n  - {type: file, path: '-', retry: {initial_backoff: 20s, max_backoff: 1s}}\n"),
    Case("replay-backoff-initial-above-max", OFFLINE, 2, ["replay.initial_backoff: 9s is above max_backoff 5s"],
         SOURCE + FILE_SINK + "replay: {initial_backoff: 9s}\n"),
    Case("discovery-interval-zero", OFFLINE, 2, ["discovery.dns.interval: must be greater than 0"],
         "discovery: {dns: {name: vllm.ns.svc.cluster.local, interval: 0}}\n" + FILE_SINK),
    # -- templates and documented refusals, on every sink type
    Case("kafka-placeholder-typo", OFFLINE, 2,
         ["sinks[kafka].topic: unknown placeholder {sorce} in 'kv.{sorce}'", "did you mean {source}?"],
         SOURCE + "sinks:\n  - {type: kafka, bootstrap_servers: 'k:9092', topic: 'kv.{sorce}'}\n"),
    Case("nats-placeholder-typo", OFFLINE, 2, ["sinks[0].subject: unknown placeholder {rank}"],
         SOURCE + "sinks:\n  - {type: nats, subject: 'kv.{source}.{rank}'}\n"),
    Case("redis-placeholder-typo", OFFLINE, 2, ["sinks[0].stream: unknown placeholder {modle}", "known: {source}"],
         "sources:\n  - {name: a, endpoint: 'tcp://h:5557', labels: {model: m}}\n"
         "sinks:\n  - {type: redis, url: 'redis://r:6379', stream: 'kv:{modle}:{source}:{dp_rank}'}\n"),
    # breaker93 B3: one key needed as a stream and a set (or hash): "config ok", then WRONGTYPE on every write;
    # breaker95 B3: the same through a label.
    Case("redis-index-key-is-the-stream-key", OFFLINE, 2,
         ["sinks[0].index.key: 'kv:{source}:{dp_rank}' is the stream template too",
          "give it a key of its own, e.g. index.key: 'kv:{source}:{dp_rank}:blocks'"],
         SOURCE + "sinks:\n  - {type: redis, url: 'redis://r:6379', index: {enabled: true, key: 'kv:{source}:{dp_rank}'}}\n"),
    # breaker101 B1: the stream key is the index's counts hash: "config ok", then WRONGTYPE, nothing stored;
    # across two sinks the same.
    Case("redis-stream-key-is-the-index-counts-hash", OFFLINE, 2,
         ["sinks[0].index.key: 'kv:{source}:{dp_rank}' keeps its counts in 'kv:{source}:{dp_rank}:counts', the stream "
          "template"],
         SOURCE + "sinks:\n  - {type: redis, url: 'redis://r:6379', stream: 'kv:{source}:{dp_rank}:counts', "
         "index: {enabled: true, key: 'kv:{source}:{dp_rank}'}}\n"),
    Case("redis-stream-key-is-another-sinks-index-counts-hash", OFFLINE, 2,
         ["sinks[1] (r2): writes key 'kv:{source}:{dp_rank}:counts' on r:6379/0, as sinks[0] (r1) does"],
         SOURCE + "sinks:\n  - {type: redis, name: r1, url: 'redis://r:6379', stream: 'ev:{source}:{dp_rank}', "
         "index: {enabled: true, key: 'kv:{source}:{dp_rank}'}}\n"
         "  - {type: redis, name: r2, url: 'redis://r:6379', stream: 'kv:{source}:{dp_rank}:counts'}\n"),
    Case("redis-state-key-is-a-stream-key-through-a-label", OFFLINE, 2,
         ["sinks[0] (r): state.key and stream both name key 'kv:a:0': one key holds one type"],
         "sources:\n  - {name: a, endpoint: 'tcp://h:1', labels: {ns: kv}}\n"
         "sinks:\n  - {type: redis, name: r, url: 'redis://r:6379', stream: '{labels.ns}:{source}:{dp_rank}', "
         "state: {enabled: true, key: 'kv:{source}:{dp_rank}'}}\n"),
    Case("nats-state-with-type-in-subject", OFFLINE, 2,
         ["sinks[0].subject: {type} not allowed with state.enabled", "remove it, or turn state off"],
         SOURCE + "sinks:\n  - {type: nats, subject: 'kv.{source}.{dp_rank}.{type}', state: {enabled: true}}\n"),
    # breaker93 B6: every write waited a 60 s linger and was cut at write_timeout: "config ok", nothing ever stored.
    Case("kafka-linger-over-the-write-timeout", OFFLINE, 2,
         ["sinks[kafka].linger_ms: 60000 ms is over half of retry.write_timeout (30s)", "lower linger_ms"],
         SOURCE + "sinks:\n  - {type: kafka, bootstrap_servers: 'k:9092', linger_ms: 60000}\n"),
    # breaker93 B1/B2: events in the compacted state topic; two topics Kafka takes for one ("config ok" both).
    Case("kafka-topics-that-clash", OFFLINE, 2,
         ["sinks[0] (k): the topic template 'kv.{source}' renders 'kv.b', the sink's state topic",
          "sinks[0] (k): topics 'kv.a.x' and 'kv.a_x' differ only by '.' and '_'"],
         "sources:\n  - {name: a.x, endpoint: 'tcp://h:1'}\n  - {name: a_x, endpoint: 'tcp://h:2'}\n"
         "  - {name: b, endpoint: 'tcp://h:3'}\n"
         "sinks:\n  - {type: kafka, name: k, bootstrap_servers: 'k:9092', topic: 'kv.{source}', "
         "state: {enabled: true, topic: kv.b}}\n"),
    # breaker93 B5: the run created the topic, then refused it for its timestamp window: "config ok", never ready.
    Case("kafka-created-topics-refuse-the-records", OFFLINE, 2,
         ["sinks[0].create_topics.configs: message.timestamp.before.max.ms 1000 would make the topics it creates refuse "
          "the sink's records", "use 60000 or more"],
         SOURCE + "sinks:\n  - {type: kafka, bootstrap_servers: 'k:9092', create_topics: {enabled: true, "
         "configs: {message.timestamp.before.max.ms: '1000'}}}\n"),
    # breaker97 B4: a linger the write timeout allows, a window over request_timeout: "config ok", 0 records
    # stored in 160 s, and /readyz blamed the clock. A record waits its linger after it is stamped.
    Case("kafka-created-topics-refuse-lingering-records", OFFLINE, 2,
         ["sinks[0].create_topics.configs: message.timestamp.before.max.ms 60000 would make the topics it creates "
          "refuse the sink's records", "then may wait linger_ms", "use 80000 or more"],
         SOURCE + "sinks:\n  - {type: kafka, bootstrap_servers: 'k:9092', linger_ms: 70000, retry: {write_timeout: 150s}, "
         "create_topics: {enabled: true, configs: {message.timestamp.before.max.ms: '60000'}}}\n"),
    Case("kafka-state-with-drop", OFFLINE, 2,
         ["sinks[0].state.enabled: needs backpressure: block", "set backpressure: block or turn state off"],
         SOURCE + "sinks:\n  - {type: kafka, bootstrap_servers: 'k:9092', backpressure: drop, state: {enabled: true}}\n"),
    # -- every problem in one pass: sink-level problems beside others, each once
    Case("sink-problem-beside-others", OFFLINE, 2,
         ["sources[0].dp_ranks: must be at least 1, got 0", "sinks[0].state.enabled: needs backpressure: block",
          "sinks[1].subject: {type} not allowed with state.enabled", "nope: unknown key"],
         "sources:\n  - {name: a, endpoint: 'tcp://h:5557', dp_ranks: 0}\nnope: 1\n"
         "sinks:\n  - {type: kafka, name: kafka-main, bootstrap_servers: 'k:9092', backpressure: drop, "
         "state: {enabled: true}}\n  - {type: nats, subject: 'kv.{source}.{dp_rank}.{type}', state: {enabled: true}}\n"),
    Case("unknown-sink-type", OFFLINE, 2, ["sinks[0].type: unknown sink type 'kafak'; known: "],
         SOURCE + "sinks:\n  - {type: kafak}\n"),
    Case("missing-env-variable", OFFLINE, 2, ["sinks[0].path: environment variable KVB_TEST_UNSET is not set (or give"],
         SOURCE + "sinks:\n  - {type: file, path: '${KVB_TEST_UNSET}'}\n"),
    Case("sinks-not-a-list", OFFLINE, 2, ["sinks: expected a list, got dict"], SOURCE + "sinks: {type: file}\n"),
    Case("top-level-a-list", OFFLINE, 2, ["top level: expected a mapping (sources:, sinks:, ...), got a list"], "- a\n- b\n"),
    Case("yaml-syntax-error", OFFLINE, 2, ["cannot parse the file: line 2, column 1: expected the node content"], "sources: [\n"),
    Case("duplicate-source-name", OFFLINE, 2, ["sources[1].name: 'a' is already used by sources[0]"],
         "sources:\n  - {name: a, endpoint: 'tcp://h:5557'}\n  - {name: a, endpoint: 'tcp://g:5557'}\n" + FILE_SINK),
    Case("config-file-missing", ["--config", "{tmp}/nope.yaml", "--check", "--offline"], 2,
         ["nope.yaml: cannot read the config file (No such file or directory)"]),
    Case("config-file-type", ["--config", "{tmp}/c.ini", "--check"], 2, ["unknown config file type '.ini': use .yaml"]),
    # -- a local file the sink needs (TLS, credentials) missing or not what it should hold: a config
    # problem naming its key, offline, online and at a run's start alike (breaker46 B1: online it was
    # "reachable, not usable as configured" where nothing listens, Redis "unreachable", offline ok)
    Case("tls-ca-file-missing-offline", OFFLINE, 2,
         ["sinks[0].tls.ca_file: {tmp}/missing.pem: no such file (give the path of a PEM file the bridge can read)"],
         SOURCE + "sinks:\n  - {type: kafka, bootstrap_servers: '127.0.0.1:{dead}', security_protocol: SSL, "
         "tls: {ca_file: '{tmp}/missing.pem'}}\n"),
    Case("tls-ca-file-not-pem", CHECK, 2,
         ["sinks[0].tls.ca_file: {tmp}/garbage.pem: holds no PEM certificate (", "give the PEM bundle of the CA"],
         SOURCE + "sinks:\n  - {type: nats, servers: 'tls://127.0.0.1:{dead}', tls: {ca_file: '{tmp}/garbage.pem'}}\n"),
    Case("nats-credentials-missing", CHECK, 2,
         ["sinks[0].credentials: {tmp}/missing.creds: no such file (give the path of a .creds file the bridge can read)"],
         SOURCE + "sinks:\n  - {type: nats, servers: 'nats://127.0.0.1:{dead}', credentials: '{tmp}/missing.creds'}\n"),
    Case("nats-credentials-not-creds", CHECK, 2,
         ["sinks[0].credentials: {tmp}/garbage.pem: holds no user JWT"],
         SOURCE + "sinks:\n  - {type: nats, servers: 'nats://127.0.0.1:{dead}', credentials: '{tmp}/garbage.pem'}\n"),
    Case("run-tls-ca-file-missing", RUN, 2, ["sinks[0].tls.ca_file: {tmp}/missing.pem: no such file"],
         SOURCE + "sinks:\n  - {type: redis, url: 'rediss://127.0.0.1:{dead}/0', tls: {ca_file: '{tmp}/missing.pem'}}\n"),
    # -- valid, with a warning: a secret written in plain text
    Case("plain-text-secret", OFFLINE, 0,
         ["warning: sinks[0].password: this secret is written in plain text in the config file: give it as ${VAR} "
          "from the environment (the chart: secretEnv)"],
         SOURCE + "sinks:\n  - {type: nats, user: u, password: hunter2}\n"),
    Case("plain-text-url-password", OFFLINE, 0, ["warning: sinks[0].url: the password in this URL is written in plain text"],
         SOURCE + "sinks:\n  - {type: redis, url: 'redis://:hunter2@r:6379/0'}\n"),
    # -- valid, with a warning: a field name close to a known one (ignored: records with only type)
    Case("fields-keep-typo", OFFLINE, 0,
         ["warning: sinks[0].fields.keep[0]: no event has a field 'block_hashs' (did you mean 'block_hashes'?): it is ignored",
          "warning: sinks[0].fields.by_type.BlockRemoved.drop[0]: no event has a field 'mediun' (did you mean 'medium'?)"],
         SOURCE + "sinks:\n  - {type: file, path: '{tmp}/o', fields: {keep: [block_hashs, new_field], "
         "by_type: {BlockRemoved: {drop: [mediun]}}}}\n"),
    # -- valid, but something unreachable or unwritable: 3, and nothing created
    Case("file-sink-unwritable", CHECK, 3, ["sinks[file].path: cannot create {tmp}/plain/o: {tmp}/plain is not a directory"],
         SOURCE + "sinks:\n  - {type: file, path: '{tmp}/plain/o'}\n"),
    Case("dead-letter-unwritable", CHECK, 3, ["dead_letter.path: cannot create {tmp}/plain/dl: {tmp}/plain is not a directory"],
         SOURCE + FILE_SINK + "dead_letter: {path: '{tmp}/plain/dl'}\ncheckpoint: {path: '{tmp}/ck/ck.json'}\n"),
    Case("discovery-finds-nothing", CHECK, 3,
         ["discovery.dns.name: no-such-service.invalid finds no engine (", "check the Service name and namespace"],
         "discovery: {dns: {name: no-such-service.invalid, timeout: 2s}}\n" + FILE_SINK),
    Case("redis-unreachable", CHECK, 3, ["(is the server up and reachable from here? --offline skips this step)"],
         SOURCE + "sinks:\n  - {type: redis, url: 'redis://127.0.0.1:{dead}/0', timeout: 2s}\n"),
    # An address the bridge listens on that another process holds now: a warning (that process may
    # be this bridge, running with this config); one not on this host: a problem.
    Case("check-bind-port-in-use", CHECK, 0,
         ["warning: sources[0].endpoint: cannot bind tcp://127.0.0.1:{busy} (Address already in use); another process "
          "holds the port: stop it, or choose another address, or set bind: false", "nothing to fix if it is this bridge"],
         "sources:\n  - {name: a, endpoint: 'tcp://127.0.0.1:{busy}', bind: true}\n" + FILE_SINK),
    Case("check-bind-address-not-here", CHECK, 3,
         ["sources[0].endpoint: cannot bind tcp://10.255.255.1:{dead} (Cannot assign requested address); the address "
          "is not this host's"],
         "sources:\n  - {name: a, endpoint: 'tcp://10.255.255.1:{dead}', bind: true}\n" + FILE_SINK),
    Case("check-metrics-port-in-use", CHECK, 0, ["warning: metrics.listen: cannot listen on 127.0.0.1:{busy}"],
         "sources:\n  - {name: a, endpoint: 'tcp://127.0.0.1:{dead}', bind: true}\n" + FILE_SINK
         + "metrics: {listen: '127.0.0.1:{busy}'}\n"),
    # A checkpoint the bridge would not read (a later release's, after a roll back): a warning.
    Case("check-checkpoint-of-a-later-release", CHECK, 0,
         ["warning: checkpoint.path: checkpoint {tmp}/later.json: written by a later release (format version 99; this "
          "release reads version 1 and earlier); run that release again, or move the file away to start afresh (the "
          "bridge would start every stream afresh)"],
         "sources:\n  - {name: a, endpoint: 'tcp://127.0.0.1:{dead}', bind: true}\n" + FILE_SINK
         + "checkpoint: {path: '{tmp}/later.json'}\n"),
    # -- run: the same validation at start, and start-up failures in one line
    Case("run-bind-port-in-use", RUN, 1,
         ["sources[0].endpoint: cannot bind tcp://127.0.0.1:{busy} (Address already in use); another process holds the port"],
         "sources:\n  - {name: a, endpoint: 'tcp://127.0.0.1:{busy}', bind: true}\n" + FILE_SINK),
    Case("run-invalid-config", RUN, 2, ["sources[0].endpoint: 'vllm-host:5557' has no transport"],
         "sources:\n  - {name: a, endpoint: 'vllm-host:5557'}\n" + FILE_SINK),
    Case("run-placeholder-typo", RUN, 2, ["unknown placeholder {sorce}"],
         SOURCE + "sinks:\n  - {type: nats, subject: 'kv.{sorce}.{dp_rank}'}\n"),
    Case("run-metrics-port-in-use", RUN, 1,
         ["metrics.listen: cannot listen on 127.0.0.1:{busy}", "another process holds the port: stop it, or choose another "
          "host:port in metrics.listen"],
         SOURCE + FILE_SINK + "metrics: {listen: '127.0.0.1:{busy}'}\n"),
    Case("run-checkpoint-unwritable", RUN, 1,
         ["cannot start: checkpoint.path: cannot create {tmp}/plain/ck.json: {tmp}/plain is not a directory; give a path"],
         SOURCE + FILE_SINK + "checkpoint: {path: '{tmp}/plain/ck.json'}\n"),
    Case("no-config", [], 2, ["--config FILE is required"]),
    # -- the other commands
    Case("tail-endpoint-without-transport", ["tail", "vllm-host:5557"], 2,
         ["tail: endpoint: 'vllm-host:5557' has no transport: write tcp://vllm-host:5557"]),
    Case("tail-from-seq-without-replay", ["tail", "tcp://127.0.0.1:{dead}", "--from-seq", "0"], 2,
         ["--from-seq needs --replay-endpoint"]),
    Case("tail-bind-port-in-use", ["tail", "tcp://127.0.0.1:{busy}", "--bind"], 1,
         ["tail: cannot bind tcp://127.0.0.1:{busy} (Address already in use", "another process holds the port"]),
    Case("tail-dp-ranks-zero", ["tail", "tcp://127.0.0.1:{dead}", "--dp-ranks", "0"], 2,
         ["--dp-ranks: expected a whole number of at least 1, got 0"]),
    Case("simulate-port-in-use", ["simulate", "--endpoint", "tcp://127.0.0.1:{busy}", "--replay-endpoint", ""], 1,
         ["cannot bind the PUB socket to tcp://127.0.0.1:{busy} (Address already in use", "choose another port"]),
    Case("simulate-endpoint-without-transport", ["simulate", "--endpoint", "127.0.0.1:5557"], 2,
         ["simulate: --endpoint: '127.0.0.1:5557' has no transport: write tcp://127.0.0.1:5557"]),
    Case("simulate-ranks-zero", ["simulate", "--ranks", "0"], 2, ["--ranks: expected a whole number of at least 1, got 0"]),
    Case("simulate-drop-rate", ["simulate", "--drop-rate", "2"], 2, ["--drop-rate: expected a fraction from 0 to 1, got 2"]),
    Case("demo-metrics-without-port", ["demo", "--metrics", "localhost"], 2,
         ["demo: --metrics: 'localhost' is not host:port"]),
    Case("demo-metrics-port-in-use", ["demo", "--metrics", "127.0.0.1:{busy}", "--duration", "5"], 1,
         ["cannot listen on 127.0.0.1:{busy}", "choose another host:port with --metrics"]),
    Case("schema-check-missing-file", ["schema", "--check", "{tmp}/nope.json"], 1, ["nope.json: No such file or directory"]),
]  # fmt: skip


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


async def check_config(tmp_path: Path, config: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """``python -m bridge --config FILE --check`` on ``config``, as a user runs it."""
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(config))
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "bridge", "--config", str(path), "--check"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_a_mistake_ends_in_one_line_per_problem(case: Case, tmp_path: Path, busy_port: int) -> None:
    (tmp_path / "plain").write_text("a file, not a directory\n")
    (tmp_path / "later.json").write_text('{"version": 99, "streams": {}}')
    (tmp_path / "garbage.pem").write_text("not a certificate\n")
    values = {"tmp": str(tmp_path), "busy": str(busy_port), "dead": str(free_ports(1)[0]), "cfg": str(tmp_path / "c.yaml")}

    def fill(text: str) -> str:
        for key, value in values.items():
            text = text.replace("{" + key + "}", value)
        return text

    if case.config is not None:
        (tmp_path / "c.yaml").write_text(fill(case.config))
    (tmp_path / "c.ini").write_text("[x]\n")
    before = _files(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "KVB_TRACEBACK"}
    proc = subprocess.run(
        [sys.executable, "-m", "bridge", *[fill(a) for a in case.args]],
        cwd=ROOT, env={**env, **case.env}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    out, err = proc.stdout, proc.stderr
    assert "Traceback" not in out + err, err
    assert proc.returncode == case.exit, f"exit {proc.returncode}\n{out}\n{err}"
    lines = err.splitlines()
    for expected in map(fill, case.lines):
        holding = [ln for ln in lines if expected in ln]
        assert len(holding) == 1, f"{expected!r} in {len(holding)} lines of:\n{err}"
    problems = [ln for ln in lines if ln.startswith("  ")]
    assert len(problems) == len(set(problems)), f"a problem told twice:\n{err}"  # each once
    for ln in lines:
        if ln.endswith("problem(s)"):  # the count is the number of lines that follow
            assert ln.split()[-2].isdigit() and int(ln.split()[-2]) == len(problems), err
    if "--check" in case.args:
        assert _files(tmp_path) == before, "--check created a file"
        assert not [ln for ln in lines if ln.startswith("  ") and ln.count(": ") < 1], err  # path: problem


def test_check_asks_each_engine_endpoint_which_socket_answers(tmp_path: Path) -> None:
    """A live endpoint on the engine's replay ROUTER (easy with dp ranks: rank r uses port + r on
    both sockets), a replay endpoint on a PUB, a name that does not resolve, a port nobody listens
    on: --check says which, with the fix, and exits 3 (valid, but not reachable as configured)."""
    ctx = zmq.Context()
    try:
        router, pub = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PUB)
        r, p = router.bind_to_random_port("tcp://127.0.0.1"), pub.bind_to_random_port("tcp://127.0.0.1")
        dead = free_ports(1)[0]
        (tmp_path / "c.yaml").write_text(
            f"sources:\n  - {{name: a, endpoint: 'tcp://127.0.0.1:{r}', replay_endpoint: 'tcp://127.0.0.1:{p}'}}\n"
            "  - {name: b, endpoint: 'tcp://no-such-host.invalid:5557'}\n"
            f"  - {{name: c, endpoint: 'tcp://127.0.0.1:{dead}'}}\n"
            # breaker78 B2: ipc:// endpoints were not asked: "config ok", and the run read nothing.
            f"  - {{name: d, endpoint: 'ipc://{tmp_path}/kv', replay_endpoint: 'ipc://{tmp_path}/replay'}}\n"
            # breaker80 B3: Linux's abstract namespace (libzmq's ipc://@name) has no file to look for.
            f"  - {{name: e, endpoint: 'ipc://@kvb-{r}'}}\n"
            "sinks:\n  - {type: file, path: '-'}\n"
        )
        router.bind(f"ipc://{tmp_path}/kv")  # (a ROUTER: the live endpoint of source d is the wrong socket)
        pub.bind(f"ipc://@kvb-{r}")  # (the PUB of source e: right)
        proc = subprocess.run(
            [sys.executable, "-m", "bridge", "--config", str(tmp_path / "c.yaml"), "--check"],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        ctx.destroy(linger=0)
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stderr
    assert "engines: 1 of 7 endpoint(s) answer as they should" in proc.stdout
    problems = [ln.strip() for ln in proc.stderr.splitlines() if ln.startswith("  ")]
    assert problems == [
        f"sources[0].endpoint: tcp://127.0.0.1:{r}: a ROUTER socket answers, not PUB or XPUB; this looks like the "
        "engine's replay port: give its PUB (kv-events endpoint) port here (with dp ranks, rank r uses port + r on "
        "both sockets)",
        f"sources[0].replay_endpoint: tcp://127.0.0.1:{p}: a PUB socket answers, not ROUTER; this looks like the "
        "engine's live PUB port: give its replay_endpoint port here",
        problems[2],
        f"sources[2].endpoint: tcp://127.0.0.1:{dead}: connection refused; is the engine running with KV events on "
        "(vLLM: --kv-events-config with enable_kv_cache_events), and is this its port?",
        f"sources[3].endpoint: ipc://{tmp_path}/kv: a ROUTER socket answers, not PUB or XPUB; this looks like the "
        "engine's replay port: give its PUB (kv-events endpoint) port here (with dp ranks, rank r uses port + r on "
        "both sockets)",
        f"sources[3].replay_endpoint: ipc://{tmp_path}/replay: no socket at {tmp_path}/replay; is the engine running "
        "on this host with this ipc path, and does the bridge see its filesystem (in Kubernetes, a volume shared "
        "with the engine's container)?",
    ]
    assert problems[2].startswith(
        "sources[1].endpoint: tcp://no-such-host.invalid:5557: cannot resolve the host 'no-such-host.invalid' ("
    )


async def test_check_creates_no_topic_stream_or_bucket(tmp_path: Path, kafka: KafkaServer, nats_server: NatsServer) -> None:
    """``--check`` is side-effect free: sinks that create what they write to at connect
    (``create_topics``, ``stream.create``, ``state.create``) are checked as the run would connect,
    and a missing topic, stream or bucket the run would create counts as fine: nothing is created."""
    tag = uuid.uuid4().hex[:8]
    topic, state_topic, stream, bucket = f"chk-{tag}", f"chk-{tag}-state", f"CHK{tag}", f"chk{tag}"
    config = {
        "sources": [{"name": "a", "endpoint": f"tcp://127.0.0.1:{free_ports(1)[0]}", "bind": True}],
        "sinks": [
            {
                "type": "kafka",
                "name": "k",
                "bootstrap_servers": kafka.bootstrap_servers,
                "topic": topic,
                "create_topics": {"enabled": True},
                "state": {"enabled": True, "topic": state_topic, "create": True},
            },
            {
                "type": "nats",
                "name": "n",
                "servers": [nats_server.url],
                "subject": f"chk{tag}.{{source}}.{{dp_rank}}",
                "stream": {"create": True, "name": stream},
                "state": {"enabled": True, "bucket": bucket, "create": True},
            },
        ],
        "checkpoint": {"path": str(tmp_path / "checkpoint.json")},
    }
    proc = await check_config(tmp_path, config)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers)
    await admin.start()
    try:
        topics = set(await admin.list_topics())
    finally:
        await admin.close()
    assert not {topic, state_topic} & topics
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        for name in (stream, f"KV_{bucket}"):
            with pytest.raises(nats.js.errors.NotFoundError):
                await js.stream_info(name)
    finally:
        await nc.close()
    assert not (tmp_path / "checkpoint.json").exists()


async def test_check_says_whether_an_engine_sends_its_publisher_uuid(tmp_path: Path) -> None:
    """--check listens briefly on each live endpoint that answered: a vLLM #57789 publisher shows
    its UUID (restarts are then certain), an older one shows none (restarts inferred)."""
    ports = free_ports(2)
    new = SimulatorOptions(endpoint=f"tcp://127.0.0.1:{ports[0]}", replay_endpoint=None, profile="vllm-pr57789-uuid", rate=20)
    old = SimulatorOptions(endpoint=f"tcp://127.0.0.1:{ports[1]}", replay_endpoint=None, rate=20)
    (tmp_path / "c.yaml").write_text(
        f"sources:\n  - {{name: new, endpoint: 'tcp://127.0.0.1:{ports[0]}'}}\n"
        f"  - {{name: old, endpoint: 'tcp://127.0.0.1:{ports[1]}'}}\n"
        "sinks:\n  - {type: file, path: '-'}\n"
    )
    async with Simulator(new) as a, Simulator(old) as b:
        runners = [asyncio.create_task(a.run()), asyncio.create_task(b.run())]
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bridge", "--config", str(tmp_path / "c.yaml"), "--check",
                cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            for r in runners:
                r.cancel()
            await asyncio.gather(*runners, return_exceptions=True)
        instance = uuid.UUID(bytes=a.ranks[0].instance)
    out = stdout.decode()
    assert proc.returncode == 0 and "Traceback" not in stderr.decode(), stderr.decode()
    assert f"engines: sources[0].endpoint: tcp://127.0.0.1:{ports[0]}: publisher UUID {instance}" in out, out
    assert f"engines: sources[1].endpoint: tcp://127.0.0.1:{ports[1]}: no publisher UUID" in out, out


async def check_while_publishing(
    tmp_path: Path, config: dict[str, Any], *engines: tuple[ScriptedEngine, bytes | None]
) -> subprocess.CompletedProcess[str]:
    """``--check`` on ``config`` while each engine publishes a batch (or these bytes) every 50 ms."""

    async def publish() -> None:
        while True:
            for engine, payload in engines:
                await engine.publish(1, payload=payload)
            await asyncio.sleep(0.05)

    publisher = asyncio.create_task(publish())
    try:
        return await check_config(tmp_path, config)
    finally:
        publisher.cancel()
        await asyncio.gather(publisher, return_exceptions=True)


@pytest.mark.parametrize(
    ("payload", "said"),
    [
        (b"\xc1 not msgpack", "an undecodable batch (bad_msgpack: "),
        (msgspec.msgpack.encode([1.0, [1, 2], 0]), "2 event(s), none of which decodes ("),
    ],
    ids=["batch", "events"],
)
async def test_check_refuses_an_engine_whose_first_batch_cannot_be_decoded(tmp_path: Path, payload: bytes, said: str) -> None:
    """Breaker30h U1: --check printed "an undecodable batch" for the engine's first message, then
    "config ok", exit 0, and the run delivered nothing. It is a problem now: exit 3, naming the
    source's endpoint and what was seen; so is a batch none of whose events decodes (breaker30h2
    B4: "0 event(s): none", exit 0)."""
    live, rep = free_ports(2)
    config = {
        "sources": [{"name": "e", "endpoint": f"tcp://127.0.0.1:{live}", "replay_endpoint": f"tcp://127.0.0.1:{rep}"}],
        "sinks": [{"type": "file", "path": str(tmp_path / "out.jsonl")}],
        "checkpoint": {"path": str(tmp_path / "checkpoint.json")},
    }
    async with ScriptedEngine(live, rep) as engine:
        proc = await check_while_publishing(tmp_path, config, (engine, payload))
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith(f"  sources[0].endpoint: tcp://127.0.0.1:{live}")]
    assert len(lines) == 1 and said in lines[0], proc.stdout + proc.stderr
    assert "config ok" not in proc.stdout.splitlines()


async def test_check_reads_past_an_idle_heartbeat_to_the_engines_first_batch(tmp_path: Path) -> None:
    """breaker83 B2: a vLLM #57789 engine sent an idle heartbeat first, then only batches the bridge
    cannot decode: --check described the heartbeat, said "config ok" (exit 0), and the run
    delivered nothing. It reads past a heartbeat to the first batch within its window."""
    live, rep = free_ports(2)
    config = {
        "sources": [{"name": "e", "endpoint": f"tcp://127.0.0.1:{live}", "replay_endpoint": f"tcp://127.0.0.1:{rep}"}],
        "sinks": [{"type": "file", "path": str(tmp_path / "out.jsonl")}],
        "checkpoint": {"path": str(tmp_path / "checkpoint.json")},
    }

    async def publish(engine: ScriptedEngine) -> None:
        while True:
            await engine.publish(1, payload=b"")  # (an idle heartbeat)
            await asyncio.sleep(0.3)
            await engine.publish(1, payload=b"\xc1 not msgpack")
            await asyncio.sleep(0.05)

    async with ScriptedEngine(live, rep, uuid=True) as engine:
        publisher = asyncio.create_task(publish(engine))
        try:
            proc = await check_config(tmp_path, config)
        finally:
            publisher.cancel()
            await asyncio.gather(publisher, return_exceptions=True)
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert "an undecodable batch (bad_msgpack: " in proc.stderr, proc.stderr
    assert "config ok" not in proc.stdout.splitlines()


async def test_check_refuses_an_engine_whose_first_message_is_over_max_frame_bytes(tmp_path: Path) -> None:
    """breaker66 B1: --check read the first message with a 64 MiB limit, printed it and said "config
    ok"; the run, with ``ingest.max_frame_bytes`` 1 KiB, read nothing (ZMQ drops the connection at
    each larger message). It is a problem now: exit 3, naming the frame's size and the limit."""
    live, rep = free_ports(2)
    config = {
        "sources": [{"name": "e", "endpoint": f"tcp://127.0.0.1:{live}", "replay_endpoint": f"tcp://127.0.0.1:{rep}"}],
        "sinks": [{"type": "file", "path": str(tmp_path / "out.jsonl")}],
        "ingest": {"max_frame_bytes": "1KiB"},
        "checkpoint": {"path": str(tmp_path / "checkpoint.json")},
    }
    # A batch that decodes: one BlockStored with 1,000 tokens.
    batch = msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, list(range(1000, 2000)), 16, None]], 0])
    async with ScriptedEngine(live, rep) as engine:
        proc = await check_while_publishing(tmp_path, config, (engine, batch))
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert f"a message with a {len(batch)}-byte frame" in proc.stderr, proc.stderr
    assert "over ingest.max_frame_bytes (1024 bytes)" in proc.stderr, proc.stderr
    assert "config ok" not in proc.stdout.splitlines()


@pytest.mark.parametrize("own", [False, True], ids=["another engine's", "its own"])
async def test_check_refuses_a_replay_endpoint_that_answers_for_another_engine(tmp_path: Path, own: bool) -> None:
    """breaker66 B2: a replay_endpoint that is another engine's passed --check; the run took that
    engine's replies for restarts of this one and delivered its batches under this stream. --check
    asks the replay socket for the seq of the live endpoint's first message: another batch there
    is a problem (exit 3); the engine's own replay socket is not."""
    live_a, rep_a, live_b, rep_b = free_ports(4)
    replay = rep_a if own else rep_b
    config = {
        "sources": [{"name": "e", "endpoint": f"tcp://127.0.0.1:{live_a}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"}],
        "sinks": [{"type": "file", "path": str(tmp_path / "out.jsonl")}],
        "checkpoint": {"path": str(tmp_path / "checkpoint.json")},
    }
    async with ScriptedEngine(live_a, rep_a) as a, ScriptedEngine(live_b, rep_b) as b:
        proc = await check_while_publishing(tmp_path, config, (a, None), (b, None))
    assert "Traceback" not in proc.stderr, proc.stderr
    if own:
        assert proc.returncode == 0 and "config ok" in proc.stdout, proc.stdout + proc.stderr
        return
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert f"the replay endpoint tcp://127.0.0.1:{rep_b} answers for seq " in proc.stderr, proc.stderr
    assert "another engine's replay socket" in proc.stderr


async def test_check_says_it_did_not_check_the_replay_endpoint_of_an_idle_engine(tmp_path: Path) -> None:
    """breaker108 G1: with the engine idle while --check listened, "config ok" read as if the
    replay endpoint (another engine's) had been checked; the run then took that engine's batches
    for this one's. The line says it was not checked, and how to check it."""
    live_a, rep_a, live_b, rep_b = free_ports(4)
    config = {
        "sources": [{"name": "e", "endpoint": f"tcp://127.0.0.1:{live_a}", "replay_endpoint": f"tcp://127.0.0.1:{rep_b}"}],
        "sinks": [{"type": "file", "path": str(tmp_path / "out.jsonl")}],
        "checkpoint": {"path": str(tmp_path / "checkpoint.json")},
    }
    async with ScriptedEngine(live_a, rep_a), ScriptedEngine(live_b, rep_b):
        proc = await check_config(tmp_path, config)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert "nothing published within" in proc.stdout + proc.stderr
    assert "replay_endpoint not checked" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


@pytest.mark.parametrize("case", ["no batch at the seq", "bound source"])
async def test_check_says_it_did_not_check_a_replay_endpoint_it_could_not_compare(tmp_path: Path, case: str) -> None:
    """breaker116 5: a replay_endpoint that is another engine's, which holds no batch at the seq of
    the live endpoint's first message (started later, or further on), or a ``bind: true`` source's
    (--check does not take the engine's connection): --check said nothing of it, exit 0, 6 of 6.
    The run then takes that engine's answers for this one's. Each line now says it was not checked."""
    live_a, rep_a, live_b, rep_b = free_ports(4)
    bound = case == "bound source"
    source = {"name": "e", "endpoint": f"tcp://127.0.0.1:{live_a}", "replay_endpoint": f"tcp://127.0.0.1:{rep_b}"}
    config = {
        "sources": [source | ({"bind": True} if bound else {})],
        "sinks": [{"type": "file", "path": str(tmp_path / "out.jsonl")}],
        "checkpoint": {"path": str(tmp_path / "checkpoint.json")},
    }
    if bound:
        async with ScriptedEngine(live_b, rep_b):
            proc = await check_config(tmp_path, config)
        said = f"sources[0].replay_endpoint: tcp://127.0.0.1:{rep_b}: not checked (bind: true"
    else:
        async with ScriptedEngine(live_a, rep_a) as a, ScriptedEngine(live_b, rep_b):  # (b publishes nothing)
            proc = await check_while_publishing(tmp_path, config, (a, None))
        said = "; replay_endpoint not checked (it holds no batch at seq "
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert said in proc.stdout, proc.stdout + proc.stderr


async def test_check_warns_of_a_source_topic_the_engine_does_not_publish_under(tmp_path: Path) -> None:
    """breaker46 B2: --check subscribed to the configured topic alone, heard nothing from an engine
    publishing 20 batches/s under another, called it "an idle engine" and said "config ok"; the run,
    which listens to every topic, was never ready (wrong_topic). --check listens as the run does and
    names the topic seen and the fix. breaker53 B3: as a refusal (exit 3) it was wrong where the
    engine publishes its own topic only now and then beside a busier one (the run is ready then):
    in 1.5 s --check cannot tell the two apart, so it says so, as a warning (exit 0)."""
    live = free_ports(1)[0]
    opts = SimulatorOptions(endpoint=f"tcp://127.0.0.1:{live}", replay_endpoint=None, topic="kv-events", rate=20)
    config: dict[str, Any] = {
        "sources": [{"name": "e", "endpoint": f"tcp://127.0.0.1:{live}", "topic": "vllm-kv"}],
        "sinks": [{"type": "file", "path": str(tmp_path / "out.jsonl")}],
    }
    async with Simulator(opts) as sim:
        runner = asyncio.create_task(sim.run())
        try:
            wrong = await check_config(tmp_path, config)
            config["sources"][0]["topic"] = "kv-"  # a prefix of the engine's topic: what the run takes
            right = await check_config(tmp_path, config)
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
    assert wrong.returncode == 0 and "Traceback" not in wrong.stderr, wrong.stdout + wrong.stderr
    assert "idle engine" not in wrong.stdout, wrong.stdout
    warnings = [ln for ln in wrong.stderr.splitlines() if ln.startswith("warning: ")]
    assert warnings == [
        "warning: the engine publishes under 'kv-events' and nothing under a topic starting with 'vllm-kv' within 1.5s: if "
        "its KV events go under another topic, the run receives nothing (not ready, reason wrong_topic): set the "
        "source's topic to it; an engine that publishes under 'vllm-kv' only now and then needs nothing"
    ], wrong.stderr
    assert right.returncode == 0, right.stdout + right.stderr
    assert f"engines: sources[0].endpoint: tcp://127.0.0.1:{live}: no publisher UUID" in right.stdout, right.stdout


async def topics_of(kafka: KafkaServer) -> set[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers)
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("state_replicas", "replication factor of 3 cannot be reached"),
        ("events_replicas", "replication factor of 3 cannot be reached"),
        ("events_config", "Invalid value bogus for configuration cleanup.policy"),
    ],
)
async def test_check_refuses_kafka_topics_the_cluster_cannot_create(
    tmp_path: Path, kafka: KafkaServer, case: str, reason: str
) -> None:
    """Issue 29 C3: ``--check`` counted a topic the run would create as fine without asking the
    cluster: "config ok", then the run never became ready (a replication factor above the
    brokers, an invalid ``create_topics.configs``). It asks now (CreateTopics with
    ``validate_only``): the broker's reason, and nothing created."""
    tag = uuid.uuid4().hex[:8]
    topic, state_topic = f"chk-{tag}", f"chk-{tag}-state"
    sink: dict[str, object] = {
        "type": "kafka",
        "name": "k",
        "bootstrap_servers": kafka.bootstrap_servers,
        "topic": topic,
        "allow_auto_create_topics": False,
        "create_topics": {"enabled": True, "replication_factor": 3},
    }
    if case == "state_replicas":
        sink["state"] = {"enabled": True, "topic": state_topic, "create": True}
        sink["topic"] = await kafka.anew_topic()  # the events topic exists: the state topic is refused
    elif case == "events_config":
        sink["create_topics"] = {"enabled": True, "configs": {"cleanup.policy": "bogus"}}
    config = {
        "sources": [{"name": "a", "endpoint": f"tcp://127.0.0.1:{free_ports(1)[0]}", "bind": True}],
        "sinks": [sink],
        "checkpoint": {"path": str(tmp_path / "checkpoint.json")},
    }
    proc = await check_config(tmp_path, config)
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    refused = state_topic if case == "state_replicas" else topic
    assert f"cannot create topic {refused!r}" in proc.stderr and reason in proc.stderr, proc.stderr
    assert not {topic, state_topic} & await topics_of(kafka)  # nothing created


@pytest.mark.parametrize(
    ("case", "exit", "problem"),
    [
        ("created", 2, "partition: 3 does not exist in a topic create_topics makes (create_topics.partitions: 2"),
        ("created_state", 2, "partition: 3 does not exist in a topic create_topics makes (create_topics.partitions: 2"),
        ("auto", 3, "would be created with 1 partition(s); partition 3 does not exist"),
        ("existing", 3, "has 2 partition(s); partition 3 does not exist"),
    ],
)
async def test_check_refuses_a_kafka_partition_the_topic_will_not_have(
    tmp_path: Path, kafka: KafkaServer, case: str, exit: int, problem: str
) -> None:
    """breaker30r P1: ``partition: 3`` with a topic that will have fewer partitions (made by
    ``create_topics`` with 2, or auto-created by the broker with its ``num.partitions`` of 1):
    ``--check`` said "config ok" and the run was never ready (``unknown_partition``, nothing
    delivered). The contradiction with ``create_topics.partitions`` is a config error now; a topic
    the broker would auto-create is compared with the broker's ``num.partitions``. Nothing created."""
    tag = uuid.uuid4().hex[:8]
    topic, state_topic = f"chk-{tag}", f"chk-{tag}-state"
    sink: dict[str, object] = {
        "type": "kafka",
        "name": "k",
        "bootstrap_servers": kafka.bootstrap_servers,
        "topic": topic,
        "partition": 3,
        "allow_auto_create_topics": case == "auto",
        "create_topics": {"enabled": case.startswith("created"), "partitions": 2},
    }
    if case == "created_state":
        sink["state"] = {"enabled": True, "topic": state_topic, "create": True, "partitions": 1}
    if case == "existing":
        sink["topic"] = topic = await kafka.anew_topic(2)
    config = {
        "sources": [{"name": "a", "endpoint": f"tcp://127.0.0.1:{free_ports(1)[0]}", "bind": True}],
        "sinks": [sink],
        "checkpoint": {"path": str(tmp_path / "checkpoint.json")},
    }
    proc = await check_config(tmp_path, config)
    assert proc.returncode == exit and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert problem in proc.stderr, proc.stderr
    if case != "existing":
        assert not {topic, state_topic} & await topics_of(kafka)  # nothing created


@pytest.mark.parametrize(
    ("case", "exit", "problem"),
    [
        ("auto", 3, "would be created with 1 partition(s); partition 3 does not exist"),
        ("existing", 3, "has 1 partition(s); partition 3 does not exist"),
        ("missing", 3, "does not exist on"),
        ("enough", 0, ""),
    ],
)
async def test_check_checks_a_templated_kafka_topic_for_each_configured_source(
    tmp_path: Path, kafka: KafkaServer, case: str, exit: int, problem: str
) -> None:
    """breaker30r2 P2: with ``topic: chk-TAG-{source}``, ``--check`` prepared no topic: "config
    ok" for a rendered topic that does not exist and nothing creates, or that lacks ``partition:
    3`` (made with 1, or auto-created with the broker's ``num.partitions`` of 1), and the run was
    never ready. It checks each configured source's topic as the static one now; nothing created."""
    tag = uuid.uuid4().hex[:8]
    rendered = f"chk-{tag}-eng"
    sink: dict[str, object] = {
        "type": "kafka",
        "name": "k",
        "bootstrap_servers": kafka.bootstrap_servers,
        "topic": f"chk-{tag}-{{source}}",
        "partition": 3,
        "allow_auto_create_topics": case == "auto",
    }
    if case in ("existing", "enough"):
        await kafka.anew_topic(1 if case == "existing" else 4, name=rendered)
    config = {
        "sources": [{"name": "eng", "endpoint": f"tcp://127.0.0.1:{free_ports(1)[0]}", "bind": True}],
        "sinks": [sink],
        "checkpoint": {"path": str(tmp_path / "checkpoint.json")},
    }
    proc = await check_config(tmp_path, config)
    assert proc.returncode == exit and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    if exit:
        assert f"topic {rendered!r} {problem}" in proc.stderr, proc.stderr
    if case in ("auto", "missing"):
        assert rendered not in await topics_of(kafka)  # nothing created


@pytest.mark.parametrize("credentials", ["options", "url"])
async def test_check_refuses_a_redis_user_the_writes_would_be_refused_for(
    tmp_path: Path, redis_server: RedisServer, credentials: str
) -> None:
    """breaker30r A1: the docs' example user (``~kv:* +@all -@dangerous``) with a stream template
    outside its keys passed ``--check`` ("config ok": connect ran an empty script) and every write
    of the run was refused NOPERM. ``--check`` asks for the keys of each configured source now.
    breaker65 B2: with the user in the URL, the refusal named the user 'default' and its fix."""
    user = f"a1-{uuid.uuid4().hex[:8]}"
    admin = aioredis.Redis.from_url(redis_server.url)
    await admin.execute_command("ACL", "SETUSER", user, "reset", "on", ">a1-pw", "~kv:*", "+@all", "-@dangerous")
    if credentials == "url":
        sink = {"type": "redis", "name": "r", "url": redis_server.url.replace("redis://", f"redis://{user}:a1-pw@")}
    else:
        sink = {"type": "redis", "name": "r", "url": redis_server.url, "username": user, "password": "a1-pw"}
    config = {
        "sources": [{"name": "a", "endpoint": f"tcp://127.0.0.1:{free_ports(1)[0]}", "bind": True, "dp_ranks": 2}],
        "sinks": [{**sink, "stream": "events:{source}:{dp_rank}"}],
        "checkpoint": {"path": str(tmp_path / "checkpoint.json")},
    }
    try:
        proc = await check_config(tmp_path, config)
        assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
        assert f"ACL user {user!r} may not run TYPE, XREVRANGE, XADD on key 'events:a:0'" in proc.stderr, proc.stderr
        assert f"ACL SETUSER {user} ~events:a:0 ~events:a:1" in proc.stderr, proc.stderr
        config["sinks"] = [sink]  # the default keys (kv:...): allowed
        proc = await check_config(tmp_path, config)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    finally:
        await admin.execute_command("ACL", "DELUSER", user)
        await admin.aclose()


async def test_check_refuses_a_redis_key_of_another_type_than_the_writes_need(tmp_path: Path, redis_server: RedisServer) -> None:
    """breaker46 B3: a stream key holding a string passed ``--check`` ("config ok"), and the run was
    never ready and dead-lettered every batch of that stream (WRONGTYPE). ``--check`` asks each
    configured stream's keys' TYPE now: the stream key, the block index and its counts, the state
    hash; exit 3 naming each key, its type and the fix. Keys that do not exist yet pass."""
    prefix = f"b3-{uuid.uuid4().hex[:8]}"
    sink = {
        "type": "redis", "name": "r", "url": redis_server.url, "stream": prefix + ":{source}:{dp_rank}",
        "index": {"enabled": True, "key": prefix + ":{source}:{dp_rank}:blocks"},
        "state": {"enabled": True, "key": prefix + ":{source}:{dp_rank}:state"},
    }  # fmt: skip
    config = {
        "sources": [{"name": "a", "endpoint": f"tcp://127.0.0.1:{free_ports(1)[0]}", "bind": True, "dp_ranks": 2}],
        "sinks": [sink],
        "checkpoint": {"path": str(tmp_path / "checkpoint.json")},
    }
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        fresh = await check_config(tmp_path, config)
        assert fresh.returncode == 0, fresh.stdout + fresh.stderr
        await admin.set(f"{prefix}:a:1", "not a stream")
        await admin.sadd(f"{prefix}:a:0:blocks:counts", "m")
        await admin.xadd(f"{prefix}:a:1:state", {"f": "v"})
        await admin.xadd(f"{prefix}:a:0", {"f": "v"})  # the right type: fine
        proc = await check_config(tmp_path, config)
        assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
        problems = [ln.strip() for ln in proc.stderr.splitlines() if ln.startswith("  ")]
        assert problems == [
            f"sinks[r]: {redis_server.url}: index key '{prefix}:a:0:blocks:counts' holds a set, not a hash; stream key "
            f"'{prefix}:a:1' holds a string, not a stream; state key '{prefix}:a:1:state' holds a stream, not a hash: "
            "the sink's writes there would be refused (WRONGTYPE); delete the key if nothing else needs it, or change "
            "index.key or stream or state.key so that the sink writes to keys of its own"
        ], proc.stderr
        assert "sinks[0] (r): reachable, not usable as configured" in proc.stdout, proc.stdout
    finally:
        await admin.delete(*[f"{prefix}:a:1", f"{prefix}:a:0:blocks:counts", f"{prefix}:a:1:state", f"{prefix}:a:0"])
        await admin.aclose()


@pytest.mark.parametrize("held", ["::1", "127.0.0.1", None])
async def test_check_takes_every_address_the_metrics_name_stands_for_as_the_run_does(
    monkeypatch: pytest.MonkeyPatch, held: str | None
) -> None:
    """A name for both loopbacks (``localhost`` on many hosts): the run listens on each, so --check
    must take each too, and says "ok" exactly where the run can listen."""
    from bridge.errors import StartupError
    from bridge.health import HealthServer, listen_problem

    real = socket.getaddrinfo
    port = free_ports(1)[0]

    def dual(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host != "both-loopbacks":
            return real(host, *args, **kwargs)
        return real("127.0.0.1", *args, **kwargs) + real("::1", *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", dual)
    with contextlib.ExitStack() as stack:
        if held is not None:
            family = socket.AF_INET6 if ":" in held else socket.AF_INET
            other = stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
            if family == socket.AF_INET6:
                other.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            other.bind((held, port))
            other.listen()
        said = listen_problem(f"both-loopbacks:{port}")
        server = HealthServer(f"both-loopbacks:{port}", lambda: asyncio.sleep(0, []), lambda detail: (True, {}))
        try:
            await server.start()
            started = True
        except StartupError:
            started = False
        finally:
            await server.stop()
    assert started == (held is None)
    assert (said is None) == started, said
    if said is not None:
        assert said[1] and f":{port} (Address already in use)" in said[0]

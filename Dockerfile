# syntax=docker/dockerfile:1
# kv-event-bridge: KV-cache events from vLLM / SGLang (ZeroMQ) to Kafka, Redis Streams and NATS.
#
#   docker build -t kv-event-bridge:0.1.0 .
#   docker run --rm -v $PWD/bridge.yaml:/etc/kv-event-bridge/config.yaml:ro -p 9300:9300 kv-event-bridge:0.1.0
#
# Two stages: the builder turns the source into a wheel and installs it with its dependencies into
# a virtual environment; the final image copies only that environment onto a clean slim base (no
# compilers, no source tree), and runs as an unprivileged numeric user, so Kubernetes'
# runAsNonRoot can verify it. It works with a read-only root filesystem: bytecode is compiled at
# build time and the bridge writes only its checkpoint (a volume) and /tmp.

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# Compilers only for a dependency without a binary wheel on this platform (most ship one).
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY bridge/ bridge/
COPY connectors/ connectors/
COPY consumer/ consumer/
# "fast" adds uvloop; more PyPI packages (e.g. a third-party connector) with --build-arg EXTRA_PACKAGES="pkg ..."
ARG EXTRAS=fast
ARG EXTRA_PACKAGES=""
# The consumer library (./consumer) is a dependency of the bridge: its wheel is named, not looked up.
RUN /opt/venv/bin/pip wheel --no-deps --wheel-dir /wheels ./consumer . \
 && /opt/venv/bin/pip install "$(ls /wheels/kv_event_consumer-*.whl)" "$(ls /wheels/kv_event_bridge-*.whl)[${EXTRAS}]" ${EXTRA_PACKAGES} \
 && /opt/venv/bin/python -m compileall -q /opt/venv/lib \
 && /opt/venv/bin/python -m bridge --version

FROM python:${PYTHON_VERSION}-slim-bookworm
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="kv-event-bridge" \
      org.opencontainers.image.description="KV-cache events from vLLM/SGLang (ZeroMQ) to Kafka, Redis Streams and NATS" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
# The uid/gid the Helm chart's securityContext names (runAsUser/runAsGroup 10001).
RUN groupadd --system --gid 10001 kvbridge \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin kvbridge \
 && mkdir -p /etc/kv-event-bridge /var/lib/kv-event-bridge \
 && chown 10001:10001 /var/lib/kv-event-bridge
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /var/lib/kv-event-bridge
# /metrics, /healthz, /readyz (metrics.listen; 0.0.0.0:9300 by default)
EXPOSE 9300
# Docker and Compose use this; Kubernetes ignores it (the chart has its own probes). No curl in the
# image: urlopen raises, and the command exits non-zero, unless /healthz answers 2xx.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ.get('KVB_HEALTHZ_URL', 'http://127.0.0.1:9300/healthz'), timeout=4)"]
# The bridge handles SIGTERM itself (stop reading, flush sinks, save the checkpoint, exit 0), and
# starts no child processes, so it can run as PID 1 without an init.
STOPSIGNAL SIGTERM
ENTRYPOINT ["python", "-m", "bridge"]
CMD ["--config", "/etc/kv-event-bridge/config.yaml"]

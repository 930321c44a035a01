"""The image a pod runs: built from the Dockerfile, run from its own filesystem as the chart runs it.

``tests/infra/image.py`` builds the Dockerfile with buildah (a locally made stand-in for the
official base image when the registry is out of reach; layers cached) and runs programs in a
working container's root filesystem like a container runtime would: the image's ENV, USER and
WORKDIR, /dev and /proc, chroot (no runtime is needed). The tests check that the image's bridge
runs the demo, accepts the config the Helm chart renders, runs as uid 10001 able to write only its
checkpoint directory and temporary directories, carries no compiler and no source tree, and that
its metadata is what the chart expects. When the image cannot be built (no root, no network, no
buildah) the tests are skipped, or fail under ``CI=true``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.infra import image as images
from tests.infra.servers import InstallError, free_port
from tests.integration.conftest import unavailable
from tests.integration.test_helm import ENV as CHART_ENV
from tests.integration.test_helm import by_kind, config_text, containers, render

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]  # a first build makes the base

ROOT = Path(__file__).resolve().parents[2]
UID = 10001
PORT = 9300
CHECKPOINT_DIR = "/var/lib/kv-event-bridge"
# Sticky world-writable directories of every Debian base: anyone may create files there, nobody
# may touch anyone else's. The chart mounts an emptyDir on /tmp and makes the root read-only.
TEMPORARY_DIRS = {"/tmp", "/var/tmp", "/run/lock"}
# gcc, x86_64-linux-gnu-gcc-12, c++, clang-16, ld.bfd, make, ... (not ld.so, the dynamic loader)
COMPILER = re.compile(
    r"(?:\w+-linux-gnu\w*-)?(?:gcc|cc|g\+\+|c\+\+|clang|clang\+\+|make|ld(?:\.bfd|\.gold|\.lld)?|as|cpp)(?:-[\d.]+)?"
)


@pytest.fixture(scope="module")
def image() -> images.Image:
    try:
        return images.build()
    except InstallError as exc:
        unavailable("image", exc)


@pytest.fixture(scope="module")
def rootfs(image: images.Image) -> Iterator[Path]:
    with contextlib.ExitStack() as stack:
        try:
            path = stack.enter_context(images.rootfs(image))
        except InstallError as exc:
            unavailable("image rootfs", exc)
        yield path


@pytest.fixture(scope="module")
def chart() -> list[dict[str, Any]]:
    """The chart's manifests with its default values."""
    try:
        out = subprocess.run(["bash", str(ROOT / "tools" / "helm.sh")], capture_output=True, text=True, timeout=1500)
    except (OSError, subprocess.TimeoutExpired) as exc:
        unavailable("helm", exc)
    if out.returncode != 0:
        unavailable("helm", f"tools/helm.sh failed:\n{out.stderr[-2000:]}")
    return render(out.stdout.strip().splitlines()[-1])


def run(
    rootfs: Path, image: images.Image, argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        images.command(rootfs, image, argv),
        env=images.environment(rootfs, image, env),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def bridge_container(chart: list[dict[str, Any]]) -> dict[str, Any]:
    return next(c for c in containers(by_kind(chart, "Deployment")) if c["name"] == "bridge")


def test_metadata_is_what_the_chart_expects(image: images.Image, chart: list[dict[str, Any]]) -> None:
    # Numeric, so that Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
    assert image.user == f"{UID}:{UID}"
    pod = by_kind(chart, "Deployment")["spec"]["template"]["spec"]
    container = bridge_container(chart)
    for context in (pod["securityContext"], container["securityContext"]):
        assert (context["runAsUser"], context["runAsGroup"], context["runAsNonRoot"]) == (UID, UID, True)
    # The chart gives args only: the image's ENTRYPOINT must run the bridge, and its CMD is the
    # same config path the chart mounts its Secret at.
    assert "command" not in container
    assert image.entrypoint == ["python", "-m", "bridge"]
    assert image.cmd == container["args"] == ["--config", "/etc/kv-event-bridge/config.yaml"]
    assert any(m["mountPath"] == "/etc/kv-event-bridge" for m in container["volumeMounts"])
    assert list(image.config.get("ExposedPorts") or {}) == [f"{PORT}/tcp"]
    assert [p["containerPort"] for p in container["ports"]] == [PORT]
    assert image.workdir == CHECKPOINT_DIR
    assert {m["mountPath"] for m in container["volumeMounts"]} >= {CHECKPOINT_DIR, "/tmp"}
    assert image.config.get("StopSignal") == "SIGTERM"
    assert image.env["PATH"].split(":")[0] == "/opt/venv/bin"
    assert image.env.get("PYTHONDONTWRITEBYTECODE") == "1"  # the root filesystem is read-only
    assert (image.config.get("Healthcheck") or {}).get("Test", [""])[0] == "CMD"


def test_demo_prints_events_and_answers_its_healthcheck(rootfs: Path, image: images.Image) -> None:
    port = free_port()
    demo = subprocess.Popen(
        images.command(rootfs, image, [*image.entrypoint, "demo", "--duration", "6", "--metrics", f"127.0.0.1:{port}"]),
        env=images.environment(rootfs, image),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        # The image's own HEALTHCHECK command, pointed at the demo's metrics port.
        healthcheck = image.config["Healthcheck"]["Test"][1:]
        deadline = time.monotonic() + 5
        while True:
            probe = run(rootfs, image, healthcheck, env={"KVB_HEALTHZ_URL": f"http://127.0.0.1:{port}/healthz"})
            if probe.returncode == 0 or time.monotonic() > deadline or demo.poll() is not None:
                break
            time.sleep(0.3)
        stdout, stderr = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.communicate()
    assert demo.returncode == 0, stderr[-3000:]
    assert probe.returncode == 0, probe.stderr[-3000:]
    records = [json.loads(line) for line in stdout.splitlines()]
    assert len(records) >= 10, stdout[-2000:]
    assert {r["source"] for r in records} == {"demo-engine"}
    assert {"BlockStored"} <= {r["type"] for r in records}
    assert all(isinstance(r["seq"], int) and isinstance(r["epoch"], int) for r in records)


def test_check_accepts_the_charts_config(rootfs: Path, image: images.Image, chart: list[dict[str, Any]]) -> None:
    config = rootfs / "etc" / "kv-event-bridge" / "config.yaml"
    config.write_text(config_text(chart))
    config.chmod(0o644)
    listen = yaml.safe_load(config.read_text())["metrics"]["listen"]
    assert listen.rsplit(":", 1)[1] == str(PORT)
    # The container's plain env values, and stand-ins for the ones the pod fills in.
    env = {e["name"]: e["value"] for e in bridge_container(chart).get("env", []) if "value" in e}
    out = run(rootfs, image, [*image.entrypoint, *image.cmd, "--check", "--offline"], env={**CHART_ENV, **env})
    assert out.returncode == 0, out.stdout + out.stderr


def test_runs_as_10001_and_writes_only_its_directories(rootfs: Path, image: images.Image) -> None:
    probe = """
import json, os, sys
result = {"ids": [os.getuid(), os.geteuid(), os.getgid(), os.getegid(), os.getgroups()], "writes": {}}
for directory in sys.argv[1:]:
    try:
        with open(os.path.join(directory, ".kvb-write-probe"), "x") as fh:
            fh.write("x")
        os.unlink(os.path.join(directory, ".kvb-write-probe"))
        result["writes"][directory] = "ok"
    except OSError as exc:
        result["writes"][directory] = type(exc).__name__
print(json.dumps(result))
"""
    denied = ["/", "/etc", "/etc/kv-event-bridge", "/opt/venv", "/opt/venv/bin", "/usr", "/usr/local", "/var", "/root"]
    allowed = [CHECKPOINT_DIR, "/tmp"]
    out = run(rootfs, image, ["python", "-c", probe, *denied, *allowed])
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["ids"] == [UID, UID, UID, UID, []]
    assert result["writes"] == {**dict.fromkeys(denied, "PermissionError"), **dict.fromkeys(allowed, "ok")}
    # And nothing else in the whole filesystem is writable by that user.
    writable = []
    for directory, dirnames, filenames in os.walk(rootfs):
        inside = "/" + os.path.relpath(directory, rootfs).removeprefix(".").lstrip("/")
        if inside in ("/proc", "/dev", "/sys"):
            dirnames.clear()
            continue
        for name in [*dirnames, *filenames]:
            st = os.lstat(os.path.join(directory, name))
            if stat.S_ISLNK(st.st_mode):
                continue
            path = os.path.join(inside, name)
            if path == CHECKPOINT_DIR:
                assert (st.st_uid, st.st_gid) == (UID, UID)
                dirnames[:] = [d for d in dirnames if d != name]
                continue
            if path in TEMPORARY_DIRS:
                assert st.st_mode & stat.S_ISVTX, f"{path} is world-writable but not sticky"
                continue
            user_w = st.st_uid == UID and st.st_mode & stat.S_IWUSR
            group_w = st.st_gid == UID and st.st_mode & stat.S_IWGRP
            if user_w or group_w or st.st_mode & stat.S_IWOTH:
                writable.append(path)
    assert writable == []


def test_no_compiler_and_no_source_tree(rootfs: Path, image: images.Image) -> None:
    dirs = {*image.env["PATH"].split(":"), "/usr/bin", "/usr/local/bin", "/bin"}
    found = []
    for directory in sorted(dirs):
        host_dir = rootfs / directory.lstrip("/")
        if not host_dir.is_dir():
            continue
        found += [f"{directory}/{entry.name}" for entry in host_dir.iterdir() if COMPILER.fullmatch(entry.name)]
    assert found == []
    assert not list((rootfs / "usr" / "lib").glob("gcc/*/*/cc1"))
    status = rootfs / "var" / "lib" / "dpkg" / "status"
    if status.exists():
        installed = {line.split(": ", 1)[1] for line in status.read_text().splitlines() if line.startswith("Package: ")}
        assert not installed & {"gcc", "g++", "build-essential", "make", "binutils", "clang"}
    for pattern in ("src", "wheels", "opt/venv/lib/python*/site-packages/tests"):
        assert not list(rootfs.glob(pattern)), pattern

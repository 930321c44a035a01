"""The container image built from the repository's Dockerfile, for the image test.

``build()`` builds the Dockerfile with buildah (``--isolation chroot --network host --pull=never``,
layer cache on) as ``localhost/kv-event-bridge:test`` and returns its configuration. No registry is
needed: when the image store lacks the base image the Dockerfile's ``FROM`` names (the official
``python:3.11-slim-bookworm``), a stand-in made with ``debootstrap --variant=minbase`` (Debian's
python3 and python3-venv, with this machine's CA certificates so pip and apt work behind a
TLS-inspecting proxy) is imported under that name. The stand-in's root filesystem is made once
and cached as a tarball under ``$KVB_CACHE_DIR/image``; buildah keeps the layers between runs, so
a second build only redoes the steps whose inputs changed.

No container runtime is needed either: ``rootfs()`` mounts a writable working container of the
image, and ``command()`` runs a program in it as the image's user with the image's working
directory, like a container would, through ``unshare``: a private mount namespace gets /dev and
/proc and dies with the process, so nothing stays mounted whatever happens to the test.

Building needs root (debootstrap, buildah's chroot isolation) and network access to the Debian
mirror and PyPI. Failures raise ``ImageError`` naming the step, its exit status and its output.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.infra.servers import InstallError, cache_dir, ensure_apt_package, run_dir

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
TAG = "localhost/kv-event-bridge:test"
# What debootstrap adds to minbase so the stand-in can do what the official python image does for
# the Dockerfile: `python -m venv`, pip over HTTPS.
BASE_PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates")
DEBIAN_PYTHON = {"bullseye": "3.9", "bookworm": "3.11", "trixie": "3.13"}
# The official python image's PATH and locale; python itself is in /usr/local/bin there and in
# /usr/bin in the stand-in, and both are on this PATH.
BASE_ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8")
STAND_IN_LABEL = "org.kv-event-bridge.stand-in"
CONTAINER_PREFIX = "kvb-image-"

DEBOOTSTRAP_TIMEOUT = 1200.0
BUILD_TIMEOUT = 1800.0
STEP_TIMEOUT = 300.0


class ImageError(InstallError):
    """The image, or a tool or base image it needs, could not be made."""

    def __init__(self, message: str, log_path: Path | None = None) -> None:
        super().__init__("image", message, log_path)


@dataclass(frozen=True)
class Image:
    """A built image: its reference, id and configuration (Docker's image config keys)."""

    ref: str
    id: str
    base: str
    config: Mapping[str, Any]
    notes: tuple[str, ...] = field(default=())

    @property
    def env(self) -> dict[str, str]:
        """The image's ENV, as the runtime would set it."""
        return dict(item.split("=", 1) for item in self.config.get("Env") or [])

    @property
    def user(self) -> str:
        return str(self.config.get("User") or "")

    @property
    def workdir(self) -> str:
        return str(self.config.get("WorkingDir") or "/")

    @property
    def entrypoint(self) -> list[str]:
        return list(self.config.get("Entrypoint") or [])

    @property
    def cmd(self) -> list[str]:
        return list(self.config.get("Cmd") or [])


# ---------------------------------------------------------------------------------------------
# Running tools


def _run(argv: Sequence[str | Path], *, timeout: float, what: str, hint: str = "", log_path: Path | None = None) -> str:
    """Run argv, return its stdout; raise ImageError with its output (or log) when it fails."""
    args = [str(a) for a in argv]
    try:
        if log_path is None:
            out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
            stdout, detail = out.stdout, (out.stdout + out.stderr).strip()[-4000:]
        else:
            with log_path.open("a") as log:
                out = subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, stdin=subprocess.DEVNULL)
            stdout, detail = "", ""
    except subprocess.TimeoutExpired as exc:
        raise ImageError(f"{what} timed out after {timeout:.0f}s: {' '.join(args)}{hint}", log_path) from exc
    except OSError as exc:
        raise ImageError(f"{what} could not run: {exc}") from exc
    if out.returncode != 0:
        text = f"{what} failed (exit {out.returncode}): {' '.join(args)}{hint}"
        raise ImageError(f"{text}\n{detail}" if detail else text, log_path)
    return stdout


def _tool(binary: str, package: str) -> str:
    return ensure_apt_package(binary, package, server="image")


def _buildah(*args: str | Path, timeout: float = STEP_TIMEOUT, what: str = "", hint: str = "") -> str:
    return _run([_tool("buildah", "buildah"), *args], timeout=timeout, what=what or f"buildah {args[0]}", hint=hint)


def _inspect(ref: str) -> dict[str, Any] | None:
    """buildah's description of a local image, or None when the store lacks it."""
    argv = [_tool("buildah", "buildah"), "inspect", "--type", "image", ref]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=STEP_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        raise ImageError(f"buildah inspect timed out after {STEP_TIMEOUT:.0f}s: {' '.join(argv)}") from exc
    if out.returncode != 0:
        return None
    found: dict[str, Any] = json.loads(out.stdout)
    return found


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One build at a time per cache directory (two sessions may ask at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def image_cache() -> Path:
    """Where the base root filesystem tarball is kept (``$KVB_CACHE_DIR/image``)."""
    return cache_dir() / "image"


# ---------------------------------------------------------------------------------------------
# The base image the Dockerfile names


def base_ref(dockerfile: Path = DOCKERFILE) -> str:
    """The one external image the Dockerfile's stages start FROM, fully qualified.

    ARGs declared before the first FROM are substituted with their defaults; a FROM naming an
    earlier stage is not external.
    """
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    args: dict[str, str] = {}
    stages: set[str] = set()
    refs: set[str] = set()
    for line in text.splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        keyword = words[0].upper()
        if keyword == "ARG" and not refs and len(words) > 1 and "=" in words[1]:
            name, value = words[1].split("=", 1)
            args[name] = value.strip("\"'")
        elif keyword == "FROM":
            operands = [w for w in words[1:] if not w.startswith("--")]
            ref = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], ""), operands[0])
            if len(operands) >= 3 and operands[1].upper() == "AS":
                stages.add(operands[2].lower())
            if ref.lower() not in stages:
                refs.add(ref)
    if len(refs) != 1:
        raise ImageError(f"{dockerfile} starts from {sorted(refs) or 'nothing'}: expected one base image")
    ref = refs.pop()
    first = ref.split("/", 1)[0]
    if "/" not in ref:
        return f"docker.io/library/{ref}"
    if "." not in first and ":" not in first and first != "localhost":
        return f"docker.io/{ref}"
    return ref


def _stages(dockerfile: Path = DOCKERFILE) -> list[str]:
    """The Dockerfile's stage names in order (FROM ... AS NAME); an unnamed stage as ''."""
    names = []
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if words and words[0].upper() == "FROM":
            operands = [w for w in words[1:] if not w.startswith("--")]
            names.append(operands[2].lower() if len(operands) >= 3 and operands[1].upper() == "AS" else "")
    return names


def _stand_in_suite(ref: str) -> tuple[str, list[str]]:
    """The Debian suite a stand-in for ref is made of, and notes on how it differs."""
    match = re.fullmatch(r"docker\.io/library/python:(\d+\.\d+)[\w.]*-slim-(\w+)", ref)
    if not match or match[2] not in DEBIAN_PYTHON:
        raise ImageError(
            f"the Dockerfile starts FROM {ref}, which is not in the image store and has no local stand-in "
            "(made for python:X.Y-slim-<debian suite>); pull it first"
        )
    version, suite = match[1], match[2]
    notes = []
    if DEBIAN_PYTHON[suite] != version:
        notes.append(f"the stand-in for {ref} runs Debian {suite}'s Python {DEBIAN_PYTHON[suite]}, not {version}")
    return suite, notes


def _mounts_under(path: Path) -> list[str]:
    found = []
    with open("/proc/self/mounts") as fh:
        for line in fh:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), line.split()[1])
            if point == str(path) or point.startswith(f"{path}/"):
                found.append(point)
    return sorted(found, key=len, reverse=True)


def _unmount_under(path: Path) -> None:
    """Unmount what debootstrap left mounted in its target (it mounts /proc and /sys there)."""
    for point in _mounts_under(path):
        if subprocess.run(["umount", point], capture_output=True, timeout=60).returncode != 0:
            subprocess.run(["umount", "-l", point], capture_output=True, timeout=60)


def base_tarball(suite: str, mirror: str | None = None) -> Path:
    """The cached root filesystem of the stand-in base image, made with debootstrap when missing."""
    mirror = mirror or os.environ.get("KVB_DEBIAN_MIRROR") or "http://deb.debian.org/debian"
    spec = f"{suite} minbase {','.join(BASE_PACKAGES)}"
    path = image_cache() / f"debian-{suite}-minbase-{hashlib.sha256(spec.encode()).hexdigest()[:8]}.tar.gz"
    if path.exists():
        return path
    debootstrap = _tool("debootstrap", "debootstrap")
    path.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rootfs-", dir=path.parent))
    target = work / "rootfs"
    host = urllib.parse.urlsplit(mirror).hostname or mirror
    try:
        try:
            _run(
                [debootstrap, "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", suite, target, mirror],
                timeout=DEBOOTSTRAP_TIMEOUT,
                what="debootstrap",
                hint=f"; needs network access to {host} (or set KVB_DEBIAN_MIRROR)",
            )
        finally:
            _unmount_under(target)
        # Package caches are of no use in an image; the Dockerfile runs apt-get update itself.
        for pattern in ("var/cache/apt/archives/*.deb", "var/lib/apt/lists/*"):
            for junk in target.glob(pattern):
                if junk.is_file():
                    junk.unlink()
        partial = path.with_suffix(".partial")
        _run(["tar", "--numeric-owner", "-C", target, "-czf", partial, "."], timeout=STEP_TIMEOUT, what="tar of the base rootfs")
        partial.rename(path)
    finally:
        if _mounts_under(work):
            raise ImageError(f"{work} still has mounts after debootstrap; unmount them and remove it by hand")
        shutil.rmtree(work, ignore_errors=True)
    return path


def ensure_base(ref: str) -> list[str]:
    """Make sure the image store has ref, importing the stand-in when it lacks it; returns notes."""
    found = _inspect(ref)
    if found is not None:
        label = (found.get("Docker", {}).get("config") or {}).get("Labels") or {}
        return [
            f"base       {ref}: " + (f"stand-in, {label[STAND_IN_LABEL]}" if STAND_IN_LABEL in label else "in the image store")
        ]
    suite, notes = _stand_in_suite(ref)
    began = time.monotonic()
    cached = any(image_cache().glob(f"debian-{suite}-minbase-*.tar.gz"))
    tarball = base_tarball(suite)
    made = "" if cached else f"root filesystem made in {time.monotonic() - began:.0f}s, "
    container = f"{CONTAINER_PREFIX}base-{os.getpid()}"
    _buildah("from", "--name", container, "scratch")
    try:
        _buildah("add", container, tarball, "/", timeout=600)
        # This machine's CA certificates, so that apt and pip in the build trust its proxy (if
        # any); the extra ones also where update-ca-certificates looks, so a rerun keeps them.
        for crt in sorted(Path("/usr/local/share/ca-certificates").glob("*.crt")):
            _buildah("copy", container, crt, "/usr/local/share/ca-certificates/")
        bundle = Path("/etc/ssl/certs/ca-certificates.crt")
        if bundle.is_file():
            _buildah("copy", container, bundle.resolve(), "/etc/ssl/certs/ca-certificates.crt")
        what = f"debootstrap {suite} minbase + {', '.join(BASE_PACKAGES)} ({tarball.name})"
        env = [arg for item in BASE_ENV for arg in ("--env", item)]
        _buildah("config", *env, "--cmd", "python3", "--label", f"{STAND_IN_LABEL}={what}", container)
        _buildah("commit", "--format", "docker", container, ref, timeout=600)
    finally:
        subprocess.run([_tool("buildah", "buildah"), "rm", container], capture_output=True, timeout=STEP_TIMEOUT)
    return [f"base       {ref}: stand-in imported ({made}{time.monotonic() - began:.0f}s in all), {what}", *notes]


# ---------------------------------------------------------------------------------------------
# The image


def build(tag: str = TAG) -> Image:
    """Build the Dockerfile as tag (layers cached between runs) and describe the result."""
    if os.geteuid() != 0:
        raise ImageError("building the image needs root (debootstrap, buildah with chroot isolation)")
    with _locked(image_cache() / ".lock"):
        ref = base_ref()
        notes = ensure_base(ref)
        began = time.monotonic()
        log_path = run_dir() / "image-build.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text("")
        # The image, then each earlier stage under a tag of its own (all cached by then): the
        # stages' last layers stay tagged, so the prune below keeps what the next build reuses
        # and drops only what no build will (earlier builds' layers).
        for target in [None, *filter(None, _stages()[:-1])]:
            _run(
                [
                    _tool("buildah", "buildah"),
                    "build",
                    "--isolation",
                    "chroot",
                    "--network",
                    "host",
                    "--pull=never",
                    "--layers",
                    "--format",
                    "docker",  # OCI's config has no HEALTHCHECK
                    *(["--target", target, "--tag", f"{tag}-{target}"] if target else ["--tag", tag]),
                    "--file",
                    DOCKERFILE,
                    ROOT,
                ],
                timeout=BUILD_TIMEOUT,
                what="buildah build" + (f" --target {target}" if target else ""),
                hint="; the build runs apt-get (deb.debian.org) and pip (PyPI)",
                log_path=log_path,
            )
        subprocess.run([_tool("buildah", "buildah"), "rmi", "--prune"], capture_output=True, timeout=STEP_TIMEOUT)
        found = _inspect(tag)
        if found is None:
            raise ImageError(f"buildah build succeeded but {tag} is not in the image store", log_path)
        image_id = str(found["FromImageID"])
        notes.append(f"build      {time.monotonic() - began:.1f}s")
    return Image(ref=tag, id=image_id, base=ref, config=found["Docker"]["config"], notes=tuple(notes))


def _remove_stale_containers() -> None:
    """Working containers that a killed run of this module left behind (their pid is gone)."""
    out = subprocess.run(
        [_tool("buildah", "buildah"), "containers", "--format", "{{.ContainerName}}"],
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT,
    )
    for name in out.stdout.split():
        match = re.fullmatch(rf"{CONTAINER_PREFIX}(?:base|test)-(\d+)(?:-\w+)?", name)
        if match and not Path(f"/proc/{match[1]}").exists():
            subprocess.run([_tool("buildah", "buildah"), "rm", name], capture_output=True, timeout=STEP_TIMEOUT)


@contextlib.contextmanager
def rootfs(image: Image) -> Iterator[Path]:
    """The root filesystem of a new working container of image, writable, removed on exit."""
    _remove_stale_containers()
    name = f"{CONTAINER_PREFIX}test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    _buildah("from", "--pull=never", "--name", name, image.id)
    path: Path | None = None
    try:
        path = Path(_buildah("mount", name).strip())
        yield path
    finally:
        removed = subprocess.run([_tool("buildah", "buildah"), "rm", name], capture_output=True, text=True, timeout=STEP_TIMEOUT)
    if removed.returncode != 0:
        raise ImageError(f"buildah rm {name} failed (exit {removed.returncode}): {removed.stderr.strip()}")
    left = _mounts_under(path) if path is not None else []
    if left:
        raise ImageError(f"still mounted after removing working container {name}: {left}")


def mount_for_inspection(image: Image, name: str = f"{CONTAINER_PREFIX}manual") -> Path:
    """Mount a working container of image that stays until ``buildah rm NAME``; its rootfs path."""
    subprocess.run([_tool("buildah", "buildah"), "rm", name], capture_output=True, timeout=STEP_TIMEOUT)
    _buildah("from", "--pull=never", "--name", name, image.id)
    return Path(_buildah("mount", name).strip())


def _resolve_id(rootfs_path: Path, value: str, table: str) -> str:
    if value.isdigit():
        return value
    for line in (rootfs_path / "etc" / table).read_text().splitlines():
        fields = line.split(":")
        if fields[0] == value:
            return fields[2]
    raise ImageError(f"{value!r} is not in the image's /etc/{table}")


def command(rootfs_path: Path, image: Image, argv: Sequence[str], *, user: str | None = None) -> list[str]:
    """argv for running argv in rootfs_path like a container of image (its USER and WORKDIR).

    In a private mount namespace (gone with the process): /dev and /proc mounted into the rootfs,
    then chroot, chdir, setgid (supplementary groups dropped) and setuid, and exec. Each step
    execs the next, so the returned process is the program itself (a timeout's kill reaches it).
    Run it with ``environment()`` as its environment.
    """
    name, _, group = (user if user is not None else image.user or "0").partition(":")
    uid = _resolve_id(rootfs_path, name, "passwd")
    gid = _resolve_id(rootfs_path, group, "group") if group else _primary_gid(rootfs_path, uid)
    unshare = shutil.which("unshare") or "/usr/bin/unshare"
    mount = shutil.which("mount") or "/usr/bin/mount"
    script = 'mount=$1 root=$2; shift 2; "$mount" --rbind /dev "$root/dev"; "$mount" -t proc proc "$root/proc"; exec "$@"'
    return [
        *(unshare, "--mount", "--propagation", "private", "--", "/bin/sh", "-ec", script, "sh", mount, str(rootfs_path)),
        *(unshare, f"--root={rootfs_path}", f"--wd={image.workdir}", "--setgid", gid, "--setuid", uid, "--", *argv),
    ]


def _primary_gid(rootfs_path: Path, uid: str) -> str:
    for line in (rootfs_path / "etc" / "passwd").read_text().splitlines():
        fields = line.split(":")
        if len(fields) > 3 and fields[2] == uid:
            return fields[3]
    return uid


def environment(rootfs_path: Path, image: Image, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a container of image starts with: its ENV, and HOME from its passwd."""
    uid = _resolve_id(rootfs_path, image.user.partition(":")[0] or "0", "passwd")
    home = "/"
    for line in (rootfs_path / "etc" / "passwd").read_text().splitlines():
        fields = line.split(":")
        if len(fields) > 5 and fields[2] == uid:
            home = fields[5]
    return {"HOME": home, **image.env, **(extra or {})}


def describe(image: Image, seconds: float) -> str:
    lines = [f"image      {image.ref} {image.id[:12]} ready in {seconds:.1f}s"]
    lines += [f"  {note}" for note in image.notes]
    lines.append(f"  log        {run_dir() / 'image-build.log'}")
    lines.append(f"  cache      {image_cache()} (base root filesystem); layers in buildah's image store")
    return "\n".join(lines)


def build_and_describe(mount: bool) -> str:
    began = time.monotonic()
    image = build()
    text = describe(image, time.monotonic() - began)
    if mount:
        path = mount_for_inspection(image)
        name = f"{CONTAINER_PREFIX}manual"
        text += f"\n  rootfs     {path} (working container {name}; `buildah rm {name}` removes it)"
    else:
        text += "\n  rootfs     `python -m tests.infra image --mount` mounts a working container and prints its path"
    return text

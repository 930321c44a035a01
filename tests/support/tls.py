"""Test certificates made with ``openssl``: a CA, a server certificate for 127.0.0.1 / localhost and
a client certificate, all PEM (keys unencrypted PKCS#8, which Kafka's PEM keystore, Redis and
NATS all read)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class Certificates:
    dir: Path
    ca: Path  # CA certificate (what clients trust)
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @property
    def server_chain_pem(self) -> str:
        return self.server_cert.read_text()

    @property
    def server_key_pem(self) -> str:
        return self.server_key.read_text()


def available() -> bool:
    return shutil.which("openssl") is not None


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certificates(d: Path, *, days: int = 2) -> Certificates:
    """Create (or reuse) the certificates in ``d``."""
    d.mkdir(parents=True, exist_ok=True)
    if not (d / "client.pem").exists():
        n = str(days)
        _openssl("req", "-x509", *_KEY, "-keyout", "ca.key", "-out", "ca.pem", "-days", n, "-subj", "/CN=kvb-test-ca", cwd=d)
        (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
        (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
        for name in ("server", "client"):
            _openssl("req", *_KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=kvb-test-{name}", cwd=d)
            _openssl(
                "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", n, "-extfile", f"{name}.ext", cwd=d,
            )  # fmt: skip
    return Certificates(d, d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key")

"""A real redis-server on a free loopback port for the shared-tier tests: no persistence, stopped afterwards; it
can be killed (SIGKILL), hung (SIGSTOP) and resumed, and restarted on the same port. Optionally also on a unix
socket (`unix_url`), with TLS on a second port (`tls_url`, certificates from make_certificates) and with an ACL
user."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

BINARY = shutil.which("redis-server")
NEEDS_REDIS = pytest.mark.skipif(BINARY is None, reason="redis-server is not installed (scripts/test.sh installs "
                                                       "Debian's redis-server package when run as root)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, folder, port: int | None = None, password: str | None = None, unix_socket: bool = False,
                 tls: dict | None = None, user: tuple[str, str] | None = None):
        self.folder = folder
        self.port = port or free_port()
        self.password = password
        self.url = f"redis://{f':{password}@' if password else ''}127.0.0.1:{self.port}/0"
        self.socket = folder / "redis.sock" if unix_socket else None
        self.unix_url = f"unix://{self.socket}?db=0" if unix_socket else None
        self.tls = tls  # {"cert", "key", "ca"}: file paths
        self.tls_port = free_port() if tls else None
        self.tls_url = f"rediss://127.0.0.1:{self.tls_port}/0?ssl_ca_certs={tls['ca']}" if tls else None
        self.user = user  # (name, password): kvboost:* keys and the commands KVBoost needs only
        self.proc: subprocess.Popen | None = None

    def start(self) -> "RedisServer":
        extra = ["--requirepass", self.password] if self.password else []
        if self.socket is not None:
            extra += ["--unixsocket", str(self.socket), "--unixsocketperm", "700"]
        if self.tls:
            extra += ["--tls-port", str(self.tls_port), "--tls-cert-file", str(self.tls["cert"]), "--tls-key-file",
                      str(self.tls["key"]), "--tls-ca-cert-file", str(self.tls["ca"]), "--tls-auth-clients", "no"]
        if self.user:
            # the ACL of docs/guide/shared-tier.md for KVBoost (less +client|setinfo, which Redis 7.0 does not know)
            extra += ["--user", self.user[0], "on", f">{self.user[1]}", "~kvboost:*", "+get", "+mget", "+set", "+del",
                      "+hsetnx", "+hgetall", "+scan", "+strlen", "+info", "+ping", "+select"]
        self.proc = subprocess.Popen(
            [BINARY, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.folder), *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if self.client().ping():
                    return self
            except Exception:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=2,
                           socket_connect_timeout=2)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def make_certificates(folder) -> dict:
    """A CA and a server certificate for 127.0.0.1 signed by it (PEM files in `folder`), for TLS tests."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    week = datetime.timedelta(days=7)

    def certificate(subject, key, issuer, issuer_key, ca):
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - week)
                   .not_valid_after(now + week)
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvboost test CA")])
    ca = certificate(ca_name, ca_key, ca_name, ca_key, True)
    server = certificate(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]), server_key, ca_name,
                         ca_key, False)
    paths = {"ca": folder / "ca.pem", "cert": folder / "server.pem", "key": folder / "server.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(server_key.private_bytes(serialization.Encoding.PEM,
                                                      serialization.PrivateFormat.TraditionalOpenSSL,
                                                      serialization.NoEncryption()))
    return paths


def running_redis(tmp_path):
    """The body of a test module's `redis_server` fixture: a started server, stopped after the test."""
    if BINARY is None:
        pytest.skip("redis-server is not installed (scripts/test.sh installs Debian's redis-server package when "
                    "run as root)")
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()

"""TCP listeners: plaintext on loopback only; TLS and mutual TLS through gRPC's
credentials, with certificates generated here (``cryptography``, an SGLang dependency)."""

from __future__ import annotations

import datetime
import ipaddress
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from compactor_service.client import GrpcCompactor
from compactor_service.tls import channel_credentials
from compactor_service.v1 import compactor_pb2 as pb
from sglang_evict.config import EvictionConfig
from tests.compactor_process import ROOT, CompactorProcess, call, make_pool
from tests.redis_server import free_port
from tests.test_compactor_service import two_request_plans


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject, key, issuer, issuer_key, *, ca: bool, sans=()):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(directory: Path, name: str, cert, key) -> tuple[str, str]:
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate
    signed by it, and a client certificate of an unrelated CA."""
    directory = tmp_path_factory.mktemp("pki")
    files = {}
    authorities = {}
    for ca_name in ("ca", "other-ca"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate(ca_name, key, ca_name, key, ca=True)
        authorities[ca_name] = (cert, key)
        files[ca_name] = _write(directory, ca_name, cert, key)
    sans = (x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    for name, ca_name, names in (
        ("server", "ca", sans),
        ("client", "ca", ()),
        ("stranger", "other-ca", ()),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        ca_key = authorities[ca_name][1]
        cert = _certificate(name, key, ca_name, ca_key, ca=False, sans=names)
        files[name] = _write(directory, name, cert, key)
    return files


def _run_compactor(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "compactor_service", "--no-socket", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'kernels'}"},
    )


@pytest.mark.parametrize("host", ["0.0.0.0", "[::]", "10.1.2.3", "compactor.example"])
def test_tcp_beyond_loopback_without_tls_is_refused_naming_the_flags(host):
    result = _run_compactor("--tcp", f"{host}:{free_port()}")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "--tls-cert" in lines[0] and "--tls-key" in lines[0] and "without TLS" in lines[0]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--tls-cert", "/nonexistent.crt"), "--tls-cert and --tls-key go together"),
        (("--tls-cert", "/nonexistent.crt", "--tls-key", "/nonexistent.key"), "cannot read"),
        (("--tls-client-ca", "/nonexistent.crt"), "--tls-client-ca needs --tls-cert"),
    ],
)
def test_bad_tls_flags_are_refused_in_one_line(flags, message):
    result = _run_compactor("--tcp", f"0.0.0.0:{free_port()}", *flags)
    assert result.returncode == 2 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def _stats(target: str, credentials) -> grpc.StatusCode:
    return call(target, "Stats", pb.StatsRequest(), timeout_s=10, credentials=credentials)[0]


def _credentials(pki, client: str | None, ca: str = "ca"):
    cert, key = pki[client] if client else (None, None)
    return channel_credentials(pki[ca][0], cert, key)


@pytest.fixture(scope="module")
def mtls_compactor(tmp_path_factory, pki):
    """Listens on every interface (allowed: TLS), requiring client certificates."""
    port = free_port()
    process = CompactorProcess(
        tmp_path_factory.mktemp("mtls"),
        "--tcp",
        f"0.0.0.0:{port}",
        "--tls-cert",
        pki["server"][0],
        "--tls-key",
        pki["server"][1],
        "--tls-client-ca",
        pki["ca"][0],
    ).start()
    yield process, f"127.0.0.1:{port}"
    process.stop()


def test_mutual_tls_admits_only_clients_with_a_certificate_of_its_ca(mtls_compactor, pki):
    _, target = mtls_compactor
    assert _stats(target, None) == grpc.StatusCode.UNAVAILABLE  # plaintext
    assert _stats(target, _credentials(pki, None)) == grpc.StatusCode.UNAVAILABLE  # no cert
    assert _stats(target, _credentials(pki, "stranger")) == grpc.StatusCode.UNAVAILABLE
    assert _stats(target, _credentials(pki, "client", ca="other-ca")) == (
        grpc.StatusCode.UNAVAILABLE  # the client does not trust the server's CA
    )
    assert _stats(target, _credentials(pki, "client")) == grpc.StatusCode.OK


def test_the_scheduler_client_compacts_over_mutual_tls(mtls_compactor, pki):
    _, target = mtls_compactor
    shared = make_pool()
    try:
        plans = two_request_plans()
        expected = [b.clone() for b in shared.k + shared.v]
        for plan in plans:
            for buffer in expected:
                buffer[plan.dst_slots] = buffer[plan.src_slots]
        client = GrpcCompactor(
            target, shared.layout, timeout_s=10, credentials=_credentials(pki, "client")
        )
        result = client.compact(plans)
        assert result.slots_moved == sum(p.num_moves for p in plans)
        assert all(torch.equal(a, b) for a, b in zip(shared.k + shared.v, expected, strict=True))
        assert client.healthy(timeout_s=5)
        client.close()
    finally:
        shared.close()


def test_compactor_health_probes_over_mutual_tls(mtls_compactor, pki):
    _, target = mtls_compactor
    probe = [sys.executable, "-m", "compactor_service.health", "--tcp", target]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'kernels'}"}
    with_cert = [*probe, "--tls-ca", pki["ca"][0], "--tls-cert", pki["client"][0]]
    with_cert += ["--tls-key", pki["client"][1]]
    ok = subprocess.run(with_cert, capture_output=True, text=True, timeout=60, env=env)
    assert ok.returncode == 0 and "SERVING" in ok.stdout
    refused = subprocess.run(probe, capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode == 1 and "NOT SERVING: UNAVAILABLE" in refused.stdout


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"compactor_address": "no-port"}, "--kv-compactor-address takes HOST:PORT"),
        ({"compactor_tls_ca": "/ca.crt"}, "add --kv-compactor-address"),
        (
            {"compactor_address": "127.0.0.1:1", "compactor_tls_cert": "/c.crt"},
            "need --kv-compactor-tls-ca",
        ),
        (
            {
                "compactor_address": "127.0.0.1:1",
                "compactor_tls_ca": "/ca.crt",
                "compactor_tls_cert": "/c.crt",
            },
            "go together",
        ),
    ],
)
def test_scheduler_tls_settings_are_checked_with_the_flag_named(fields, message):
    with pytest.raises(ValueError, match=message):
        EvictionConfig(kv_budget_tokens=512, **fields)

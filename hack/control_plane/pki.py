"""Certificates and keys for a loopback-only control plane: a CA, the apiserver's serving certificate, an
admin client certificate (group system:masters), the service-account signing key, and the aggregation
layer's front-proxy CA and client certificate (the apiserver's identity towards extension apiservers such as
KEDA's metrics apiserver)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=7)
SERVICE_CLUSTER_IP = "10.0.0.1"
FRONT_PROXY_CLIENT = "front-proxy-client"
APISERVER_DNS_NAMES = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    serving_cert: Path
    serving_key: Path
    admin_cert: Path
    admin_key: Path
    service_account_key: Path
    service_account_public_key: Path
    front_proxy_ca_cert: Path
    front_proxy_client_cert: Path
    front_proxy_client_key: Path


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attributes)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path.chmod(0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _builder(subject: x509.Name, issuer: x509.Name, public_key: object) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    # Key identifiers: strict verifiers (Python 3.13's default SSL context, as pods running Debian 13's
    # python3 use) refuse a chain without them.
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)  # type: ignore[arg-type]
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)  # type: ignore[arg-type]
    )


def _leaf(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_name: x509.Name,
    subject: x509.Name,
    usage: x509.ObjectIdentifier,
    alt_names: list[x509.GeneralName] | None = None,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        _builder(subject, ca_name, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if alt_names:
        builder = builder.add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def _certificate_authority(common_name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(common_name)
    usage = x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=True,
        crl_sign=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        encipher_only=False,
        decipher_only=False,
    )
    cert = (
        _builder(name, name, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(usage, critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def generate(directory: Path, extra_ips: tuple[str, ...] = ()) -> Pki:
    """Write a fresh set of certificates and keys into `directory` and return their paths; the apiserver's
    certificate also names `extra_ips`."""
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(
        ca_cert=directory / "ca.crt",
        serving_cert=directory / "apiserver.crt",
        serving_key=directory / "apiserver.key",
        admin_cert=directory / "admin.crt",
        admin_key=directory / "admin.key",
        service_account_key=directory / "service-account.key",
        service_account_public_key=directory / "service-account.pub",
        front_proxy_ca_cert=directory / "front-proxy-ca.crt",
        front_proxy_client_cert=directory / "front-proxy-client.crt",
        front_proxy_client_key=directory / "front-proxy-client.key",
    )
    ca_cert, ca_key = _certificate_authority("warmstart-local-ca")
    ca_name = ca_cert.subject
    _write_cert(pki.ca_cert, ca_cert)

    alt_names: list[x509.GeneralName] = [x509.DNSName(name) for name in APISERVER_DNS_NAMES]
    apiserver_ips = ("127.0.0.1", SERVICE_CLUSTER_IP, *extra_ips)
    alt_names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in apiserver_ips]
    serving, serving_key = _leaf(
        ca_key, ca_name, _name("kube-apiserver"), ExtendedKeyUsageOID.SERVER_AUTH, alt_names
    )
    _write_cert(pki.serving_cert, serving)
    _write_key(pki.serving_key, serving_key)

    admin, admin_key = _leaf(
        ca_key, ca_name, _name("admin", "system:masters"), ExtendedKeyUsageOID.CLIENT_AUTH
    )
    _write_cert(pki.admin_cert, admin)
    _write_key(pki.admin_key, admin_key)

    service_account_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_key(pki.service_account_key, service_account_key)
    pki.service_account_public_key.write_bytes(
        service_account_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )

    # A CA of its own: a client certificate from the main CA can never pass as the aggregator.
    front_ca, front_ca_key = _certificate_authority("warmstart-front-proxy-ca")
    _write_cert(pki.front_proxy_ca_cert, front_ca)
    client, client_key = _leaf(
        front_ca_key, front_ca.subject, _name(FRONT_PROXY_CLIENT), ExtendedKeyUsageOID.CLIENT_AUTH
    )
    _write_cert(pki.front_proxy_client_cert, client)
    _write_key(pki.front_proxy_client_key, client_key)
    return pki

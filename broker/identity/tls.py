"""TLS for Redis (``rediss://``): the run's own certificate authority and the
Redis server's certificate, made by ``ddiloco keys`` (docs/security.md).

Files in the run's key folder (0600)::

    tls.ca.crt   the run's CA certificate, PEM            (everyone: clients check
                                                           the server against it)
    tls.ca.key   the CA's private key                     (the operator only: it
                                                           issues server certificates)
    redis.crt    the Redis server's certificate, PEM      (the Redis server)
    redis.key    its private key                          (the Redis server)

Clients authenticate the server (its certificate names the host they dial);
the server authenticates clients by their ACL user and password, not by
certificates, so a learner needs nothing but the CA certificate.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from broker.errors import ConfigError
from broker.files import write_private

TLS_CA = "tls.ca.crt"
TLS_CA_KEY = "tls.ca.key"
REDIS_CERT = "redis.crt"
REDIS_KEY = "redis.key"
# Names the Redis server is reached by unless told otherwise: this host, and
# the compose files' service names (compose.sentinel.yaml's servers and
# Sentinels show the same certificate).
DEFAULT_REDIS_HOSTS = (
    "localhost", "127.0.0.1", "::1", "redis", "redis-replica",
    "sentinel-1", "sentinel-2", "sentinel-3",
)  # fmt: skip
_CA_DAYS = 3650
_SERVER_DAYS = 397  # what browsers accept for a server certificate; rotate within it


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()


def _pem_cert(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def _subject_names(hosts: tuple[str, ...]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def make_tls(folder: Path, hosts: tuple[str, ...] = DEFAULT_REDIS_HOSTS) -> None:
    """A new CA and a Redis server certificate for ``hosts``, in ``folder``."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ddiloco run CA")])
    start = _now() - datetime.timedelta(minutes=5)  # clocks a little behind still accept it
    ca = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=_CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .sign(ca_key, hashes.SHA256())
    )
    write_private(folder / TLS_CA_KEY, _pem_key(ca_key))
    write_private(folder / TLS_CA, _pem_cert(ca))
    issue_redis_cert(folder, hosts)


def _load_ca(folder: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        ca = x509.load_pem_x509_certificate((folder / TLS_CA).read_bytes())
        key = serialization.load_pem_private_key((folder / TLS_CA_KEY).read_bytes(), None)
    except FileNotFoundError as e:
        raise ConfigError(
            f"{e.filename}: missing; make the run's keys with `ddiloco keys`"
        ) from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{folder / TLS_CA_KEY}: not the EC key `ddiloco keys` makes")
    return ca, key


def issue_redis_cert(folder: Path, hosts: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """A new key and certificate for the Redis server, signed by the run's CA
    (``ddiloco keys rotate-tls``): for ``hosts``, or the names the current
    certificate holds. Returns the names. Redis takes it up when told
    (``CONFIG SET tls-cert-file ... tls-key-file ...``); connections open keep
    the old one, new ones get the new."""
    ca, ca_key = _load_ca(folder)
    if hosts is None:
        hosts = redis_cert_hosts(folder)
    key = ec.generate_private_key(ec.SECP256R1())
    start = _now() - datetime.timedelta(minutes=5)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=_SERVER_DAYS))
        .add_extension(x509.SubjectAlternativeName(_subject_names(hosts)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    write_private(folder / REDIS_KEY, _pem_key(key))
    write_private(folder / REDIS_CERT, _pem_cert(cert))
    return hosts


def redis_cert_hosts(folder: Path) -> tuple[str, ...]:
    """The host names and addresses the Redis server's certificate holds."""
    cert = x509.load_pem_x509_certificate((folder / REDIS_CERT).read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return tuple(str(n.value) for n in names)


def redis_server_tls_args(folder: Path, port: int) -> list[str]:
    """``redis-server`` arguments for TLS only on ``port``, with the folder's files."""
    return [
        "--port", "0",
        "--tls-port", str(port),
        "--tls-cert-file", str(folder / REDIS_CERT),
        "--tls-key-file", str(folder / REDIS_KEY),
        "--tls-ca-cert-file", str(folder / TLS_CA),
        "--tls-auth-clients", "no",  # clients prove who they are by their ACL user
    ]  # fmt: skip

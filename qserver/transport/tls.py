"""TLS on every link: clients (HTTP and WebSocket), peer links and membership links.

A node with `tls_cert_file` and `tls_key_file` serves HTTPS and WSS on its port and on its
membership port; it dials its peers (both kinds of link) over TLS and checks their
certificates against `tls_ca_file`. Peers still authenticate each other with the cluster
secret (qserver/transport/peers.py): TLS adds privacy and the server's identity on the wire. Clients
check a node's certificate against the CA file their credentials name (`ca_file`) or that
`qctl --ca-file` gives.

`qserver init --tls` makes what a cluster on one machine (or a compose file) needs, under the
data directory's `tls/`: the first node a local CA (ca.pem, ca-key.pem; the key stays with
the first node) and each node a certificate for its host names signed by it (node.pem,
node-key.pem); a joining node (`--join`) takes the CA of the node it joins.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

TLS_DIR = "tls"
CA_FILE, CA_KEY_FILE, NODE_FILE, NODE_KEY_FILE = "ca.pem", "ca-key.pem", "node.pem", "node-key.pem"
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
CA_DAYS, NODE_DAYS = 3650, 825


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    return context


def client_context(ca_file: str) -> ssl.SSLContext:
    """Verifies the server's certificate and host name against this CA only."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def make_tls_files(data_dir: Path, node_id: str, hosts: tuple[str, ...] = DEFAULT_HOSTS,
                   ca_from: Path | None = None) -> dict[str, str]:
    """A node's TLS files under data_dir/tls: its certificate for `hosts` signed by the CA of
    `ca_from` (another node's data directory) or by a new CA made here. Returns the
    configuration keys that name them."""
    target = data_dir / TLS_DIR
    target.mkdir(parents=True, exist_ok=True)
    source = (ca_from / TLS_DIR) if ca_from is not None else target
    if ca_from is None:
        _write_ca(target)
    ca_cert = x509.load_pem_x509_certificate((source / CA_FILE).read_bytes())
    ca_key = serialization.load_pem_private_key((source / CA_KEY_FILE).read_bytes(), password=None)
    if ca_from is not None:
        (target / CA_FILE).write_bytes((source / CA_FILE).read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    now = datetime.datetime.now(datetime.UTC)
    certificate = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"qserver {node_id}")]))
                   .issuer_name(ca_cert.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=NODE_DAYS))
                   .add_extension(x509.SubjectAlternativeName(names), critical=False)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                         ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                   .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    (target / NODE_FILE).write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    _write_private(target / NODE_KEY_FILE, key)
    return {"tls_cert_file": str(target / NODE_FILE), "tls_key_file": str(target / NODE_KEY_FILE),
            "tls_ca_file": str(target / CA_FILE)}


def _write_ca(target: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "qserver local CA")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
                   .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                   .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                content_commitment=False, key_encipherment=False,
                                                data_encipherment=False, key_agreement=False,
                                                encipher_only=False, decipher_only=False), critical=True)
                   .sign(key, hashes.SHA256()))
    (target / CA_FILE).write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    _write_private(target / CA_KEY_FILE, key)


def _write_private(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)

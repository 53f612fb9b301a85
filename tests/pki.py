"""Certificates made on the spot for TLS tests: a CA, a server certificate for 127.0.0.1/localhost, a client
certificate (both signed by the CA) and an unrelated CA, as PEM bytes and as files (servers and clients take paths)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def certificate(subject: str, key, issuer: str, issuer_key, ca: bool = False) -> bytes:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:  # what the client checks the server's name against
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_pki(out: Path) -> dict:
    """{"ca", "server": (key, cert), "client": (key, cert), "other_ca"} as PEM bytes, and the same as files under
    `out`: "ca_path", "server_key_path", "server_cert_path", "client_key_path", "client_cert_path"."""
    ca_key, server_key, client_key, other_key = new_key(), new_key(), new_key(), new_key()
    ca = certificate("test-ca", ca_key, "test-ca", ca_key, ca=True)
    pki = {"ca": ca,
           "server": (pem_key(server_key), certificate("server", server_key, "test-ca", ca_key)),
           "client": (pem_key(client_key), certificate("client", client_key, "test-ca", ca_key)),
           "other_ca": certificate("other-ca", other_key, "other-ca", other_key, ca=True)}
    files = {"ca_path": ("ca.pem", ca), "server_key_path": ("server.key", pki["server"][0]),
             "server_cert_path": ("server.pem", pki["server"][1]), "client_key_path": ("client.key", pki["client"][0]),
             "client_cert_path": ("client.pem", pki["client"][1])}
    for name, (filename, data) in files.items():
        (out / filename).write_bytes(data)
        pki[name] = str(out / filename)
    return pki

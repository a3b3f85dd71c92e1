"""The cluster's keys and certificates: one CA, a serving certificate for everything that listens
on 127.0.0.1 (the API server and the JobSet and Kueue webhooks), an admin client certificate and
the service-account signing key. Written once per cluster folder; valid for a year."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

# Kueue's certificate rotator (it runs when Kueue does not read its metrics certificate from a
# fixed /etc/kueue path) keeps a certificate it is given only if the CA names itself "kueue-ca"
# and the serving certificate its webhook Service's DNS name.
KUEUE_CA_NAME = "kueue-ca"
KUEUE_WEBHOOK_NAME = "kueue-webhook-service.kueue-system.svc"
SERVING_NAMES = ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                 KUEUE_WEBHOOK_NAME)
SERVING_IPS = ("127.0.0.1", "10.96.0.1")  # loopback; the `kubernetes` Service's cluster IP
ADMIN = ("gemmalab-admin", "system:masters")  # a member of system:masters: every permission


def _key() -> rsa.RSAPrivateKey:
    # RSA in PKCS#1 PEM: Kueue's certificate rotator (cert-controller) reads nothing else.
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _write_key(key, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.TraditionalOpenSSL,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _certificate(subject: x509.Name, key, issuer: x509.Name, issuer_key, *, ca: bool,
                 extensions=()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=365))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    for extension in extensions:
        builder = builder.add_extension(extension, critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write_cert(cert: x509.Certificate, path: Path) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def ensure(folder: Path) -> Path:
    """Create the files below ``folder`` unless they exist; returns ``folder``."""
    if (folder / "ca.crt").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gemmalab-local-ca")])
    ca = _certificate(ca_name, ca_key, ca_name, ca_key, ca=True, extensions=[
        x509.SubjectAlternativeName([x509.DNSName(KUEUE_CA_NAME)])])

    serving_key = _key()
    names = [x509.DNSName(n) for n in SERVING_NAMES]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in SERVING_IPS]
    serving = _certificate(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gemmalab-local")]), serving_key,
        ca_name, ca_key, ca=False,
        extensions=[x509.SubjectAlternativeName(names),
                    x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH])])

    admin_key = _key()
    admin = _certificate(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ADMIN[0]),
                   x509.NameAttribute(NameOID.ORGANIZATION_NAME, ADMIN[1])]),
        admin_key, ca_name, ca_key, ca=False,
        extensions=[x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH])])

    service_accounts = _key()
    for name, key in (("ca", ca_key), ("serving", serving_key), ("admin", admin_key),
                      ("service-accounts", service_accounts)):
        _write_key(key, folder / f"{name}.key")
    for name, cert in (("ca", ca), ("serving", serving), ("admin", admin)):
        _write_cert(cert, folder / f"{name}.crt")
    (folder / "service-accounts.pub").write_bytes(service_accounts.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    # controller-runtime's webhook servers read tls.crt/tls.key from their certDir.
    webhook_certs = folder / "webhook"
    webhook_certs.mkdir(exist_ok=True)
    (webhook_certs / "tls.crt").write_bytes((folder / "serving.crt").read_bytes())
    _write_key(serving_key, webhook_certs / "tls.key")
    return folder


def kubeconfig(folder: Path, server: str) -> str:
    """The admin kubeconfig (YAML) for the API server at ``server``."""
    import yaml

    return yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "gemmalab-local",
        "clusters": [{"name": "gemmalab-local", "cluster": {
            "server": server, "certificate-authority": str(folder / "ca.crt")}}],
        "users": [{"name": "gemmalab-admin", "user": {
            "client-certificate": str(folder / "admin.crt"),
            "client-key": str(folder / "admin.key")}}],
        "contexts": [{"name": "gemmalab-local", "context": {
            "cluster": "gemmalab-local", "user": "gemmalab-admin", "namespace": "default"}}],
    }, sort_keys=False)

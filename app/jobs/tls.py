"""The embedded cluster's TLS credentials, made afresh at each start: a self-signed key and
certificate that every process of the cluster (scheduler, workers, nannies, the job runner)
presents and trusts, as `distributed.Security.temporary()` makes them. Dask's TLS is mutual: a
listener refuses a peer without a certificate of its CA, so nothing without these files can
talk to the cluster.

Standard library and cryptography only (no Dask): gunicorn's master makes them before it
spawns the cluster's supervisor.
"""
import datetime
import os
import tempfile

PREFIX = "DASK_DISTRIBUTED__COMM__"


def credentials() -> tuple[str, dict[str, str]]:
    """(a new 0700 directory holding key.pem and cert.pem, 0600, the Dask configuration that makes
    a process of any role use them, as environment variables)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())  # EC: far quicker to make than RSA (docs/jobs.md)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "blockgrad-dask")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    directory = tempfile.mkdtemp(prefix="blockgrad-dask-tls-")  # 0700
    files = {"key.pem": key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()),
             "cert.pem": cert.public_bytes(serialization.Encoding.PEM)}
    for file, data in files.items():
        fd = os.open(os.path.join(directory, file), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
    cert_path, key_path = (os.path.join(directory, file) for file in ("cert.pem", "key.pem"))
    env = {f"{PREFIX}REQUIRE_ENCRYPTION": "True", f"{PREFIX}TLS__CA_FILE": cert_path}
    for role in ("SCHEDULER", "WORKER", "CLIENT"):
        env |= {f"{PREFIX}TLS__{role}__CERT": cert_path, f"{PREFIX}TLS__{role}__KEY": key_path}
    return directory, env

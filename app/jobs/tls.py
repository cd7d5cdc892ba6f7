"""The embedded cluster's TLS credentials, made afresh at each start: a self-signed key and
certificate that every process of the cluster (scheduler, workers, nannies, the job runner)
presents and trusts, as `distributed.Security.temporary()` makes them. Dask's TLS is mutual: a
listener refuses a peer without a certificate of its CA, so nothing without them can talk to
the cluster.

They are Dask configuration in the environment, PEM text in place of file names (Dask takes
either): only the processes given that environment have them, no file outlives the service
(a SIGKILLed one included), and /proc shows a process's environment to its own user only.
Standard library and cryptography only (no Dask): gunicorn's master makes them before it
spawns the cluster's supervisor.
"""
import datetime

PREFIX = "DASK_DISTRIBUTED__COMM__"


def credentials() -> dict[str, str]:
    """The Dask configuration, as environment variables, that makes a process of any role speak
    TLS with a key and certificate made now."""
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
    cert_pem = cert.public_bytes(serialization.Encoding.PEM).decode()
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()).decode()
    env = {f"{PREFIX}REQUIRE_ENCRYPTION": "True", f"{PREFIX}TLS__CA_FILE": cert_pem}
    for role in ("SCHEDULER", "WORKER", "CLIENT"):
        env |= {f"{PREFIX}TLS__{role}__CERT": cert_pem, f"{PREFIX}TLS__{role}__KEY": key_pem}
    return env

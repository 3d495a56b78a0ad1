"""``vllite serve``'s HTTP flags with vLLM's names and defaults: TLS (``--ssl-keyfile/--ssl-certfile/--ssl-ca-certs/
--ssl-cert-reqs``, tested with a self-signed certificate made here), CORS (``--allowed-origins/-methods/-headers``,
``--allow-credentials``) and ``--root-path``; each bad value stops the start-up naming its flag."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import ssl
import subprocess
import sys

import pytest
from http_client import request

from vllite.plugins.openai_server.testing import RemoteServer

openai = pytest.importorskip("openai")


def make_self_signed(directory) -> tuple[str, str]:
    """A key and a certificate for 127.0.0.1 / localhost (``cryptography`` when installed, else ``openssl``)."""
    key, cert = str(directory / "key.pem"), str(directory / "cert.pem")
    try:
        return _with_cryptography(key, cert)
    except ImportError:
        pass
    if shutil.which("openssl") is None:
        pytest.skip("needs the cryptography package or the openssl command to make a certificate")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True,
    )  # fmt: skip
    return key, cert


def _with_cryptography(key_path: str, cert_path: str) -> tuple[str, str]:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    alt = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(alt, critical=False)
        .sign(key, hashes.SHA256())
    )
    with open(key_path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))  # fmt: skip
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    key, cert = make_self_signed(tmp_path_factory.mktemp("tls"))
    args = ["--served-model-name", "demo", "--max-model-len", "256", "--ssl-keyfile", key, "--ssl-certfile", cert,
            "--root-path", "/api", "--allowed-origins", '["https://app.example"]', "--allowed-methods", "GET,POST",
            "--allow-credentials"]  # fmt: skip
    server = RemoteServer(args, timeout_s=180)
    server.context = ssl.create_default_context(cafile=cert)
    try:
        yield server
    finally:
        server.stop()


def test_tls_serves_https_to_the_openai_client(tls):
    assert tls.url.startswith("https://127.0.0.1:")
    http_client = openai.DefaultHttpxClient(verify=tls.context)
    with openai.OpenAI(base_url=tls.url + "/v1", api_key="x", http_client=http_client, max_retries=0) as client:
        assert [m.id for m in client.models.list().data] == ["demo"]
        completion = client.completions.create(model="demo", prompt="Hello", max_tokens=3)
        assert completion.usage.completion_tokens == 3


def test_tls_refuses_plain_http_and_untrusted_clients(tls):
    plain_url = tls.url.replace("https://", "http://") + "/health"
    with pytest.raises(Exception):  # noqa: B017 - the connection is dropped: any transport error
        request("GET", plain_url, timeout=10)
    with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"):  # not signed by a CA the client trusts
        request("GET", tls.url + "/health", context=ssl.create_default_context(), timeout=10)
    assert request("GET", tls.url + "/health", context=tls.context).status_code == 200


def test_root_path_serves_under_the_prefix_and_as_stripped_by_a_proxy(tls):
    assert request("GET", tls.url + "/api/v1/models", context=tls.context).json()["data"][0]["id"] == "demo"
    assert request("GET", tls.url + "/v1/models", context=tls.context).status_code == 200


def test_cors_flags(tls):
    allowed = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    preflight = request("OPTIONS", tls.url + "/v1/completions", headers=allowed, context=tls.context)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    assert preflight.headers["access-control-allow-credentials"] == "true"
    assert set(preflight.headers["access-control-allow-methods"].replace(" ", "").split(",")) == {"GET", "POST"}
    other = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    assert request("OPTIONS", tls.url + "/v1/completions", headers=other, context=tls.context).status_code == 400
    delete = {"Origin": "https://app.example", "Access-Control-Request-Method": "DELETE"}
    assert request("OPTIONS", tls.url + "/v1/completions", headers=delete, context=tls.context).status_code == 400
    simple = request("GET", tls.url + "/v1/models", headers={"Origin": "https://evil.example"}, context=tls.context)
    assert "access-control-allow-origin" not in {k.lower() for k in simple.headers}


def _settings(*argv: str):
    from vllite.plugins.openai_server.cli import add_serve_arguments, server_settings

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return server_settings(parser.parse_args(list(argv)), "demo")


def test_cors_defaults_are_vllms():
    settings = _settings()
    assert settings.allowed_origins == settings.allowed_methods == settings.allowed_headers == ("*",)
    assert settings.allow_credentials is False and settings.root_path == ""
    assert _settings("--allowed-headers", '["X-A", "X-B"]').allowed_headers == ("X-A", "X-B")


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--allowed-origins", "[not json"], "--allowed-origins"),
        (["--allowed-methods", '{"GET": 1}'], "--allowed-methods"),
        (["--ssl-keyfile", "k.pem"], "--ssl-keyfile"),
        (["--ssl-keyfile", "/no/such/key.pem", "--ssl-certfile", "/no/such/cert.pem"], "--ssl-keyfile"),
        (["--ssl-cert-reqs", "7"], "--ssl-cert-reqs"),
        (["--ssl-cert-reqs", "2"], "--ssl-ca-certs"),
        (["--root-path", "api"], "--root-path"),
    ],
)
def test_bad_http_flags_name_the_flag(argv, flag):
    with pytest.raises(ValueError, match=re.escape(flag)):
        _settings(*argv)


def test_a_bad_flag_stops_vllite_serve_before_the_engine_starts():
    argv = [sys.executable, "-m", "vllite.cli", "serve", "--port", "0", "--root-path", "no-slash"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ})
    assert done.returncode != 0
    assert "--root-path must start with '/'" in done.stdout + done.stderr

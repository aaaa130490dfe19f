"""TLS, optional: HTTPS on the proxy's listener (the openai client trusting a CA file) and
on the proxy's connections to P, D and the bootstrap sidecars (verified with
upstream_ca_file)."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
from pathlib import Path

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.proxy.conftest import MakeCluster


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_pki(out: Path, cn: str = "ca") -> tuple[Path, Path, Path]:
    """(CA file, certificate, key): a CA and a server certificate for 127.0.0.1."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(_name("proxy")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    out.mkdir(parents=True, exist_ok=True)
    ca_file, cert_file, key_file = out / "ca.pem", out / "cert.pem", out / "key.pem"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return ca_file, cert_file, key_file


def _server_ctx(cert: Path, key: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    return ctx


async def test_https_listener_with_the_openai_client_and_a_ca_file(
        make_cluster: MakeCluster, tmp_path: Path) -> None:
    ca, cert, key = make_pki(tmp_path)
    c = await make_cluster(tls_cert_file=str(cert), tls_key_file=str(key), ready=False)
    assert c.url.startswith("https://")
    async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=str(ca))) as http:
        for _ in range(100):
            if (await http.get(c.url + "/health")).status_code == 200:
                break
            await asyncio.sleep(0.05)
        client = openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="unused", http_client=http)
        answer = await client.completions.create(model="m", prompt="hi", max_tokens=4)
        assert answer.choices[0].text
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True)
        assert [chunk async for chunk in stream]
    # A client that does not trust the CA cannot talk to it.
    async with httpx.AsyncClient() as http:
        client = openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="unused", http_client=http,
                                    max_retries=0)
        with pytest.raises(openai.APIConnectionError):
            await client.completions.create(model="m", prompt="hi", max_tokens=4)


async def test_https_upstreams_verified_with_the_ca_file(make_cluster: MakeCluster,
                                                         tmp_path: Path) -> None:
    ca, cert, key = make_pki(tmp_path)
    c = await make_cluster(upstream_tls=_server_ctx(cert, key), upstream_ca_file=str(ca))
    assert c.prefill[0].url.startswith("https://")
    status = (await c.post())[0]
    assert status == 200
    assert c.prefill[0].received and c.decode[0].received


async def test_https_upstream_with_an_untrusted_certificate_is_refused(
        make_cluster: MakeCluster, tmp_path: Path) -> None:
    ca, cert, key = make_pki(tmp_path / "node")
    other_ca, _, _ = make_pki(tmp_path / "other", cn="other")
    c = await make_cluster(upstream_tls=_server_ctx(cert, key),
                           upstream_ca_file=str(other_ca), ready=False)
    status = (await c.post())[0]
    assert status >= 500  # never sent in the clear, never to an unverified node
    assert not c.decode[0].received and not c.prefill[0].received


def test_tls_settings_go_together(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from appliance.proxy import ProxySettings

    with pytest.raises(ValidationError, match="go together"):
        ProxySettings(tls_cert_file=str(tmp_path / "c.pem"))
    with pytest.raises(ValueError, match="tls_cert_file"):
        ProxySettings(tls_cert_file=str(tmp_path / "c.pem"),
                      tls_key_file=str(tmp_path / "k.pem")).listener_ssl()

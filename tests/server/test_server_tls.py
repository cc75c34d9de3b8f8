"""`plait serve --ssl-keyfile K --ssl-certfile C` serves HTTPS (SGLang's and vLLM's flags), with a
self-signed certificate made by the openssl command line."""

from __future__ import annotations

import shutil
import subprocess
import time

import httpx
import pytest

from tests.server.conftest import HTTP_TIMEOUT, STARTUP_TIMEOUT

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


@pytest.fixture(scope="module")
def tls_server(start_server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    srv = start_server("tls", wait=False, ssl_keyfile=key, ssl_certfile=cert)
    url = f"https://127.0.0.1:{srv.port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        assert srv.proc.poll() is None, srv.log()
        try:
            if httpx.get(url + "/health", verify=False, timeout=1.0).status_code == 200:
                return srv, url, cert
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"no HTTPS answer:\n{srv.log()}")


def test_https_serves_a_completion_verified_against_the_certificate(tls_server):
    srv, url, cert = tls_server
    r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3}, verify=str(cert),
                   timeout=HTTP_TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def test_plain_http_gets_no_answer_on_the_https_port(tls_server):
    srv, _, _ = tls_server
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=HTTP_TIMEOUT)


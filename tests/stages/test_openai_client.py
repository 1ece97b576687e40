"""The OpenAI-compatible client's retries, against a local HTTP server that answers from a script."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from stages.openai_client import EndpointError, OpenAIClient


class Scripted:
    """Answers POSTs with the next (status, headers, body) of `script`; the last one repeats."""

    def __init__(self, script):
        self.script, self.seen = list(script), []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                outer.seen.append(dict(self.headers))
                self.rfile.read(int(self.headers["Content-Length"]))
                status, headers, body = outer.script.pop(0) if len(outer.script) > 1 else outer.script[0]
                data = json.dumps(body).encode()
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


OK = (200, {}, {"choices": [{"message": {"content": "1"}}]})


def test_429_and_5xx_are_retried_with_backoff_and_counted():
    server = Scripted([(503, {}, {"error": {"message": "overloaded"}}), (429, {"Retry-After": "0.2"}, {}),
                       (502, {}, "bad gateway"), OK])
    waits = []
    client = OpenAIClient(server.url, "sk-abc", max_retries=4, backoff=0.5, sleep=waits.append)
    try:
        assert client.chat("m", [{"role": "user", "content": "hi"}]) == "1"
    finally:
        server.close()
    assert client.retries == 3 and len(server.seen) == 4
    # backoff 0.5 then doubled (with up to 10% jitter); Retry-After honoured for the 429
    assert 0.5 <= waits[0] <= 0.55 and waits[1] == 0.2 and 2.0 <= waits[2] <= 2.2
    assert server.seen[0]["Authorization"] == "Bearer sk-abc"


def test_a_server_that_stays_down_fails_with_endpoint_last_error_and_retries():
    server = Scripted([(500, {}, {"error": {"message": "boom"}})])
    client = OpenAIClient(server.url, "sk-abc", max_retries=2, backoff=0.01, sleep=lambda s: None)
    try:
        with pytest.raises(EndpointError) as err:
            client.post("/chat/completions", {})
    finally:
        server.close()
    assert str(err.value) == f"{server.url}/chat/completions failed after 2 retries; last error: HTTP 500: boom"
    assert err.value.retries == 2 and err.value.status == 500 and "sk-abc" not in str(err.value) + repr(client)


def test_other_http_errors_are_not_retried():
    server = Scripted([(400, {}, {"detail": "bad field"})])  # FastAPI's shape (transformers serve)
    client = OpenAIClient(server.url, max_retries=5, backoff=0.01, sleep=lambda s: None)
    try:
        with pytest.raises(EndpointError, match="answered HTTP 400: bad field"):
            client.post("/completions", {})
    finally:
        server.close()
    assert client.retries == 0 and len(server.seen) == 1 and "Authorization" not in server.seen[0]

"""A small client of OpenAI-compatible HTTP endpoints (`vllm serve`, `transformers serve`, hosted APIs), with retries.

Standard library only. Timeouts, refused connections, HTTP 429 and 5xx are retried with exponential
backoff (a `Retry-After` header is honoured, capped at `max_backoff`); every retry is counted in
`client.retries`. Other HTTP errors (400, 401, 404...) are not retried: they will not get better.
When the retries are spent, `EndpointError` names the endpoint, the last error and how many
retries were made. The API key is sent as a bearer header and kept nowhere else: not in errors,
not in logs, not in any record.
"""
from __future__ import annotations

import http.client
import json
import random
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

RETRIED_STATUS = (429, 500, 502, 503, 504)


class EndpointError(RuntimeError):
    """An endpoint that answered with an error, or stayed unreachable through every retry."""

    def __init__(self, message: str, *, endpoint: str = "", status: int | None = None, retries: int = 0):
        super().__init__(message)
        self.endpoint, self.status, self.retries = endpoint, status, retries


class OpenAIClient:
    """POST/GET JSON to `base_url` (the `.../v1` URL).

    Args:
        api_key: sent as `Authorization: Bearer`; None: no header.
        timeout: seconds to wait for one answer.
        max_retries: retries of one request after the first try (0: none).
        backoff: seconds before the first retry; doubled each time (with up to 10% jitter), at most `max_backoff`.
        sleep: how to wait (tests pass a recorder).
    """

    def __init__(self, base_url: str, api_key: str | None = None, *, timeout: float = 60.0, max_retries: int = 4,
                 backoff: float = 1.0, max_backoff: float = 30.0, sleep: Callable[[float], None] = time.sleep):
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key
        self.timeout, self.max_retries, self.backoff, self.max_backoff = timeout, max_retries, backoff, max_backoff
        self.sleep = sleep
        self.retries = 0  # every retry of every request, for the record
        self.requests = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:  # never shows the key
        return f"OpenAIClient({self.base_url!r}, retries={self.retries})"

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        return headers

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.send("POST", path, json.dumps(body).encode())

    def get(self, path: str) -> dict[str, Any]:
        return self.send("GET", path, None)

    def send(self, method: str, path: str, data: bytes | None) -> dict[str, Any]:
        url = self.base_url + path
        with self._lock:
            self.requests += 1
        attempt = 0
        while True:
            request = urllib.request.Request(url, data=data, headers=self.headers(), method=method)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as r:
                    return json.loads(r.read())
            except urllib.error.HTTPError as e:
                detail = error_message(e.read())
                if e.code not in RETRIED_STATUS:
                    raise EndpointError(f"{url} answered HTTP {e.code}: {detail}", endpoint=url, status=e.code,
                                        retries=attempt) from None
                last, status, wait_hint = f"HTTP {e.code}: {detail}", e.code, retry_after(e.headers.get("Retry-After"))
            except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException) as e:
                last, status, wait_hint = f"{type(e).__name__}: {getattr(e, 'reason', e)}", None, None
            if attempt >= self.max_retries:
                raise EndpointError(f"{url} failed after {attempt} retries; last error: {last}", endpoint=url,
                                    status=status, retries=attempt)
            attempt += 1
            with self._lock:
                self.retries += 1
            delay = min(self.max_backoff, self.backoff * 2 ** (attempt - 1) * (1 + 0.1 * random.random()))
            self.sleep(min(self.max_backoff, wait_hint) if wait_hint is not None else delay)

    def served_models(self) -> list[str]:
        return [m.get("id") for m in self.get("/models").get("data", [])]

    def chat(self, model: str, messages: list[dict[str, str]], **options: Any) -> str:
        """The first choice's message text of a `/chat/completions` request."""
        answer = self.post("/chat/completions", {"model": model, "messages": messages, **options})
        choices = answer.get("choices") or []
        if not choices:
            raise EndpointError(f"{self.base_url}/chat/completions returned no choices", endpoint=self.base_url)
        return choices[0].get("message", {}).get("content") or ""


def retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def error_message(raw: bytes) -> str:
    try:
        data = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:500]
    err = data.get("error", data.get("detail", data)) if isinstance(data, dict) else data  # OpenAI's or FastAPI's
    if isinstance(err, dict):
        return str(err.get("message", err))[:500]
    return str(err)[:500]

"""A small plain-HTTP client on the standard library for the server tests: any method, query parameters (a list
value repeats the key), a JSON body, streamed lines, and every status answered (never raised)."""

from __future__ import annotations

import json as jsonlib
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any


class HttpResponse:
    """The status, headers and body of one answer."""

    def __init__(self, status_code: int, headers: dict[str, str], content: bytes) -> None:
        self.status_code = status_code
        self.headers = headers
        self.content = content

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def json(self) -> Any:
        return jsonlib.loads(self.content)


def _build(method: str, url: str, params: dict[str, Any] | None, json: Any, headers: dict[str, str] | None) -> Any:
    if params:
        url += "?" + urllib.parse.urlencode(params, doseq=True)
    data = None
    all_headers = dict(headers or {})
    if json is not None:
        data = jsonlib.dumps(json).encode()
        all_headers.setdefault("Content-Type", "application/json")
    elif method in ("POST", "PUT"):
        data = b""
    return urllib.request.Request(url, data=data, method=method, headers=all_headers)


def request(
    method: str,
    url: str,
    *,
    params: dict[str, Any] | None = None,
    json: Any = None,
    headers: dict[str, str] | None = None,
    context: ssl.SSLContext | None = None,
    timeout: float = 60,
) -> HttpResponse:
    """One request; an HTTP error status is returned as a response."""
    req = _build(method, url, params, json, headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as response:
            return HttpResponse(response.status, dict(response.headers.items()), response.read())
    except urllib.error.HTTPError as exc:
        return HttpResponse(exc.code, dict(exc.headers.items()), exc.read())


class HttpClient:
    """``request`` against one base URL with default headers."""

    def __init__(self, base_url: str, *, headers: dict[str, str] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = dict(headers or {})

    def request(self, method: str, path: str, **kwargs: Any) -> HttpResponse:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        return request(method, self.base_url + path, headers=headers, **kwargs)

    def get(self, path: str, **kwargs: Any) -> HttpResponse:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> HttpResponse:
        return self.request("POST", path, **kwargs)

    def options(self, path: str, **kwargs: Any) -> HttpResponse:
        return self.request("OPTIONS", path, **kwargs)

    def stream_lines(self, method: str, path: str, *, json: Any = None) -> Iterator[str]:
        """The answer's lines as they arrive."""
        req = _build(method, self.base_url + path, None, json, self.headers)
        with urllib.request.urlopen(req, timeout=60) as response:
            for raw in response:
                yield raw.decode().rstrip("\r\n")

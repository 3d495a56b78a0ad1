"""A stand-in for the Hugging Face Hub on loopback HTTP (point ``HF_ENDPOINT`` at ``FakeHub.url``), and an executor
that records the model path each engine process was given.

``FakeHub`` serves what ``huggingface_hub.snapshot_download`` reads: the model info
(``GET /api/models/{repo}[/revision/{rev}]``, whose ``sha`` is the commit), the file listing
(``GET /api/models/{repo}/tree/{rev}``) and the files (``HEAD`` / ``GET /{repo}/resolve/{rev}/{path}`` with
``X-Repo-Commit``, ``ETag`` and ``Content-Length``). Errors carry the Hub's ``X-Error-Code`` header
(``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``, ``GatedRepo``): a gated repository answers 401 without a
token and 403 with a wrong one. Every request is recorded in ``requests`` as ``(method, path)``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

RECORD_ENV = "VLLITE_TEST_RECORD_MODEL_PATHS"
_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/(?P<op>revision|tree)/(?P<rev>[^/]+))?/?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")


@dataclass
class FakeRepo:
    """One repository: branch/tag names to commits, each commit's files, and the token a gated repo admits."""

    refs: dict[str, str] = field(default_factory=dict)
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    gated_token: str | None = None

    def commit_of(self, revision: str) -> str | None:
        return revision if revision in self.commits else self.refs.get(revision)


class FakeHub:
    """The Hub's endpoints for ``snapshot_download`` over ``ThreadingHTTPServer`` on 127.0.0.1 (a free port)."""

    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add_commit(self, repo_id: str, files: dict[str, bytes], *, refs: tuple[str, ...] = ("main",)) -> str:
        """Adds a commit holding ``files`` to ``repo_id`` (created on first use), pointed to by ``refs``; returns
        its 40-hex commit hash."""
        digest = hashlib.sha1()
        for name in sorted(files):
            digest.update(name.encode() + b"\0" + files[name])
        commit = digest.hexdigest()
        repo = self.repos.setdefault(repo_id, FakeRepo())
        repo.commits[commit] = dict(files)
        repo.refs.update(dict.fromkeys(refs, commit))
        return commit

    def downloaded(self, repo_id: str) -> list[str]:
        """The files of ``repo_id`` fetched with ``GET`` (in request order; a file fetched twice appears twice)."""
        prefix = f"/{repo_id}/resolve/"
        return [
            path[len(prefix) :].split("/", 1)[1]
            for method, path in self.requests
            if method == "GET" and path.startswith(prefix)
        ]

    def record(self, method: str, path: str) -> None:
        with self._lock:
            self.requests.append((method, path))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            self._answer(body=True)

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def _answer(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.record(self.command, path)
            api, resolve = _API.match(path), _RESOLVE.match(path)
            match = api or resolve
            repo = hub.repos.get(match["repo"]) if match else None
            if repo is None:
                return self._error(404, "RepoNotFound", "Repository not found", body)
            commit = repo.commit_of(match["rev"] or "main")  # type: ignore[index]
            if commit is None:
                return self._error(404, "RevisionNotFound", "Invalid rev id", body)
            files = repo.commits[commit]
            if api and api["op"] == "tree":
                listing = [_tree_entry(name, data) for name, data in sorted(files.items())]
                return self._send(200, json.dumps(listing).encode(), {"Content-Type": "application/json"}, body)
            if api:
                info = {"id": api["repo"], "sha": commit, "siblings": [{"rfilename": name} for name in sorted(files)]}
                return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
            assert resolve is not None
            token = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
            if repo.gated_token is not None and token != repo.gated_token:
                status = 403 if token else 401
                return self._error(status, "GatedRepo", "Access to this model is restricted", body)
            data = files.get(resolve["file"])
            if data is None:
                return self._error(404, "EntryNotFound", "Entry not found", body)
            headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
            self._send(200, data, {"Content-Type": "application/octet-stream", **headers}, body)

        def _error(self, status: int, code: str, message: str, body: bool) -> None:
            payload = json.dumps({"error": message}).encode()
            headers = {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"}
            self._send(status, payload, headers, body)

        def _send(self, status: int, payload: bytes, headers: dict[str, str], body: bool) -> None:
            self.send_response(status)
            for name, value in {**headers, "Content-Length": str(len(payload))}.items():
                self.send_header(name, value)
            self.end_headers()
            if body:
                self.wfile.write(payload)

    return Handler


def _tree_entry(name: str, data: bytes) -> dict[str, Any]:
    return {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}


def folder_files(folder: str | Path) -> dict[str, bytes]:
    """Every file under ``folder`` as ``relative path -> bytes`` (a model folder as a commit's content)."""
    root = Path(folder)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _default_executor() -> type:
    from vllite.plugins.transformers_executor.executor import DefaultExecutor

    return DefaultExecutor


class PathRecordingExecutor(_default_executor()):  # type: ignore[misc]
    """The default executor, which first writes the model path its config names to ``$RECORD_ENV/engine-PID``."""

    def _init_executor(self) -> Any:
        folder = os.environ.get(RECORD_ENV)
        if folder:
            Path(folder, f"engine-{os.getpid()}").write_text(str(self.config.model_config.model), encoding="utf-8")
        return super()._init_executor()

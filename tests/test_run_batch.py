"""``vllite run-batch`` end to end, as ``vllm run-batch``: OpenAI's batch input lines for chat, completions (and a
pooling model's embeddings) in, OpenAI's batch output lines out in input order; a malformed or invalid line gets
an error record naming the problem and the rest are processed; http(s) input and output URLs."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading

import pytest

from vllite.assets import default_model_path

GOOD_CHAT = {
    "custom_id": "chat-1",
    "method": "POST",
    "url": "/v1/chat/completions",
    "body": {"model": "demo", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4},
}
GOOD_COMPLETION = {
    "custom_id": "cmpl-1",
    "method": "POST",
    "url": "/v1/completions",
    "body": {"model": "demo", "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0},
}


def run_batch(input_file: str, output_file: str, *extra: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "vllite.cli", "run-batch", "-i", input_file, "-o", output_file, "--model",
            str(default_model_path()), "--served-model-name", "demo", "--max-model-len", "256", *extra]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def batch_output(tmp_path_factory):
    directory = tmp_path_factory.mktemp("batch")
    lines = [
        json.dumps(GOOD_CHAT),
        "{this is not json",
        json.dumps(GOOD_COMPLETION),
        json.dumps({**GOOD_CHAT, "custom_id": "bad-temp", "body": {**GOOD_CHAT["body"], "temperature": "hot"}}),
        json.dumps({**GOOD_COMPLETION, "custom_id": "bad-url", "url": "/v1/images"}),
        json.dumps({"custom_id": "no-body", "method": "POST", "url": "/v1/completions"}),
        json.dumps({**GOOD_COMPLETION, "custom_id": "streamed", "body": {**GOOD_COMPLETION["body"], "stream": True}}),
        json.dumps({**GOOD_COMPLETION, "custom_id": "get", "method": "GET"}),
        json.dumps({**GOOD_COMPLETION, "custom_id": "other-model", "body": {**GOOD_COMPLETION["body"], "model": "x"}}),
        "",
        json.dumps({**GOOD_COMPLETION, "custom_id": "cmpl-2"}),
    ]
    source = directory / "input.jsonl"
    source.write_text("\n".join(lines) + "\n")
    target = directory / "output.jsonl"
    done = run_batch(str(source), str(target))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "10 requests, 7 failed" in done.stderr
    return [json.loads(line) for line in target.read_text().splitlines()]


def by_id(records, custom_id):
    return next(r for r in records if r["custom_id"] == custom_id)


def test_output_is_openais_batch_format_in_input_order(batch_output):
    assert [r["custom_id"] for r in batch_output] == [
        "chat-1", None, "cmpl-1", "bad-temp", "bad-url", "no-body", "streamed", "get", "other-model", "cmpl-2",
    ]  # fmt: skip
    for record in batch_output:
        assert set(record) == {"id", "custom_id", "response", "error"}
        assert record["id"].startswith("vllite-")
        assert set(record["response"]) == {"status_code", "request_id", "body"}


def test_good_lines_carry_the_routes_answer(batch_output):
    chat = by_id(batch_output, "chat-1")
    assert chat["error"] is None and chat["response"]["status_code"] == 200
    assert chat["response"]["body"]["object"] == "chat.completion"
    assert chat["response"]["body"]["model"] == "demo"
    assert chat["response"]["body"]["usage"]["completion_tokens"] <= 4
    first, second = by_id(batch_output, "cmpl-1"), by_id(batch_output, "cmpl-2")
    assert first["response"]["body"]["object"] == "text_completion"
    assert first["response"]["body"]["choices"][0]["text"] == second["response"]["body"]["choices"][0]["text"]


def test_greedy_completion_equals_llm_generate(batch_output):
    from vllite import LLM, SamplingParams

    with LLM(model=str(default_model_path()), max_model_len=256) as llm:
        expected = llm.generate([GOOD_COMPLETION["body"]["prompt"]], SamplingParams(max_tokens=5, temperature=0))
    assert by_id(batch_output, "cmpl-1")["response"]["body"]["choices"][0]["text"] == expected[0].outputs[0].text


@pytest.mark.parametrize(
    ("index", "status", "param", "words"),
    [
        (1, 400, None, "not valid JSON"),
        (3, 400, "body.temperature", "temperature"),
        (4, 404, "url", "/v1/images"),
        (5, 400, "body", "body"),
        (6, 400, "body.stream", "stream mode"),
        (7, 400, "method", "POST"),
        (8, 404, "model", "`x` does not exist"),
    ],
)
def test_each_bad_line_gets_an_error_record_naming_the_problem(batch_output, index, status, param, words):
    record = batch_output[index]
    assert record["response"]["status_code"] == status
    assert record["response"]["body"]["error"]["code"] == status
    error = record["error"]
    assert error["param"] == param, error
    assert words in error["message"]
    assert error["line"] == index + 1
    assert error["code"] == ("invalid_request" if status == 400 else "not_found")


def test_missing_input_file_fails_before_the_engine_starts(tmp_path):
    done = run_batch(str(tmp_path / "nope.jsonl"), str(tmp_path / "out.jsonl"))
    assert done.returncode != 0
    assert "--input-file: no such file" in done.stdout + done.stderr


class _Store(http.server.BaseHTTPRequestHandler):
    """GET serves ``files[path]``; PUT stores the body into it."""

    files: dict[str, bytes] = {}

    def do_GET(self) -> None:
        body = self.files.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.end_headers()
        self.wfile.write(body or b"")

    def do_PUT(self) -> None:
        self.files[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_http_input_and_output_urls(tmp_path):
    _Store.files = {"/in.jsonl": (json.dumps(GOOD_COMPLETION) + "\n").encode()}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Store)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        done = run_batch(base + "/in.jsonl", base + "/out.jsonl", "--output-tmp-dir", str(tmp_path))
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in _Store.files["/out.jsonl"].decode().splitlines()]
    assert [r["custom_id"] for r in records] == ["cmpl-1"] and records[0]["response"]["status_code"] == 200
    assert list(tmp_path.iterdir()) == []  # the temporary output is gone once uploaded

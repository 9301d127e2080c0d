"""The malformed-input corpus (malformed_corpus.py) against the real servers on loopback (conftest.py).

For every case: no 5xx; the expected 4xx in OpenAI's error shape, its `param` the field at fault;
then `/health` answers 200 on the same keep-alive connection (http.client never reconnects behind
our back: a connection the server dropped fails the next request). Afterwards no video job was
stored and no engine request is left running.
"""

import http.client
import json
import time
from urllib.parse import urlsplit

import pytest
from malformed_corpus import CASES, Case

SERVERS = {"text": "text_server", "images": "image_server", "videos": "video_server"}
ERROR_KEYS = {"message", "type", "param", "code"}


def _connect(url: str) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.connect()
    return conn


def _send(conn: http.client.HTTPConnection, case: Case) -> tuple[http.client.HTTPResponse, bytes]:
    body = case.raw if case.raw is not None else None if case.json is None else json.dumps(case.json).encode()
    headers = {} if body is None else {"Content-Type": case.content_type}
    conn.request(case.method, case.path, body=body, headers=headers)
    response = conn.getresponse()
    return response, response.read()


def _problems(case: Case, response: http.client.HTTPResponse, data: bytes) -> list[str]:
    found = []
    if response.status != case.status:
        found.append(f"status {response.status}, want {case.status}")
    try:
        error = json.loads(data)["error"]
    except (ValueError, KeyError, TypeError):
        return found + [f"not an OpenAI error: {data[:200]!r}"]
    if set(error) != ERROR_KEYS:
        found.append(f"error keys {sorted(error)}")
    if error.get("param") != case.param:
        found.append(f"param {error.get('param')!r}, want {case.param!r} ({error.get('message', '')[:160]})")
    if response.will_close:
        found.append("the server closed the connection")
    return found


def _idle(engine, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while engine.stats()["num_running"] or engine.stats()["num_waiting"]:
        assert time.time() < deadline, f"requests left in the engine: {engine.stats()}"
        time.sleep(0.05)


def _video_ids(conn: http.client.HTTPConnection) -> list[str]:
    conn.request("GET", "/v1/videos?limit=100")
    response = conn.getresponse()
    assert response.status == 200
    return [job["id"] for job in json.loads(response.read())["data"]]


@pytest.mark.parametrize("kind", list(SERVERS))
def test_malformed_corpus(kind, request):
    server = request.getfixturevalue(SERVERS[kind])
    cases = [c for c in CASES if c.server == kind]
    assert len(cases) >= 25
    conn = _connect(server.url)
    jobs = _video_ids(conn) if kind == "videos" else None
    failures = []
    for case in cases:
        try:
            response, data = _send(conn, case)
            problems = _problems(case, response, data)
            sock = conn.sock
            conn.request("GET", "/health")              # the same connection serves the next request
            health = conn.getresponse()
            health.read()
            if health.status != 200 or conn.sock is not sock:
                problems.append(f"/health after it: {health.status}, same connection: {conn.sock is sock}")
        except (http.client.HTTPException, OSError) as e:
            problems = [f"connection failed: {e!r}"]
            conn.close()
            conn = _connect(server.url)
        if problems:
            failures.append(f"{case.id}: {'; '.join(problems)}")
    if kind == "videos":
        assert _video_ids(conn) == jobs, "a refused video job was stored"
    conn.close()
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures)
    _idle(server.engine)

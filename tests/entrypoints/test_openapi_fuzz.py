"""Schemathesis over the server's own `/openapi.json` (the shared servers of conftest.py, on loopback).

For each route, a bounded number of generated requests, derandomized (the same ones every run):
requests that fit the schema and, where they cannot start expensive work, requests that do not.
None may get a 5xx; every 4xx is an OpenAI-style error. The image and video routes get only
requests that break the schema: a valid one could ask the tiny models for 1000 steps at 1024x1024.
"""

import time

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

EXAMPLES = 8                                    # per route and mode: ~1 s a route on the 2-core machine
POSITIVE, NEGATIVE = (GenerationMode.POSITIVE,), (GenerationMode.NEGATIVE,)
BOTH = POSITIVE + NEGATIVE                      # negative data needs a body or query to break
ROUTES = {                                      # fixture -> "METHOD path" -> generation modes
    "text_server": {"POST /v1/completions": BOTH, "POST /v1/chat/completions": BOTH, "POST /v1/audio/speech": BOTH,
                    "POST /v1/audio/speech/batch": NEGATIVE, "GET /v1/audio/voices": POSITIVE,
                    "POST /v1/audio/voices": NEGATIVE, "DELETE /v1/audio/voices/{name}": POSITIVE,
                    "GET /v1/models": POSITIVE, "GET /health": POSITIVE},
    "image_server": {"POST /v1/images/generations": NEGATIVE, "POST /v1/images/edits": NEGATIVE},
    "video_server": {"POST /v1/videos": NEGATIVE, "GET /v1/videos": BOTH, "GET /v1/videos/{video_id}": POSITIVE,
                     "GET /v1/videos/{video_id}/content": BOTH, "DELETE /v1/videos/{video_id}": POSITIVE},
}


def _check(case, response, failures: list[str]) -> None:
    where = f"{case.method} {case.formatted_path} {str(case.body)[:200]!r}"
    if response.status_code >= 500:
        failures.append(f"{where}: {response.status_code} {response.text[:300]}")
    elif response.status_code >= 400:
        try:
            keys = set(response.json()["error"])
        except (ValueError, KeyError, TypeError):
            keys = set()
        if keys != {"message", "type", "param", "code"}:
            failures.append(f"{where}: {response.status_code} not an OpenAI error: {response.text[:200]}")


@pytest.mark.parametrize("fixture", list(ROUTES))
def test_generated_requests_get_no_5xx(fixture, request):
    server = request.getfixturevalue(fixture)
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    routes, failures, sent = ROUTES[fixture], [], 0
    with requests.Session() as session:
        for result in schema.get_all_operations():
            op = result.ok()
            for mode in routes.get(f"{op.method.upper()} {op.path}", ()):
                @given(case=op.as_strategy(mode))
                @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
                def run(case):
                    nonlocal sent
                    sent += 1
                    _check(case, case.call(base_url=server.url, session=session, timeout=120), failures)

                run()
    assert sent >= EXAMPLES * len(routes)
    assert not failures, "\n".join(failures)
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    deadline = time.time() + 30
    while server.engine.stats()["num_running"] or server.engine.stats()["num_waiting"]:
        assert time.time() < deadline, f"requests left in the engine: {server.engine.stats()}"
        time.sleep(0.05)

"""The web playground in a real headless browser: Debian's `chromium` driven by Playwright's Python
client (`executable_path`, no browser download), against the real server on loopback (the shared
tiny servers of conftest.py: a tiny LM cascaded into Piper, a tiny Qwen-Image, a tiny Wan 2.1).

* chat: a message sent from the page streams its answer into the DOM in more than one update, and
  the text shown is the server's own answer to the same request (greedy); with "speak the answer"
  its audio chunks are played as they stream and kept as a clip;
* images: the prompt generates with per-step progress shown, and the `<img>` that appears has loaded
  the very PNG the API returns for the same seed;
* speech: the Piper voice speaks, streamed, into a playable clip;
* video: a job made on the page completes, plays in a `<video>` and is deleted;
* `--api-key`: the page asks for the key, refuses a wrong one, and works once the right one is given.

Without chromium or playwright the module skips with the reason, unless OMNISTAGE_REQUIRE_BROWSER=1
(set by .ci/run, which installs chromium), where it fails instead.
"""

import base64
import os
import shutil

import httpx
import pytest
from live_server import live_server

CHROMIUM = os.environ.get("OMNISTAGE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
TIMEOUT_MS = 60_000                             # generous: the machine is shared and loaded
KEY = "playground-test-key"


def _missing() -> str:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[dev]')"
    if not os.path.exists(CHROMIUM):
        return f"no chromium at {CHROMIUM} (apt-get install chromium; .ci/run does)"
    return ""


if _missing():
    if os.environ.get("OMNISTAGE_REQUIRE_BROWSER") == "1":
        raise RuntimeError(f"the browser test is required here: {_missing()}")
    pytest.skip(_missing(), allow_module_level=True)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                              args=["--no-sandbox", "--disable-dev-shm-usage",
                                    "--autoplay-policy=no-user-gesture-required"])
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context()
    pg = context.new_page()
    pg.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


# Every text a node under `selector` was given, in order: each `textContent` assignment adds a new
# text node, and the records keep them even when several land in one observer callback.
RECORD = """(selector) => {
  window.__texts = [];
  new MutationObserver((records) => {
    for (const r of records) for (const n of r.addedNodes) if (n.nodeType === 3) window.__texts.push(n.data);
  }).observe(document.querySelector(selector), {childList: true, subtree: true});
}"""


def _settings(page, **values) -> None:
    page.click("#chat-form summary")
    for name, value in values.items():
        page.fill(f"#chat-{name}", str(value))


def _chat(page, text: str) -> str:
    page.fill("#chat-input", text)
    page.click("#chat-send")
    page.wait_for_selector(".msg.assistant[data-finish]:not(.streaming)")
    return page.inner_text(".msg.assistant .text")


def test_chat_streams_the_servers_answer_into_the_page(text_server, page):
    page.goto(text_server.url + "/")
    page.wait_for_selector("#tab-chat")
    assert page.inner_text("#model") == text_server.name
    assert page.is_visible("#tab-speech") and not page.query_selector("#tab-images")  # only what it can do
    _settings(page, **{"max-tokens": 40, "temperature": 0})
    page.evaluate(RECORD, "#chat-log")
    shown = _chat(page, "Tell me about the harbour.")
    texts = [t for t in page.evaluate("window.__texts") if t]
    assert len(set(texts)) > 1, f"the answer did not stream: {texts}"
    assert all(shown.startswith(t) for t in texts)
    reply = httpx.post(text_server.url + "/v1/chat/completions", timeout=120, json={
        "model": text_server.name, "messages": [{"role": "user", "content": "Tell me about the harbour."}],
        "max_tokens": 40, "temperature": 0}).json()
    assert shown == reply["choices"][0]["message"]["content"] and shown.strip()


def test_chat_answer_is_spoken_while_it_streams(text_server, page):
    page.goto(text_server.url + "/")
    page.wait_for_selector("#tab-chat")
    _settings(page, **{"max-tokens": 6})
    page.check("#chat-speak")
    assert page.eval_on_selector_all("#chat-voice option", "os => os.map(o => o.value)") == ["joe"]
    _chat(page, "Say something.")
    clip = page.wait_for_selector(".msg.assistant audio.clip")
    assert int(page.get_attribute(".msg.assistant", "data-audio-pieces")) >= 1
    page.wait_for_function("(a) => a.readyState >= 1 && a.duration > 0.1", arg=clip)


def test_image_appears_with_per_step_progress(image_server, page):
    page.goto(image_server.url + "/")
    page.wait_for_selector("#image-prompt")
    assert not page.query_selector("#tab-chat")
    page.fill("#image-prompt", "a red cube on a table")
    for name, value in {"width": 64, "height": 48, "steps": 3, "seed": 7}.items():
        page.fill(f"#image-{name}", str(value))
    page.evaluate(RECORD, "#image-status")
    page.click("#image-go")
    img = page.wait_for_selector("#image-results img.generated")
    page.wait_for_function("(img) => img.complete && img.naturalWidth > 0", arg=img)
    assert page.evaluate("(img) => [img.naturalWidth, img.naturalHeight]", img) == [64, 48]
    assert [t for t in page.evaluate("window.__texts") if t.startswith("step")] == [
        "step 1 / 3", "step 2 / 3", "step 3 / 3"]
    api = httpx.post(image_server.url + "/v1/images/generations", timeout=120, json={
        "prompt": "a red cube on a table", "size": "64x48", "num_inference_steps": 3, "seed": 7}).json()
    src = img.get_attribute("src")
    assert src.startswith("data:image/png;base64,")
    assert base64.b64decode(src.split(",", 1)[1]) == base64.b64decode(api["data"][0]["b64_json"])


def test_speech_streams_into_a_playable_clip(text_server, page):
    page.goto(text_server.url + "/")
    page.click("#tab-speech")
    assert page.eval_on_selector_all("#speech-voice option", "os => os.map(o => o.value)") == ["joe"]
    page.fill("#speech-input", "Good morning.")
    assert page.is_checked("#speech-stream")
    page.click("#speech-go")
    clip = page.wait_for_selector("#speech-out audio")
    page.wait_for_function("(a) => a.readyState >= 1 && a.duration > 0.2", arg=clip)


def test_page_asks_for_the_api_key(text_server, page):
    from omnistage.entrypoints.openai.api_server import build_app

    app = build_app(text_server.engine, text_server.name, api_key=KEY)
    with live_server(app) as url:
        assert httpx.get(url + "/").status_code == 200                      # the page itself needs no key
        assert httpx.get(url + "/v1/capabilities").status_code == 401
        page.goto(url + "/")
        page.wait_for_selector("#key-dialog[open]")
        assert not page.query_selector("#tab-chat")
        page.fill("#key-input", "wrong")
        page.click("#key-save")
        page.wait_for_selector("#key-dialog[open]")
        assert "refused" in page.inner_text("#key-message")
        page.fill("#key-input", KEY)
        page.click("#key-save")
        page.wait_for_selector("#tab-chat")
        _settings(page, **{"max-tokens": 6})
        assert _chat(page, "Hi").strip()


def test_video_job_runs_plays_and_is_deleted(video_server, page):
    page.goto(video_server.url + "/")
    page.wait_for_selector("#video-prompt")
    page.fill("#video-prompt", "waves at dusk")
    for name, value in {"width": 32, "height": 32, "steps": 2, "frames": 5, "fps": 8, "seed": 1}.items():
        page.fill(f"#video-{name}", str(value))
    before = [j["id"] for j in httpx.get(video_server.url + "/v1/videos?limit=100").json()["data"]]
    page.click("#video-go")
    # the shared server may hold other tests' jobs: ours is the one the page lists that was not there
    page.wait_for_function("(before) => [...document.querySelectorAll('.job[data-status=completed]')]"
                           ".some((j) => !before.includes(j.dataset.id))", arg=before)
    job = next(j for j in page.query_selector_all(".job[data-status=completed]")
               if j.get_attribute("data-id") not in before)
    video_id = job.get_attribute("data-id")
    assert "5 frames @ 8 fps" in job.inner_text()
    job.query_selector("button.play").click()
    clip = page.wait_for_selector(f"#video-players figure[data-id='{video_id}'] video")
    page.wait_for_function("(v) => v.readyState >= 1 && v.videoWidth === 32", arg=clip)
    job.query_selector("button.delete").click()
    page.wait_for_function("(id) => !document.querySelector(`.job[data-id='${id}']`)", arg=video_id)
    assert video_id not in [j["id"] for j in httpx.get(video_server.url + "/v1/videos?limit=100").json()["data"]]

"""Progress lines of long requests and the start banner per kind of model (no server needed)."""

import logging

from omnistage.entrypoints.openai.api_server import usage_banner
from omnistage.entrypoints.progress_log import ProgressLog
from omnistage.outputs import CompletionOutput, RequestMetrics, RequestOutput


def test_a_long_request_logs_its_progress_every_interval_and_its_end(caplog):
    log = ProgressLog(interval_s=5.0)
    with caplog.at_level(logging.INFO, logger="omnistage.requests"):
        for t, progress in ((100.0, 0.1), (102.0, 0.2), (105.5, 0.4), (107.0, 0.5), (111.0, 0.8)):
            log.on_output(RequestOutput("img-1", progress=progress, metrics=RequestMetrics(arrival_time=100.0)), t)
        log.on_output(RequestOutput("img-1", finished=True, progress=1.0), 112.0)
        log.on_output(RequestOutput("quick", outputs=[CompletionOutput(index=0, text="hi", token_ids=[1, 2])],
                                    finished=True, metrics=RequestMetrics(arrival_time=111.0)), 112.0)
    lines = [r.getMessage() for r in caplog.records if r.name == "omnistage.requests"]
    assert lines == ["request img-1: 40% of its steps after 6 s", "request img-1: 80% of its steps after 11 s",
                     "request img-1 finished in 12.0 s"]
    assert log.seen == {}


def test_the_banner_shows_a_request_the_model_answers():
    image = usage_banner("0.0.0.0", 8000, "tiny-z-image", False, "image")
    assert "curl http://127.0.0.1:8000/v1/images/generations" in image and "chat/completions" not in image
    assert "client.images.generate(model='tiny-z-image'" in image
    video = usage_banner("127.0.0.1", 8000, "tiny-wan", True, "video")
    assert "/v1/videos" in video and "Bearer $OMNISTAGE_API_KEY" in video
    assert "/v1/chat/completions" in usage_banner("127.0.0.1", 8000, "m", False)

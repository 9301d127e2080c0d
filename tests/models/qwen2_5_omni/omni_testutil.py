"""Helpers shared by the Qwen2.5-Omni tests (imported by name: pytest puts this folder on sys.path)."""

import contextlib
import socket
import threading
import time

import torch


@contextlib.contextmanager
def single_thread():
    """Runs torch single-threaded inside the block and restores the thread count afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def openai_client(async_omni):
    """The real `openai` client against `omnistage serve`'s app on loopback."""
    import openai
    import uvicorn

    from omnistage.entrypoints.openai.api_server import build_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(async_omni, "tiny-omni"), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 30
        while not server.started:
            assert time.time() < deadline and thread.is_alive()
            time.sleep(0.02)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="x", max_retries=0)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()

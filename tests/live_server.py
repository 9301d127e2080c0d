"""A FastAPI app served by uvicorn on a free loopback port, in a background thread (tests only)."""

import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import uvicorn


@contextmanager
def live_server(app, timeout: float = 30.0) -> Iterator[str]:
    """Yields the server's base URL ("http://127.0.0.1:PORT"); stops the server on exit."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + timeout
    try:
        while not srv.started:
            assert time.time() < deadline and thread.is_alive(), "server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        sock.close()

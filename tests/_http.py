"""An ASGI app served by uvicorn in a thread of the test process, for every test that needs a live
HTTP endpoint it controls (the embedded server's app, stub workers, scripted or fault-injecting
endpoints).

    with ThreadedServer(app) as server:
        httpx.get(server.url + "/health")

The socket is bound before the thread starts (port 0: the OS picks one), so no other process can
take the port between choosing and serving it.
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


class ThreadedServer:
    def __init__(self, app, port: int = 0, start_timeout_s: float = 10.0):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.start_timeout_s = start_timeout_s

    @property
    def app(self):
        return self.server.config.app

    def start(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.server.started:
            assert self.thread.is_alive(), f"the test server on {self.url} exited while starting"
            assert time.monotonic() < deadline, f"the test server on {self.url} did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

"""A small HTTP proxy on 127.0.0.1 in front of an S3 endpoint (moto's server) that injects the faults
of an object store: 503 SlowDown answers, lost responses (the request is done, its answer never
arrives) and an outage (every connection closed unanswered). It serves from a daemon thread and
stops when its ``with`` block ends; every socket has a timeout, so nothing waits forever."""
from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

TIMEOUT_SECONDS = 10.0
SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


class FaultProxy:
    """Forwards every request to `upstream` (http://host:port) unless a fault is armed."""

    def __init__(self, upstream: str):
        self.upstream = urlsplit(upstream).netloc
        self.lock = threading.Lock()
        self.slow_downs, self.lose_suffix, self.down, self.faults_served = 0, None, False, 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def slow_down(self, count: int) -> None:
        """Answer the next `count` requests but HEADs with 503 SlowDown."""
        with self.lock:
            self.slow_downs = count

    def lose_response_of(self, suffix: str) -> None:
        """Forward the next PUT to a key ending with `suffix`, then close the connection unanswered."""
        with self.lock:
            self.lose_suffix = suffix

    def go_down(self) -> None:
        self.down = True

    def come_back(self) -> None:
        self.down = False

    def fault_for(self, method: str, path: str) -> str | None:
        """The fault this request meets (counted), or None."""
        with self.lock:
            if self.down:
                fault = "down"
            elif self.slow_downs and method != "HEAD":  # a HEAD answer has no body to carry the code
                self.slow_downs -= 1
                fault = "slow down"
            elif method == "PUT" and self.lose_suffix and path.split("?")[0].endswith(self.lose_suffix):
                self.lose_suffix, fault = None, "lose response"
            else:
                return None
            self.faults_served += 1
            return fault

    def __enter__(self) -> FaultProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(TIMEOUT_SECONDS)


def _handler(proxy: FaultProxy):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = TIMEOUT_SECONDS

        def log_message(self, *arguments) -> None:  # quiet
            pass

        def _serve(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            fault = proxy.fault_for(self.command, self.path)
            if fault == "down":
                self.close_connection = True
                return
            if fault == "slow down":
                self._answer(503, {"Content-Type": "application/xml"}, SLOW_DOWN)
                return
            status, headers, answer = self._forward(body)
            if fault == "lose response":
                self.close_connection = True
                return
            self._answer(status, headers, answer)

        def _forward(self, body: bytes):
            connection = http.client.HTTPConnection(proxy.upstream, timeout=TIMEOUT_SECONDS)
            try:
                headers = {key: value for key, value in self.headers.items() if key.lower() != "expect"}
                connection.request(self.command, self.path, body=body, headers=headers)
                response = connection.getresponse()
                return response.status, dict(response.getheaders()), response.read()
            finally:
                connection.close()

        def _answer(self, status: int, headers: dict, body: bytes) -> None:
            self.send_response(status)
            for key, value in headers.items():
                if key.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date"):
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _serve

    return Handler

"""Model servers for the protocol suite: each speaks GIE's model server protocol as far as a picker reads
it (Prometheus ``/metrics`` with vLLM's names, ``/health``) and can be loaded, saturated or stopped by the
test. They serve no completions: the suite plays the data plane itself, so no request reaches them."""

from __future__ import annotations

import http.server
import socket
import threading
from dataclasses import dataclass, field


@dataclass
class ModelServer:
    """One endpoint ``127.0.0.1:port``; :meth:`stop` closes its socket (a dead pod), :meth:`start` reopens
    it on the same port."""

    port: int = 0
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    _server: http.server.ThreadingHTTPServer | None = field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metrics(self) -> bytes:
        return (
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="m"}} {self.waiting}\n'
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="m"}} {self.running}\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{model_name="m"}} {self.kv_usage}\n'
        ).encode()

    def start(self) -> None:
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/metrics":
                    body, ctype = owner.metrics(), "text/plain; version=0.0.4"
                elif self.path == "/health":
                    body, ctype = b"", "text/plain"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        class Server(http.server.ThreadingHTTPServer):
            allow_reuse_address = True
            daemon_threads = True

        srv = Server(("127.0.0.1", self.port), Handler)
        self.port = srv.server_address[1]
        self._server = srv
        threading.Thread(target=srv.serve_forever, daemon=True, name=f"model-{self.port}").start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def up(self) -> bool:
        return self._server is not None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

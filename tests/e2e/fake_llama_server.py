#!/usr/bin/env python3
"""A stand-in for llama-server, for supervising tests that need no C++ build.

Takes llama-server's command line (`-m FILE --host H --port P ...`; the rest is ignored),
answers `/health`, `/metrics` (a few `llamacpp:` families) and streams chat completions
as llama-server does, with one `: preempted` / `: preempt-keepalive` / `: resumed` park in
the middle of each stream when `FAKE_PARK_S` is set (keepalives every
`FAKE_PARK_KEEPALIVE_S`, default 0.5; `0` = a silent park). `--help` lists `--preempt-ram` unless
`FAKE_NO_PREEMPT=1`, so `up`'s feature probe can be exercised both ways; `--fake-fail`
makes it exit at once like a bad argument would.
Standard library only; one thread per connection.
"""

from __future__ import annotations

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STATE = {"parks": 0, "resumes": 0, "parked": 0, "tokens": 0}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        sys.stdout.write("fake: " + (format % args) + "\n")
        sys.stdout.flush()

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, b'{"status":"ok"}')
        elif self.path == "/metrics":
            text = (
                "# TYPE llamacpp:n_preempt_total counter\n"
                f"llamacpp:n_preempt_total {STATE['parks']}\n"
                "# TYPE llamacpp:n_resume_total counter\n"
                f"llamacpp:n_resume_total {STATE['resumes']}\n"
                "# TYPE llamacpp:requests_preempted gauge\n"
                f"llamacpp:requests_preempted {STATE['parked']}\n"
                "# TYPE llamacpp:preempt_recompute_total counter\n"
                "llamacpp:preempt_recompute_total 0\n"
                "# TYPE llamacpp:preempt_dropped_total counter\n"
                "llamacpp:preempt_dropped_total 0\n"
                "# TYPE llamacpp:preempt_ram_bytes gauge\n"
                f"llamacpp:preempt_ram_bytes {STATE['parked'] * 1048576}\n"
                "# TYPE llamacpp:n_decode_total counter\n"
                f"llamacpp:n_decode_total {STATE['tokens']}\n"
                "# TYPE llamacpp:tokens_predicted_total counter\n"
                f"llamacpp:tokens_predicted_total {STATE['tokens']}\n"
            )
            self._send(200, text.encode(), "text/plain; version=0.0.4")
        else:
            self._send(404, b'{"error":{"code":404,"message":"File Not Found"}}')

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n) or b"{}")
        tokens = int(body.get("max_tokens") or body.get("n_predict") or 8)
        if not body.get("stream"):
            msg = {"choices": [{"message": {"role": "assistant", "content": "x" * tokens}}]}
            self._send(200, json.dumps(msg).encode())
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        park_s = float(os.environ.get("FAKE_PARK_S") or 0)
        ka_s = float(os.environ.get("FAKE_PARK_KEEPALIVE_S", "0.5"))
        try:
            for i in range(tokens):
                if park_s and i == tokens // 2:
                    STATE["parks"] += 1
                    STATE["parked"] += 1
                    self._chunk(b": preempted\n\n")
                    deadline = time.monotonic() + park_s
                    while time.monotonic() < deadline:
                        left = deadline - time.monotonic()
                        if not ka_s:  # a silent park
                            time.sleep(max(0.0, left))
                            break
                        time.sleep(min(ka_s, max(0.0, left)))
                        self._chunk(b": preempt-keepalive\n\n")
                    STATE["parked"] -= 1
                    STATE["resumes"] += 1
                    self._chunk(b": resumed\n\n")
                ev = {"choices": [{"index": 0, "delta": {"content": "tok "}}]}
                STATE["tokens"] += 1
                self._chunk(b"data: " + json.dumps(ev).encode() + b"\n\n")
                time.sleep(0.005)
            self._chunk(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


def main(argv: list[str]) -> int:
    if "--help" in argv:
        print("usage: fake llama-server\n  -m, --model FNAME\n  --port PORT")
        if os.environ.get("FAKE_NO_PREEMPT") != "1":
            print("  --preempt-ram N    MiB of host RAM for parked states")
        return 0
    if "--fake-fail" in argv:  # an argument llama-server would reject
        print("error: invalid argument: --fake-fail", flush=True)
        return 1
    host, port = "127.0.0.1", 8080
    for i, a in enumerate(argv):
        if a == "--host":
            host = argv[i + 1]
        elif a == "--port":
            port = int(argv[i + 1])
    print("fake llama-server argv: " + json.dumps(argv), flush=True)
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer((host, port), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

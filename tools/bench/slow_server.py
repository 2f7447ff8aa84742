#!/usr/bin/env python3
"""A static file server with HTTP range support that answers every request after a fixed delay: a stand-in
for a distant repository (this VM's kernel has no netem). Benchmarks only.

    python3 tools/bench/slow_server.py DIR PORT DELAY_MS
"""
import os
import sys
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

ROOT, PORT, DELAY = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]) / 1000.0


class Handler(SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def __init__(self, *a, **kw):
        super().__init__(*a, directory=ROOT, **kw)

    def log_message(self, *a):
        pass

    def send_head_range(self, path):
        size = os.path.getsize(path)
        spec = self.headers["Range"].removeprefix("bytes=")
        start, end = (int(x) for x in spec.split("-"))
        if start > end or end >= size:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        with open(path, "rb") as f:
            f.seek(start)
            body = f.read(end - start + 1)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        time.sleep(DELAY)
        path = self.translate_path(self.path)
        if self.headers.get("Range") and os.path.isfile(path):
            return self.send_head_range(path)
        return super().do_GET()

    def do_HEAD(self):
        time.sleep(DELAY)
        return super().do_HEAD()


ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()

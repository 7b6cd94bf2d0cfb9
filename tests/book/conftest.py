"""Fixtures for the checks on the built book (run after `make book`, as `make test` does)."""

import functools
import http.server
import threading
from pathlib import Path

import pytest

HTML = Path(__file__).resolve().parents[2] / "_build" / "html"


@pytest.fixture(scope="session")
def html_root():
    if not (HTML / "index.html").exists():
        pytest.fail("the book is not built: run `make book` first (make test does)")
    return HTML


# Pages served beside the book, path -> HTML: a test puts a probe page here that drives a chapter in an iframe
# (same origin, so the probe's script can click in the chapter and write what it saw into its own DOM).
EXTRA_PAGES: dict[str, str] = {}


@pytest.fixture(scope="session")
def extra_pages():
    return EXTRA_PAGES


@pytest.fixture(scope="session")
def server(html_root):
    """Serve the built book (and EXTRA_PAGES) on 127.0.0.1 (a free port) for the duration of the tests."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(html_root))

    class Quiet(handler.func):
        def log_message(self, *args):
            pass

        def do_GET(self):
            page = EXTRA_PAGES.get(self.path)
            if page is None:
                return super().do_GET()
            body = page.encode("utf-8")
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(html_root)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()

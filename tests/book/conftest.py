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


@pytest.fixture(scope="session")
def server(html_root):
    """Serve the built book on 127.0.0.1 (a free port) for the duration of the tests."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(html_root))

    class Quiet(handler.func):
        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(html_root)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()

"""`make lab` starts JupyterLab on notebooks/, also as root (as in containers)."""

import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lab_command() -> list[str]:
    """The `lab` recipe of the Makefile, with the venv's jupyter replaced by this interpreter's."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^lab:.*\n\t(.+)$", makefile, re.MULTILINE).group(1)
    args = shlex.split(recipe)
    assert args[0].endswith("bin/jupyter") and args[1] == "lab", recipe
    return [sys.executable, "-m", "jupyterlab", *args[2:]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_make_lab_serves_the_notebooks():
    port = free_port()
    cmd = lab_command() + ["--no-browser", f"--ServerApp.port={port}", "--ServerApp.ip=127.0.0.1",
                           "--IdentityProvider.token=groundup-test"]
    assert "--allow-root" in cmd, "containers run as root: JupyterLab refuses to start there without --allow-root"
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        listing = None
        while time.monotonic() < deadline and server.poll() is None:
            try:
                url = f"http://127.0.0.1:{port}/api/contents?token=groundup-test"
                with urllib.request.urlopen(url, timeout=5) as response:
                    listing = response.read().decode()
                break
            except OSError:
                time.sleep(0.5)
        assert server.poll() is None, f"JupyterLab exited: {server.stderr.read()[-2000:]}"
        assert listing is not None, "JupyterLab did not answer within 90 s"
        assert "01_language_models.ipynb" in listing, "JupyterLab must open on notebooks/"
    finally:
        server.terminate()
        server.wait(timeout=30)

"""The book's diagrams: every name has its files, the files are valid and re-drawn byte for byte, show() works."""

import base64
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from IPython.core.formatters import DisplayFormatter

from groundup import diagrams

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "src" / "groundup" / "diagrams"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_names_are_the_fixed_list():
    assert diagrams.names() == ("attention_head", "multi_head", "block_post_pre", "residual_stream",
                                "encoder_decoder")
    assert set(diagrams.DESCRIPTIONS) == set(diagrams.names())


def test_the_folder_holds_exactly_the_named_diagrams():
    stored = {p.name for p in FOLDER.iterdir() if p.suffix in (".png", ".svg")}
    assert stored == {f"{n}.{ext}" for n in diagrams.names() for ext in ("png", "svg")}


@pytest.mark.parametrize("name", diagrams.names())
def test_files_are_valid_svg_and_png(name):
    svg = diagrams.path(name, format="svg").read_bytes()
    root = ET.fromstring(svg)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert float(root.get("width").removesuffix("pt")) > 200
    assert b"<dc:date>" not in svg, "a date would change the file on every run"
    assert b"http" not in svg.replace(b"http://www.w3.org/", b"").replace(b"http://purl.org/", b"") \
        .replace(b"http://creativecommons.org/", b""), "the SVG must not load anything from the network"
    png = diagrams.path(name).read_bytes()
    assert png.startswith(PNG_SIGNATURE)
    width = int.from_bytes(png[16:20], "big")
    assert 1000 <= width <= 1600, "drawn at 200 pixels per inch for a column of about 6.8 inches"


def test_redrawing_gives_identical_bytes(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "make_diagrams.py"), "--out", str(tmp_path)],
                            capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"})
    assert result.returncode == 0, result.stderr
    for name in diagrams.names():
        for ext in ("svg", "png"):
            new, stored = (tmp_path / f"{name}.{ext}").read_bytes(), (FOLDER / f"{name}.{ext}").read_bytes()
            assert new == stored, (f"{name}.{ext} differs from a fresh drawing: run tools/make_diagrams.py "
                                     "(with requirements.lock's matplotlib and pillow)")


def test_show_displays_one_png(monkeypatch):
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj: shown.append(obj))
    assert diagrams.show("multi_head") is None
    assert len(shown) == 1
    data, metadata = DisplayFormatter().format(shown[0])
    assert set(data) == {"image/png", "text/plain"}, "PNG only: the notebook tests forbid SVG outputs"
    assert data["text/plain"] == "<IPython.core.display.Image object>", "nbval compares this text: no address"
    png = base64.b64decode(data["image/png"])  # a notebook stores the PNG base64-encoded
    assert png == diagrams.path("multi_head").read_bytes()
    width = int.from_bytes(png[16:20], "big")
    assert metadata["image/png"] == {"width": width // 2}, "shown at half its pixel width; no height: no distortion"


def test_image_as_svg():
    svg = diagrams.image("attention_head", format="svg")
    data, _ = DisplayFormatter().format(svg)
    assert data["image/svg+xml"].lstrip().startswith("<svg") or "<svg" in data["image/svg+xml"]


def test_unknown_names_and_formats_are_refused_with_the_list():
    with pytest.raises(ValueError, match="attention_head, multi_head, block_post_pre"):
        diagrams.show("transformer")
    with pytest.raises(TypeError, match="must be a string"):
        diagrams.show(3)
    with pytest.raises(ValueError, match="format must be one of"):
        diagrams.image("multi_head", format="jpg")


def test_package_data_includes_the_diagrams():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["groundup"]
    assert "diagrams/*.png" in patterns and "diagrams/*.svg" in patterns


def test_notebooks_show_only_known_diagrams_and_store_them_as_png():
    import json
    import re

    shown = re.compile(r"""show\(\s*["']([a-z_]+)["']""")
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            text = "".join(cell["source"])
            if cell["cell_type"] != "code" or "diagrams" not in text:
                continue
            for name in shown.findall(text):
                assert name in diagrams.names(), f"{path.name} shows an unknown diagram {name!r}"
            for out in cell.get("outputs", []):
                assert "image/svg+xml" not in out.get("data", {}), f"{path.name}: diagrams are stored as PNG"

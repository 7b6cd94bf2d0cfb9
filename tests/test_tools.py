"""The notebook sync script and the book builder, on throw-away inputs."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import build_book  # noqa: E402
import sync_notebooks  # noqa: E402

REPO = sync_notebooks.repository_url()


def notebook(*cells):
    def cell(i, kind, src):
        extra = {"outputs": [], "execution_count": None} if kind == "code" else {}
        return {"cell_type": kind, "id": f"c{i}", "metadata": {}, "source": src, **extra}

    return {"cells": [cell(i, kind, src) for i, (kind, src) in enumerate(cells)], "metadata": {}, "nbformat": 4,
            "nbformat_minor": 5}


def test_repository_url_comes_from_pyproject():
    assert REPO.startswith("https://github.com/") and not REPO.endswith("/")


def test_sync_inserts_badge_and_setup_cell():
    nb = notebook(("markdown", "# 9. Test\n\nIntro."), ("code", "import groundup"))
    new = sync_notebooks.synced(nb, "09_test.ipynb", REPO)
    first = new["cells"][0]["source"]
    assert first.startswith("# 9. Test\n\n[Open in Colab](https://colab.research.google.com/github/")
    assert "/blob/main/notebooks/09_test.ipynb)" in first and first.endswith("\n\nIntro.")
    setup = new["cells"][1]
    assert setup["cell_type"] == "code" and setup["source"].startswith("# Setup: on Colab")
    assert pip_requirement(setup["source"]) == f"groundup @ git+{REPO}" and "google.colab" in setup["source"]
    assert setup["metadata"]["tags"] == ["remove-cell"]
    assert new["cells"][2]["source"] == "import groundup"
    again = sync_notebooks.synced(new, "09_test.ipynb", REPO)
    assert again == new, "syncing twice changes nothing"


def pip_requirement(source):
    """The last element of the list literal the setup cell passes to subprocess.run (what pip installs)."""
    calls = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "run"]
    assert len(calls) == 1, "the setup cell makes one subprocess.run call"
    return ast.literal_eval(calls[0].args[0].elts[-1])


@pytest.mark.parametrize("repo", [REPO, "https://github.com/o/n", "https://github.com/" + "o" * 25 + "/" + "n" * 26])
def test_setup_cell_fits_the_book_and_installs_the_repository(repo):
    source = sync_notebooks.setup_source(repo)
    wide = [line for line in source.split("\n") if len(line) > 88]
    assert not wide, f"the book cuts code lines wider than 88 characters: {wide}"
    assert pip_requirement(source) == f"groundup @ git+{repo}"
    assert source.startswith("# Setup: on Colab")


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.stem)
def test_sync_writes_the_layout_the_notebooks_are_stored_in(path):
    """A sync rewrites only what it changes: its writer reproduces a stored notebook byte for byte (nbformat's
    layout: sorted keys, indent 1, sources as lists of lines), and a string source is written as lines."""
    text = path.read_text(encoding="utf-8")
    assert sync_notebooks.notebook_text(json.loads(text)) == text
    one = json.loads(sync_notebooks.notebook_text(notebook(("code", "a = 1\nb = 2"))))
    assert one["cells"][0]["source"] == ["a = 1\n", "b = 2"]


def test_sync_replaces_a_stale_badge_and_setup_cell():
    stale = notebook(("markdown", "# 9. Test\n\n[Open in Colab](https://old.example/x.ipynb)\n\nIntro."),
                     ("code", "# Setup: on Colab (old)\nprint('old')"))
    new = sync_notebooks.synced(stale, "09_test.ipynb", REPO)
    assert "old.example" not in new["cells"][0]["source"]
    assert "print('old')" not in new["cells"][1]["source"] and len(new["cells"]) == 2


def test_sync_rejects_a_notebook_without_a_title():
    with pytest.raises(ValueError, match="first cell must be markdown starting with the '# N. Title' heading"):
        sync_notebooks.synced(notebook(("code", "x = 1")), "09_test.ipynb", REPO)


def test_check_mode_fails_on_a_stale_notebook(tmp_path):
    path = tmp_path / "09_test.ipynb"
    path.write_text(json.dumps(notebook(("markdown", "# 9. Test"), ("code", "x = 1"))))
    script = ROOT / "tools" / "sync_notebooks.py"
    check = subprocess.run([sys.executable, str(script), "--check", str(path)], capture_output=True, text=True)
    assert check.returncode == 1 and "out of sync" in check.stdout
    assert subprocess.run([sys.executable, str(script), str(path)], capture_output=True).returncode == 0
    check = subprocess.run([sys.executable, str(script), "--check", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout


def fake_build(returncode, page):
    """A stand-in for the jupyter-book run: writes ``page`` as index.html into its output folder."""

    def run(cmd, **kwargs):
        out = Path(cmd[cmd.index("--path-output") + 1]) / "_build" / "html"
        out.mkdir(parents=True)
        (out / "index.html").write_text(page)
        return subprocess.CompletedProcess(cmd, returncode)

    return run


@pytest.fixture
def previous_book(tmp_path, monkeypatch):
    build = tmp_path / "_build"
    (build / "html").mkdir(parents=True)
    (build / "html" / "index.html").write_text("the previous book")
    monkeypatch.setattr(build_book, "BUILD", build)
    monkeypatch.setattr(build_book, "vendor_mathjax", lambda: None)
    return build


def test_failed_book_build_leaves_nothing_half_written(previous_book, monkeypatch):
    monkeypatch.setattr(build_book.subprocess, "run", fake_build(1, "half a book"))
    with pytest.raises(SystemExit, match="book build failed"):
        build_book.build()
    assert (previous_book / "html" / "index.html").read_text() == "the previous book"
    assert sorted(p.name for p in previous_book.iterdir()) == ["html"], "no temporary build folder may remain"


def test_successful_book_build_replaces_the_previous_one(previous_book, monkeypatch):
    monkeypatch.setattr(build_book.subprocess, "run", fake_build(0, "new book"))
    index = build_book.build()
    assert index == previous_book / "html" / "index.html" and index.read_text() == "new book"
    assert sorted(p.name for p in previous_book.iterdir()) == ["html"]


# ---- regression tests: malformed notebooks, failed runs, stale MathJax, atomic book, collapsed solutions -----

import run_notebook  # noqa: E402


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"cells": "nope"}', '{"cells": [{"source": "x"}]}'])
def test_sync_names_the_file_of_a_malformed_notebook(tmp_path, text):
    path = tmp_path / "09_broken.ipynb"
    path.write_text(text)
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "sync_notebooks.py"), "--check", str(path)],
                            capture_output=True, text=True)
    assert result.returncode == 2 and str(path) in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert path.read_text() == text


def test_run_notebook_names_the_file_of_a_malformed_notebook(tmp_path):
    path = tmp_path / "09_broken.ipynb"
    path.write_text("{not json")
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "run_notebook.py"), str(path)],
                            capture_output=True, text=True)
    assert result.returncode != 0 and str(path) in result.stderr and "Traceback" not in result.stderr
    assert path.read_text() == "{not json"


def test_failed_execution_does_not_rewrite_the_notebook(tmp_path, monkeypatch):
    path = tmp_path / "09_test.ipynb"
    original = json.dumps(notebook(("markdown", "# 9. Test"), ("code", "1 / 0")))
    path.write_text(original)

    class Failing:
        def __init__(self, nb, **kwargs):
            nb.cells[-1].outputs = [{"output_type": "stream", "name": "stdout", "text": "half\n"}]

        def execute(self):
            raise RuntimeError("cell failed")

    monkeypatch.setattr(run_notebook, "NotebookClient", Failing)
    with pytest.raises(run_notebook.NotebookError, match=re.escape(str(path)) + ".*not rewritten"):
        run_notebook.run(path)
    assert path.read_text() == original, "neither the sync nor the half-run may touch the file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["09_test.ipynb"]


def test_successful_run_writes_the_synced_executed_notebook(tmp_path, monkeypatch):
    path = tmp_path / "09_test.ipynb"
    path.write_text(json.dumps(notebook(("markdown", "# 9. Test"), ("code", "# Solution\nx = 1"))))

    class Passing:
        def __init__(self, nb, **kwargs):
            self.nb = nb

        def execute(self):
            for i, cell in enumerate(c for c in self.nb.cells if c.cell_type == "code"):
                cell.execution_count = i + 1

    monkeypatch.setattr(run_notebook, "NotebookClient", Passing)
    run_notebook.run(path)
    cells = [{**c, "source": "".join(c["source"])} for c in json.loads(path.read_text())["cells"]]
    assert cells[1]["source"].startswith("# Setup: on Colab")
    assert cells[2]["source"] == "#### Solution" and cells[3]["execution_count"] == 2


def test_solutions_are_collapsed_in_the_book_jupyterlab_and_colab():
    nb = notebook(("markdown", "# 9. Test"), ("markdown", "### Exercise 9.1"), ("code", "def my_f(): ..."),
                  ("code", "# Solution\ndef f_solution(): ..."), ("code", "# Solution (cont.)\nprint(1)"),
                  ("markdown", "### Exercise 9.2"), ("code", "# Solution\nprint(2)"))
    new = sync_notebooks.hide_solutions(nb)
    kinds = [(c["cell_type"], c["source"].splitlines()[0]) for c in new["cells"]]
    assert kinds == [("markdown", "# 9. Test"), ("markdown", "### Exercise 9.1"), ("code", "def my_f(): ..."),
                     ("markdown", "#### Solution"), ("code", "# Solution"), ("code", "# Solution (cont.)"),
                     ("markdown", "### Exercise 9.2"), ("markdown", "#### Solution"), ("code", "# Solution")]
    headings = [c for c in new["cells"] if c["source"] == "#### Solution"]
    assert new["metadata"]["colab"]["collapsed_sections"] == [h["metadata"]["id"] for h in headings]
    for h in headings:
        assert h["metadata"]["jp-MarkdownHeadingCollapsed"] is True and h["metadata"]["tags"] == ["remove-cell"]
    for c in new["cells"]:
        if c["source"].startswith("# Solution"):
            assert c["metadata"]["tags"] == ["hide-cell"]
            assert c["metadata"]["jupyter"] == {"source_hidden": True, "outputs_hidden": True}
    assert sync_notebooks.hide_solutions(new) == new, "idempotent: ids and cells stay put"


def test_stale_vendored_mathjax_is_replaced_cleanly(tmp_path, monkeypatch):
    vendor = tmp_path / "book" / "_vendor" / "mathjax"
    (vendor / "input").mkdir(parents=True)
    (vendor / "tex-chtml.js").write_text("// MathJax 2, stale")
    (vendor / "leftover.js").write_text("// not part of the new copy")
    monkeypatch.setattr(build_book, "VENDOR", vendor)
    monkeypatch.setattr(build_book, "MATHJAX_PARTS", ["tex-chtml.js", "input"])
    build_book.vendor_mathjax()
    assert not (vendor / "leftover.js").exists(), "a stale folder is replaced as a whole, not patched"
    assert (vendor / "tex-chtml.js").read_text() != "// MathJax 2, stale" and (vendor / "input").is_dir()
    assert sorted(p.name for p in vendor.parent.iterdir()) == ["mathjax"], "no temporary folders remain"
    stamp = (vendor / build_book.STAMP).stat().st_mtime_ns
    build_book.vendor_mathjax()
    assert (vendor / build_book.STAMP).stat().st_mtime_ns == stamp, "a current copy is left alone"


def test_the_built_book_is_swapped_in_atomically(tmp_path, monkeypatch):
    html, new = tmp_path / "html", tmp_path / "new"
    html.mkdir()
    (html / "index.html").write_text("old")
    new.mkdir()
    (new / "index.html").write_text("new")
    build_book.swap_into_place(new, html)
    assert (html / "index.html").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["html"]
    # without renameat2 the fallback rolls back when the second rename fails
    monkeypatch.setattr(build_book, "_exchange", lambda a, b: False)
    missing = tmp_path / "missing"
    with pytest.raises(OSError):
        build_book.swap_into_place(missing, html)
    assert (html / "index.html").read_text() == "new", "the previous book is put back"


import threading  # noqa: E402
import time  # noqa: E402

import nbval_lanes  # noqa: E402


def test_nbval_lanes_keep_the_chapter7_models_notebooks_together_and_in_order(tmp_path):
    for name, text in [("01_a.ipynb", "{}"), ("07_b.ipynb", "chapter7_model"), ("08_c.ipynb", "x chapter7_model()"),
                       ("10_d.ipynb", "{}")]:
        (tmp_path / name).write_text(text)
    first, rest = nbval_lanes.lanes(sorted(tmp_path.glob("*.ipynb")))
    assert [p.name for p in first] == ["07_b.ipynb", "08_c.ipynb"]
    assert [p.name for p in rest] == ["01_a.ipynb", "10_d.ipynb"]
    real_first, real_rest = nbval_lanes.lanes(sorted((ROOT / "notebooks").glob("*.ipynb")))
    assert "07_training.ipynb" in [p.name for p in real_first] and real_rest
    for group in (real_first, real_rest):  # longest first, so that no long notebook starts last
        seconds = [nbval_lanes.EXPECTED_SECONDS[p.name] for p in group]
        assert seconds == sorted(seconds, reverse=True), [p.name for p in group]
    assert set(nbval_lanes.EXPECTED_SECONDS) == {p.name for p in (ROOT / "notebooks").glob("*.ipynb")}


def test_nbval_lanes_report_the_first_failing_job(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(nbval_lanes, "NOTEBOOKS", tmp_path)
    monkeypatch.setattr(nbval_lanes, "train_model_command", lambda: [sys.executable, "-c", "pass"])
    (tmp_path / "07_a.ipynb").write_text("chapter7_model")
    (tmp_path / "01_b.ipynb").write_text("{}")
    # pytest on a file that is not a test module and a missing option: both notebooks fail, the status says so
    status = nbval_lanes.main(["--", "--no-such-option"])
    out = capsys.readouterr().out
    assert status != 0
    assert "jobs, in the order the lanes take them: the chapter 7 model; 01_b.ipynb; 07_a.ipynb" in out
    assert "the chapter 7 model: exit 0 after" in out
    assert out.count(": exit 4 after") == 2, "each notebook's pytest reports its usage error"


class _Recorder:
    """A stand-in for subprocess.Popen: records starts and ends in ``events``; ``times`` and ``codes`` by name."""

    events, lock, times, codes, waits_for = [], threading.Lock(), {}, {}, {}
    pid = 2 ** 22 + 12345  # above Linux's largest pid: killing its group finds no process

    def __init__(self, command, **kwargs):
        self.name = next((Path(a).name for a in command if a.endswith(".ipynb")),
                         "model" if "chapter7_model" in " ".join(command) else "unit")
        self.env = kwargs.get("env")
        with self.lock:
            self.events.append(("start", self.name))

    def wait(self, timeout=None):
        time.sleep(self.times.get(self.name, 0.01))
        for name in self.waits_for.get(self.name, ()):  # ends only after these jobs have ended (or 10 s)
            deadline = time.monotonic() + 10
            while ("end", name) not in self.events and time.monotonic() < deadline:
                time.sleep(0.01)
        with self.lock:
            self.events.append(("end", self.name))
        return self.codes.get(self.name, 0)

    def poll(self):
        return 0


def test_nbval_lanes_train_the_model_beside_the_unit_tests_and_share_the_notebooks(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(nbval_lanes, "NOTEBOOKS", tmp_path)
    for name in ("07_a", "08_b", "09_c", "12_d"):
        (tmp_path / f"{name}.ipynb").write_text("chapter7_model")
    for name in ("01_e", "02_f"):
        (tmp_path / f"{name}.ipynb").write_text("{}")
    # the model ends only after the unit tests and both other notebooks: they must have run beside it
    recorder = type("R", (_Recorder,), {"events": [], "codes": {"09_c.ipynb": 3},
                                        "waits_for": {"model": ("unit", "01_e.ipynb", "02_f.ipynb")}})
    monkeypatch.setattr(nbval_lanes.subprocess, "Popen", recorder)
    monkeypatch.setattr(nbval_lanes.os, "killpg", lambda pid, sig: None)
    assert nbval_lanes.main(["--unit", "tests -q -n 0", "--", "-q"]) == 3, "a failing notebook's status is the run's"
    events = recorder.events
    starts = [name for kind, name in events if kind == "start"]
    assert set(starts[:2]) == {"model", "unit"}, "one lane trains while the other runs the unit tests"
    assert sorted(starts) == sorted(["model", "unit", "01_e.ipynb", "02_f.ipynb", "07_a.ipynb", "08_b.ipynb",
                                     "09_c.ipynb", "12_d.ipynb"]), "each job runs once"
    trained = events.index(("end", "model"))
    for name in ("07_a.ipynb", "08_b.ipynb", "09_c.ipynb", "12_d.ipynb"):
        assert events.index(("start", name)) > trained, f"{name} started before the model was trained"
    for name in ("01_e.ipynb", "02_f.ipynb"):  # the unit tests' lane goes on while the model trains
        assert events.index(("start", name)) < trained
    out = capsys.readouterr().out
    assert "jobs, in the order the lanes take them: the chapter 7 model; unit tests; 01_e.ipynb" in out


def test_nbval_lanes_start_no_model_notebook_when_the_model_failed(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(nbval_lanes, "NOTEBOOKS", tmp_path)
    (tmp_path / "07_a.ipynb").write_text("chapter7_model")
    (tmp_path / "01_b.ipynb").write_text("{}")
    recorder = type("R", (_Recorder,), {"events": [], "times": {}, "codes": {"model": 1}})
    monkeypatch.setattr(nbval_lanes.subprocess, "Popen", recorder)
    monkeypatch.setattr(nbval_lanes.os, "killpg", lambda pid, sig: None)
    assert nbval_lanes.main(["--", "-q"]) == 1
    assert ("start", "07_a.ipynb") not in recorder.events and ("start", "01_b.ipynb") in recorder.events
    assert "07_a.ipynb: not started, because the chapter 7 model failed" in capsys.readouterr().out


def test_nbval_lanes_run_the_unit_tests_in_the_callers_arithmetic(tmp_path, monkeypatch):
    monkeypatch.setattr(nbval_lanes, "NOTEBOOKS", tmp_path)
    (tmp_path / "01_b.ipynb").write_text("{}")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    jobs = {j.name: j for j in nbval_lanes.jobs_for([tmp_path / "01_b.ipynb"], ["-q"], ["tests", "-q"])}
    assert set(jobs) == {"unit tests", "01_b.ipynb"}, "no model job without a notebook that needs it"
    assert jobs["unit tests"].env["ATEN_CPU_CAPABILITY"] == "avx2"  # the package is tested on the fastest kernels
    assert jobs["01_b.ipynb"].env["ATEN_CPU_CAPABILITY"] == "default"
    assert jobs["unit tests"].command[-3:] == ["pytest", "tests", "-q"]
    assert jobs["unit tests"].env["OMP_NUM_THREADS"] == "1"  # one core: the other trains the model
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # a count the caller chose is kept
    jobs = {j.name: j for j in nbval_lanes.jobs_for([tmp_path / "01_b.ipynb"], ["-q"], ["tests", "-q"])}
    assert jobs["unit tests"].env["OMP_NUM_THREADS"] == "2"
    assert jobs["01_b.ipynb"].env["OMP_NUM_THREADS"] == "2"


def test_nbval_lanes_run_only_the_notebooks_named(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(nbval_lanes, "NOTEBOOKS", tmp_path)
    for name, text in (("07_a", "chapter7_model"), ("01_b", "{}"), ("02_c", "{}")):
        (tmp_path / f"{name}.ipynb").write_text(text)
    seen = []
    monkeypatch.setattr(nbval_lanes.subprocess, "call", lambda command, *, cwd, env: seen.append(command) or 0)
    assert nbval_lanes.main(["--lanes", "1", "--", "-q", str(tmp_path / "02_c.ipynb")]) == 0
    assert [Path(a).name for a in seen[0] if a.endswith(".ipynb")] == ["02_c.ipynb"] and "-q" in seen[0]
    assert nbval_lanes.main(["--", "-q", str(tmp_path / "nope.ipynb")]) == 2
    assert "no such notebook" in capsys.readouterr().err


def test_nbval_lanes_run_with_passive_openmp_threads(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(nbval_lanes, "NOTEBOOKS", tmp_path)
    (tmp_path / "07_a.ipynb").write_text("chapter7_model")
    (tmp_path / "01_b.ipynb").write_text("{}")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    seen = []

    class Recorder:
        pid = 2 ** 22 + 12345  # above Linux's largest pid: killing its group finds no process

        def __init__(self, command, *, env, **kwargs):
            seen.append(env.get("OMP_WAIT_POLICY"))
            assert env["MKL_CBWR"] == "COMPATIBLE"

        def wait(self, timeout=None):
            return 0

        def poll(self):
            return 0

    monkeypatch.setattr(nbval_lanes.subprocess, "Popen", Recorder)
    assert nbval_lanes.main(["--", "-q"]) == 0
    assert seen == ["PASSIVE"] * 3  # the model, then both notebooks
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # a policy the caller chose is kept
    seen.clear()
    assert nbval_lanes.main(["--", "-q"]) == 0
    assert seen == ["ACTIVE"] * 3


def test_notebooks_run_on_one_arithmetic_for_every_cpu(tmp_path, monkeypatch):
    expected = dict(nbval_lanes.REPRODUCIBLE)
    assert expected["MKL_CBWR"] == "COMPATIBLE" and expected["ATEN_CPU_CAPABILITY"] == "default"
    assert expected["ONEDNN_MAX_CPU_ISA"] == "SSE41" and expected["OMP_NUM_THREADS"] == "2"
    for name in [*expected, *nbval_lanes.UNSET]:
        monkeypatch.delenv(name, raising=False)
    assert {k: nbval_lanes.notebook_env()[k] for k in expected} == expected
    # the stored outputs were made on this arithmetic: a caller's other choice would print other numbers
    monkeypatch.setenv("MKL_CBWR", "AVX2")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.check=3")
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    monkeypatch.setenv("NPY_ENABLE_CPU_FEATURES", "X86_V3")  # NumPy refuses it beside NPY_DISABLE_CPU_FEATURES
    env = nbval_lanes.notebook_env(OMP_WAIT_POLICY="PASSIVE")
    assert {k: env[k] for k in expected} == expected and env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "NPY_ENABLE_CPU_FEATURES" not in env
    assert nbval_lanes.notebook_env(environ={"MKL_CBWR": "AUTO", "HOME": "/x"})["MKL_CBWR"] == "COMPATIBLE"
    monkeypatch.setattr(nbval_lanes, "NOTEBOOKS", tmp_path)
    (tmp_path / "01_b.ipynb").write_text("{}")
    seen = []
    monkeypatch.setattr(nbval_lanes.subprocess, "call", lambda command, *, cwd, env: seen.append(env) or 0)
    assert nbval_lanes.main(["--lanes", "1", "--", "-q"]) == 0
    assert {k: seen[0][k] for k in expected} == expected and "NPY_ENABLE_CPU_FEATURES" not in seen[0]


NANOGPT_STANDIN = '''
from dataclasses import dataclass
import torch
from torch import nn
import torch.nn.functional as F

@dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 65
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True

class GPT(nn.Module):  # a stand-in with nanoGPT's interface, not its model
    def __init__(self, config):
        super().__init__()
        self.emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=config.bias)

    def forward(self, idx, targets):
        logits = self.head(self.emb(idx))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        return torch.optim.AdamW(self.parameters(), lr=learning_rate, betas=betas, weight_decay=weight_decay)
'''


def test_nanogpt_side_by_side_times_both_models_and_refuses_other_files(tmp_path):
    import nanogpt_side_by_side as side

    model_py = tmp_path / "model.py"
    model_py.write_text(NANOGPT_STANDIN)
    line = side.compare(side.load_nanogpt(model_py), bias=False, rounds=4)
    assert line.startswith("without biases: nanoGPT ") and "groundup" in line
    assert re.search(r"ratio of medians \d+\.\d{3}, per-round ratio median \d+\.\d{3} \(quartiles ", line)
    with pytest.raises(SystemExit, match="is not a file"):
        side.load_nanogpt(tmp_path / "missing.py")
    other = tmp_path / "other.py"
    other.write_text("x = 1\n")
    with pytest.raises(SystemExit, match="defines no GPT and GPTConfig"):
        side.load_nanogpt(other)


def test_chapter_figures_are_numbered_per_chapter_after_sphinx():
    """book/_ext/chapter_figures.py: Sphinx numbers the figures of an unnumbered toctree through the whole book; the
    extension renumbers a chapter page's figures N.1, N.2, ... in page order, leaves other pages alone, reports the
    pages it changed, and runs after Sphinx's own numbering (the toctree collector's default priority, 500)."""
    import importlib.util
    import types

    spec = importlib.util.spec_from_file_location("chapter_figures", ROOT / "book" / "_ext" / "chapter_figures.py")
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    env = types.SimpleNamespace(toc_fignumbers={
        "book/preface": {"figure": {"fig-a": (1,)}},
        "notebooks/01_language_models": {"figure": {"fig-ch01-x": (2,), "fig-ch01-y": (3,)}},
        "notebooks/12_pretrained": {"figure": {"fig-ch12-b": (40,), "fig-ch12-a": (41,)}, "table": {"t": (1,)}},
        "notebooks/07_training_further": {"figure": {"fig-ch07-c": (9,)}},
        "notebooks/07_training": {"figure": {"fig-ch07-a": (7,), "fig-ch07-b": (8,)}},
    })
    assert ext.renumber(None, env) == ["notebooks/01_language_models", "notebooks/07_training",
                                       "notebooks/07_training_further", "notebooks/12_pretrained"]
    # a chapter's second notebook goes on counting where its first (in name order) stopped
    assert env.toc_fignumbers["notebooks/07_training"]["figure"] == {"fig-ch07-a": (7, 1), "fig-ch07-b": (7, 2)}
    assert env.toc_fignumbers["notebooks/07_training_further"]["figure"] == {"fig-ch07-c": (7, 3)}
    assert env.toc_fignumbers["notebooks/12_pretrained"] == {"figure": {"fig-ch12-b": (12, 1), "fig-ch12-a": (12, 2)},
                                                              "table": {"t": (1,)}}
    assert env.toc_fignumbers["notebooks/01_language_models"]["figure"] == {"fig-ch01-x": (1, 1), "fig-ch01-y": (1, 2)}
    assert env.toc_fignumbers["book/preface"] == {"figure": {"fig-a": (1,)}}
    assert ext.renumber(None, env) == [], "a second pass changes nothing"

    connected = []
    ext.setup(types.SimpleNamespace(connect=lambda event, fn, priority=500: connected.append((event, fn, priority))))
    assert connected == [("env-get-updated", ext.renumber, 900)]
    config = (ROOT / "book" / "_config.yml").read_text()
    assert re.search(r"^\s+chapter_figures: _ext\b", config, re.MULTILINE)
    assert re.search(r'^\s+numfig_format: \{figure: "Figure %s:"\}', config, re.MULTILINE)


import results_file  # noqa: E402


def test_results_file_adds_entries_sorted_and_keeps_the_others(tmp_path):
    path = tmp_path / "results" / "chapter99.json"
    results_file.add_entry(path, "seed1", {"loss": 2.5}, header={"about": "runs ±"})
    results_file.add_entry(path, "seed0", {"loss": 2.4})
    results_file.add_entry(path, "seed1", {"loss": 2.3})  # replaced, not duplicated
    stored = json.loads(path.read_text(encoding="utf-8"))
    assert stored == {"about": "runs ±", "runs": {"seed0": {"loss": 2.4}, "seed1": {"loss": 2.3}}}
    assert list(stored["runs"]) == ["seed0", "seed1"] and "±" in path.read_text(encoding="utf-8")
    flat = tmp_path / "flat.json"
    results_file.add_entry(flat, "b", 1, section=None)
    results_file.add_entry(flat, "a", 2, section=None)
    assert list(json.loads(flat.read_text())) == ["a", "b"]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["chapter99.json", "flat.json", "results"]  # no lock file


def test_every_results_tool_stores_through_results_file():
    tools = sorted((ROOT / "tools").glob("ch[0-9][0-9]_*.py"))
    assert {"ch03_results.py", "ch04_results.py", "ch13_classification.py", "ch14_results.py"} <= {
        t.name for t in tools}
    for tool in tools:
        text = tool.read_text(encoding="utf-8")
        assert "add_entry(" in text, f"{tool.name} does not store through results_file.add_entry"
        for own_write in ("fcntl", "atomic_write_text", "write_text(", "json.dump("):
            assert own_write not in text, f"{tool.name} writes its json by itself ({own_write})"


def figure_cell(plot_lines: int, other_lines: int, image: bool = True) -> dict:
    source = "\n".join(["fig, ax = plt.subplots()"] + [f"ax.plot(x, y{i})" for i in range(plot_lines - 1)]
                       + [f"z{i} = {i}" for i in range(other_lines)] + ["# a comment does not count"])
    outputs = [{"output_type": "display_data", "data": {"image/png": "iVBOR", "text/plain": "<Figure>"},
                "metadata": {}}] if image else []
    return {"cell_type": "code", "id": "f", "metadata": {}, "source": source, "outputs": outputs,
            "execution_count": 1}


@pytest.mark.parametrize("plot_lines, other_lines, image, folded", [
    (8, 8, True, True),     # 8 plotting lines, half of the code: folded
    (8, 9, True, False),    # less than half plotting: the computation stays in view
    (7, 0, True, False),    # too short to be in the way
    (12, 0, False, False),  # no figure drawn
])
def test_sync_folds_figure_code_in_the_book(plot_lines, other_lines, image, folded):
    nb = {"cells": [figure_cell(plot_lines, other_lines, image)], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    new = sync_notebooks.hide_figure_code(nb)
    assert ("hide-input" in new["cells"][0]["metadata"].get("tags", [])) is folded
    assert sync_notebooks.hide_figure_code(new) == new, "folding twice changes nothing"
    assert "jupyter" not in new["cells"][0]["metadata"], "JupyterLab and Colab keep showing the code"


def test_a_solution_that_draws_is_not_folded_as_figure_code():
    cell = figure_cell(10, 0)
    cell["source"] = "# Solution (hidden in the book until clicked)\n" + cell["source"]
    assert not sync_notebooks.is_figure_code(cell)


def test_results_tools_restart_on_the_notebooks_arithmetic(tmp_path):
    assert results_file.NOTEBOOK_ARITHMETIC == nbval_lanes.ARITHMETIC
    assert "OMP_NUM_THREADS" not in results_file.NOTEBOOK_ARITHMETIC  # a tool sets its own threads
    script = tmp_path / "tool.py"
    script.write_text("import os, sys\nsys.path.insert(0, sys.argv[1])\n"
                      "from results_file import NOTEBOOK_ARITHMETIC, machine, on_notebook_arithmetic\n"
                      "on_notebook_arithmetic()\n"
                      "e = os.environ\nprint(e['MKL_CBWR'], e['ATEN_CPU_CAPABILITY'], e['ONEDNN_MAX_CPU_ISA'],"
                      " 'NPY_ENABLE_CPU_FEATURES' in e, sys.argv[2:],"
                      " machine()['arithmetic'] == NOTEBOOK_ARITHMETIC)\n")
    env = {k: v for k, v in os.environ.items() if k not in nbval_lanes.REPRODUCIBLE}
    env["ATEN_CPU_CAPABILITY"] = "avx2"  # one set otherwise, the others unset: all end as the notebooks have them
    env["NPY_ENABLE_CPU_FEATURES"] = "X86_V3"  # removed
    out = subprocess.run([sys.executable, str(script), str(ROOT / "tools"), "--entry", "x"], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert out == "COMPATIBLE default SSE41 False ['--entry', 'x'] True\n"  # and the stored machine says so

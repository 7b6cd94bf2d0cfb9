"""The lock, environment.yml, pyproject and the Makefile must describe the same environment."""

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PYTHON_MIN = "3.11.5"  # the book's Python floor (the lock's soupsieve needs 3.11.5), stated in every file below
PACKAGE_PYTHON_MIN = "3.11"  # groundup's own (pyproject): its dependencies' locked numpy, matplotlib need 3.11
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([A-Za-z0-9_.+\-]+)$")


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_lines():
    return [line.strip() for line in (ROOT / "requirements.lock").read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def test_lock_pins_everything_exactly_and_torch_first():
    lines = lock_lines()
    assert lines[0] == "torch==2.13.0", "torch==2.13.0 must come first (make installs it on its own)"
    for line in lines:
        assert PIN.match(line), f"not an exact pin: {line!r}"
    names = [canonical(PIN.match(line).group(1)) for line in lines]
    assert len(names) == len(set(names)), "a package is pinned twice"


def test_environment_yml_installs_the_lock_itself_with_cpu_torch():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    assert pip == [f"--extra-index-url {CPU_INDEX}", "-r requirements.lock"], "one list of pins: the lock"
    assert f"python>={PYTHON_MIN},<3.12" in env["dependencies"]


def test_the_python_floor_is_the_same_everywhere():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["requires-python"] == f">={PACKAGE_PYTHON_MIN}"
    assert pyproject["tool"]["ruff"]["target-version"] == "py" + PACKAGE_PYTHON_MIN.replace(".", "")
    assert re.search(rf"^PYTHON_MIN := {re.escape(PYTHON_MIN)}$", (ROOT / "Makefile").read_text(), re.M)
    assert f"Python {PYTHON_MIN}" in (ROOT / "README.md").read_text()
    assert f"Python {PYTHON_MIN}" in (ROOT / "book" / "setup.md").read_text()
    assert f"Python {PYTHON_MIN}" in (ROOT / "requirements.lock").read_text().splitlines()[0]
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "book.yml").read_text())
    versions = [step["with"]["python-version"] for job in workflow["jobs"].values() for step in job.get("steps", [])
                if "setup-python" in step.get("uses", "")]
    assert versions == [PACKAGE_PYTHON_MIN]  # setup-python's "3.11" is the newest 3.11.x


def test_the_python_floor_is_what_the_locked_packages_require():
    """Every pinned package installed here accepts the floor; numpy, matplotlib, ipython refuse 3.10, soupsieve
    3.11.4."""
    floor = Version(PYTHON_MIN)
    refusing = {"3.10": [], "3.11.4": []}
    for line in lock_lines():
        name, version = PIN.match(line).groups()
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed in this environment: nothing to read
        requires = SpecifierSet(dist.metadata.get("Requires-Python") or "")
        assert requires.contains(floor), f"{name}=={version} needs Python {requires}, above the floor {floor}"
        for before, names in refusing.items():
            if not requires.contains(Version(before)):
                names.append(canonical(name))
    assert {"numpy", "matplotlib", "ipython", "contourpy"} <= set(refusing["3.10"]), refusing
    assert refusing["3.11.4"] == ["soupsieve"], refusing  # the one reason the floor is 3.11.5, not 3.11


def _old_python(folder: Path, version: str) -> Path:
    """A stand-in interpreter reporting ``version`` (it runs this Python with ``sys.version_info`` replaced)."""
    fake = folder / f"python{version}"
    info = (*map(int, version.split(".")), "final", 0)
    fake.write_text(f"""#!/bin/sh
case "$1" in
  -V) echo "Python {version}" ;;
  -c) exec {sys.executable} -I -c 'import sys; sys.version_info = {info}; exec(sys.argv[1])' "$2" ;;
  *) exit 99 ;;
esac
""")
    fake.chmod(0o755)
    return fake


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("version", ["3.10.12", "3.11.4"])
def test_make_setup_stops_on_an_old_python_before_creating_the_venv(tmp_path, version):
    for name in ("requirements.lock", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    old = _old_python(tmp_path, version)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    run = subprocess.run(["make", "-f", str(ROOT / "Makefile"), "setup", f"PYTHON={old}"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert f"error: the book needs Python {PYTHON_MIN} or newer" in run.stderr
    assert f"{old} is Python {version}" in run.stderr and "make setup PYTHON=python3.12" in run.stderr
    assert not (tmp_path / ".venv").exists()
    ok = subprocess.run(["make", "-f", str(ROOT / "Makefile"), "python-version", f"PYTHON={sys.executable}"],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_setup_gets_torch_from_the_cpu_index_unless_told_otherwise(tmp_path):
    """`make -n` (print, do not run): the CPU index by default, none with TORCH_INDEX=, a CUDA one when named."""
    for name in ("requirements.lock", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}

    def torch_command(*args):
        out = subprocess.run(["make", "-n", "-f", str(ROOT / "Makefile"), "setup", *args], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=60, check=True).stdout
        return " ".join(out.replace("\\\n", " ").split("torch==2.13.0")[0].split("pip install")[-1].split())

    assert torch_command() == f"--quiet --disable-pip-version-check --extra-index-url {CPU_INDEX} --retries 0"
    assert torch_command("TORCH_INDEX=") == "--quiet --disable-pip-version-check"
    cuda = "https://download.pytorch.org/whl/cu128"
    assert torch_command(f"TORCH_INDEX={cuda}") == f"--quiet --disable-pip-version-check --extra-index-url {cuda} " \
                                                   "--retries 0"
    readme, setup = (ROOT / "README.md").read_text(), (ROOT / "book" / "setup.md").read_text()
    assert all("TORCH_INDEX=" in text and CPU_INDEX in text for text in (readme, setup))


def test_pyproject_uses_minimum_versions_covered_by_the_lock():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = {canonical(PIN.match(line).group(1)) for line in lock_lines()}
    for requirement in project["dependencies"] + project["optional-dependencies"]["dev"]:
        name = canonical(re.split(r"[<>=!~\[ ]", requirement, maxsplit=1)[0])
        assert "==" not in requirement, f"pyproject pins {requirement!r}: use a minimum version, the lock pins"
        assert name in pinned, f"{name} is a dependency but not pinned in requirements.lock"

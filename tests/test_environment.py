"""The lock, environment.yml and pyproject must describe the same environment."""

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([A-Za-z0-9_.+\-]+)$")


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_lines():
    return [line.strip() for line in (ROOT / "requirements.lock").read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def test_lock_pins_everything_exactly_and_torch_first():
    lines = lock_lines()
    assert lines[0] == "torch==2.13.0", "torch==2.13.0 must come first (a CPU build; a bare torch pulls CUDA)"
    for line in lines:
        assert PIN.match(line), f"not an exact pin: {line!r}"
    names = [canonical(PIN.match(line).group(1)) for line in lines]
    assert len(names) == len(set(names)), "a package is pinned twice"


def test_environment_yml_mirrors_the_lock():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    assert pip == lock_lines(), "environment.yml drifted from requirements.lock: regenerate its pip list"
    assert any(str(d).startswith("python=3.11") for d in env["dependencies"])


def test_pyproject_uses_minimum_versions_covered_by_the_lock():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = {canonical(PIN.match(line).group(1)) for line in lock_lines()}
    for requirement in project["dependencies"] + project["optional-dependencies"]["dev"]:
        name = canonical(re.split(r"[<>=!~\[ ]", requirement, maxsplit=1)[0])
        assert "==" not in requirement, f"pyproject pins {requirement!r}: use a minimum version, the lock pins"
        assert name in pinned, f"{name} is a dependency but not pinned in requirements.lock"

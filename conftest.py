"""Repository-wide pytest hooks."""

from pathlib import Path


def pytest_configure(config):
    # nbval opens --nbval-sanitize-with relative to the current directory; anchor it at the repository root.
    opt = getattr(config.option, "nbval_sanitize_with", None)
    if opt and not Path(opt).is_absolute():
        config.option.nbval_sanitize_with = str(Path(config.rootpath, opt))

"""Repository-wide pytest hooks."""

import signal
from collections import defaultdict
from pathlib import Path

_notebook_seconds = defaultdict(float)


def pytest_configure(config):
    # A shell that starts a command in the background (`cmd &`, nohup) makes it ignore SIGINT, and Python then
    # keeps SIGINT ignored: the tests of Ctrl-C handling would see no KeyboardInterrupt. Give the test process
    # (and, through exec's reset of handlers, the processes it starts) Python's usual Ctrl-C.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # nbval opens --nbval-sanitize-with relative to the current directory; anchor it at the repository root.
    opt = getattr(config.option, "nbval_sanitize_with", None)
    if opt and not Path(opt).is_absolute():
        config.option.nbval_sanitize_with = str(Path(config.rootpath, opt))


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    if path.endswith(".ipynb"):
        _notebook_seconds[path] += report.duration


def pytest_terminal_summary(terminalreporter):
    """Each notebook's total run time, so that growth shows in every CI log."""
    if not _notebook_seconds:
        return
    terminalreporter.write_sep("=", "notebook durations")
    for path, seconds in sorted(_notebook_seconds.items()):
        terminalreporter.write_line(f"{seconds:7.1f} s  {path}")
    terminalreporter.write_line(f"{sum(_notebook_seconds.values()):7.1f} s  in all")

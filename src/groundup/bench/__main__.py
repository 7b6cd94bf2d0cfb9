"""Run every benchmark section and print the report (``python -m groundup.bench [section ...]``)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from groundup.bench import format_rows
from groundup.bench.cpu import describe_cpu

# Each name is a submodule of groundup.bench with a run() -> list[Row], run in this order. A new section is one
# more module and one more name here.
SECTIONS = ["matmul", "training", "throughput", "attention", "tokenizers", "gpt2_tokenizer", "generation",
            "versus_transformers", "smollm2"]
# Minutes-long runs, only when named (python -m groundup.bench quality, make bench-quality).
OPTIONAL = ["quality"]
QUIET_NOTE = ("[quality] measures time budgets (validation loss within 10 minutes of training), not ratios: its "
              "numbers need a quiet machine. Run it when nothing else is running.")


def cores() -> int:
    """The CPU cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def load_line(when: str) -> str:
    """The load average (1, 5, 15 minutes) and, above the core count, a warning that times are inflated."""
    try:
        load = os.getloadavg()
    except OSError:  # not available on this platform
        return f"load average at {when}: unavailable"
    line = f"load average at {when}: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} ({cores()} cores)"
    if load[0] > cores():
        line += (f"\nWARNING: the load exceeds the {cores()} cores: other processes compete, so absolute times are "
                 f"inflated. Ratios come from alternating rounds and hold better; their quartiles show the noise.")
    return line


def header() -> str:
    """The top of the report: the CPU, its vector extensions and PyTorch's kernels (the ratios depend on them), then
    the load at the start."""
    return describe_cpu() + "\n" + load_line("start")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="groundup bench", description="Print the package's performance figures.")
    parser.add_argument("sections", nargs="*", help=f"sections to run (default: all of {', '.join(SECTIONS)}; "
                        f"also {', '.join(OPTIONAL)}: minutes-long quality runs, only when named)")
    args = parser.parse_args(argv)
    unknown = [s for s in args.sections if s not in SECTIONS + OPTIONAL]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS + OPTIONAL)}")
    print(header(), end="\n\n", flush=True)
    if "quality" in args.sections:
        print(QUIET_NOTE, end="\n\n", flush=True)
    status = 0
    for name in args.sections or SECTIONS:
        module = importlib.import_module(f"groundup.bench.{name}")
        try:
            rows = module.run()
        except ModuleNotFoundError as err:  # an optional dependency (a bug in groundup itself still raises)
            if not err.name or err.name.split(".")[0] == "groundup":
                raise
            print(f"[{name}] skipped: {err}", file=sys.stderr, flush=True)
            # asked for by name: an error; skipped in the run of every section: a note, the rest still counts
            status = 1 if args.sections else status
            continue
        print(format_rows(f"[{name}]", rows), end="\n\n", flush=True)
    print(load_line("end"), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())

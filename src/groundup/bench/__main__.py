"""Run every benchmark section and print the report (``python -m groundup.bench [section ...]``)."""

from __future__ import annotations

import argparse
import importlib
import sys

from groundup.bench import format_rows

# Each name is a submodule of groundup.bench with a run() -> list[Row].
SECTIONS = ["matmul", "training", "attention", "tokenizers", "generation"]
# Minutes-long runs, only when named (python -m groundup.bench quality, make bench-quality).
OPTIONAL = ["quality"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="groundup bench", description="Print the package's performance figures.")
    parser.add_argument("sections", nargs="*", help=f"sections to run (default: all of {', '.join(SECTIONS)}; "
                        f"also {', '.join(OPTIONAL)}: minutes-long quality runs, only when named)")
    args = parser.parse_args(argv)
    unknown = [s for s in args.sections if s not in SECTIONS + OPTIONAL]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS + OPTIONAL)}")
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
    return status


if __name__ == "__main__":
    sys.exit(main())

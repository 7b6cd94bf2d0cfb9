"""The ``groundup`` command: runs longer than a notebook cell, from a shell.

    groundup data [shakespeare|tinyshakespeare]   download, verify and cache a corpus; print its size
    groundup bench [section ...]                  print the performance figures
    groundup train --out run/ [options]           train a character-level GPT (chapter 7's CPU recipe)
    groundup sample run/ --prompt "ROMEO:"        generate text from a trained run (chapter 8)
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="groundup", description="Transformers from the Ground Up: the command line.")
    sub = parser.add_subparsers(dest="command", required=True)
    data = sub.add_parser("data", help="download, verify and cache a corpus")
    data.add_argument("name", nargs="?", default="shakespeare")
    bench = sub.add_parser("bench", help="print the performance figures")
    bench.add_argument("sections", nargs="*")
    from groundup import runs

    runs.add_train_parser(sub)
    runs.add_sample_parser(sub)
    args = parser.parse_args(argv)
    if args.command in ("train", "sample"):
        return args.handler(args)

    if args.command == "data":
        from groundup import data as data_module

        return data_module.main([args.name])
    if args.command == "bench":
        from groundup.bench.__main__ import main as bench_main

        return bench_main(args.sections)
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""The ``groundup`` command: runs longer than a notebook cell, from a shell.

    groundup data [shakespeare|tinyshakespeare|smollm2]   download, verify and cache a corpus or model file
    groundup bench [section ...]                  print the performance figures
    groundup train --out run/ [options]           train a character-level GPT (chapter 7's CPU recipe)
    groundup train --task dates --out run/        train chapter 10's encoder-decoder: dates in words to ISO 8601
    groundup sample run/ --prompt "ROMEO:"        generate text from a trained run (chapter 8), or translate a date
    groundup sample --pretrained smollm2 --chat --prompt "..."   a real pretrained model, offline (chapter 12)
    groundup finetune --out ft/ [--task dates | --data FILE.jsonl]   instruction-tune SmolLM2 with LoRA (chapter 13)
    groundup --version                            print the package's version

``python -m groundup`` is the same command. Output piped into a program that stops reading early (``| head``)
ends the command quietly with status 141 (128 + SIGPIPE, what a shell reports for a program killed by the
broken pipe); an I/O error (a full disk, say) prints one line and exits with status 1; Ctrl-C ends it with status
130 (``groundup train`` and ``groundup finetune`` first save a checkpoint).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

EXIT_BROKEN_PIPE = 128 + getattr(signal, "SIGPIPE", 13)
"""Exit status after the reader of our output went away (``groundup ... | head``)."""
EXIT_INTERRUPTED = 128 + signal.SIGINT
"""Exit status after Ctrl-C (128 + SIGINT, what a shell reports for a program killed by it)."""


class _Parser(argparse.ArgumentParser):
    """argparse, except that a failed write of --help/--version (a full disk) is reported, not swallowed."""

    def _print_message(self, message, file=None):
        if message:
            (file or sys.stderr).write(message)


def _parser() -> argparse.ArgumentParser:
    from groundup import __version__
    from groundup.bench.__main__ import OPTIONAL, SECTIONS
    from groundup.data import ASSETS, CORPORA, MODEL_FILES

    parser = _Parser(prog="groundup", description="Transformers from the Ground Up: the command line.")
    parser.add_argument("--version", action="version", version=f"groundup {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    corpora = ", ".join(sorted(CORPORA) + sorted(ASSETS) + sorted(MODEL_FILES))
    data = sub.add_parser("data", help="download, verify and cache a corpus",
                          description=f"Download, verify and cache a corpus and print its size. Corpora: {corpora}.")
    data.add_argument("name", nargs="?", default="shakespeare",
                      help=f"the corpus: one of {corpora} (default: shakespeare)")
    bench = sub.add_parser("bench", help="print the performance figures",
                           description="Measure and print the package's performance figures.")
    bench.add_argument("sections", nargs="*", metavar="section",
                       help=f"sections to run: {', '.join(SECTIONS)} (default: all of these); also "
                            f"{', '.join(OPTIONAL)} (minutes-long quality runs, only when named)")
    from groundup import runs, sampling

    runs.add_train_parser(sub)
    sampling.add_sample_parser(sub)
    from groundup import finetuning

    finetuning.add_finetune_parser(sub)
    return parser


def _run(argv) -> int:
    args = _parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # groundup train --nproc N passes them to torchrun
    if args.command in ("train", "sample", "finetune"):
        return args.handler(args)

    if args.command == "data":
        from groundup import data as data_module

        return data_module.main([args.name])
    if args.command == "bench":
        from groundup.bench.__main__ import main as bench_main

        return bench_main(args.sections)
    return 2


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's final flush cannot fail (and print a traceback) again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout replaced by an object without a file descriptor
        pass


def _describe(err: OSError) -> str:
    what = err.strerror or str(err) or type(err).__name__
    return f"{what}: {err.filename}" if err.filename else what


def main(argv=None) -> int:
    """Run the command line; returns the exit status (``sys.exit(main())``)."""
    try:
        try:
            status = _run(argv)
        except SystemExit:  # argparse's --help, --version and usage errors: flush their output first
            sys.stdout.flush()
            raise
        sys.stdout.flush()  # a full disk or closed pipe shows up here, inside the handlers below
        return status
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:  # Ctrl-C where a command has no handling of its own (data, bench): no traceback
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as err:
        try:
            sys.stdout.flush()
        except OSError:
            _silence_stdout()
        print(f"groundup: error: {_describe(err)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

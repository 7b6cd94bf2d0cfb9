"""``python -m groundup``: the ``groundup`` command line (:mod:`groundup.cli`)."""

import sys

from groundup.cli import main

if __name__ == "__main__":
    sys.exit(main())

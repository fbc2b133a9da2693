"""`python -m dcp_opt`: the `dcp-opt` command line (dcp_opt.cli)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())

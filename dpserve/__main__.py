"""`python -m dpserve ...` is the `dpserve` command."""

import sys

from dpserve.cli import main

sys.exit(main())

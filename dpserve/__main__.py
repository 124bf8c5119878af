"""`python -m dpserve ...` is the `dpserve` command."""

from dpserve.cli import entry

entry()

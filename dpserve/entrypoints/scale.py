"""`dpserve scale N --url http://host:port [--api-key K]`: change a server's engine count.

Sends `POST /scale_elastic_ep {"new_data_parallel_size": N}` (the server needs
`--enable-admin-api`) and waits for the answer: prints the server's message
and exits 0 when the change is done; otherwise one line on stderr (the
server's error message and HTTP status, or why it could not be reached) and
exit 1. Standard library only (urllib).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request

_TIMEOUT_S = 1800.0  # loading engines on a real model takes a while


def add_scale_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("size", type=int, help="The new number of DP engines.")
    parser.add_argument("--url", default="http://127.0.0.1:8000",
                        help="The server (any of its API servers).")
    parser.add_argument("--api-key", default=None,
                        help="The server's --api-key (default: $DPSERVE_API_KEY).")
    parser.add_argument("--timeout", type=float, default=_TIMEOUT_S,
                        help="Seconds to wait for the change to finish.")


def run_scale(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/") + "/scale_elastic_ep"
    if not url.startswith(("http://", "https://")):
        print(f"dpserve: error: --url must start with http:// or https://, got {args.url!r}",
              file=sys.stderr)
        return 2
    headers = {"Content-Type": "application/json"}
    key = args.api_key or os.environ.get("DPSERVE_API_KEY")
    if key:
        headers["Authorization"] = f"Bearer {key}"
    body = json.dumps({"new_data_parallel_size": args.size}).encode()
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            answer = json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as e:
        print(f"dpserve: error: scale to {args.size}: {_error_message(e)} "
              f"(HTTP {e.code})", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        print(f"dpserve: error: cannot reach {args.url}: {reason}", file=sys.stderr)
        return 1
    print(answer.get("message", f"scaled to {args.size} engines"))
    return 0


def _error_message(error: urllib.error.HTTPError) -> str:
    """The OpenAI-shaped error's message, else the status text."""
    if error.code == 404:
        return "the server has no /scale_elastic_ep (start it with --enable-admin-api)"
    try:
        return str(json.loads(error.read())["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return str(error.reason)

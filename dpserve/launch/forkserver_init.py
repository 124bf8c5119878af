"""Imported first by the engines' forkserver (`dpserve.launch.process.engine_context`):
a SIGTERM to the whole process group (systemd's stop) drains the engines and must
not kill the forkserver under them (their exit codes come through it). It exits
when the launcher does. Its children restore SIGTERM before their target runs.
"""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)

"""Lifecycle: addresses, process managers, the start-up handshake, the rendezvous,
the DP coordinator, the Ray backend and teardown. No other package spawns processes."""

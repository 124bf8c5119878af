"""Lifecycle: addresses, process managers, the start-up handshake, the rendezvous,
the DP coordinator, the failure policy and the supervisors that carry it out, the
Ray backend and teardown. No other package spawns processes."""

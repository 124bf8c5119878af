"""Where a serving instance's TCP ports come from: free, never handed out twice, and
outside the kernel's ephemeral range, where a process binding port 0 (the local Ray
instance starting while the engines load) could take one before it is bound."""

import socket

import pytest

from dpserve.launch import addresses
from dpserve.launch.addresses import AddressAllocator, pick_port


def _ephemeral() -> tuple[int, int]:
    with open(addresses._EPHEMERAL_RANGE) as f:
        low, high = map(int, f.read().split())
    return low, high


def test_ports_come_from_outside_the_ephemeral_range_and_are_bindable():
    low, high = _ephemeral()
    allocator = AddressAllocator(local_only=False)
    ports = [allocator.free_port() for _ in range(50)]
    assert len(set(ports)) == 50  # never one handed out before
    assert all(not low <= p <= high for p in ports), (low, high, ports)
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free when handed out


def test_a_taken_or_avoided_port_is_never_chosen(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        # A window of two ports, one bound by someone else, one to avoid: the
        # window is too small (under 1,000), so the choice falls back to port 0.
        monkeypatch.setattr(addresses, "_STATIC_LOW", busy - 1)
        monkeypatch.setattr(addresses, "_ephemeral_low", lambda: busy + 1)
        port = pick_port(avoid={busy - 1})
        assert port not in (busy, busy - 1)


def test_an_unreadable_range_falls_back_to_linux_default(monkeypatch, tmp_path):
    monkeypatch.setattr(addresses, "_EPHEMERAL_RANGE", str(tmp_path / "missing"))
    assert addresses._ephemeral_low() == 32768
    port = pick_port()
    assert addresses._STATIC_LOW <= port < 32768


@pytest.mark.parametrize(("text", "low"), [("", 32768), ("garbage", 32768),
                                           ("40000\t60999\n", 40000)])
def test_the_range_file_is_read_or_ignored(monkeypatch, tmp_path, text, low):
    path = tmp_path / "range"
    path.write_text(text)
    monkeypatch.setattr(addresses, "_EPHEMERAL_RANGE", str(path))
    assert addresses._ephemeral_low() == low


@pytest.mark.procs
def test_a_port_another_live_process_chose_is_reserved_until_it_exits():
    """Two servers starting at once, from two processes: the port one chose (and has
    not bound yet) is never chosen by the other; once the chooser is gone it is free."""
    import subprocess
    import sys

    child = subprocess.Popen(
        [sys.executable, "-c", "import sys\n"
         "from dpserve.launch.addresses import pick_port\n"
         "print(pick_port(), flush=True)\nsys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: chosen, not bound
        assert not addresses.reserve_port("127.0.0.1", port)
        assert addresses.reserve_port("127.0.0.1", port + 1 if port % 2 else port - 1)
    finally:
        child.communicate("", timeout=30)
    assert child.returncode == 0
    assert addresses.reserve_port("127.0.0.1", port)  # its holder exited
    assert addresses.reserve_port("127.0.0.1", port)  # and this process holds it now

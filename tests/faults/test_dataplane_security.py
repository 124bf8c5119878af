"""The data plane's exposure: what dpserve listens on, who may join its DP group's
store, which secrets it accepts, and that no secret shows in `ps`, logs or outputs.

A real lockstep DP=2 server on loopback listens on no wildcard address in any of
its processes (the store and gloo's own listener included) and keeps its API key
and data-plane secret out of every process's command line, its log and its
/engines and /debug outputs; the store refuses a peer without the secret; a
non-loopback tcp:// data plane without a secret, a short secret or a readable
secret file are refused in one line before anything starts.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest
import torch
import torch.distributed as dist
from helpers import descendants, free_port, output, serve, stop, wait_until

from dpserve.config import ConfigError, EngineArgs
from dpserve.engine.dp_store import DPStoreServer, ZmqStore, gloo_device, store_address
from dpserve.security import SecretError, check_ray_secret, derive_keys

SECRET = "dpserve-test-secret-" + "0123456789abcdef" * 2  # 52 characters
API_KEY = "sk-dpserve-test-api-key-4f1d2c"
STORE_TIMEOUT = datetime.timedelta(seconds=20)


# ---- what a process listens on ----------------------------------------------------------

def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:  # gone meanwhile
        pass
    return inodes


def _ip(hex_addr: str) -> str:
    """/proc/net/tcp{,6}'s little-endian hex address -> its text form."""
    import ipaddress

    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return str(ipaddress.IPv6Address(words))


def listeners(pids: list[int]) -> dict[int, set[tuple[str, int]]]:
    """pid -> {(ip, port)} of every TCP socket it listens on (from /proc/net/tcp and
    tcp6, matched by socket inode, so other processes on the machine do not count)."""
    table: dict[int, tuple[str, int]] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A":  # LISTEN
                    addr, port = cols[1].split(":")
                    table[int(cols[9])] = (_ip(addr), int(port, 16))
    return {pid: {table[i] for i in _socket_inodes(pid) if i in table} for pid in pids}


# ---- the store ----------------------------------------------------------------------------

def _form_group(address: str, rank: int, out: dict) -> None:
    """Rank `rank` of a 2-member gloo group through the store; all-reduce MAX."""
    store = ZmqStore(address, SECRET, STORE_TIMEOUT)
    try:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = STORE_TIMEOUT
        options._devices = [gloo_device("127.0.0.1")]
        group = dist.ProcessGroupGloo(dist.PrefixStore("dpserve-dp/1", store), rank, 2,
                                      options)
        out[f"listening{rank}"] = listeners([os.getpid()])[os.getpid()]
        tensor = torch.tensor([rank, 10 - rank])
        reduce = dist.AllreduceOptions()
        reduce.reduceOp = dist.ReduceOp.MAX
        group.allreduce([tensor], reduce).wait()
        out[rank] = tensor.tolist()
    finally:
        store.close()


def _refused(address: str, key: str | None, op: str) -> None:
    """An outsider's `op` on rank 0's key (a poisoning write, a joining read) times out."""
    outsider = ZmqStore(address, key, datetime.timedelta(seconds=1))
    try:
        with pytest.raises(RuntimeError, match=f"no answer to {op}"):
            if op == "set":
                outsider.set("dpserve-dp/2/0", b"the attacker's address")
            else:
                outsider.get("dpserve-dp/2/0")
    finally:
        outsider.close()


def test_store_forms_a_gloo_group_and_refuses_outsiders():
    """gloo's rendezvous runs over the ZMQ store (set / wait / get); a peer without the
    secret, or with another, can neither write a key (poison) nor read one (join):
    its calls time out and the store is unchanged; every listener is on loopback."""
    address = store_address("127.0.0.1", free_port())
    server = DPStoreServer(address, SECRET)
    try:
        before = listeners([os.getpid()])[os.getpid()]
        out: dict = {}
        threads = [threading.Thread(target=_form_group, args=(address, r, out)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert out.get(0) == out.get(1) == [1, 10], out
        # Premise: gloo opened listeners of its own here; none is on a wildcard address.
        opened = (out["listening0"] | out["listening1"]) - before
        assert opened, "gloo opened no listener: nothing was checked"
        assert all(ip == "127.0.0.1" for ip, _ in opened | before), opened | before

        insider = ZmqStore(address, SECRET, datetime.timedelta(seconds=5))
        insider.set("dpserve-dp/1/extra", b"generation 1")
        insider.set("dpserve-dp/2/0", b"rank 0's address")
        # Four refused calls (each waits out its 1 s timeout), at once.
        with ThreadPoolExecutor(4) as pool:
            for done in [pool.submit(_refused, address, key, op)
                         for key in (None, "another secret, also long enough to be accepted!")
                         for op in ("set", "get")]:
                done.result()
        assert insider.get("dpserve-dp/2/0") == b"rank 0's address"
        # Old generations go: a key of generation 3 drops generation 1's, keeps 2's.
        assert insider.check(["dpserve-dp/1/extra"])
        insider.set("dpserve-dp/3/0", b"")
        assert not insider.check(["dpserve-dp/1/extra"])
        assert insider.check(["dpserve-dp/2/0", "dpserve-dp/3/0"])
        # The rest of the Store API that torch may call.
        assert insider.add("counter", 3) == 3 and insider.add("counter", 2) == 5
        assert insider.compare_set("cas", "", "first") == b"first"
        assert insider.compare_set("cas", "wrong", "second") == b"first"
        assert insider.check(["cas", "counter"]) and not insider.check(["missing"])
        assert insider.delete_key("cas") and not insider.check(["cas"])
        insider.close()
    finally:
        server.close()


def test_keys_come_from_a_kdf_per_role():
    keys = derive_keys(SECRET)
    assert keys["server"] != keys["client"] and len(keys["server"]) == 40
    assert derive_keys(SECRET[:-1] + "X")["server"] != keys["server"]
    import hashlib

    from zmq.utils import z85

    old = z85.encode(hashlib.sha256(f"dpserve-dp-server\0{SECRET}".encode()).digest())
    assert keys["server"] != old  # no longer one SHA-256 of the secret


# ---- the command line ---------------------------------------------------------------------

def _serve_fails(tmp_path, *args: str, env: dict | None = None) -> str:
    """`dpserve serve` that must fail at once: its one-line error."""
    out = subprocess.run([sys.executable, "-m", "dpserve.cli", "serve", str(tmp_path),
                          "--port", str(free_port()), *args], capture_output=True,
                         text=True, timeout=60, env={**os.environ, **(env or {})})
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


REMOTE = ("--data-parallel-size", "2", "--data-parallel-size-local", "1")


@pytest.mark.parametrize("args, names", [
    # a tcp:// data plane on a non-loopback address without a secret
    ((*REMOTE, "--data-parallel-address", "0.0.0.0"),
     ("--data-parallel-secret", "--data-parallel-insecure", "0.0.0.0")),
    (("--data-parallel-size", "2", "--data-parallel-rank", "0",
      "--data-parallel-address", "10.11.12.13"),
     ("--data-parallel-secret", "--data-parallel-insecure")),
    (("--headless", *REMOTE, "--data-parallel-start-rank", "1",
      "--data-parallel-address", "192.0.2.1"),
     ("--data-parallel-secret", "--data-parallel-insecure")),
    # a short secret
    (("--data-parallel-secret", "short but not 32"), ("--data-parallel-secret", "32")),
])
@pytest.mark.procs
def test_exposed_or_weak_data_plane_is_refused_in_one_line(tmp_path, args, names):
    line = _serve_fails(tmp_path, *args)
    assert all(n in line for n in names), line
    assert "short but not 32" not in line  # the secret itself is never echoed


@pytest.mark.procs
def test_short_secret_from_the_environment_is_refused(tmp_path):
    line = _serve_fails(tmp_path, env={"DPSERVE_DP_SECRET": "tiny"})
    assert "--data-parallel-secret" in line and "32" in line, line


def test_a_secret_reaches_ray_actors_only_where_ray_authenticates(monkeypatch, caplog):
    """Off loopback, a secret in Ray actors' arguments needs RAY_AUTH_MODE=token; the
    operator may accept the exposure with --data-parallel-insecure (a warning)."""
    secret = "s" * 40
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with pytest.raises(SecretError, match="RAY_AUTH_MODE=token.*--data-parallel-insecure"):
        check_ray_secret("10.1.2.3", secret, insecure=False)
    check_ray_secret("127.0.0.1", secret, insecure=False)  # loopback: this host only
    check_ray_secret("10.1.2.3", None, insecure=False)  # no secret travels
    with caplog.at_level("WARNING"):
        check_ray_secret("10.1.2.3", secret, insecure=True)
    assert "RAY_AUTH_MODE=token" in caplog.text
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    check_ray_secret("10.1.2.3", secret, insecure=False)


@pytest.mark.procs
def test_secret_file_must_be_private_and_long(tmp_path):
    path = tmp_path / "dp.secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o644)
    line = _serve_fails(tmp_path, "--data-parallel-secret-file", str(path))
    assert "--data-parallel-secret-file" in line and "644" in line, line
    path.chmod(0o600)
    path.write_text("too short\n")
    line = _serve_fails(tmp_path, "--data-parallel-secret-file", str(path))
    assert "--data-parallel-secret-file" in line and "32" in line, line
    line = _serve_fails(tmp_path, "--data-parallel-secret-file", str(path),
                        "--data-parallel-secret", SECRET)
    assert "--data-parallel-secret-file" in line, line


def test_secret_sources_the_override_and_reprs(tiny_llama, tmp_path, monkeypatch):
    """The secret comes from the option, a private file or $DPSERVE_DP_SECRET and is in
    no repr; --data-parallel-insecure lets a plain non-loopback tcp data plane start."""
    model = str(tiny_llama)
    path = tmp_path / "dp.secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    args = EngineArgs(model=model, data_parallel_secret_file=str(path))
    config = args.create_config()
    assert config.parallel.data_parallel_secret == SECRET
    monkeypatch.setenv("DPSERVE_DP_SECRET", SECRET[::-1])
    assert EngineArgs(model=model).create_config().parallel.data_parallel_secret == \
        SECRET[::-1]
    given = EngineArgs(model=model, data_parallel_secret=SECRET)
    assert SECRET not in repr(given) and SECRET not in repr(given.create_config())
    monkeypatch.delenv("DPSERVE_DP_SECRET")
    remote = dict(model=model, data_parallel_size=2, data_parallel_size_local=1,
                  data_parallel_address="10.11.12.13")
    with pytest.raises(ConfigError, match="--data-parallel-insecure"):
        EngineArgs(**remote).check_options()
    EngineArgs(**remote, data_parallel_insecure=True).check_options()
    EngineArgs(**remote, data_parallel_secret=SECRET).check_options()


# ---- a real lockstep server ------------------------------------------------------------------

def _tree(pid: int) -> list[psutil.Process]:
    return [psutil.Process(pid), *descendants(pid)]


def _engines_in_group(url: str) -> dict | None:
    engines = httpx.get(url + "/debug/dp_state", timeout=10,
                        headers={"Authorization": f"Bearer {API_KEY}"}).json()["engines"]
    states = [engines.get(r, {}).get("dp", {}) for r in ("0", "1")]
    in_group = all(s.get("in_group") and s.get("members") == [0, 1] for s in states)
    return engines if in_group else None


@pytest.mark.procs
def test_lockstep_server_binds_loopback_only_and_shows_no_secret(tiny_llama):
    """DP=2 lockstep on loopback with --api-key K and --data-parallel-secret S: it
    answers; once the engines' gloo group has formed, no process of its tree listens
    on 0.0.0.0 or [::] (the HTTP port, the store and gloo's listeners are all on
    127.0.0.1); neither K nor S is in any process's command line, the log, /engines or
    /debug/dp_state."""
    model = str(tiny_llama)
    with serve(model, "--data-parallel-size", "2", "--data-parallel-lockstep",
               "--threads-per-engine", "1", "--max-model-len", "256", "--num-kv-blocks", "64",
               "--api-key", API_KEY, "--data-parallel-secret", SECRET, timeout=240,
               headers={"Authorization": f"Bearer {API_KEY}"}) as (proc, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, timeout=60)
        out = client.completions.create(model=model, prompt="hello", max_tokens=4)
        assert out.choices[0].text and out.usage.completion_tokens == 4
        wait_until(lambda: _engines_in_group(url), 120, "both ranks in the DP group")

        tree = _tree(proc.pid)
        listening = listeners([p.pid for p in tree])
        every = set().union(*listening.values())
        port = int(url.rsplit(":", 1)[1])
        assert ("127.0.0.1", port) in every, every  # premise: we see its listeners
        engine_pids = {p.pid for p in tree if "EngineCore" in " ".join(p.cmdline())}
        assert len(engine_pids) == 2, engine_pids
        for pid in engine_pids:  # gloo's listener in each engine
            assert listening.get(pid), f"engine {pid} listens on nothing: no gloo seen"
        wildcard = {a for a in every if a[0] in ("0.0.0.0", "::")}
        assert not wildcard, f"listeners on every interface: {wildcard}"
        assert all(ip == "127.0.0.1" for ip, _ in every), every

        for p in tree:
            cmdline = "\0".join(p.cmdline())
            assert API_KEY not in cmdline and SECRET not in cmdline, (p.name(), cmdline)
        for path in ("/engines", "/debug/dp_state", "/debug/request_state"):
            body = httpx.get(url + path, timeout=10,
                             headers={"Authorization": f"Bearer {API_KEY}"}).text
            assert API_KEY not in body and SECRET not in body, path
        stop(proc, 30)  # the whole log, shutdown lines included
        assert proc.returncode == 0, output(proc)[-3000:]
        log = output(proc)
    assert "joined DP group generation" in log  # premise: the log has the engines' lines
    assert API_KEY not in log and SECRET not in log

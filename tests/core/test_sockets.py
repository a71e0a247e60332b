"""Every socket polynya opens on its own binds loopback: the one-rank process group (no
TCPStore at all; gloo on 127.0.0.1) and a weight-sync group on 127.0.0.1 (store and gloo).
Checked from ``/proc/net/tcp*`` in a fresh process. (The HTTP server binds the host it is given,
127.0.0.1 by default: ``tests/client``.)"""

import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import os, threading, torch
    from polynya.distributed import ensure_process_group, free_port
    from polynya.sync import SyncGroup

    def listening():
        mine = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                link = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                mine.add(link[8:-1])
        out = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in open(table).read().splitlines()[1:]:
                f = line.split()
                if f[3] == "0A" and f[9] in mine:  # state LISTEN, a socket of this process
                    out.append(f[1].split(":")[0])
        return out

    ensure_process_group(torch.device("cpu"))
    t = torch.ones(3)
    torch.distributed.all_reduce(t)
    port, groups = free_port(), {}
    th = threading.Thread(target=lambda: groups.update(
        r=SyncGroup("127.0.0.1", port, rank=1, world_size=2, device="cpu", timeout_s=60)))
    th.start()
    sender = SyncGroup("127.0.0.1", port, rank=0, world_size=2, device="cpu", timeout_s=60)
    th.join(60)
    buf = torch.zeros(4)
    w = groups["r"].broadcast(buf, 0)
    sender.broadcast(torch.arange(4.0), 0).wait()
    w.wait()
    assert buf.tolist() == [0.0, 1.0, 2.0, 3.0]
    print("LISTEN", " ".join(listening()))
""")

LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


@pytest.mark.timeout(300)
def test_every_listening_socket_is_loopback():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    addrs = next(line for line in out.stdout.splitlines() if line.startswith("LISTEN")).split()[1:]
    assert len(addrs) >= 4, addrs  # gloo (default group, sync group x2), the sync group's store
    assert set(addrs) <= LOOPBACK, f"listening off loopback: {set(addrs) - LOOPBACK}"

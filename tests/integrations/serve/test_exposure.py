"""What the server started as the CLI starts it (`--host 127.0.0.1`) exposes beyond this machine:
every TCP port that its Ray listens on is bound to loopback, but the one that Ray Serve binds to
every interface whatever the node's address, each replica's inter-deployment gRPC server
(docs/serve.md, "Ray's ports").

Ray's processes are this one (the driver) and its descendants: `ray.init` starts the GCS, the
raylet and the dashboard processes, and the raylet starts the agents and the workers.
"""
from __future__ import annotations

import ipaddress
import os
from collections import Counter

import pytest

pytest.importorskip("ray", reason="needs the 'serve' extra: pip install -e '.[serve]'")
psutil = pytest.importorskip("psutil")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPLICA = "ray::ServeReplica:"  # the title Ray gives a Serve replica's process
WILDCARDS = ("0.0.0.0", "::")


def ray_listeners() -> list[tuple[int, str, str, int]]:
    """(pid, process name, address, port) of each TCP socket listening in this process or a
    descendant of it."""
    rows = []
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            name = process.name()
            sockets = process.net_connections(kind="tcp")
        except psutil.NoSuchProcess:  # an idle worker that exited meanwhile
            continue
        rows += [(process.pid, name, s.laddr.ip, s.laddr.port) for s in sockets if s.status == psutil.CONN_LISTEN]
    return rows


def on_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None  # ::ffff:127.0.0.1
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def test_ray_of_a_loopback_server_listens_on_loopback_only(service):
    if os.environ.get("RAY_ADDRESS"):
        pytest.skip("the server joined the Ray at RAY_ADDRESS, which it leaves as it is")
    listeners = ray_listeners()
    assert {"gcs_server", "raylet"} <= {name for _, name, _, _ in listeners}, listeners  # Ray's are in view
    exposed = [row for row in listeners if not on_loopback(row[2])]
    # Ray Serve 2.60 binds it to [::]:0 (serve/_private/replica.py) with no option: one per replica.
    replica_grpc = [row for row in exposed if row[1].startswith(REPLICA) and row[2] in WILDCARDS]
    assert max(Counter(pid for pid, *_ in replica_grpc).values(), default=0) <= 1, exposed
    assert [row for row in exposed if row not in replica_grpc] == [], listeners

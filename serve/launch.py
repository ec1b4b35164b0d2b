"""What `ddtree serve` does around Ray's start and stop: it waits for the ports a server stopped
moments ago still holds before its own Ray starts, chooses where Ray's node (and its metrics
endpoint) listens, and drains the requests in flight before the app shuts down."""

from __future__ import annotations

import socket
import sys
import time

PORT_WAIT_S = 60.0  # how long `ddtree serve` waits for a port a stopped server's processes still hold


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed socket's TIME_WAIT is no holder
        try:
            probe.bind(("", port))
        except OSError:
            return True
    return False


def wait_for_ports(ports: list[tuple[str, str, int]]) -> str | None:
    """Waits up to PORT_WAIT_S for each of `ports` ((what it serves, the flag that moves it,
    port)) to be free; the error to print for one still held, else None. Ray's processes of a
    server stopped moments ago keep its metrics and HTTP ports a while after the command has
    returned; a new Ray whose metrics agent then cannot bind fails its start-up only after
    minutes, with "The current node timed out during startup"."""
    deadline = time.monotonic() + PORT_WAIT_S
    for what, flag, port in ports:
        waited = False
        while port_in_use(port):
            if not waited:
                print(f"ddtree serve: port {port} ({what}) is in use; waiting up to {PORT_WAIT_S:g} s for it (a "
                      "server stopped moments ago holds it until its Ray processes have exited)", file=sys.stderr,
                      flush=True)
                waited = True
            if time.monotonic() > deadline:
                return (f"port {port} ({what}) is still in use after {PORT_WAIT_S:g} s: stop what holds it "
                        f"(`ss -ltnp 'sport = :{port}'` names it) or choose another with {flag}")
            time.sleep(0.5)
    return None


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def ray_init_options(host: str, metrics_host: str | None, metrics_port: int) -> dict:
    """ray.init's options for `ddtree serve` (--host, --metrics-host, --metrics-port). Ray binds
    its metrics endpoint to the node's address when that is a loopback one and to every interface
    otherwise; so a server whose metrics host (by default, the API's host) is loopback runs its
    Ray node on 127.0.0.1, which keeps the metrics endpoint (and Ray's own ports) on this machine."""
    options = {"include_dashboard": False, "_metrics_export_port": metrics_port}
    metrics_host = metrics_host or host
    if metrics_host in LOOPBACK_HOSTS or metrics_host.startswith("127."):
        options["_node_ip_address"] = "127.0.0.1"
    return options


def drain(app_name: str, grace_s: float) -> None:
    """Refuse new generation requests (503) and wait up to `grace_s` for those in flight."""
    from ray import serve

    ingress = serve.get_app_handle(app_name)
    deadline = time.monotonic() + grace_s
    left = ingress.drain.remote().result()
    while left and time.monotonic() < deadline:
        print(f"ddtree serve: draining, {left} requests in flight", file=sys.stderr, flush=True)
        time.sleep(0.5)
        left = ingress.in_flight.remote().result()

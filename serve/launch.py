"""`ddtree serve` (`run`): it waits for the ports a server stopped moments ago still holds before
its own Ray starts, chooses where Ray's node (and its metrics endpoint) listens, serves the app
until SIGTERM or Ctrl-C, and drains the requests in flight before the app shuts down."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
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


def run(config, host: str, port: int, metrics_host: str | None, metrics_port: int) -> int:
    """Starts a local Ray and the app of `config` (a ServeConfig) on host:port, with Ray's metrics
    on metrics_port, and serves until SIGTERM or Ctrl-C; then drains and shuts down. The exit
    code: 0, or 2 when a port stays held."""
    import ray
    from ray import serve

    from .app import build_app

    held = wait_for_ports([("the API", "--port", port), ("Ray's metrics", "--metrics-port", metrics_port)])
    if held is not None:
        print(f"ddtree serve: {held}", file=sys.stderr)
        return 2
    options = ray_init_options(host, metrics_host, metrics_port)
    # Serve's HTTP proxy hands each request and its stream's events to the ingress over gRPC
    # rather than through Ray's object store (less CPU a token; docs/deployment.md, "Cores").
    # The local Ray's processes inherit it; a value the caller set is kept.
    os.environ.setdefault("RAY_SERVE_PROXY_USE_GRPC", "1")
    ray.init(**options)
    # after ray.init, whose own SIGTERM handler would replace this one; before the app serves
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(config), name="ddtree", route_prefix="/")
    print(
        f"ddtree serves {config.served_name} (budget {config.budget}, per request: \"speculation\": {{\"budget\": N}}) "
        f"on http://{host}:{port}/v1 ; metrics on http://{options.get('_node_ip_address', '0.0.0.0')}:{metrics_port}"
        f"/metrics ; {'API keys required; ' if config.api_key else ''}Ctrl-C or SIGTERM stops (draining for up to "
        f"{config.graceful_shutdown_timeout_s:g} s)",
        flush=True,
    )
    # Not serve.run(blocking=True): it sleeps until a KeyboardInterrupt, so SIGTERM would have to
    # raise one, and a SIGTERM during start-up would then break serve.run off mid-deployment.
    # The handler above only sets `stop`, which is waited for here; the drain follows either way.
    try:
        stop.wait()
    except KeyboardInterrupt:  # Ctrl-C
        pass
    drain("ddtree", config.graceful_shutdown_timeout_s)
    serve.shutdown()
    ray.shutdown()
    return 0

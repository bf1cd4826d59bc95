"""ROS service overhead of restore and snapshot: round trip minus the engine's own time.

``python -m flashrt_ros.bench.ros_services [--calls 400] [--json out.json]``

The node runs as its own process (``python -m flashrt_ros.ros.main``, the code
of ``flashrt_node``) in a private ROS domain; this process is the client. Each
response carries ``latency_ms``, the time the engine spent (lock wait
included), so round trip - latency_ms is what ROS, DDS, the executor and the
adapter cost. The same is measured with node and client in one process, to
separate the transport from the process hop. A bare rclpy std_srvs/Trigger
server (empty callback, a single-threaded executor like the one that serves
the capsule services) is measured alongside: it is the floor that rclpy and
DDS set on this machine, whatever the node does.
Targets: p50 <= 0.5 ms, p99 <= 2 ms.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

from .common import bench_main, machine, positive_int, verdict

TARGET_P50_MS, TARGET_P99_MS = 0.5, 2.0


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _measure(client_node, calls: int) -> dict[str, dict[str, float]]:
    from ..srv import DropCapsule, Restore, Snapshot

    clients = {t: client_node.create_client(t, f"/flashrt/{name}") for t, name in
               ((Snapshot, "snapshot"), (Restore, "restore"), (DropCapsule, "drop_capsule"))}
    for c in clients.values():
        if not c.wait_for_service(timeout_sec=120):
            raise RuntimeError("flashrt node did not come up")

    def call(srv, **fields):
        done = threading.Event()
        start = time.perf_counter()
        future = clients[srv].call_async(srv.Request(**fields))
        future.add_done_callback(lambda _: done.set())
        if not done.wait(30):
            raise TimeoutError(f"{srv.__name__} not answered")
        return (time.perf_counter() - start) * 1e3, future.result()

    while True:  # autostart finishes activation after the services appear
        _, first = call(Snapshot, name="bench-base")
        if first.success:
            break
        time.sleep(0.2)
    base = first.capsule_id
    samples: dict[str, dict[str, list[float]]] = {k: {"round_trip": [], "engine": [], "overhead": []}
                                                  for k in ("restore", "snapshot")}
    for i in range(calls + 20):
        order = ["restore", "snapshot"]
        random.shuffle(order)  # neither always runs first after the drop
        for kind in order:
            if kind == "restore":
                ms, r = call(Restore, capsule_id=base)
            else:
                ms, r = call(Snapshot)
            if not r.success:
                raise RuntimeError(f"{kind} failed: {r.message}")
            if i >= 20:  # warm-up
                samples[kind]["round_trip"].append(ms)
                samples[kind]["engine"].append(r.latency_ms)
                samples[kind]["overhead"].append(ms - r.latency_ms)
            if kind == "snapshot":
                call(DropCapsule, capsule_id=r.capsule_id)  # keep the store at one capsule
    return {kind: {f"{what}_{q}": _percentile(vals, p) for what, vals in series.items()
                   for q, p in (("p50", 0.5), ("p99", 0.99))}
            for kind, series in samples.items()}


# A server that does nothing: what rclpy + DDS cost for one call on this machine, with
# the executor kind that serves the capsule services (ros/services.py).
_BARE_SERVER = """
import rclpy
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from std_srvs.srv import Trigger
rclpy.init()
node = rclpy.create_node("bare_trigger")
node.create_service(Trigger, "/bare_trigger", lambda request, response: response)
executor = SingleThreadedExecutor()
executor.add_node(node)
try:
    executor.spin()
except (KeyboardInterrupt, ExternalShutdownException):
    pass
"""


def _bare_round_trip(client_node, calls: int) -> dict[str, float]:
    from std_srvs.srv import Trigger

    client = client_node.create_client(Trigger, "/bare_trigger")
    if not client.wait_for_service(timeout_sec=60):
        raise RuntimeError("bare Trigger server did not come up")
    times = []
    for i in range(calls + 20):
        done = threading.Event()
        start = time.perf_counter()
        client.call_async(Trigger.Request()).add_done_callback(lambda _: done.set())
        done.wait(30)
        if i >= 20:
            times.append((time.perf_counter() - start) * 1e3)
    return {"round_trip_p50": _percentile(times, 0.5), "round_trip_p99": _percentile(times, 0.99)}


def _client(context):
    import rclpy
    from rclpy.executors import SingleThreadedExecutor

    node = rclpy.create_node("flashrt_bench_client", context=context)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(node)
    executor.spinner = threading.Thread(target=executor.spin, daemon=True)
    executor.spinner.start()
    return node, executor


def _stop(executor) -> None:
    executor.shutdown(timeout_sec=5)
    executor.spinner.join(5)  # out of rclpy's C++ wait before the interpreter exits


def cross_process(calls: int) -> dict:
    import rclpy
    from rclpy.context import Context

    proc = subprocess.Popen([sys.executable, "-m", "flashrt_ros.ros.main", "--ros-args", "-p", "autostart:=true",
                             "-p", "max_seq_len:=1024", "-p", "status_rate:=0.0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    bare = subprocess.Popen([sys.executable, "-c", _BARE_SERVER], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=dict(os.environ))
    context = Context()
    rclpy.init(context=context)
    node, executor = _client(context)
    try:
        stats = _measure(node, calls)
        stats["bare_trigger"] = _bare_round_trip(node, calls)
        return stats
    finally:
        bare.send_signal(signal.SIGTERM)
        _stop(executor)
        node.destroy_node()
        context.try_shutdown()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def same_process(calls: int) -> dict:
    import rclpy
    from rclpy.context import Context
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.parameter import Parameter

    from ..ros.node import FlashRTNode

    context = Context()
    rclpy.init(context=context)
    server = FlashRTNode(context=context, parameter_overrides=[Parameter("max_seq_len", value=1024),
                                                               Parameter("status_rate", value=0.0)])
    server.trigger_configure()
    server.trigger_activate()
    executor = SingleThreadedExecutor(context=context)   # as flashrt_node spins it
    executor.add_node(server)
    threading.Thread(target=executor.spin, daemon=True).start()
    node, client_executor = _client(context)
    try:
        return _measure(node, calls)
    finally:
        _stop(client_executor)
        executor.shutdown()
        node.destroy_node()
        server.destroy_node()
        context.try_shutdown()


def run(calls: int = 400) -> dict:
    # Discovery on this host only, in a domain of its own (same host, same domain = crosstalk).
    os.environ.setdefault("ROS_DOMAIN_ID", str(100 + os.getpid() % 100))
    os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    os.environ.setdefault("FASTDDS_BUILTIN_TRANSPORTS", "UDPv4")
    print(f"== ROS service overhead (round trip - engine time), {calls} calls each; {machine()}")
    results = {"machine": machine(), "calls": calls, "modes": {}, "checks": []}
    for mode, fn in (("cross_process", cross_process), ("same_process", same_process)):
        stats = fn(calls)
        results["modes"][mode] = stats
        for kind, s in stats.items():
            if kind == "bare_trigger":
                print(f"  {mode:13s} bare rclpy Trigger round trip p50 {s['round_trip_p50']:.3f}"
                      f" p99 {s['round_trip_p99']:.3f} ms (the floor)")
                continue
            print(f"  {mode:13s} {kind:8s} round trip p50 {s['round_trip_p50']:.3f} p99 {s['round_trip_p99']:.3f} ms"
                  f" | engine p50 {s['engine_p50']:.3f} | overhead p50 {s['overhead_p50']:.3f}"
                  f" p99 {s['overhead_p99']:.3f} ms")
    cross = results["modes"]["cross_process"]
    for kind in ("restore", "snapshot"):
        s = cross[kind]
        ratio = s["overhead_p50"] / cross["bare_trigger"]["round_trip_p50"]
        s["overhead_over_bare_p50"] = ratio
        print(f"  {kind}: overhead p50 / bare rclpy round trip p50 = {ratio:.2f}")
        results["checks"].append(verdict(f"{kind} service overhead p50 ms (cross-process)", s["overhead_p50"],
                                           TARGET_P50_MS, higher_is_better=False))
        results["checks"].append(verdict(f"{kind} service overhead p99 ms (cross-process)", s["overhead_p99"],
                                           TARGET_P99_MS, higher_is_better=False))
    return results


def main() -> None:
    bench_main(__doc__, lambda parser: parser.add_argument("--calls", type=positive_int, default=400),
               lambda a: run(a.calls), device=False)


if __name__ == "__main__":
    main()

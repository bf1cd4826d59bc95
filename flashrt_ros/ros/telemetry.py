"""What the node reports about itself: ~/status and /diagnostics messages, latency windows."""
from __future__ import annotations

from collections import deque
from typing import Any

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue

from ..capsule import TIERS
from ..msg import RuntimeStatus

# A tier above this share of its budget is reported as a warning.
_FULL = 0.9


class Latencies:
    """The last ``window`` latencies per operation, for p50/p99 in diagnostics."""

    def __init__(self, window: int = 512) -> None:
        self._window = window
        self._ms: dict[str, deque[float]] = {}

    def add(self, kind: str, ms: float) -> None:
        self._ms.setdefault(kind, deque(maxlen=self._window)).append(ms)

    def percentiles(self) -> dict[str, tuple[float, float, int]]:
        out = {}
        for kind, values in list(self._ms.items()):
            ordered = sorted(values)
            if ordered:
                out[kind] = (ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
                             len(ordered))
        return out


def status_msg(lifecycle: str, engine: Any, digest: str, now) -> RuntimeStatus:
    msg = RuntimeStatus(lifecycle_state=lifecycle)
    msg.header.stamp = now
    if engine is None:
        return msg
    msg.model_fingerprint = engine.model_fingerprint
    msg.layout_fingerprint = engine.layout_fingerprint
    msg.device = str(engine.device)
    msg.dtype = str(engine.dtype).removeprefix("torch.")
    msg.cuda_graphs = engine.cuda_graphs
    msg.position = engine.position
    msg.max_seq_len = engine.max_seq_len
    msg.capsule_count = len(engine.capsules.list())
    msg.arena_bytes = engine.arena.nbytes
    for tier in TIERS:
        setattr(msg, f"{tier}_used_bytes", engine.capsules.used_bytes(tier))
        setattr(msg, f"{tier}_budget_bytes", engine.capsules.budget_bytes(tier))
    msg.state_digest = digest
    return msg


def diagnostics_msg(node_name: str, status: RuntimeStatus, latencies: Latencies, counters: dict[str, int],
                    now) -> DiagnosticArray:
    values = [KeyValue(key="lifecycle_state", value=status.lifecycle_state)]
    level, message = DiagnosticStatus.OK, "serving"
    if status.lifecycle_state != "active":
        level, message = DiagnosticStatus.WARN, f"not serving ({status.lifecycle_state})"
    if status.device:
        values += [KeyValue(key="device", value=status.device), KeyValue(key="dtype", value=status.dtype),
                   KeyValue(key="graph_mode", value="cuda_graphs" if status.cuda_graphs else "eager"),
                   KeyValue(key="position", value=f"{status.position}/{status.max_seq_len}"),
                   KeyValue(key="capsules", value=str(status.capsule_count)),
                   KeyValue(key="arena_bytes", value=str(status.arena_bytes))]
        for tier in TIERS:
            used, budget = getattr(status, f"{tier}_used_bytes"), getattr(status, f"{tier}_budget_bytes")
            values.append(KeyValue(key=f"{tier}_bytes", value=f"{used}/{budget}"))
            if budget and used > _FULL * budget and level == DiagnosticStatus.OK:
                level, message = DiagnosticStatus.WARN, f"{tier} tier above {_FULL:.0%} of its budget"
        if status.max_seq_len and status.position >= status.max_seq_len:
            level, message = DiagnosticStatus.ERROR, (f"context full: position {status.position} of max_seq_len "
                                                      f"{status.max_seq_len}; steps and tokens are refused with "
                                                      "CONTEXT_FULL until a restore, rollback or reset frees room")
    for kind, (p50, p99, n) in sorted(latencies.percentiles().items()):
        values.append(KeyValue(key=f"{kind}_latency_ms", value=f"p50 {p50:.3f} p99 {p99:.3f} (n={n})"))
    values += [KeyValue(key=k, value=str(v)) for k, v in sorted(counters.items())]
    entry = DiagnosticStatus(level=level, name=f"{node_name}: engine", message=message,
                             hardware_id=status.device or "none", values=values)
    array = DiagnosticArray(status=[entry])
    array.header.stamp = now
    return array


def fleet_diagnostics(node_name: str, watch: Any, stats: Any) -> DiagnosticStatus:
    """The fleet tier's entry: whether its server answers (``ros.fleet_watch``), the last ping's
    round trip, and what this node sent and received (``capsule.fleet.FleetStats``)."""
    config, seen = watch.fleet.config, watch.seen()
    if seen.reachable is None:
        level, message = DiagnosticStatus.WARN, "fleet tier: not reached yet"
    elif seen.reachable:
        level, message = DiagnosticStatus.OK, "fleet tier reachable"
    else:
        level, message = DiagnosticStatus.ERROR, f"fleet tier unreachable: {seen.error}"[:500]
    values = [KeyValue(key="url", value=config.url), KeyValue(key="prefix", value=config.prefix),
              KeyValue(key="holder", value=config.node),
              KeyValue(key="ping_ms", value=f"{seen.latency_s * 1e3:.3f}"),
              KeyValue(key="published", value=str(stats.published)), KeyValue(key="pulled", value=str(stats.pulled)),
              KeyValue(key="served_locally", value=str(stats.served_locally)),
              KeyValue(key="bytes_sent", value=str(stats.bytes_sent)),
              KeyValue(key="bytes_received", value=str(stats.bytes_received)),
              KeyValue(key="failures", value=str(stats.failures)),
              KeyValue(key="last_error", value=stats.last_error[:500])]
    return DiagnosticStatus(level=level, name=f"{node_name}: fleet", message=message, hardware_id=config.url,
                            values=values)

"""What a configured node serves: made by configure, closed by cleanup.

The engine and its session, the tokenizer, the journal bag while ``journal_path`` records
one, the policy topics, the ~/session record, and the timer that ends leases and sends the
store's events. Nothing here outlives a cleanup, and a configure that fails part-way closes
what it made before it says so.
"""
from __future__ import annotations

import os
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from rclpy.clock import Clock, ClockType

from ..capsule import CapsuleInfo, signing
from ..errors import ErrorCode, InvalidArgument
from ..msg import JournalSession
from ..replay.session import session_of
from ..runtime import Engine
from ..runtime.tokenizer import load_tokenizer
from ..serving import Journal, Session
from ..serving.record import SessionRecord
from . import params
from .convert import outcome, session_msg
from .fleet_watch import FleetWatch
from .policy_io import PolicyIO
from .recorder import Recorder
from .reporting import STATUS_QOS, Unasked

TICK_S = 0.05   # a lease ends, and a capsule event goes out, within this
EXCHANGE_S = 2.0   # the longest one exchange with the fleet's server may take


class ConfigureFailed(Exception):
    """Why a configure failed; everything it made is closed already."""


class Served:
    """Made by ``open``; ``close`` frees the engine and destroys every entity made here."""

    def __init__(self, node: Any, vals: dict[str, Any]) -> None:
        self._node = node
        self.engine, self.tokenizer = _build(vals)
        try:
            self.fleet = _fleet(vals, node)
        except BaseException:
            self.engine.close()
            raise
        if self.fleet is not None:   # each snapshot's chunks named with its digest: a publish sends at once
            self.fleet.prepare(self.engine.capsules)
        self.session = Session(self.engine, fleet=self.fleet)
        self.fleet_watch = FleetWatch(self.fleet) if self.fleet is not None else None
        self.bag: Recorder | None = None
        self.policy: PolicyIO | None = None
        self._record_pub = None
        self._timer = None

    @classmethod
    def open(cls, node: Any, vals: dict[str, Any], count: int) -> "Served":
        """Load and serve per the parameter values ``vals``; ``count``: the configure's number,
        which names its journal bag."""
        try:
            served = cls(node, vals)
        except Exception as exc:  # any failure to load is a failed transition, never a dead node
            raise ConfigureFailed(outcome(exc)[1]) from exc
        try:
            served._start(vals, count)
        except BaseException:
            served.close()
            raise
        return served

    def _start(self, vals: dict[str, Any], count: int) -> None:
        node = self._node
        record = self.record_of(vals)
        if vals["journal_path"]:
            try:
                self._start_journal(Path(vals["journal_path"]), record, count)
            except Exception as exc:
                raise ConfigureFailed(f"journal_path: {outcome(exc)[1]}") from exc
        self.policy = PolicyIO(node, vals, node.record, self._context_full, node.policy_stepped,
                               lambda: node.report.count("rejected_observations"), self._episode_restored)
        try:
            self.policy.start_episodes(self.session)
        except Exception as exc:
            raise ConfigureFailed(f"episode-start capsule: {outcome(exc)[1]}") from exc
        self._record_pub = node.create_publisher(JournalSession, "~/session", STATUS_QOS)
        try:
            self._record_pub.publish(session_msg(record, node.get_clock().now().nanoseconds))
        except Exception as exc:   # the record is for replay; serving does not depend on it
            node.get_logger().error(f"~/session not published: {outcome(exc)[1]}")
        # Wall-clock time, as the leases keep: on the node's clock, under use_sim_time with a
        # simulation faster than real time, it would fire on every tick of /clock.
        self._timer = node.create_timer(TICK_S, self._tick, callback_group=node.timer_group,
                                              clock=Clock(clock_type=ClockType.STEADY_TIME))

    def record_of(self, vals: dict[str, Any]) -> SessionRecord:
        """The engine's session record (``replay.session``) and how this node serves it: what
        replay of a bag of its topics and service events needs (see msg/JournalSession.msg)."""
        node = self._node
        return replace(session_of(self.engine, vals["model_path"], vals["seed"]),
                       node=node.get_fully_qualified_name(), default_tier=vals["default_tier"],
                       joint_names=tuple(vals["policy.joint_names"]), max_pose_age=float(vals["policy.max_pose_age"]),
                       joint_states_topic=node.resolve_topic_name("~/joint_states"),
                       ee_pose_topic=node.resolve_topic_name("~/ee_pose"),
                       action_topic=node.resolve_topic_name("~/action"))

    def _start_journal(self, folder: Path, record: SessionRecord, count: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        # The node name too: two nodes of one process may share journal_path and start in the same second.
        path = folder / (f"session-{time.strftime('%Y%m%d-%H%M%S')}-{self._node.get_name()}-{os.getpid()}-{count}")
        journal = Journal(session=record)
        self.bag = Recorder(path, journal.session, self._node)
        journal.listeners.append(self.bag)
        self.session.journal = journal
        self._node.get_logger().info(f"journal: recording into {path}")

    def _tick(self) -> None:
        """What the store did on its own goes out (a spill, an eviction, a digest done), and
        leases that have run out end (while active: an inactive node serves no one)."""
        node = self._node
        try:
            for kind, info in self.engine.capsules.take_events():
                node.report.store_event(kind, info, self.engine.position)
            if self.fleet_watch is not None:
                for reachable, error in self.fleet_watch.take_changes():
                    node.report.fleet_event(reachable, error, self.engine.position)
            if not node.serving:
                return
            for info in self.session.expire():
                node.report.event("drop", info, Unasked(position=self.engine.position,
                                                        message=f"lease of capsule {info.id} ended"))
        except Exception:   # like the status: an engine fault must not stop the executor
            if node.context.ok():
                node.get_logger().error(f"capsule events or lease expiry failed:\n{traceback.format_exc()}",
                                        throttle_duration_sec=5.0)
        node.report_journal()

    def _context_full(self, why: str) -> None:
        """Said once per filling: the steps that follow are refused alike until something frees room."""
        node = self._node
        node.get_logger().error(f"policy: {why}; steps are refused with CONTEXT_FULL until a restore, rollback "
                                "or new goal frees positions")
        node.report.event("context_full", None, Unasked(position=self.engine.position, message=why, success=False,
                                                        error_code=int(ErrorCode.CONTEXT_FULL)))
        node.report.dirty.set()

    def _episode_restored(self, info: CapsuleInfo | None, error_code: int, message: str) -> None:
        """A goal or route restored the episode-start capsule ``info`` (or was refused): a restore
        event, at the capsule's position when restored (read here, the live one could already be
        a step past it), the live one when refused (as it was)."""
        node = self._node
        position = info.position if info is not None and not error_code else self.engine.position
        node.report.event("restore", info, Unasked(position=position, message=message, success=not error_code,
                                                   error_code=error_code))
        if not error_code:   # a refusal changes nothing the status shows
            node.report.dirty.set()

    def close(self) -> None:
        """Destroy what was made, close the bag, free the engine. The node no longer hands this out
        (it let go of it under the engine lock, so operations in flight have ended)."""
        node = self._node
        try:
            for entity, destroy in ((self._timer, node.destroy_timer), (self._record_pub, node.destroy_publisher)):
                if entity is not None:
                    destroy(entity)
            self._timer = self._record_pub = None
            policy, self.policy = self.policy, None
            if policy is not None:
                policy.close()
            bag, self.bag = self.bag, None
            self.session.journal = None
            if bag is not None:
                try:
                    bag.close()
                except Exception as exc:  # e.g. its folder was deleted: the engine is freed all the same
                    node.get_logger().error(f"journal could not be closed: {exc}")
        finally:   # whatever failed above, the engine's memory and threads go, and the fleet's connections
            if self.fleet_watch is not None:
                self.fleet_watch.close()
            if self.fleet is not None:
                self.fleet.close()
            self.engine.close()
            if self.engine.device.type == "cuda":
                torch.cuda.empty_cache()


def _fleet(vals: dict[str, Any], node: Any) -> Any:
    """The fleet tier of ``fleet.url`` (None: none), holding references as this host's node.
    Nothing connects here: a node configures while its server is down, and says so per request."""
    if not vals["fleet.url"]:
        return None
    from ..capsule.fleet import FleetTier   # with its client library, only where a fleet is configured
    from ..capsule.fleet_config import node_id
    # One exchange is bounded by the request's budget too, where that is shorter than the tier's own.
    exchange_s = min(EXCHANGE_S, float(vals["fleet.timeout_s"]))
    return FleetTier(vals["fleet.url"], signing.load_key(vals["capsule_key_file"]), vals["fleet.prefix"],
                     password_file=vals["fleet.password_file"], username=vals["fleet.username"],
                     node=node_id(node.get_fully_qualified_name()), timeout_s=exchange_s,
                     connect_timeout_s=exchange_s)


def _build(vals: dict[str, Any]) -> tuple[Engine, Any]:
    device = vals["device"]
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidArgument(f"device={device!r} but CUDA is not available (torch {torch.__version__})")
    opts = dict(device=device, dtype=getattr(torch, vals["dtype"]), max_seq_len=vals["max_seq_len"],
                cuda_graphs=vals["cuda_graphs"], cpu_kernels=vals["cpu_kernels"],
                capsule_dir=vals["capsule_dir"] or None,
                capsule_key=signing.load_key(vals["capsule_key_file"]) if vals["capsule_key_file"] else None,
                budgets=params.budgets(vals), spill=vals["spill"], rollback_depth=vals["rollback_depth"],
                max_draft_tokens=vals["max_draft_tokens"])
    engine = Engine.load(vals["model_path"], seed=vals["seed"], mtp_head=vals["mtp_head"] or None,
                         policy_dims=(vals["policy.obs_dim"], vals["policy.action_dim"]), **opts)
    try:
        return engine, load_tokenizer(vals["model_path"])
    except BaseException:
        engine.close()   # its arena, pool and digest thread: a failed configure keeps nothing
        raise

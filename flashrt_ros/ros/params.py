"""The node's parameters: one table gives each its default, type, range and meaning.

``config/flashrt.yaml`` lists every one of them with its default; a test keeps
the two in step. Parameters that shape the model or the arena are read-only:
they are read once, at configure, and changing them means a new node.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from rclpy.exceptions import ParameterUninitializedException
from rcl_interfaces.msg import (FloatingPointRange, IntegerRange, ParameterDescriptor, ParameterType,
                                SetParametersResult)

from ..capsule.info import TIERS
from ..serving.observation import GOAL_SIZE

DTYPES = ("float32", "bfloat16", "float16")
INTROSPECTION = ("off", "metadata", "contents")
_DEVICE = re.compile(r"cpu|cuda(:\d{1,2})?")
_MiB = 1 << 20


@dataclass(frozen=True)
class Param:
    name: str
    default: Any
    description: str
    read_only: bool = True
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] = ()

    def descriptor(self) -> ParameterDescriptor:
        kind = {bool: ParameterType.PARAMETER_BOOL, int: ParameterType.PARAMETER_INTEGER,
                float: ParameterType.PARAMETER_DOUBLE, str: ParameterType.PARAMETER_STRING,
                list: ParameterType.PARAMETER_STRING_ARRAY}[type(self.default)]
        d = ParameterDescriptor(name=self.name, type=kind, description=self.description,
                                read_only=self.read_only)
        if self.choices:
            d.additional_constraints = "one of: " + ", ".join(self.choices)
        if isinstance(self.default, bool) or self.lo is None:
            return d
        if isinstance(self.default, int):
            d.integer_range = [IntegerRange(from_value=int(self.lo), to_value=int(self.hi), step=0)]
        else:
            d.floating_point_range = [FloatingPointRange(from_value=float(self.lo), to_value=float(self.hi), step=0.0)]
        return d


PARAMS = (
    Param("model_path", "", "Hugging Face checkpoint folder; empty = the embedded default model"),
    Param("seed", 0, "seed of the embedded default's weights and of heads a checkpoint lacks", lo=0, hi=2**31 - 1),
    Param("device", "cpu", "torch device of the model and the state arena", choices=("cpu", "cuda", "cuda:N")),
    Param("dtype", "float32", "model and state dtype", choices=DTYPES),
    Param("max_seq_len", 8192, "positions the state arena holds", lo=16, hi=1 << 20),
    Param("cuda_graphs", True, "replay decode as captured CUDA graphs (CUDA devices only)"),
    Param("cpu_kernels", True, "CPU, float32: decode and policy steps, and every linear-attention layer, on "
          "the package's C library where it is built (runtime.backends.cpu); false: the torch reference path"),
    Param("capsule_dir", "", "folder of the disk tier; capsules found there are loaded at configure"),
    Param("capsule_key_file", "", "file holding a key (16 bytes or more) that signs every capsule file; files "
          "without a valid signature are refused (UNTRUSTED_CAPSULE); empty = digests only, which catch "
          "accidents, not deliberate edits"),
    Param("default_tier", "device", "tier of a Snapshot whose request leaves tier empty", read_only=False,
          choices=TIERS),
    Param("budgets.device_mb", 0, "device-tier budget in MiB; 0 = 8 x the arena", lo=0, hi=1 << 24),
    Param("budgets.host_mb", 0, "host-tier budget in MiB; 0 = 32 x the arena", lo=0, hi=1 << 24),
    Param("budgets.disk_mb", 4096, "disk-tier budget in MiB", lo=0, hi=1 << 24),
    Param("spill", True, "over budget: move the least recently used unpinned capsule down a tier "
          "(false: refuse with BUDGET_EXCEEDED)", read_only=False),
    Param("speculative", 0, "drafts per pass of speculative decoding (the MTP layer drafts, one forward "
          "verifies; the same tokens) for Generate goals that leave `speculative` at -1; 0 = off",
          read_only=False, lo=0, hi=16),
    Param("max_draft_tokens", 4, "the most drafts a speculative pass verifies (the engine keeps the fixed-size "
          "state of that many rows plus one; at most 7 on the CPU backend)", lo=1, hi=64),
    Param("mtp_head", "", "MTP head file (flashrt-train-mtp) in place of the checkpoint's MTP layer; "
          "empty = the checkpoint's (seeded where it has none)"),
    Param("rollback_depth", 8, "committed boundaries Rollback can step back through", lo=1, hi=4096),
    Param("policy.obs_dim", 23, "observation size: 2 x joints (positions, velocities) + 3 (ee position) "
          "+ 6 (ee rotation, two matrix columns); 0 turns policy mode off", lo=0, hi=65536),
    Param("policy.action_dim", 7, "action size published on ~/action; 0 turns policy mode off", lo=0, hi=65536),
    Param("policy.joint_names", [f"joint{i}" for i in range(1, 8)],
          "joints read from ~/joint_states by name, in this order (obs_dim = 2 x their count + 9)"),
    Param("policy.goal", False, "take a goal on ~/goal (PoseStamped) into the next observation: 4 more inputs "
          "(x, y, z, then 1), zeros on every other step, so obs_dim = 2 x joints + 13; each goal starts an "
          "episode from the state configure left (the pinned episode-start capsule)"),
    Param("policy.frame_id", "", "frame ~/ee_pose and ~/goal must be stamped in; others are refused (empty: "
          "not checked)"),
    Param("policy.command_stamp", "observation", "stamp of ~/joint_trajectory: the answered joint state's "
          "(observation), or none (zero: start now)", choices=("observation", "zero")),
    Param("policy.input_reliability", "reliable", "QoS reliability of ~/joint_states and ~/ee_pose: "
          "best_effort also takes sensor-data (best-effort) publishers; reliable takes reliable ones only",
          choices=("reliable", "best_effort")),
    Param("policy.max_pose_age", 0.5, "seconds an ~/ee_pose may be apart from the ~/joint_states it is paired "
          "with, by their header stamps (unstamped messages are not checked); 0 = no check", read_only=False,
          lo=0.0, hi=3600.0),
    Param("status_rate", 1.0, "Hz of ~/status and /diagnostics (also sent on every change); 0 = on change only",
          read_only=False, lo=0.0, hi=100.0),
    Param("journal_path", "", "folder for journal bags: each configure records its committed operations "
          "into a new MCAP bag there (replay with flashrt-replay); empty = off"),
    Param("service_introspection", "off", "service introspection of the capsule services, as Jazzy names its "
          "levels: events on <service>/_service_event with the request and response (contents), without them "
          "(metadata), or none (off); a bag of them with contents replays (flashrt-replay)",
          choices=("off", "metadata", "contents")),
    Param("fleet.url", "", "the fleet tier's Valkey or Redis server: redis://host:6379/0, rediss:// (TLS) or "
          "unix:///path; its capsules are signed with capsule_key_file, which it requires; empty = no fleet tier"),
    Param("fleet.prefix", "flashrt", "key prefix on the server, so that several fleets or models share one"),
    Param("fleet.password_file", "", "file holding the server's password (of fleet.username, or of the URL's "
          "user); empty = none"),
    Param("fleet.username", "", "ACL user on the server; empty = the URL's, or the default user"),
    Param("fleet.timeout_s", 5.0, "seconds one fleet request (a publish, a pull, both for a fork) may take, "
          "checked between its exchanges, each of which takes at most 2 s (or this, if shorter, as read at "
          "configure); a capsule service waits behind one about this long", read_only=False, lo=0.01,
          hi=3600.0),
    Param("autostart", False, "configure and activate at start"),
)


def declare_all(node: Any, table: tuple[Param, ...] = PARAMS) -> None:
    node.declare_parameters("", [(p.name, p.default, p.descriptor()) for p in table])


def values(node: Any) -> dict[str, Any]:
    return {p.name: _given(p.name, _value(node, p.name)) for p in PARAMS}


def _value(node: Any, name: str) -> Any:
    try:
        return node.get_parameter(name).value
    except ParameterUninitializedException:   # declared with a type, given none: see _given
        return None


_LISTS = frozenset(p.name for p in PARAMS if isinstance(p.default, list))


def _given(name: str, value: Any) -> Any:
    """An empty list given at launch (``[]`` in YAML, ``:=[]``) arrives without a type, as None."""
    return [] if value is None and name in _LISTS else value


MIN_STATUS_RATE = 1e-3   # one status every 1000 s


def check(parameters: list, reason_of: Callable[[str, Any], str] | None = None) -> SetParametersResult:
    """Value checks beyond type and range (which rclpy applies from the descriptors): the first
    parameter ``reason_of`` (default: this node's checks) finds a reason to refuse, refuses all."""
    for parameter in parameters:
        reason = (reason_of or _reason)(parameter.name, parameter.value)
        if reason:
            return SetParametersResult(successful=False, reason=f"{parameter.name}: {reason}")
    return SetParametersResult(successful=True)


def _reason(name: str, value: Any) -> str:
    value = _given(name, value)
    if value is None:
        return "needs a value (an empty list is no value for it)"
    if name == "device" and not _DEVICE.fullmatch(str(value)):
        return f"{value!r} is not a torch device of the form cpu, cuda or cuda:N"
    if name == "dtype" and value not in DTYPES:
        return f"{value!r} is not one of {', '.join(DTYPES)}"
    if name == "service_introspection" and value not in INTROSPECTION:
        return f"{value!r} is not one of {', '.join(INTROSPECTION)}"
    if name == "default_tier" and value not in TIERS:
        return f"{value!r} is not one of {', '.join(TIERS)}"
    if name == "status_rate" and 0.0 < value < MIN_STATUS_RATE:
        # The timer period is 1 / rate in integer nanoseconds: a tiny rate overflows it.
        return f"{value} Hz is below {MIN_STATUS_RATE} Hz; use 0 for status on change only"
    if name == "policy.joint_names":
        if any(not n for n in value):
            return "joint names must not be empty"
        if len(set(value)) != len(value):
            return "joint names must be unique"
    return ""


def check_together(vals: dict[str, Any]) -> str:
    """Cross-parameter checks, done at configure; returns the reason for a refusal, or ''."""
    if vals["default_tier"] == "disk" and not vals["capsule_dir"]:
        return "default_tier=disk needs a capsule_dir: every Snapshot with an empty tier would be refused"
    if vals["fleet.url"] and not vals["capsule_key_file"]:
        return "fleet.url needs a capsule_key_file: the fleet tier publishes and loads signed capsules only"
    obs, act = vals["policy.obs_dim"], vals["policy.action_dim"]
    if (obs == 0) != (act == 0):
        return f"policy.obs_dim={obs} and policy.action_dim={act}: both > 0, or both 0 to turn policy mode off"
    joints = vals["policy.joint_names"]
    extra = GOAL_SIZE if vals["policy.goal"] else 0
    if obs and obs != 2 * len(joints) + 9 + extra:
        return (f"policy.obs_dim={obs} does not fit {len(joints)} joint names "
                f"(2 x {len(joints)} + 9{' + 4 (the goal)' if extra else ''} = {2 * len(joints) + 9 + extra})")
    return ""


def budgets(vals: dict[str, Any]) -> dict[str, int]:
    """Engine budgets in bytes; tiers left at 0 keep the engine's default."""
    out = {}
    for tier in TIERS:
        mb = vals[f"budgets.{tier}_mb"]
        if mb or tier == "disk":
            out[tier] = int(mb) * _MiB
    return out

"""The colcon-built package: install layout, interfaces, version, layering, DDS.

Run through `make test`, which sources install/setup.sh: these tests check
the installed package, not the source tree.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import threading
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

if not os.environ.get("AMENT_PREFIX_PATH"):
    pytest.skip("needs the colcon-built package: run `make test`", allow_module_level=True)

import rclpy  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.node import Node  # noqa: E402

from flashrt_ros import action as fr_action  # noqa: E402
from flashrt_ros import msg as fr_msg  # noqa: E402
from flashrt_ros import srv as fr_srv  # noqa: E402

SOURCE_ROOT = Path(__file__).resolve().parent.parent

ERROR_CODES = [
    "OK", "UNKNOWN_CAPSULE", "INVALID_ARGUMENT", "FINGERPRINT_MISMATCH", "CORRUPT_CAPSULE",
    "BUDGET_EXCEEDED", "BUSY", "NOT_ACTIVE", "IO_ERROR", "INTERNAL", "PREEMPTED",
    "UNTRUSTED_CAPSULE", "CONTEXT_FULL", "FLEET_UNAVAILABLE", "INCOMPLETE_CAPSULE",
]
EVENT_KINDS = ["snapshot", "restore", "fork", "rollback", "drop", "evict", "spill", "digest", "pull",
               "fleet", "context_full"]

CAPSULE_INFO = {
    "id": "string", "name": "string", "parent": "string", "position": "int64",
    "nbytes": "uint64", "tier": "string", "digest": "string", "pinned": "boolean",
    "created": "builtin_interfaces/Time", "model_fingerprint": "string",
    "layout_fingerprint": "string",
}
OUTCOME = {"success": "boolean", "error_code": "uint16", "message": "string"}
TIMING = {"position": "int64", "latency_ms": "double"}

MESSAGE_FIELDS = {
    "ErrorCode": {"code": "uint16"},
    "ChatMessage": {"role": "string", "content": "string"},
    "CapsuleInfo": CAPSULE_INFO,
    "CapsuleEvent": {
        "header": "std_msgs/Header", "kind": "string", "capsule": "flashrt_ros/CapsuleInfo",
        "position": "int64", "latency_ms": "double", "success": "boolean",
        "error_code": "uint16", "message": "string",
    },
    "RuntimeStatus": {
        "header": "std_msgs/Header", "lifecycle_state": "string",
        "model_fingerprint": "string", "layout_fingerprint": "string", "device": "string",
        "dtype": "string", "cuda_graphs": "boolean", "position": "int64",
        "max_seq_len": "int64", "capsule_count": "uint32", "arena_bytes": "uint64",
        "device_used_bytes": "uint64", "device_budget_bytes": "uint64",
        "host_used_bytes": "uint64", "host_budget_bytes": "uint64",
        "disk_used_bytes": "uint64", "disk_budget_bytes": "uint64",
        "state_digest": "string",
    },
}

ONE_CAPSULE = {"capsule_id": "string", "capsule": "flashrt_ros/CapsuleInfo"}
SERVICE_FIELDS = {
    "Snapshot": (
        {"name": "string", "tier": "string", "pin": "boolean", "request_id": "string", "lease_s": "double"},
        {**OUTCOME, **ONE_CAPSULE, **TIMING},
    ),
    "Restore": (
        {"capsule_id": "string", "tier": "string", "verify": "boolean"},
        {**OUTCOME, **ONE_CAPSULE, **TIMING},
    ),
    "Fork": (
        {"source_id": "string", "name": "string", "tier": "string", "lease_s": "double"},
        {**OUTCOME, **ONE_CAPSULE, "source_id": "string", **TIMING},
    ),
    "Rollback": (
        {"steps": "int32", "to_position": "int64"},
        {**OUTCOME, "capsule_id": "string", **TIMING},
    ),
    "ListCapsules": (
        {"tier": "string"},
        {**OUTCOME, "capsules": "sequence<flashrt_ros/CapsuleInfo>", **TIMING},
    ),
    "DropCapsule": (
        {"capsule_id": "string"},
        {**OUTCOME, "capsule_id": "string", **TIMING},
    ),
}

# Top-level modules that the ROS-free layers must never import.
ROS_MODULES = re.compile(
    r"^(rclpy|rcl_\w+|rosidl\w*|launch\w*|ament_\w+|rosbag2\w*|rmw\w*|\w+_msgs|\w+_srvs"
    r"|\w+_interfaces|tf2\w*|message_filters)$"
)
FIRST_PARTY_ROS = {"flashrt_ros.msg", "flashrt_ros.srv", "flashrt_ros.action", "flashrt_ros.ros",
                   "flashrt_ros.bt", "flashrt_ros.replay"}
ROS_FREE_LAYERS = ["runtime", "capsule"]


def constants(cls: type) -> dict[str, object]:
    """The constants a generated rosidl class declares (name -> value)."""
    meta = type(cls)
    return dict(getattr(meta, f"_{meta.__name__}__constants"))


# -- install layout -----------------------------------------------------------

def test_flashrt_ros_imports_from_the_install_space_not_the_source_tree() -> None:
    import flashrt_ros
    from ament_index_python.packages import get_package_prefix

    prefix = Path(get_package_prefix("flashrt_ros")).absolute()
    package_dirs = [Path(p).absolute() for p in flashrt_ros.__path__]
    assert len(package_dirs) == 1, f"flashrt_ros spans several directories: {package_dirs}"
    # Not resolved: with --symlink-install the installed files link to the source.
    assert package_dirs[0].is_relative_to(prefix), f"{package_dirs[0]} is not under {prefix}"
    assert package_dirs[0] != SOURCE_ROOT / "flashrt_ros"
    assert str(SOURCE_ROOT) not in sys.path


def test_the_readme_commands_run_from_the_repository_root_where_the_source_tree_comes_first() -> None:
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}   # the root is sys.path[0]
    done = subprocess.run([sys.executable, "-m", "flashrt_ros.bt.examples", "--help"], cwd=SOURCE_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "attempt-with-rollback" in done.stdout, done.stderr
    probe = ("import flashrt_ros, flashrt_ros.action, flashrt_ros.runtime.backends.cpu.library as n; "
             "print(flashrt_ros.__path__[0]); print(n.library() is not None)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=SOURCE_ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    first, native = done.stdout.split()
    assert Path(first) == SOURCE_ROOT / "flashrt_ros" and native == "True"


def test_generated_interfaces_live_in_the_same_package_as_the_python_code() -> None:
    import flashrt_ros

    package_dir = Path(flashrt_ros.__file__).parent
    for module in (fr_msg, fr_srv, fr_action):
        assert Path(module.__file__).parent.parent == package_dir
    # The hand-written __init__ replaced the empty generated one.
    assert flashrt_ros.__doc__ and "capsule" in flashrt_ros.__doc__.lower()


# -- interfaces ---------------------------------------------------------------

def test_error_codes_are_the_named_constants_with_distinct_values_and_ok_zero() -> None:
    codes = constants(fr_msg.ErrorCode)
    assert list(codes) == ERROR_CODES
    assert len(set(codes.values())) == len(codes), f"duplicate values: {codes}"
    assert fr_msg.ErrorCode.OK == 0
    assert fr_msg.ErrorCode().code == fr_msg.ErrorCode.OK


def test_capsule_event_kinds_are_string_constants() -> None:
    kinds = constants(fr_msg.CapsuleEvent)
    assert sorted(kinds.values()) == sorted(EVENT_KINDS)
    assert kinds == {f"KIND_{kind.upper()}": kind for kind in EVENT_KINDS}


@pytest.mark.parametrize("name", sorted(MESSAGE_FIELDS))
def test_message_has_exactly_the_designed_fields(name: str) -> None:
    cls = getattr(fr_msg, name)
    assert cls.get_fields_and_field_types() == MESSAGE_FIELDS[name]


@pytest.mark.parametrize("name", sorted(SERVICE_FIELDS))
def test_service_request_and_response_have_exactly_the_designed_fields(name: str) -> None:
    srv = getattr(fr_srv, name)
    request, response = SERVICE_FIELDS[name]
    assert srv.Request.get_fields_and_field_types() == request
    assert srv.Response.get_fields_and_field_types() == response


@pytest.mark.parametrize("name", sorted(SERVICE_FIELDS))
def test_every_service_response_reports_outcome_position_and_latency(name: str) -> None:
    response = getattr(fr_srv, name).Response()
    fields = response.get_fields_and_field_types()
    for field in ("success", "error_code", "message", "position", "latency_ms"):
        assert field in fields, f"{name}.Response lacks {field}"
    assert response.success is False and response.error_code == fr_msg.ErrorCode.OK


def test_rollback_to_position_minus_one_means_unused_by_convention() -> None:
    # The field can carry the sentinel; its meaning is documented in the .srv.
    assert fr_srv.Rollback.Request(steps=1, to_position=-1).to_position == -1
    source = (SOURCE_ROOT / "srv" / "Rollback.srv").read_text()
    assert re.search(r"#.*-1.*unused", source)


def test_generate_action_has_the_designed_goal_result_and_feedback() -> None:
    gen = fr_action.Generate
    assert gen.Goal.get_fields_and_field_types() == {
        "prompt": "string", "token_ids": "sequence<int32>", "messages": "sequence<flashrt_ros/ChatMessage>",
        "max_new_tokens": "int32",
        "temperature": "float", "top_k": "int32", "top_p": "float", "seed": "int64", "speculative": "int32",
    }
    assert gen.Result.get_fields_and_field_types() == {
        **OUTCOME, "tokens": "sequence<int32>", "text": "string", "ttft_ms": "double",
        "tokens_per_s": "double", "position": "int64",
    }
    assert gen.Feedback.get_fields_and_field_types() == {
        "tokens": "sequence<int32>", "text": "string",
    }


# -- packaging ----------------------------------------------------------------

def test_package_xml_and_setup_py_report_the_same_version() -> None:
    xml_version = ET.parse(SOURCE_ROOT / "package.xml").getroot().findtext("version")
    result = subprocess.run(
        [sys.executable, "setup.py", "--version"],
        cwd=SOURCE_ROOT, capture_output=True, text=True, check=True,
    )
    setup_version = result.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+\.\d+\.\d+", xml_version or "")
    assert setup_version == xml_version


def _module_file(module: str) -> Path | None:
    """Source file of a first-party module name, if it exists."""
    base = SOURCE_ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(path: Path) -> Iterator[str]:
    """Absolute module names imported by a source file."""
    package = ".".join(path.relative_to(SOURCE_ROOT).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rsplit(".", 1)[0]
    else:
        package = package.removesuffix(".__init__")
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def test_runtime_and_capsule_layers_import_no_ros_module() -> None:
    """Follows first-party imports, so a ROS import one module away is caught too."""
    roots = [SOURCE_ROOT / "flashrt_ros" / layer for layer in ROS_FREE_LAYERS]
    todo = [p for root in roots if root.is_dir() for p in sorted(root.rglob("*.py"))]
    if not todo:
        pytest.skip("flashrt_ros/runtime and flashrt_ros/capsule do not exist yet")
    todo.append(SOURCE_ROOT / "flashrt_ros" / "__init__.py")
    seen: set[Path] = set()
    offenders: list[str] = []
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for module in _imports(path):
            top = module.split(".", 1)[0]
            where = path.relative_to(SOURCE_ROOT)
            if ROS_MODULES.match(top):
                offenders.append(f"{where}: {module}")
            elif top == "flashrt_ros":
                if any(module == m or module.startswith(m + ".") for m in FIRST_PARTY_ROS):
                    offenders.append(f"{where}: {module}")
                elif (found := _module_file(module)) is not None:
                    todo.append(found)
    assert not offenders, "ROS imports in the ROS-free layers:\n" + "\n".join(offenders)


# -- a real service round trip --------------------------------------------------

@pytest.fixture
def executor(ros_context) -> Iterator[SingleThreadedExecutor]:
    executor = SingleThreadedExecutor(context=ros_context)
    thread = threading.Thread(target=executor.spin, daemon=True)
    thread.start()
    yield executor
    executor.shutdown(timeout_sec=5.0)
    thread.join(timeout=5.0)
    assert not thread.is_alive(), "executor thread did not stop"


@pytest.fixture
def make_node(ros_context, executor) -> Iterator[Callable[[str], Node]]:
    nodes: list[Node] = []

    def make(name: str) -> Node:
        node = rclpy.create_node(name, context=ros_context)
        executor.add_node(node)
        nodes.append(node)
        return node

    yield make
    for node in reversed(nodes):
        executor.remove_node(node)
        node.destroy_node()


def test_an_rclpy_service_of_type_snapshot_answers_a_call_in_process(make_node) -> None:
    requests: list[fr_srv.Snapshot.Request] = []

    def on_snapshot(request, response):
        requests.append(request)
        response.success = True
        response.error_code = fr_msg.ErrorCode.OK
        response.capsule_id = f"capsule-{request.request_id}"
        response.capsule.id = response.capsule_id
        response.capsule.name = request.name
        response.capsule.tier = request.tier
        response.capsule.pinned = request.pin
        response.position = 42
        response.latency_ms = 0.25
        return response

    server = make_node("snapshot_server")
    server.create_service(fr_srv.Snapshot, "~/snapshot", on_snapshot)
    client_node = make_node("snapshot_client")
    client = client_node.create_client(fr_srv.Snapshot, "/snapshot_server/snapshot")
    assert client.wait_for_service(timeout_sec=10.0), "service never appeared"

    done = threading.Event()
    future = client.call_async(
        fr_srv.Snapshot.Request(name="before-grasp", tier="host", pin=True, request_id="r1")
    )
    future.add_done_callback(lambda _: done.set())
    assert done.wait(timeout=10.0), "no response within 10 s"

    response = future.result()
    assert response.success and response.error_code == fr_msg.ErrorCode.OK
    assert response.capsule_id == "capsule-r1"
    assert (response.capsule.name, response.capsule.tier, response.capsule.pinned) == (
        "before-grasp", "host", True)
    assert (response.position, response.latency_ms) == (42, 0.25)
    assert [r.request_id for r in requests] == ["r1"]

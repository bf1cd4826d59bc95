"""Policy topics, parameters (file, descriptors, refusals) and the launch file."""
from __future__ import annotations

import ast
import math
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("rclpy")

from flashrt_ros.errors import ErrorCode  # noqa: E402
from ros_harness import Harness, wait_future  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
JOINTS = [f"joint{i}" for i in range(1, 8)]


def _joint_state(positions, names=JOINTS, velocities=None):
    from sensor_msgs.msg import JointState

    return JointState(name=list(names), position=[float(p) for p in positions],
                      velocity=[float(v) for v in (velocities or [])])


def _pose(xyz=(0.4, 0.0, 0.3), wxyz=(1.0, 0.0, 0.0, 0.0)):
    from geometry_msgs.msg import PoseStamped

    msg = PoseStamped()
    msg.header.frame_id = "base"
    (msg.pose.position.x, msg.pose.position.y, msg.pose.position.z) = xyz
    (msg.pose.orientation.w, msg.pose.orientation.x, msg.pose.orientation.y, msg.pose.orientation.z) = wxyz
    return msg


def test_observation_layout_uses_names_and_a_continuous_rotation():
    from flashrt_ros.serving.observation import build_observation, observation_size

    # Joints arrive in another order than configured; they are picked by name.
    msg = _joint_state([7, 6, 5, 4, 3, 2, 1], names=list(reversed(JOINTS)), velocities=[0.7] * 7)
    half = math.sqrt(0.5)
    obs = build_observation(JOINTS, msg, _pose(wxyz=(half, 0.0, 0.0, half)))  # 90 degrees about z
    assert obs.dtype == np.float32 and obs.shape == (observation_size(7),)
    assert obs[:7].tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert np.allclose(obs[7:14], 0.7)
    assert np.allclose(obs[14:17], [0.4, 0.0, 0.3])
    assert np.allclose(obs[17:20], [0, 1, 0], atol=1e-6) and np.allclose(obs[20:23], [-1, 0, 0], atol=1e-6)


def test_a_joint_named_twice_counts_only_if_the_policy_reads_it():
    from flashrt_ros.serving.observation import build_observation

    merged = _joint_state([0.1] * 7 + [0.0, 0.5], names=JOINTS + ["gripper", "gripper"])   # two drivers' merge
    assert build_observation(JOINTS, merged, _pose())[:7].tolist() == pytest.approx([0.1] * 7)


@pytest.mark.parametrize("bad, why", [
    (lambda: (_joint_state([0] * 6, names=JOINTS[:6]), _pose()), "lacks joints"),
    (lambda: (_joint_state([0] * 7, velocities=[1.0]), _pose()), "velocities"),
    (lambda: (_joint_state([float("nan")] * 7), _pose()), "NaN"),
    (lambda: (_joint_state([0] * 7), _pose(wxyz=(0, 0, 0, 0))), "quaternion"),
    (lambda: (_joint_state([0] * 8, names=JOINTS + [JOINTS[2]]), _pose()), "more than once"),
])
def test_bad_observations_are_refused_with_a_reason(bad, why):
    from flashrt_ros.errors import InvalidArgument
    from flashrt_ros.serving.observation import build_observation

    joint_state, pose = bad()
    with pytest.raises(InvalidArgument, match=why):
        build_observation(JOINTS, joint_state, pose)


def test_policy_steps_publish_actions_equal_to_the_engine(ros_context):
    from trajectory_msgs.msg import JointTrajectoryPoint

    from flashrt_ros.serving.observation import build_observation
    from flashrt_ros.runtime import Engine, ModelConfig

    from rclpy.qos import DurabilityPolicy, QoSProfile

    from flashrt_ros.msg import RuntimeStatus

    h = Harness(ros_context)   # status_rate 0: status on change only
    try:
        actions, statuses = [], []
        h.client.create_subscription(JointTrajectoryPoint, "/flashrt/action", actions.append, 50)
        h.client.create_subscription(RuntimeStatus, "/flashrt/status", statuses.append,
                                     QoSProfile(depth=10, durability=DurabilityPolicy.TRANSIENT_LOCAL))
        joints, poses = h.policy_publishers()
        deadline = time.monotonic() + 10
        while h.node.count_publishers("/flashrt/action") == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
        joints.publish(_joint_state([0.1] * 7))      # no pose yet: dropped, counted
        time.sleep(0.3)   # (taken before the pose below: waiting together, the pose is taken first)
        pose = _pose()
        poses.publish(pose)
        time.sleep(0.3)
        inputs = [_joint_state([0.01 * i * j for j in range(7)], velocities=[0.1] * 7) for i in range(5)]
        inputs.insert(2, _joint_state([0] * 3, names=JOINTS[:3]))   # missing joints: dropped, counted
        for msg in inputs:
            joints.publish(msg)
            time.sleep(0.05)
        while len(actions) < 5 and time.monotonic() < deadline + 10:
            time.sleep(0.02)
        assert len(actions) == 5
        assert h.node.report.counters["rejected_observations"] == 2
        assert h.node.engine.position == 5
        # Policy steps change the state: "on change" status follows them, not only service calls.
        while (not statuses or statuses[-1].position != 5) and time.monotonic() < deadline + 10:
            time.sleep(0.02)
        assert statuses[-1].position == 5

        reference = Engine.from_config(ModelConfig.tiny(obs_dim=23, action_dim=7), max_seq_len=512)
        good = [m for m in inputs if len(m.name) == 7]
        for msg, got in zip(good, actions):
            expected = reference.step(build_observation(JOINTS, msg, pose))
            assert np.array_equal(np.asarray(got.positions, dtype=np.float32), expected.numpy())
        assert h.call("rollback", steps=2, to_position=-1).position == 3
    finally:
        h.close()


def _flat_params(path) -> dict:
    """A params file's parameters, nested names joined with dots (as rclpy names them)."""
    import yaml

    flat = {}

    def walk(prefix, tree):
        for key, value in tree.items():
            name = f"{prefix}.{key}" if prefix else key
            walk(name, value) if isinstance(value, dict) else flat.__setitem__(name, value)

    walk("", yaml.safe_load(path.read_text())["/**"]["ros__parameters"])
    return flat


def test_params_file_loads_and_every_parameter_is_in_it(ros_context):
    import yaml

    from flashrt_ros.ros.params import PARAMS
    from flashrt_ros.ros.node import FlashRTNode

    config = ROOT / "config" / "flashrt.yaml"
    flat = _flat_params(config)
    assert flat == {p.name: p.default for p in PARAMS}, "config/flashrt.yaml and the parameter table differ"

    from rclpy.context import Context
    import rclpy

    context = Context()
    rclpy.init(context=context, args=["--ros-args", "--params-file", str(config), "-p", "max_seq_len:=640"])
    try:
        node = FlashRTNode(context=context)
        assert node.get_parameter("max_seq_len").value == 640          # the command line wins over the file
        assert node.get_parameter("policy.joint_names").value == JOINTS
        described = node.describe_parameter("max_seq_len")
        assert described.read_only and described.integer_range[0].from_value == 16
        node.destroy_node()
    finally:
        context.try_shutdown()


@pytest.mark.parametrize("override, reason", [
    ("dtype:=float8", "dtype"),
    ("device:=tpu", "device"),
    ("max_seq_len:=0", "max_seq_len"),
    ("default_tier:=moon", "default_tier"),
    ("status_rate:=-1.0", "status_rate"),
    ("max_seq_len:=big", "max_seq_len"),
    ("status_rate:=[]", "status_rate: needs a value"),   # an empty list arrives as no value at all
])
def test_invalid_parameter_values_are_refused_with_a_reason(override, reason):
    import rclpy
    from rclpy.context import Context

    from flashrt_ros.ros.node import FlashRTNode

    context = Context()
    rclpy.init(context=context, args=["--ros-args", "-p", override])
    try:
        with pytest.raises(Exception) as refused:
            FlashRTNode(context=context).destroy_node()
        assert reason in str(refused.value)
    finally:
        context.try_shutdown()


def test_an_empty_joint_list_from_a_params_file_is_no_joints(tmp_path):
    """YAML ``[]`` reaches rclpy without a type: the node must read it as zero joints
    (obs_dim = 9: the end-effector pose alone), not fail on a None."""
    import rclpy
    from rclpy.context import Context

    from flashrt_ros.ros.node import FlashRTNode

    params = tmp_path / "no_joints.yaml"
    params.write_text("/**:\n  ros__parameters:\n    max_seq_len: 256\n"
                      "    policy:\n      joint_names: []\n      obs_dim: 9\n      action_dim: 2\n")
    context = Context()
    rclpy.init(context=context, args=["--ros-args", "--params-file", str(params)])
    node = None
    try:
        node = FlashRTNode(context=context)
        node.trigger_configure()
        assert node.engine is not None and node.engine.config.obs_dim == 9
    finally:
        if node is not None:
            node.destroy_node()
        context.try_shutdown()


def test_runtime_parameter_changes_are_checked(ros_context):
    from rclpy.parameter import Parameter

    h = Harness(ros_context)
    try:
        node = h.node
        bad = node.set_parameters([Parameter("default_tier", value="moon")])[0]
        assert not bad.successful and "default_tier" in bad.reason
        frozen = node.set_parameters([Parameter("max_seq_len", value=1024)])[0]
        assert not frozen.successful and "read-only" in frozen.reason
        no_dir = node.set_parameters([Parameter("default_tier", value="disk")])[0]
        assert not no_dir.successful and "capsule_dir" in no_dir.reason
        assert node.get_parameter("default_tier").value == "device"
        good = node.set_parameters([Parameter("default_tier", value="host"), Parameter("spill", value=False)])
        assert all(r.successful for r in good)
        assert node.engine.capsules.spill is False
        assert h.call("snapshot").capsule.tier == "host"
    finally:
        h.close()


@pytest.mark.parametrize("overrides", [{"policy.obs_dim": 10}, {"default_tier": "disk"}])
def test_configure_refuses_inconsistent_parameters_and_stays_unconfigured(ros_context, overrides):
    h = Harness(ros_context, overrides, activate=False)
    try:
        h.node.trigger_configure()
        assert h.node.engine is None
        assert h.call("list_capsules").error_code == ErrorCode.NOT_ACTIVE
    finally:
        h.close()


def test_launch_file_declares_its_arguments_and_names_the_installed_parts():
    """launch_ros is not on PyPI: read the file's structure; import it where ROS is installed."""
    source = (ROOT / "launch" / "flashrt.launch.py").read_text()
    tree = ast.parse(source)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    declared = {n.args[0].value for n in calls if getattr(n.func, "id", "") == "DeclareLaunchArgument"}
    assert declared == {"params_file", "namespace", "log_level", "autostart"}
    node = next(n for n in calls if getattr(n.func, "id", "") == "LifecycleNode")
    kw = {k.arg: k.value for k in node.keywords}
    assert kw["package"].value == "flashrt_ros" and kw["executable"].value == "flashrt_node"
    assert kw["name"].value == "flashrt"
    assert getattr(kw["parameters"].func, "id", "") == "node_parameters"
    assert '"config", "flashrt.yaml"' in source and "get_package_share_directory" in source
    from install_space import PREFIX as installed

    if installed.is_dir():
        assert (installed / "lib" / "flashrt_ros" / "flashrt_node").stat().st_mode & 0o111
        assert (installed / "share" / "flashrt_ros" / "config" / "flashrt.yaml").is_file()
        assert (installed / "share" / "flashrt_ros" / "launch" / "flashrt.launch.py").is_file()

    launch_ros = pytest.importorskip("launch_ros", reason="launch_ros is not installed (not on PyPI)")
    import importlib.util

    spec = importlib.util.spec_from_file_location("flashrt_launch", ROOT / "launch" / "flashrt.launch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    description = module.generate_launch_description()
    assert any(isinstance(e, launch_ros.actions.LifecycleNode) for e in description.entities)


def test_the_jetson_thor_profile_names_only_known_parameters_and_a_node_takes_them():
    import yaml
    from rclpy.context import Context
    import rclpy

    from flashrt_ros.ros import params
    from flashrt_ros.ros.node import FlashRTNode

    profile = ROOT / "config" / "jetson_thor.yaml"
    flat = _flat_params(profile)
    assert set(flat) <= {p.name for p in params.PARAMS}
    assert all(params._reason(name, value) == "" for name, value in flat.items())
    assert params.check_together({p.name: p.default for p in params.PARAMS} | flat) == ""
    assert (flat["device"], flat["dtype"], flat["cuda_graphs"], flat["autostart"]) == ("cuda", "bfloat16", True, True)
    context = Context()
    rclpy.init(context=context, args=["--ros-args", "--params-file", str(profile)])
    try:
        node = FlashRTNode(context=context)   # rclpy checks every value's type against its descriptor
        assert {name: node.get_parameter(name).value for name in flat} == flat
        node.destroy_node()
    finally:
        rclpy.shutdown(context=context)


def test_the_params_file_decides_autostart_unless_the_launch_argument_is_given():
    from flashrt_ros.ros.launch_args import node_parameters

    assert node_parameters("mine.yaml", "") == ["mine.yaml"]
    assert node_parameters("mine.yaml", "true") == ["mine.yaml", {"autostart": True}]
    assert node_parameters("mine.yaml", "False") == ["mine.yaml", {"autostart": False}]
    with pytest.raises(ValueError, match="use true or false"):
        node_parameters("mine.yaml", "yes please")


def test_observations_during_a_goal_are_dropped_not_interleaved_with_its_tokens(ros_context):
    from flashrt_ros.runtime import Engine, ModelConfig

    h = Harness(ros_context)
    try:
        joints, poses = h.policy_publishers()
        poses.publish(_pose())
        time.sleep(0.3)
        prompt = list(range(1, 9))
        streamed = []
        _, result = h.generate(token_ids=prompt, max_new_tokens=300, feedback=streamed.append)
        deadline = time.monotonic() + 30
        while not streamed and time.monotonic() < deadline:   # the goal holds the state from here
            time.sleep(0.001)
        sent = 0
        while not result.done():
            joints.publish(_joint_state([0.01 * sent] * 7))
            sent += 1
            time.sleep(0.003)
        answer = wait_future(result).result
        assert answer.success, answer.message
        assert answer.position == len(prompt) + len(answer.tokens)
        reference = Engine.from_config(ModelConfig.tiny(obs_dim=23, action_dim=7), max_seq_len=512)
        reference.prefill(prompt)
        assert list(answer.tokens) == reference.generate(len(answer.tokens))
        deadline = time.monotonic() + 10
        while h.node.report.counters["rejected_observations"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sent > 0 and h.node.report.counters["rejected_observations"] > 0
        # Once the goal is over, observations are steps again.
        steps = h.node.report.counters["policy_steps"]
        joints.publish(_joint_state([0.2] * 7))
        while h.node.report.counters["policy_steps"] == steps and time.monotonic() < deadline:
            time.sleep(0.01)
        assert h.node.report.counters["policy_steps"] == steps + 1
    finally:
        h.close()


def test_the_stamp_gap_is_none_for_unstamped_messages():
    from flashrt_ros.serving.observation import stamp_gap

    joints, pose = _joint_state([0.0] * 7), _pose()
    assert stamp_gap(joints, pose) is None
    joints.header.stamp.sec, joints.header.stamp.nanosec = 100, 250_000_000
    assert stamp_gap(joints, pose) is None   # the pose is unstamped
    pose.header.stamp.sec, pose.header.stamp.nanosec = 99, 750_000_000
    assert stamp_gap(joints, pose) == pytest.approx(0.5)
    assert stamp_gap(pose, joints) == pytest.approx(0.5)


def test_a_pose_too_far_from_the_joint_state_by_stamps_is_not_paired_with_it(ros_context):
    """A pose publisher that stopped must not have its last pose paired with every new joint
    state; unstamped messages and a check set to 0 step as before."""
    from rclpy.parameter import Parameter
    from trajectory_msgs.msg import JointTrajectoryPoint

    def stamped(msg, sec: int, nanosec: int = 0):
        msg.header.stamp.sec, msg.header.stamp.nanosec = sec, nanosec
        return msg

    h = Harness(ros_context)
    try:
        actions = []
        h.client.create_subscription(JointTrajectoryPoint, "/flashrt/action", actions.append, 50)
        joints, poses = h.policy_publishers()
        deadline = time.monotonic() + 10
        while h.node.count_publishers("/flashrt/action") == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        poses.publish(stamped(_pose(), 100))
        time.sleep(0.3)

        def send(msg) -> None:
            before = (len(actions), h.node.report.counters["rejected_observations"])
            joints.publish(msg)
            end = time.monotonic() + 10
            while (len(actions), h.node.report.counters["rejected_observations"]) == before and time.monotonic() < end:
                time.sleep(0.01)

        send(stamped(_joint_state([0.1] * 7), 100, 400_000_000))   # 0.4 s apart: within 0.5
        send(stamped(_joint_state([0.1] * 7), 101))                # 1 s apart: dropped
        send(_joint_state([0.1] * 7))                              # unstamped: not checked
        assert (len(actions), h.node.report.counters["rejected_observations"]) == (2, 1)
        assert h.node.set_parameters([Parameter("policy.max_pose_age", value=0.0)])[0].successful
        send(stamped(_joint_state([0.1] * 7), 160))                # a minute apart, check off
        assert (len(actions), h.node.report.counters["rejected_observations"]) == (3, 1)
        assert not h.node.set_parameters([Parameter("policy.max_pose_age", value=-1.0)])[0].successful
    finally:
        h.close()

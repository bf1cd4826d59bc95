"""The reaching task closed loop over ROS: flashrt_sim and flashrt_node (the shipped trained
policy) in processes of their own, the behaviour tree of bt.reach driving them from this one.
The jammed attempt misses, the retry from the restored snapshot reaches, and the node's
journal bag replays: exact on this machine, portable under other vector kernels."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("rclpy")
pytest.importorskip("mujoco")

from flashrt_ros.sim.train_policy import DEFAULT_OUT  # noqa: E402
from policy_recording import same_kernels_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRAINED = pytest.mark.skipif(not (DEFAULT_OUT / "model.safetensors").is_file(),
                             reason="the trained policy data/policies/reach_arm (make train-policy)")


def test_the_launch_file_wires_the_arm_to_the_policy_and_its_profile_fits_the_node():
    """launch_ros is not on PyPI: the file's structure is read; the profile is checked against
    the node's parameter table."""
    import yaml

    from flashrt_ros.ros import params

    source = (ROOT / "launch" / "reach_sim.launch.py").read_text()
    calls = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)]
    executables = {k.value.value for n in calls for k in n.keywords if k.arg == "executable"}
    assert executables == {"flashrt_sim", "flashrt_node"}
    for topic in ("joint_states", "ee_pose", "joint_trajectory"):
        assert f'("{topic}", "/flashrt/{topic}")' in source
    assert '"data", "policies", "reach_arm"' in source and '"config", "reach_sim.yaml"' in source
    flat = {}

    def walk(prefix, tree):
        for key, value in tree.items():
            name = f"{prefix}.{key}" if prefix else key
            walk(name, value) if isinstance(value, dict) else flat.__setitem__(name, value)

    walk("", yaml.safe_load((ROOT / "config" / "reach_sim.yaml").read_text())["flashrt"]["ros__parameters"])
    flat.pop("use_sim_time")   # rclpy's own
    assert set(flat) <= {p.name for p in params.PARAMS}
    assert all(params._reason(name, value) == "" for name, value in flat.items())
    assert params.check_together({p.name: p.default for p in params.PARAMS} | flat) == ""


@TRAINED
def test_the_tree_rolls_the_policy_back_after_a_jam_and_the_session_replays(monkeypatch, tmp_path):
    from flashrt_ros.demo.reach import over_ros

    for key, value in same_kernels_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    result = over_ros(tmp_path)
    log = (tmp_path / "reach_nodes.log").read_text()[-3000:]
    assert result.status == "SUCCESS", (result.attempts, log)
    (first, missed, _), (second, reached, gap) = result.attempts
    assert (first, missed, second, reached) == ("attempt", False, "retry", True), result.attempts
    assert gap < 0.03
    assert result.replay_exit == 0 and "verdict applied: exact" in result.replay_tail, result.replay_tail
    assert "exact:    identical" in result.replay_tail, result.replay_tail

    # Another machine, simulated: torch's generic kernels round some products otherwise.
    env = {**same_kernels_env(), "ATEN_CPU_CAPABILITY": "default"}
    done = subprocess.run([sys.executable, "-m", "flashrt_ros.replay.cli", str(result.bag), "--verdict", "portable"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and "portable: pass" in done.stdout, done.stdout + done.stderr


@TRAINED
def test_the_engine_acts_as_the_training_reference_on_the_shipped_policy():
    """The checkpoint the engine runs is the model training optimised: transformers'
    Qwen3_5ForCausalLM with the policy heads gives the same actions over whole episodes."""
    pytest.importorskip("transformers")
    import torch
    from safetensors.torch import load_file

    from flashrt_ros.runtime import Engine
    from flashrt_ros.sim.demonstrations import demonstrate
    from flashrt_ros.sim.train_policy import actions, build, policy_config

    model = build(policy_config(), seed=0)
    tensors = load_file(str(DEFAULT_OUT / "model.safetensors"))
    model["lm"].load_state_dict({k: v for k, v in tensors.items() if not k.startswith("policy.")})
    for head in ("obs_proj", "action_head"):
        model[head].load_state_dict({p: tensors[f"policy.{head}.{p}"] for p in ("weight", "bias")})
    demos = demonstrate(range(2))
    engine = Engine.from_pretrained(DEFAULT_OUT, max_seq_len=64)
    try:
        for episode in torch.from_numpy(demos.observations):
            with torch.no_grad():
                reference = actions(model, episode[None])[0]
            engine.reset()
            ours = torch.stack([engine.step(o) for o in episode])
            assert (ours - reference).abs().max() < 1e-5
    finally:
        engine.close()


@TRAINED
def test_the_retry_ablation_command_line_runs_the_first_episodes_and_draws(tmp_path, capsys):
    from flashrt_ros.sim import ablation

    assert ablation.main(["--episodes", "1", "--out", str(tmp_path)]) == 0
    said = capsys.readouterr().out
    assert all(label in said for label in ablation.LABELS.values())
    assert f"wrote {tmp_path / 'retry_paths.png'}" in said and (tmp_path / "retry_paths.png").stat().st_size > 0

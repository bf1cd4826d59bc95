"""Resuming the waypoint task after an urgent request, in process: the full restore and the
recompute bring back the state at the interruption byte for byte, the partial ones do not;
the shipped policy loads, acts as its training reference, and does uninterrupted routes; the
ablation runs and draws."""
from __future__ import annotations

import pytest

pytest.importorskip("mujoco")

from flashrt_ros.runtime import Engine, ModelConfig  # noqa: E402
from flashrt_ros.sim.arm import Arm  # noqa: E402
from flashrt_ros.sim.interruption import RESUMES, Interrupted, run_interrupted, run_route, state_groups  # noqa: E402
from flashrt_ros.sim.task import ACTION_DIM, OBS_DIM  # noqa: E402
from flashrt_ros.sim.train_resume_policy import DEFAULT_OUT, HELD_OUT_SEEDS, MAX_SEQ_LEN, open_policy  # noqa: E402
from flashrt_ros.sim.waypoints import Route  # noqa: E402

TRAINED = pytest.mark.skipif(not (DEFAULT_OUT / "model.safetensors").is_file(),
                             reason="the trained policy data/policies/waypoints_arm (make train-resume-policy)")


@pytest.fixture(scope="module")
def seeded_engine():
    """Seeded weights: what a restore brings back does not depend on training."""
    with Engine.from_config(ModelConfig.tiny(obs_dim=OBS_DIM, action_dim=ACTION_DIM), seed=0,
                            max_seq_len=MAX_SEQ_LEN, decode_threads=1) as engine:
        yield engine


def test_a_full_restore_and_a_recompute_bring_back_the_interrupted_state_byte_for_byte(seeded_engine):
    arm, episode = Arm(), Interrupted.sample(500, Arm())
    runs = {resume: run_interrupted(seeded_engine, arm, episode, resume) for resume in RESUMES}
    at_interruption = runs["full"].digest_at_interruption
    assert all(r.digest_at_interruption == at_interruption for r in runs.values())   # the same episode
    # Steps are one row each: feeding the history again computes what the first pass did.
    assert runs["full"].digest_recovered == runs["recompute"].digest_recovered == at_interruption
    assert runs["full"].paths["after"] == runs["recompute"].paths["after"]
    # The urgent request wrote every group, the KV rows from row 0 included.
    for partial in ("kv", "not_kv", "none", "regive"):
        assert runs[partial].digest_recovered != at_interruption, partial
    assert runs["full"].history == episode.period


def test_the_groups_other_than_kv_are_read_from_the_region_table(seeded_engine):
    groups = state_groups(seeded_engine, but="kv")
    assert "kv" not in groups and {"recurrent", "conv", "meta"} <= set(groups)


@TRAINED
def test_the_shipped_policy_loads_acts_and_reaches_the_first_waypoint_of_held_out_routes():
    arm = Arm()
    with open_policy(DEFAULT_OUT) as engine:
        assert (engine.config.obs_dim, engine.config.action_dim) == (OBS_DIM, ACTION_DIM)
        visited = [run_route(engine, arm, Route.sample(seed)).visited for seed in HELD_OUT_SEEDS[:5]]
    # The shipped policy does not do every held-out route (docs/sim.md); it takes each
    # route in and reaches its first waypoint.
    assert min(visited) >= 1, visited


@TRAINED
def test_the_engine_acts_as_the_training_reference_on_the_shipped_waypoint_policy():
    pytest.importorskip("transformers")
    import torch
    from safetensors.torch import load_file

    from flashrt_ros.sim.route_demonstrations import demonstrate
    from flashrt_ros.sim.train_policy import actions, build, policy_config

    model = build(policy_config(), seed=0)
    tensors = load_file(str(DEFAULT_OUT / "model.safetensors"))
    model["lm"].load_state_dict({k: v for k, v in tensors.items() if not k.startswith("policy.")})
    for head in ("obs_proj", "action_head"):
        model[head].load_state_dict({p: tensors[f"policy.{head}.{p}"] for p in ("weight", "bias")})
    with open_policy(DEFAULT_OUT) as engine:
        for episode in demonstrate(range(2)).observations:
            episode = torch.from_numpy(episode)
            with torch.no_grad():
                reference = actions(model, episode[None])[0]
            engine.reset()
            ours = torch.stack([engine.step(o) for o in episode])
            assert (ours - reference).abs().max() < 1e-5


@TRAINED
def test_the_shipped_policy_without_a_restore_holds_the_urgent_point_and_never_heads_on():
    arm = Arm()
    with open_policy(DEFAULT_OUT) as engine:
        for seed in (500, 501):
            episode = Interrupted.sample(seed, arm)
            resumed = run_interrupted(engine, arm, episode, "none")
            assert resumed.remaining >= 1 and not resumed.success and resumed.heading is None, seed
            x, y = resumed.paths["after"][-1]
            assert ((x - episode.point[0]) ** 2 + (y - episode.point[1]) ** 2) ** 0.5 < 0.05, seed


@TRAINED
def test_the_ablation_runs_and_draws(tmp_path):
    from flashrt_ros.sim import resume_ablation

    result = resume_ablation.run(DEFAULT_OUT, range(500, 502))
    table = result.table()
    assert all(label in table for label in resume_ablation.LABELS.values()) and "N=2" in table
    assert [r.success for r in result.runs["full"]] == [r.success for r in result.runs["recompute"]]
    assert (resume_ablation.draw(result, tmp_path)).stat().st_size > 0


@TRAINED
def test_the_ablation_command_line_runs_the_first_episodes_and_draws(tmp_path, capsys):
    from flashrt_ros.sim import resume_ablation

    assert resume_ablation.main(["--episodes", "1", "--out", str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    assert "N=1" in said and f"wrote {tmp_path / 'out' / 'resume_ablation.png'}" in said
    assert (tmp_path / "out" / "resume_ablation.png").stat().st_size > 0
    with pytest.raises(SystemExit) as exited:
        resume_ablation.main(["--episodes", "0"])
    assert exited.value.code == 2 and "--episodes must be at least 1" in capsys.readouterr().err


def test_training_runs_the_gated_deltanet_in_its_own_chunks_and_acts_as_the_default_chunks():
    pytest.importorskip("transformers")
    import inspect
    from unittest import mock

    import torch
    from transformers.models.qwen3_5 import modeling_qwen3_5 as reference

    from flashrt_ros.sim.train_policy import actions, build, policy_config
    from flashrt_ros.sim.train_resume_policy import train

    chunk = inspect.signature(train).parameters["chunk"].default
    model = build(policy_config(), seed=0)
    linear = sum(kind == "linear_attention" for kind in model["lm"].config.layer_types)
    x = torch.randn(2, 3 * chunk + 5, OBS_DIM, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        default = actions(model, x)
        # A spy: the real kernel runs, and says which chunk it was asked for.
        with mock.patch.object(reference, "torch_chunk_gated_delta_rule",
                               wraps=reference.torch_chunk_gated_delta_rule) as kernel:
            trained = actions(model, x, chunk)
    assert kernel.call_count == linear > 0
    assert all(call.kwargs.get("chunk_size") == chunk for call in kernel.call_args_list)
    assert (trained - default).abs().max() < 1e-5


def test_the_wilson_interval_matches_its_formula():
    from flashrt_ros.sim.resume_ablation import median_periods, wilson

    lo, hi = wilson(45, 50)
    assert abs(lo - 0.7864) < 1e-3 and abs(hi - 0.9565) < 1e-3
    assert wilson(0, 50)[0] == 0.0 and wilson(50, 50)[1] == 1.0
    assert median_periods([1, 2, None]) == "2" and median_periods([1, None, None]) == "never"


def test_length_batches_hold_every_sequence_once_and_group_by_length():
    import numpy as np

    from flashrt_ros.sim.route_demonstrations import Sequences
    from flashrt_ros.sim.train_resume_policy import length_batches

    lengths = [5, 90, 12, 60, 7, 80, 40, 41, 13, 6]
    data = Sequences(tuple(np.zeros((n, OBS_DIM), np.float32) for n in lengths),
                     tuple(np.zeros((n, ACTION_DIM), np.float32) for n in lengths))
    batches = length_batches(data, 3, np.random.default_rng(0))
    assert sorted(int(r) for b in batches for r in b) == list(range(len(lengths)))
    assert [len(b) for b in batches] == [3, 3, 3, 1]
    longest = [max(lengths[r] for r in b) for b in batches]
    assert longest == sorted(longest) and max(lengths[r] for r in batches[0]) <= 13

"""Rollback: k boundaries back equals stopping k boundaries earlier; to_position equals a cold run."""
from __future__ import annotations

import pytest

from flashrt_ros.capsule import CapsuleError
from flashrt_ros.errors import ErrorCode, InvalidArgument
from flashrt_ros.runtime import Engine, ModelConfig

PROMPT = list(b"The gripper closes on the handle. ")


def test_rollback_steps_continues_like_the_run_that_stopped_earlier(tiny_engine):
    reference = Engine.from_config(ModelConfig.tiny(), max_seq_len=256)
    reference.prefill(PROMPT)
    reference.generate(10)
    tiny_engine.prefill(PROMPT)
    tiny_engine.generate(13)
    assert tiny_engine.rollback(steps=3) == reference.position
    assert tiny_engine.state_digest() == reference.state_digest()
    assert tiny_engine.generate(20) == reference.generate(20)


def test_rollback_to_a_position_inside_the_prompt_equals_a_cold_prefill(tiny_engine):
    tiny_engine.prefill(PROMPT)
    tiny_engine.generate(30)
    assert tiny_engine.rollback(to_position=20) == 20
    cold = Engine.from_config(ModelConfig.tiny(), max_seq_len=256)
    cold.prefill(PROMPT[:20])
    assert tiny_engine.state_digest() == cold.state_digest()
    assert tiny_engine.generate(16) == cold.generate(16)


def test_rollback_to_a_position_older_than_the_ring_replays_the_logged_inputs():
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=256, rollback_depth=2)
    engine.prefill(PROMPT)
    engine.generate(12)
    cold = Engine.from_config(ModelConfig.tiny(), max_seq_len=256)
    cold.prefill(PROMPT)
    cold.generate(4)
    assert engine.rollback(to_position=len(PROMPT) + 4) == cold.position
    assert engine.state_digest() == cold.state_digest()
    assert engine.generate(8) == cold.generate(8)


def test_rollback_after_restore_reaches_back_to_the_capsule(tiny_engine):
    tiny_engine.prefill(PROMPT)
    capsule = tiny_engine.snapshot()
    tiny_engine.generate(5)
    tiny_engine.restore(capsule)
    tiny_engine.generate(3)
    assert tiny_engine.rollback(steps=3) == capsule.position
    assert tiny_engine.state_digest() == tiny_engine.capsules.get(capsule.id).digest


@pytest.mark.parametrize("case", ["kept", "dropped", "file gone", "file flipped"])
def test_rollback_older_than_the_ring_starts_from_a_capsule_the_run_passed_when_one_is_kept(case, tmp_path):
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=256, rollback_depth=2, capsule_dir=tmp_path)
    engine.prefill(PROMPT)
    engine.generate(4)
    capsule = engine.snapshot(tier="disk" if case.startswith("file") else "device")
    engine.generate(12)
    reference = engine.state_digest()
    kept = case == "kept"
    if case == "dropped":
        engine.capsules.drop(capsule.id)
    elif case == "file gone":   # still listed, no longer readable: the replay starts from empty
        next(tmp_path.glob("*.capsule")).unlink()
    elif case == "file flipped":
        path = next(tmp_path.glob("*.capsule"))
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    cold = Engine.from_config(ModelConfig.tiny(), max_seq_len=256)
    cold.prefill(PROMPT)
    cold.generate(9)
    assert engine.rollback(to_position=cold.position) == cold.position
    assert engine.rollback_origin == (capsule.id if kept else "")   # else the empty state and all the log
    assert engine.state_digest() == cold.state_digest()
    assert engine.generate(7) == cold.generate(7)
    assert engine.state_digest() == reference                        # the run's own state again
    # A capsule past the target, or one the run left by going back below it, is no start.
    assert engine.rollback(to_position=len(PROMPT) + 2) == len(PROMPT) + 2 and engine.rollback_origin == ""
    engine.generate(10)
    engine.rollback(to_position=len(PROMPT) + 8)
    assert engine.rollback_origin == ""


def test_policy_steps_roll_back_and_replay():
    cfg = ModelConfig.tiny(obs_dim=4, action_dim=2)
    engine, cold = Engine.from_config(cfg, max_seq_len=128, rollback_depth=2), Engine.from_config(cfg, max_seq_len=128)
    observations = [[0.1 * i, -0.2 * i, 0.3, 1.0] for i in range(10)]
    actions = [engine.step(o) for o in observations]
    for o in observations[:6]:
        cold.step(o)
    assert engine.rollback(to_position=6) == 6
    assert engine.state_digest() == cold.state_digest()
    assert engine.step(observations[6]).tolist() == actions[6].tolist()


@pytest.mark.parametrize("back", ["rollback", "restore"])
def test_tokens_over_an_abandoned_policy_step_match_a_cold_engine(back):
    """A token row must not keep the observation a rolled-back (or restored-over) step left there."""
    cfg = ModelConfig.tiny(obs_dim=6, action_dim=3)
    engine, cold = Engine.from_config(cfg, max_seq_len=64), Engine.from_config(cfg, max_seq_len=64)
    engine.prefill([5, 6, 7])
    cold.prefill([5, 6, 7])
    before = engine.snapshot()
    engine.step([1.0] * 6)
    if back == "rollback":
        engine.rollback(1)
    else:
        engine.restore(before)
    assert engine.generate(2) == cold.generate(2)
    assert engine.state_digest() == cold.state_digest()
    mine, theirs = engine.snapshot(), cold.snapshot()
    assert engine.capsules.get(mine.id).history_hash == cold.capsules.get(theirs.id).history_hash
    engine.prefill([8, 9])
    cold.prefill([8, 9])
    assert engine.state_digest() == cold.state_digest()


@pytest.mark.parametrize("kwargs, words", [
    ({"steps": -1}, "int >= 0"),
    ({"steps": 9}, "rollback_depth=8"),
    ({"to_position": 10_000}, "to_position must be"),
    ({"to_position": -2}, "to_position must be"),
])
def test_bad_rollbacks_are_refused_and_change_nothing(tiny_engine, kwargs, words):
    tiny_engine.prefill(PROMPT)
    tiny_engine.generate(12)
    before = tiny_engine.state_digest()
    with pytest.raises(InvalidArgument, match=words) as info:
        tiny_engine.rollback(**kwargs)
    assert isinstance(info.value, CapsuleError) and info.value.code == ErrorCode.INVALID_ARGUMENT
    assert tiny_engine.state_digest() == before


def test_a_rollback_whose_replay_fails_leaves_the_state_as_it_was():
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=256, rollback_depth=1)
    engine.prefill(list(range(1, 11)))
    engine.generate(5)
    before, position = engine.state_digest(), engine.position
    live = engine._live
    replay, calls = live._replay, []

    def failing(*args):   # a fault in the middle of the replay: the prefill run went through
        calls.append(args[0])
        if len(calls) == 2:
            raise RuntimeError("injected fault")
        return replay(*args)

    live._replay = failing
    with pytest.raises(RuntimeError, match="injected"):
        engine.rollback(to_position=13)
    del live._replay
    assert calls == ["prefill", "decode"]
    assert engine.state_digest() == before and engine.position == position
    assert engine.rollback(to_position=13) == 13   # and it still works

"""Engine behaviour: committed boundaries, graph-shaped decode, and bad input that changes nothing."""
from __future__ import annotations

import pytest
import torch

from flashrt_ros.errors import ErrorCode, InvalidArgument
from flashrt_ros.runtime import Engine, ModelConfig

PROMPT = list(b"The robot picks up the red cube and ")


def test_prefill_in_small_chunks_gives_the_same_continuation():
    whole = Engine.from_config(ModelConfig.tiny())
    chunked = Engine.from_config(ModelConfig.tiny(), prefill_chunk=7)
    assert torch.allclose(whole.prefill(PROMPT), chunked.prefill(PROMPT), atol=1e-4)
    assert whole.generate(32) == chunked.generate(32)


def test_prefill_appends_to_the_state():
    one = Engine.from_config(ModelConfig.tiny())
    two = Engine.from_config(ModelConfig.tiny())
    one.prefill(PROMPT)
    two.prefill(PROMPT[:11])
    two.prefill(PROMPT[11:])
    assert two.position == one.position == len(PROMPT)
    assert one.generate(24) == two.generate(24)


def test_graph_shaped_decode_computes_what_eager_decode_computes():
    eager = Engine.from_config(ModelConfig.tiny(), max_seq_len=512)
    fixed = Engine.from_config(ModelConfig.tiny(), max_seq_len=512, static_shapes=True)
    eager.prefill(PROMPT)
    fixed.prefill(PROMPT)
    assert eager.generate(48) == fixed.generate(48)
    assert torch.allclose(eager.logits(), fixed.logits(), atol=1e-5)


def test_generate_commits_one_boundary_per_token_and_records_it(tiny_engine):
    tiny_engine.prefill(PROMPT)
    tokens = tiny_engine.generate(10)
    assert tiny_engine.position == len(PROMPT) + 10
    history = tiny_engine.arena["meta.tokens"][:tiny_engine.position, 0].tolist()
    assert history == PROMPT + tokens
    assert list(tiny_engine.stream(5, sync_every=2)) == tiny_engine.arena["meta.tokens"][-5 + tiny_engine.position:tiny_engine.position, 0].tolist()


def test_greedy_generation_is_deterministic_across_engines_with_one_seed():
    a, b = Engine.from_config(ModelConfig.tiny(), seed=3), Engine.from_config(ModelConfig.tiny(), seed=3)
    assert a.model_fingerprint == b.model_fingerprint
    a.prefill(PROMPT), b.prefill(PROMPT)
    assert a.generate(20) == b.generate(20)
    assert a.state_digest() == b.state_digest()
    assert Engine.from_config(ModelConfig.tiny(), seed=4).model_fingerprint != a.model_fingerprint


def test_decode_state_is_the_same_bytes_at_any_thread_count():
    # Replay promises byte-exact digests on the same build, whatever the machine's core
    # count: the one-row projections split their work into a fixed number of slabs.
    digests = []
    for threads in (1, 3):
        engine = Engine.from_config(ModelConfig.tiny(), decode_threads=threads)
        engine.prefill(PROMPT)
        engine.generate(16)
        digests.append(engine.state_digest())
    assert digests[0] == digests[1]


def test_mtp_kv_and_last_hidden_are_current_at_every_boundary(tiny_engine):
    tiny_engine.prefill(PROMPT)
    tiny_engine.generate(3)
    p = tiny_engine.position
    mtp = tiny_engine.arena["mtp.kv"]
    assert mtp[:p].abs().sum(dim=(1, 2, 3)).gt(0).all()   # one MTP row per committed position
    assert mtp[p:].abs().sum() == 0
    assert tiny_engine.arena["meta.last_hidden"].abs().sum() > 0
    assert int(tiny_engine.arena["meta.position"]) == p


def test_reset_returns_to_the_empty_state(tiny_engine):
    empty = tiny_engine.state_digest()
    tiny_engine.prefill(PROMPT)
    tiny_engine.reset()
    assert tiny_engine.position == 0 and tiny_engine.state_digest() == empty


BAD_CALLS = {
    "token id past the vocabulary": (lambda e: e.prefill([1, 2, 260]), "out of range"),
    "negative token id": (lambda e: e.prefill([-1]), "out of range"),
    "float token ids": (lambda e: e.prefill([1.5, 2.0]), "integers"),
    "empty prompt": (lambda e: e.prefill([]), "empty"),
    "not a sequence": (lambda e: e.prefill("abc"), "sequence of ints"),
    "prompt past max_seq_len": (lambda e: e.prefill([1] * 300), "max_seq_len"),
    "generate past max_seq_len": (lambda e: e.generate(300), "max_seq_len"),
    "negative token count": (lambda e: e.generate(-1), "int >= 0"),
    "policy step without policy heads": (lambda e: e.step([0.0]), "no policy heads"),
    "a batch of prompts": (lambda e: e.prefill(torch.tensor([[1, 2], [3, 4]])), "one sequence"),
    "nested list with a bool": (lambda e: e.prefill([[True, 2]]), "one sequence"),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_input_raises_a_clear_error_and_changes_nothing(case):
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=256)
    engine.prefill(PROMPT)
    before, position = engine.state_digest(), engine.position
    call, words = BAD_CALLS[case]
    with pytest.raises(InvalidArgument, match=words) as info:
        call(engine)
    assert info.value.code == ErrorCode.INVALID_ARGUMENT
    assert engine.state_digest() == before and engine.position == position
    assert len(engine.generate(2)) == 2  # still serving


@pytest.mark.parametrize("kwargs, words", [
    ({"no_such_option": 1}, "unknown engine options"),
    ({"dtype": torch.int32}, "not supported"),
    ({"max_seq_len": 0}, "positive int"),
    ({"max_seq_len": True}, "positive int"),
    ({"decode_threads": -1}, "decode_threads must be an int >= 0"),
    ({"prefill_chunk": "x"}, "prefill_chunk must be an int >= 1"),
    ({"static_shapes": "false"}, "static_shapes must be True or False"),   # bool("false") is True
    ({"spill": 1}, "spill must be True or False"),
    ({"budgets": 5}, "budgets must be a dict"),
    ({"budgets": {"device": True}}, "budget for device must be an int"),
    ({"budgets": {"host": False}}, "budget for host must be an int"),
    ({"capsule_dir": 5}, "capsule_dir must be a non-empty path"),
    ({"capsule_dir": ""}, "capsule_dir must be a non-empty path"),   # a Path would read it as "."
    ({"capsule_dir": "caps\0ules"}, "without NUL bytes"),
    ({"capsule_dir": b"capsules"}, "capsule_dir must be a non-empty path"),
    ({"device": "gpu"}, "device must be"),
    ({"device": None}, "device must be"),
    ({"device": "meta"}, "runs on 'cpu' or 'cuda'"),
    ({"seed": 1.5}, "seed must be an int"),
    ({"seed": -5}, "seed must be an int"),
    ({"max_seq_len": 10**13}, "does not fit in cpu's memory"),
])
def test_bad_engine_arguments_are_refused(kwargs, words):
    with pytest.raises(InvalidArgument, match=words):
        Engine.from_config(ModelConfig.tiny(), **kwargs)


@pytest.mark.parametrize("n, sync_every", [(2, "x"), (2, -1), (-1, 1)])
def test_a_bad_stream_call_fails_when_made_and_commits_nothing(n, sync_every):
    engine = Engine.from_config(ModelConfig.tiny())
    engine.prefill(PROMPT)
    before = engine.state_digest()
    with pytest.raises(InvalidArgument):
        engine.stream(n, sync_every=sync_every)    # not at the first next()
    assert engine.state_digest() == before and engine.position == len(PROMPT)


@pytest.mark.parametrize("damage, words", [
    (lambda w: w.pop("model.norm.weight"), "no tensor model.norm.weight"),
    (lambda w: w.update({"model.layers.2.linear_attn.out_proj.weight": torch.randn(128, 64)}), "has shape"),
    (lambda w: w.update({"model.norm.weight": torch.zeros(128, dtype=torch.int64)}), "torch.int64"),
    (lambda w: w.update({"model.norm.weight": torch.zeros(128).to(torch.float8_e4m3fn)}), "quantized"),
    (lambda w: w["model.layers.0.mlp.down_proj.weight"].view(-1)[7].fill_(float("nan")), "NaN or infinity"),
    (lambda w: w["model.layers.1.mlp.up_proj.weight"].view(-1)[3].fill_(float("-inf")), "NaN or infinity"),
    (lambda w: w.update({"model.norm.weight": torch.full((128,), 6e4, dtype=torch.float16).index_fill_(
        0, torch.tensor([5]), float("inf"))}), "NaN or infinity"),
])
def test_weights_handed_to_the_constructor_are_checked_before_anything_runs(damage, words):
    from flashrt_ros.errors import CheckpointError
    from flashrt_ros.runtime.weights import seeded_weights

    weights = seeded_weights(ModelConfig.tiny())
    damage(weights)
    with pytest.raises(CheckpointError, match=words):
        Engine(ModelConfig.tiny(), weights)


def test_finite_weights_whose_sum_overflows_are_accepted():
    """The finiteness check sums first; a sum that overflows (fp16 tops out at 65504) is checked
    value by value, not refused."""
    from flashrt_ros.runtime.weights import seeded_weights

    weights = seeded_weights(ModelConfig.tiny())
    weights["model.norm.weight"] = torch.full((128,), 6e4, dtype=torch.float16)
    assert not torch.isfinite(weights["model.norm.weight"].sum())
    Engine(ModelConfig.tiny(), weights).close()



POLICY = ModelConfig.tiny(obs_dim=10, action_dim=4)


def test_policy_step_turns_one_observation_into_one_action_at_a_boundary():
    a, b = Engine.from_config(POLICY), Engine.from_config(POLICY)
    obs = torch.linspace(-1, 1, 10)
    actions = [a.step(obs * (i + 1)) for i in range(3)]
    assert all(act.shape == (4,) and torch.isfinite(act).all() for act in actions)
    assert not torch.equal(actions[0], actions[1])  # the state moved on
    assert a.position == 3
    assert a.arena["meta.tokens"][:3, 0].tolist() == [-1, -1, -1]
    assert torch.equal(a.arena["meta.observations"][2], obs * 3)
    replay = [b.step(obs * (i + 1)) for i in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(actions, replay))


def test_returned_logits_and_actions_are_the_callers_to_change_in_place():
    engine = Engine.from_config(POLICY)
    logits = engine.prefill([1, 2, 3])
    expected = logits / 0.7
    assert torch.equal(logits.div_(0.7), expected)       # temperature, in place
    assert engine.logits().add_(1.0).shape == logits.shape
    assert engine.step([0.5] * 10).mul_(2.0).shape == (4,)


def test_policy_steps_and_tokens_share_one_backbone_state():
    engine = Engine.from_config(POLICY)
    engine.prefill(PROMPT)
    engine.step(torch.zeros(10))
    assert len(engine.generate(4)) == 4 and engine.position == len(PROMPT) + 5


@pytest.mark.parametrize("obs, words", [([0.0] * 9, "obs_dim=10"), ([float("nan")] * 10, "NaN"),
                                        ([["x"]], "vector of numbers"),
                                        (torch.zeros(2, 5), "1-D"), (torch.zeros(10, dtype=torch.complex64), "real"),
                                        ([True] * 10, "real numbers"), ([1e300] + [0.0] * 9, "float32's range")])
def test_bad_observation_is_refused_without_a_step(obs, words):
    engine = Engine.from_config(POLICY)
    before = engine.state_digest()
    with pytest.raises(InvalidArgument, match=words):
        engine.step(obs)
    assert engine.state_digest() == before and engine.position == 0


@pytest.mark.parametrize("fixed_shapes", [False, True])
def test_an_observation_that_overflows_inside_the_model_is_undone_and_refused(fixed_shapes):
    """3.4e38 is finite, so it passes the input check, but it overflows in the projector;
    kept, it would make every later action NaN. Fixed-shape decode reads (and masks) the
    rows past the position too: the undone step's rows must not hold NaN either."""
    engine = Engine.from_config(POLICY, static_shapes=fixed_shapes)
    reference = Engine.from_config(POLICY, static_shapes=fixed_shapes)
    obs = torch.linspace(-1, 1, 10)
    engine.step(obs)
    reference.step(obs)
    before = engine.state_digest()
    with pytest.raises(InvalidArgument, match="NaN or infinity; the step was undone"):
        engine.step(torch.full((10,), 3.4e38))
    assert engine.state_digest() == before and engine.position == 1
    engine.rollback(1)   # the undone step's row is now ahead of the next one, masked, not overwritten
    reference.rollback(1)
    assert torch.equal(engine.step(obs * 2), reference.step(obs * 2))
    assert engine.generate(2) == reference.generate(2)
    assert engine.state_digest() == reference.state_digest()


def test_a_refused_step_costs_no_rollback_history():
    engine = Engine.from_config(POLICY, rollback_depth=3)
    obs = torch.linspace(-1, 1, 10)
    for i in range(3):
        engine.step(obs * (i + 1))
    with pytest.raises(InvalidArgument, match="undone"):
        engine.step(torch.full((10,), 3.4e38))
    assert engine.rollback(3) == 0   # all three steps back are still kept


def test_an_engine_refused_for_memory_leaves_no_digest_thread_behind():
    import threading

    def digest_threads() -> set:
        return {t for t in threading.enumerate() if t.name == "capsule-digest"}

    # Threads, not a count: earlier tests' engines may be collected (their threads end) meanwhile.
    before = digest_threads()
    for _ in range(2):
        with pytest.raises(InvalidArgument, match="does not fit"):
            Engine.from_config(ModelConfig.tiny(), rollback_depth=10**9)   # the ring, built after the store
    assert not digest_threads() - before


class _Interrupt(BaseException):
    """Stands in for Ctrl-C (or a fault) part-way through a commit."""


def _interrupt_after(engine, method: str, calls: int, monkeypatch) -> None:
    real, seen = getattr(engine.model, method), [0]

    def flaky(*args, **kwargs):
        seen[0] += 1
        if seen[0] > calls:
            raise _Interrupt
        return real(*args, **kwargs)
    monkeypatch.setattr(engine.model, method, flaky)


@pytest.mark.parametrize("what", ["second chunk of a prompt", "third layer of a decode step",
                                  "third layer of a policy step"])
def test_a_commit_interrupted_part_way_leaves_the_state_of_the_last_boundary(what, monkeypatch):
    """The first chunk of a prompt, or the first layers of a step, change the state before
    the fault: the commit is undone whole, and rollback still finds every position."""
    policy = "policy" in what
    engine = Engine.from_config(POLICY if policy else ModelConfig.tiny(), prefill_chunk=4)
    reference = Engine.from_config(POLICY if policy else ModelConfig.tiny(), prefill_chunk=4)
    for e in (engine, reference):
        e.prefill(PROMPT[:3])
    before = engine.state_digest()
    if what.startswith("second chunk"):
        _interrupt_after(engine, "prefill", 1, monkeypatch)
        call = lambda: engine.prefill(PROMPT[3:12])   # noqa: E731
    else:
        _interrupt_after(engine, "_block_forward", 2, monkeypatch)
        call = (lambda: engine.step(torch.ones(10))) if policy else (lambda: engine.generate(1))
    with pytest.raises(_Interrupt):
        call()
    monkeypatch.undo()
    assert engine.position == 3 and engine.state_digest() == before
    engine.prefill(PROMPT[3:12])
    reference.prefill(PROMPT[3:12])
    assert engine.rollback(to_position=5) == 5 and reference.rollback(to_position=5) == 5
    assert engine.state_digest() == reference.state_digest()
    assert engine.generate(4) == reference.generate(4)


def test_an_engine_used_as_a_context_manager_stops_its_digest_thread_on_exit():
    with Engine.from_config(ModelConfig.tiny()) as engine:
        engine.prefill(PROMPT)
        capsule = engine.snapshot()
        assert engine.capsules.get(capsule.id).digest
        assert engine.capsules.digests.alive
    assert not engine.capsules.digests.alive


def test_numpy_integers_are_ints_and_bools_are_not_token_ids():
    import numpy as np

    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=np.int64(64))
    engine.prefill(np.array([1, 2, 3]))
    assert len(engine.generate(np.int64(2))) == 2
    assert engine.rollback(steps=np.int32(1)) == 4 and engine.rollback(to_position=np.int64(3)) == 3
    before = engine.state_digest()
    with pytest.raises(InvalidArgument, match="bool"):
        engine.prefill([True, 2])
    with pytest.raises(InvalidArgument):
        engine.generate(True)
    assert engine.state_digest() == before


def test_a_restore_or_rollback_between_two_tokens_stops_a_stream_there():
    """A stream extends the state it started from; once another call replaces that state,
    it stops with Preempted instead of going on from a state it did not build."""
    from flashrt_ros.errors import Preempted

    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=256)
    engine.prefill(list(b"go to the door"))
    start = engine.snapshot()
    for replace in (lambda: engine.restore(start), lambda: engine.rollback(steps=1),
                    lambda: engine.rollback(to_position=start.position), engine.reset):
        engine.restore(start)
        stream = engine.stream(6)
        made = [next(stream), next(stream)]
        replace()
        position, digest = engine.position, engine.state_digest()
        with pytest.raises(Preempted, match="after 2 of 6 tokens") as info:
            made += list(stream)
        assert info.value.code == ErrorCode.PREEMPTED and len(made) == 2
        assert engine.position == position and engine.state_digest() == digest   # nothing more committed

    # What extends the state, or leaves it as it was, does not stop a stream.
    engine.restore(start)
    stream = engine.stream(4)
    made = [next(stream)]
    engine.snapshot()
    engine.rollback(steps=0)
    engine.rollback(to_position=engine.position)
    made += list(stream)
    engine.restore(start)
    assert made == engine.generate(4)

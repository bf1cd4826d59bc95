"""A captured CUDA graph replays over the addresses it was captured with: every tensor the model,
its blocks and the decoder hold must keep its storage through whatever the engine does, the
values written in place. Checked on a CPU engine at fixed shapes (what the graphs run): every
tensor reachable from them, by attribute path, before and after prefill, every kind of decode,
speculative passes, a policy step, snapshot, restore, rollback, fork, append and reset."""
from __future__ import annotations

import torch

from flashrt_ros.runtime import Engine, ModelConfig


def _addresses(obj: object, path: str, out: dict[str, int], seen: set[int]) -> dict[str, int]:
    """The data pointer of every tensor reachable from ``obj`` through the package's own
    objects (attributes, lists, tuples, dicts), by path."""
    if isinstance(obj, torch.Tensor):
        out[path] = obj.data_ptr()
        return out
    if id(obj) in seen:
        return out
    seen.add(id(obj))
    if isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            _addresses(item, f"{path}[{i}]", out, seen)
    elif isinstance(obj, dict):
        for key, item in obj.items():
            _addresses(item, f"{path}[{key!r}]", out, seen)
    elif type(obj).__module__.startswith("flashrt_ros.runtime"):
        slots = [name for cls in type(obj).__mro__ for name in getattr(cls, "__slots__", ())]
        for name in [*getattr(obj, "__dict__", {}), *slots]:
            if hasattr(obj, name):
                _addresses(getattr(obj, name), f"{path}.{name}", out, seen)
    return out


def _held(engine: Engine) -> dict[str, int]:
    seen: set[int] = set()
    out: dict[str, int] = {}
    for name in ("model", "decoder", "arena"):
        _addresses(getattr(engine, name), name, out, seen)
    return out


def _moved(engine: Engine) -> list[str]:
    """The paths whose tensor another storage holds after every kind of engine call."""
    before = _held(engine)
    assert len(before) > 100 and "decoder._verify_in" in before and "model.temperature" in before
    engine.prefill(list(range(1, 17)))
    start = engine.snapshot(name="start")
    engine.generate(4)
    engine.generate(4, temperature=0.7, seed=3)
    engine.generate(4, temperature=0.7, top_k=5, top_p=0.9)
    engine.generate(8, speculative=3)
    engine.step(torch.ones(engine.config.obs_dim))
    engine.rollback(steps=2)
    engine.restore(start)
    engine.restore(engine.fork(start))
    engine.append(7)
    engine.reset()
    after = _held(engine)
    assert set(after) == set(before), sorted(set(after) ^ set(before))[:10]
    return sorted(p for p in before if after[p] != before[p])


def _engine() -> Engine:
    # Fixed shapes on torch's products: what a GPU's graphs run.
    return Engine.from_config(ModelConfig.tiny(obs_dim=6, action_dim=3), max_seq_len=128, static_shapes=True,
                              cpu_kernels=False)


def test_no_tensor_a_graph_reads_moves_whatever_the_engine_does():
    assert _moved(_engine()) == []


def test_a_setting_rebound_rather_than_written_in_place_is_caught():
    engine = _engine()
    model = engine.model
    model.use_sampling = lambda how: setattr(model, "temperature", torch.full_like(model.temperature, how.temperature))
    assert _moved(engine) == ["model.temperature"]

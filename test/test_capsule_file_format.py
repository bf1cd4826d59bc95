"""A capsule file is a safetensors file that safetensors itself reads: one uint8 tensor of the
capsule's bytes, the capsule header as its metadata, and nothing the reader does not check."""
from __future__ import annotations

import json

from safetensors import safe_open

from flashrt_ros.capsule import diskformat
from flashrt_ros.digest import state_digest
from flashrt_ros.runtime import Engine, ModelConfig


def test_safetensors_reads_a_capsule_file_as_the_engine_wrote_it(tmp_path):
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64, capsule_dir=tmp_path)
    engine.prefill(list(range(1, 30)))
    capsule = engine.snapshot("kept", tier="disk")
    path = diskformat.path_for(tmp_path, capsule.id)
    with safe_open(str(path), framework="pt") as f:
        assert list(f.keys()) == ["state"]
        header = json.loads(f.metadata()["flashrt_capsule"])
        state = f.get_tensor("state")
    ours, data = diskformat.read(path)
    assert ours == header and header["digest"] == capsule.digest == engine.state_digest()
    assert state.dtype == data.dtype and state.numel() == data.numel() and bool((state == data).all())
    # The stored bytes are exactly what the digest covers: one pass checks all of them.
    ranges = engine.capsules.layout.ranges(capsule.position)
    assert sum(e - s for s, e in ranges) == data.numel()
    assert state_digest([(0, data.numel())], lambda s, e: data[s:e].numpy()) == capsule.digest

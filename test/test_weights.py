"""Checkpoints: single-file, sharded and multimodal layouts load; broken ones are refused by name."""
from __future__ import annotations

import gc
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashrt_ros.errors import CheckpointError, ErrorCode, NotActive
from flashrt_ros.runtime import Engine, ModelConfig
from flashrt_ros.runtime.weights import fingerprint, save_checkpoint, seeded_weights
from hf_reference import save_hf_model

CFG = ModelConfig.tiny(vocab_size=300)
PROMPT = list(range(5, 60))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("single")
    save_hf_model(CFG, seed=1, path=path)
    return path


def _continuation(engine: Engine) -> list[int]:
    engine.prefill(PROMPT)
    return engine.generate(16)


def test_sharded_checkpoint_loads_like_the_single_file(hf_dir, tmp_path):
    save_hf_model(CFG, seed=1, path=tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    single, sharded = Engine.from_pretrained(hf_dir), Engine.from_pretrained(tmp_path)
    assert single.model_fingerprint == sharded.model_fingerprint
    assert _continuation(single) == _continuation(sharded)


def test_multimodal_checkpoint_layout_is_mapped_onto_the_text_model(hf_dir, tmp_path):
    tensors = load_file(hf_dir / "model.safetensors")
    renamed = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in tensors.items()}
    renamed["model.visual.patch_embed.weight"] = torch.zeros(4, 4)
    save_file(renamed, tmp_path / "model.safetensors")
    text = json.loads((hf_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text}))
    assert _continuation(Engine.from_pretrained(tmp_path)) == _continuation(Engine.from_pretrained(hf_dir))


def test_mtp_and_policy_weights_are_loaded_when_present_and_seeded_when_absent(hf_dir, tmp_path):
    assert any(n.startswith("mtp.") for n in Engine.from_pretrained(hf_dir).seeded_weights)
    cfg = ModelConfig.tiny(obs_dim=6, action_dim=3)
    weights = seeded_weights(cfg, seed=9)
    save_checkpoint(tmp_path, cfg, weights)
    loaded = Engine.from_pretrained(tmp_path, seed=0)
    assert loaded.seeded_weights == ()
    assert loaded.model_fingerprint == Engine(cfg, weights).model_fingerprint
    assert torch.equal(loaded.step(torch.ones(6)), Engine(cfg, weights).step(torch.ones(6)))
    # policy_dims of other sizes replace the stored heads (seeded anew); the same sizes keep them.
    other = Engine.from_pretrained(tmp_path, policy_dims=(4, 2))
    assert sorted(n for n in other.seeded_weights) == sorted(n for n in weights if n.startswith("policy."))
    assert other.step(torch.ones(4)).shape == (2,)
    assert Engine.from_pretrained(tmp_path, policy_dims=(6, 3)).seeded_weights == ()


def test_fingerprint_changes_with_one_weight_element():
    weights = seeded_weights(CFG)
    before = fingerprint(CFG, weights)
    weights["model.norm.weight"][3] += 1e-3
    assert fingerprint(CFG, weights) != before


def _break_missing(path):
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.3.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors")


def _break_shape(path):
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = torch.zeros(7)
    save_file(tensors, path / "model.safetensors")


def _break_truncate(path):
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def _break_config(path):
    (path / "config.json").write_text("{not json")


def _break_no_weights(path):
    (path / "model.safetensors").unlink()


def _break_empty_index(path):
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))


def _break_folder_as_shard(path):
    (path / "zz.safetensors").mkdir()


@pytest.mark.parametrize("damage, error, words", [
    (_break_missing, CheckpointError, "k_proj"),
    (_break_empty_index, CheckpointError, "weight_map lists no shard files"),
    (_break_folder_as_shard, CheckpointError, "shard zz.safetensors is missing or not a file"),
    (_break_shape, CheckpointError, r"shape \(7,\)"),
    (_break_truncate, CheckpointError, "cannot read"),
    (_break_config, Exception, "not valid JSON"),
    (_break_no_weights, CheckpointError, "no \\*.safetensors"),
])
def test_broken_checkpoints_are_refused_with_the_reason(hf_dir, tmp_path, damage, error, words):
    for f in hf_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    damage(tmp_path)
    with pytest.raises(error, match=words) as info:
        Engine.from_pretrained(tmp_path)
    assert info.value.code in (ErrorCode.IO_ERROR, ErrorCode.INVALID_ARGUMENT)


def test_missing_folder_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="not a folder; from_pretrained reads a local folder"):
        Engine.from_pretrained(tmp_path / "Qwen" / "Qwen3.5-0.8B")   # a Hub id is not downloaded


def _copy(src, dst):
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())


def test_generation_config_stop_tokens_join_the_configs(hf_dir, tmp_path):
    """A chat release names its end-of-turn token only in generation_config.json. They stop
    generation and change no state: the model fingerprint, and every capsule and journal
    recorded before the file appeared, stay valid."""
    _copy(hf_dir, tmp_path)
    before = Engine.from_pretrained(hf_dir)
    own = before.config.eos_token_ids
    assert before.stop_token_ids == own
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [299, *own], "top_k": 20}))
    after = Engine.from_pretrained(tmp_path)
    assert after.stop_token_ids == (*own, 299)
    assert after.model_fingerprint == before.model_fingerprint and after.config == before.config
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 298}))
    assert Engine.from_pretrained(tmp_path).stop_token_ids == (*own, 298)


@pytest.mark.parametrize("content, words", [
    ("{not json", "unreadable"),
    (json.dumps({"eos_token_id": "</s>"}), "must be a token id below vocab_size=300 or a list"),
    (json.dumps({"eos_token_id": [5, True]}), "must be a token id below vocab_size=300 or a list"),
    (json.dumps({"eos_token_id": 300}), "must be a token id below vocab_size=300 or a list"),
])
def test_a_bad_generation_config_is_refused_by_name(hf_dir, tmp_path, content, words):
    _copy(hf_dir, tmp_path)
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(CheckpointError, match=words) as info:
        Engine.from_pretrained(tmp_path)
    assert "generation_config.json" in str(info.value)


def test_a_checkpoint_without_mtp_weights_warns_that_they_are_seeded(hf_dir, caplog):
    """transformers drops mtp.* on load, so a model it saved (as hf_dir is) has none."""
    with caplog.at_level("WARNING", logger="flashrt_ros.runtime.weights"):
        engine = Engine.from_pretrained(hf_dir)
    assert any(n.startswith("mtp.") for n in engine.seeded_weights)
    assert any(r.levelname == "WARNING" and "no mtp.* weights" in r.getMessage() for r in caplog.records)


def test_weights_equal_only_once_cast_to_the_compute_dtype_are_another_model():
    """The model keeps norms, A_log and dt_bias in fp32 even in bf16: a checkpoint that
    differs from another only below bf16 resolution there computes other numbers."""
    weights = seeded_weights(CFG, seed=0)
    other = {name: t.clone() for name, t in weights.items()}
    for name, t in other.items():
        if name.endswith(("norm.weight", "A_log", "dt_bias")):
            rounded = t.to(torch.bfloat16).float()
            other[name] = rounded + 0.5 * (t - rounded)   # between t and its bf16 rounding
    assert all(torch.equal(weights[n].to(torch.bfloat16), other[n].to(torch.bfloat16)) for n in weights)
    a, b = (Engine(CFG, w, dtype=torch.bfloat16, max_seq_len=32) for w in (weights, other))
    assert a.model_fingerprint != b.model_fingerprint
    assert Engine(CFG, weights, dtype=torch.bfloat16, max_seq_len=32).model_fingerprint == a.model_fingerprint
    assert Engine(CFG, weights, max_seq_len=32).model_fingerprint != a.model_fingerprint   # fp32 computes otherwise


@pytest.mark.parametrize("dims", [("a", "b"), 5, (2.7, 3), (True, 2), (-1, 2)])
def test_bad_policy_dims_are_refused(tmp_path, dims):
    from flashrt_ros.errors import InvalidArgument

    save_checkpoint(tmp_path, CFG, seeded_weights(CFG))
    with pytest.raises(InvalidArgument, match="policy_dims must be"):
        Engine.from_pretrained(tmp_path, policy_dims=dims)


def test_a_tensor_stored_twice_is_refused_not_silently_replaced(tmp_path):
    from safetensors.torch import save_file

    weights = seeded_weights(CFG)
    save_checkpoint(tmp_path, CFG, weights)
    save_file({"model.norm.weight": torch.zeros_like(weights["model.norm.weight"])}, str(tmp_path / "extra.safetensors"))
    index = {"weight_map": {name: "model.safetensors" for name in weights} | {"model.norm.weight": "extra.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="stored twice"):
        Engine.from_pretrained(tmp_path)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def test_the_engine_keeps_no_part_of_the_checkpoint_file_mapped(tmp_path):
    """Every model tensor is the model's own copy: a tensor handed through from the file's memory
    map (dt_bias was one: fp32 float() and to() return it as it is) kept the whole file mapped,
    and resident, for as long as the engine lived."""
    save_checkpoint(tmp_path, CFG, seeded_weights(CFG, seed=3))
    engine = Engine.from_pretrained(tmp_path)
    gc.collect()
    mapped = [line for line in Path("/proc/self/maps").read_text().splitlines() if str(tmp_path) in line]
    assert not mapped, mapped
    assert engine.prefill(PROMPT).shape == (CFG.vocab_size,)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="torch's x86 kernel levels")
def test_seeded_weights_are_the_same_bytes_at_every_kernel_level_and_thread_count():
    # torch.randn, which drew them before, gave other bytes at the DEFAULT level than at AVX2,
    # and on an Intel CPU than on an AMD one: a capsule or bag of the embedded default made on
    # one machine was foreign on another. Each level is a fresh process: torch reads it at start.
    script = ("import torch; from flashrt_ros.runtime import ModelConfig; "
              "from flashrt_ros.runtime.weights import fingerprint, seeded_weights; "
              "cfg = ModelConfig.tiny(obs_dim=23, action_dim=7); "
              "print(torch.backends.cpu.get_cpu_capability(), fingerprint(cfg, seeded_weights(cfg, 0)))")
    seen = []
    for level, threads in (("default", "1"), ("avx2", "2"), ("avx512", "1")):   # a level the CPU lacks: DEFAULT
        env = {**os.environ, "ATEN_CPU_CAPABILITY": level, "OMP_NUM_THREADS": threads}
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        seen.append(out.stdout.split())   # [level torch runs at, fingerprint]
    cfg = ModelConfig.tiny(obs_dim=23, action_dim=7)
    assert seen[0][0] == "DEFAULT"
    assert {digest for _, digest in seen} == {fingerprint(cfg, seeded_weights(cfg, 0))}


@pytest.mark.parametrize("cfg", [ModelConfig.tiny(), ModelConfig.tiny(obs_dim=4, action_dim=2)], ids=["lm", "policy"])
def test_a_closed_engine_frees_its_weights_with_its_last_reference_not_at_a_later_collection(cfg):
    import weakref

    gc.collect()
    gc.disable()   # what frees the weights must be the references, not a collector's pass
    try:
        engine = Engine.from_config(cfg, max_seq_len=64)
        if cfg.policy:
            engine.step(torch.zeros(cfg.obs_dim))
        else:
            engine.prefill([1, 2, 3])
            engine.generate(4, speculative=2)
        weight = weakref.ref(engine.model.lm_head.w)
        engine.close()
        with pytest.raises(NotActive, match="closed"):   # a late call is refused, by name
            engine.step(torch.zeros(cfg.obs_dim)) if cfg.policy else engine.generate(1)
        del engine
        assert weight() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_large_matrix_transposed_in_stripes_on_threads_is_the_plain_transpose(monkeypatch, threads):
    from flashrt_ros.runtime.backends.cpu import transpose_cast
    from flashrt_ros.runtime.models import cast
    monkeypatch.setattr(cast, "_STRIPED", 0)           # every matrix striped, in stripes of 7 rows
    monkeypatch.setattr(cast, "_STRIPE_BYTES", 7 * 96 * 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    parts = [torch.randn(40, 96).to(torch.bfloat16), torch.randn(25, 96).to(torch.bfloat16)]
    with transpose_cast.disabled():   # torch's copies, as where the package's library is not built
        fused = cast.Cast(torch.device("cpu"), torch.float32).t(*parts)
    assert fused.shape == (96, 65) and fused.is_contiguous()
    assert torch.equal(fused, torch.cat(parts).t().float())

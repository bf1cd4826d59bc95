"""ModelConfig: the embedded sizes, Hugging Face config parsing, and clear refusals."""
from __future__ import annotations

import json

import pytest

from flashrt_ros.errors import InvalidArgument
from flashrt_ros.runtime import ModelConfig
from flashrt_ros.runtime.weights import expected_shapes


def _params(cfg: ModelConfig) -> int:
    total = 0
    for shape in expected_shapes(cfg).values():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def test_tiny_default_is_a_few_megabytes_and_bench_about_60m_parameters():
    assert _params(ModelConfig.tiny()) * 4 < 8 * 2**20
    bench = ModelConfig.bench()
    assert 50e6 < _params(bench) < 70e6
    assert bench.hidden_size == 512 and bench.num_hidden_layers == 8
    assert bench.layer_types.count("linear_attention") == 3 * bench.layer_types.count("full_attention")


def test_hf_config_roundtrips():
    cfg = ModelConfig.tiny(tie_word_embeddings=True, obs_dim=3, action_dim=2)
    assert ModelConfig.from_hf_config(json.loads(json.dumps(cfg.to_hf_config()))) == cfg


def test_multimodal_qwen3_5_config_is_read_through_its_text_config():
    text = ModelConfig.tiny().to_hf_config()
    outer = {"model_type": "qwen3_5", "text_config": text, "vision_config": {"depth": 2}}
    assert ModelConfig.from_hf_config(outer) == ModelConfig.from_hf_config(text)


def test_layer_types_default_to_one_full_layer_in_four():
    raw = ModelConfig.tiny().to_hf_config()
    del raw["layer_types"]
    raw["num_hidden_layers"] = 8
    cfg = ModelConfig.from_hf_config(raw)
    assert cfg.full_layers == (3, 7)


def test_qwen3_next_is_refused_until_supported():
    raw = ModelConfig.tiny().to_hf_config() | {"model_type": "qwen3_next"}
    with pytest.raises(InvalidArgument, match="not supported yet"):
        ModelConfig.from_hf_config(raw)


MOE = ModelConfig.tiny(intermediate_size=0, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                       shared_expert_intermediate_size=64)


def test_moe_config_roundtrips_alone_and_inside_a_multimodal_config():
    text = json.loads(json.dumps(MOE.to_hf_config()))
    assert text["model_type"] == "qwen3_5_moe_text" and "intermediate_size" not in text
    assert ModelConfig.from_hf_config(text) == MOE
    outer = {"model_type": "qwen3_5_moe", "text_config": text | {"intermediate_size": 999},   # unused there
             "vision_config": {"depth": 2}}
    assert ModelConfig.from_hf_config(outer) == MOE


def test_moe_config_reads_as_transformers_reads_it():
    from transformers import Qwen3_5MoeTextConfig

    hf = Qwen3_5MoeTextConfig(**{k: v for k, v in MOE.to_hf_config().items() if k != "mtp_num_hidden_layers"})
    assert ModelConfig.from_hf_config(hf.to_dict() | {"mtp_num_hidden_layers": 1}) == MOE


def test_a_dense_models_fingerprint_does_not_name_the_expert_fields():
    """The expert fields came after dense capsules were made: a dense config hashes as it did."""
    assert ModelConfig.tiny().fingerprint() == "79c44a20fd374cc0fc5ea6612ee7977d"
    assert MOE.fingerprint() != ModelConfig.tiny().fingerprint()


@pytest.mark.parametrize("change, words", [
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok=9 must be in \[1, num_experts=8\]"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok=0 must be in"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size must be > 0"),
    ({"shared_expert_intermediate_size": -1}, "shared_expert_intermediate_size must be an int >= 0"),
    ({"norm_topk_prob": False}, "norm_topk_prob=False is not supported"),
    ({"num_experts": None}, "must be an int >= 0"),
])
def test_bad_moe_configs_name_the_problem(change, words):
    with pytest.raises(InvalidArgument, match=words):
        ModelConfig.from_hf_config(MOE.to_hf_config() | change)


@pytest.mark.parametrize("missing", ["num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                     "shared_expert_intermediate_size"])
def test_an_moe_config_without_an_expert_size_is_refused_by_name(missing):
    raw = MOE.to_hf_config()
    del raw[missing]
    with pytest.raises(InvalidArgument, match=missing):
        ModelConfig.from_hf_config(raw)


def test_dense_and_moe_ffn_fields_do_not_mix():
    with pytest.raises(InvalidArgument, match="intermediate_size must be 0"):
        ModelConfig.tiny(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48)
    with pytest.raises(InvalidArgument, match="a dense model"):
        ModelConfig.tiny(moe_intermediate_size=48)


@pytest.mark.parametrize("change, words", [
    ({"model_type": "llama"}, "unsupported model_type 'llama'"),
    ({"num_hidden_layers": 7}, "layer_types lists 4"),
    ({"num_attention_heads": 3}, "not a multiple"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type 'yarn'"),
    ({"hidden_size": -4}, "positive int"),
    ({"layer_types": ["linear_attention", "mamba"], "num_hidden_layers": 2}, "unknown layer types"),
    ({"obs_dim": 4}, "policy mode"),
    ({"full_attention_interval": 0, "layer_types": None}, "full_attention_interval must be a positive int"),
    ({"full_attention_interval": 4.9, "layer_types": None}, "full_attention_interval must be a positive int"),
    ({"num_hidden_layers": True, "layer_types": None}, "num_hidden_layers must be a positive int"),
    ({"eos_token_id": True}, "eos_token_ids must be token ids"),    # would be token 1
    ({"eos_token_id": 1.7}, "eos_token_ids must be token ids"),
    ({"rms_norm_eps": "abc"}, "malformed config: ValueError"),
    ({"rope_parameters": [1]}, "malformed config: AttributeError"),
    ({"layer_types": 5}, "malformed config: TypeError"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantized checkpoints"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),   # would tie
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number > 0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0.0}}, "rope_theta must be a finite number > 0"),
    ({"obs_dim": 2.5, "action_dim": 2}, "obs_dim must be an int"),
    ({"eos_token_id": [1, "x"]}, "eos_token_ids must be token ids"),
    # The MTP layer would read the shared embedding, and the dedicated one be dropped unseen.
    ({"mtp_use_dedicated_embeddings": True}, "mtp_use_dedicated_embeddings=true is not supported"),
])
def test_bad_configs_name_the_problem(change, words):
    raw = ModelConfig.tiny().to_hf_config() | change
    with pytest.raises(InvalidArgument, match=words):
        ModelConfig.from_hf_config(raw)


def test_missing_required_field_is_named():
    raw = ModelConfig.tiny().to_hf_config()
    del raw["intermediate_size"]
    with pytest.raises(InvalidArgument, match="intermediate_size"):
        ModelConfig.from_hf_config(raw)


def test_fields_left_out_take_the_defaults_transformers_gives_them():
    from transformers import Qwen3_5TextConfig

    raw = ModelConfig.tiny().to_hf_config()
    omitted = ("num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
               "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")
    raw = {k: v for k, v in raw.items() if k not in omitted}
    ours, theirs = ModelConfig.from_hf_config(raw), Qwen3_5TextConfig(**raw)
    assert {k: getattr(ours, k) for k in omitted} == {k: getattr(theirs, k) for k in omitted}

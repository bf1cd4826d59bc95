"""Tokenizers: the byte-level default, and a checkpoint's tokenizer.json with the turn end its config names."""
from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from flashrt_ros.errors import CheckpointError
from flashrt_ros.runtime.tokenizer import EOS, ByteTokenizer, load_tokenizer

VOCAB = {"<unk>": 0, "<|endoftext|>": 1, "<|im_end|>": 2, "hello": 3, "robot": 4}


@pytest.fixture
def folder(tmp_path):
    tok = Tokenizer(WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens(["<|endoftext|>", "<|im_end|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_the_default_is_byte_level_and_needs_no_files():
    tok = load_tokenizer("")
    assert isinstance(tok, ByteTokenizer) and tok.eos_id == EOS
    assert tok.decode(tok.encode("grüß")) == "grüß"


def test_a_checkpoint_without_tokenizer_json_takes_token_ids_only(tmp_path):
    assert load_tokenizer(tmp_path) is None


@pytest.mark.parametrize("eos", ["<|im_end|>", {"content": "<|im_end|>", "special": True}])
def test_the_tokenizer_configs_eos_token_is_a_stop_token(folder, eos):
    """A chat release's config.json names <|endoftext|>; its turns end with <|im_end|>."""
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    tok = load_tokenizer(folder)
    assert tok.eos_id == 2
    assert tok.encode("hello robot") == [3, 4]
    assert tok.decode([3, 4, 2]) == "hello robot"   # special tokens are not text


def test_without_a_tokenizer_config_the_checkpoint_config_decides(folder):
    assert load_tokenizer(folder).eos_id is None
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|not-in-vocab|>"}))
    assert load_tokenizer(folder).eos_id is None


@pytest.mark.parametrize("content", ["{broken", "[1, 2]"])
def test_an_unreadable_tokenizer_config_is_refused_by_name(folder, content):
    (folder / "tokenizer_config.json").write_text(content)
    with pytest.raises(CheckpointError, match="tokenizer_config.json: unreadable"):
        load_tokenizer(folder)

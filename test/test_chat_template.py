"""A checkpoint's chat template: rendered as transformers renders it, refusals with the template's own message."""
from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from flashrt_ros.errors import ErrorCode, InvalidArgument
from flashrt_ros.runtime.chat import TEMPLATE_FILE
from flashrt_ros.runtime.tokenizer import load_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The form of Qwen3.5's template, written here: a default system turn when none is given, each
# turn between <|im_start|> and <|im_end|>, the assistant's opened at the end. A role it does
# not know is refused with the template's own message.
QWEN_FORM = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful robot.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('unknown role ' ~ message['role'] ~ ': the template takes system, user, assistant, tool') }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- '' if eos_token == '<|im_end|>' else raise_exception('eos_token is not passed to the template') }}")
CHAT = [{"role": "user", "content": "pick the red cube"},
        {"role": "assistant", "content": "picked. grüße"},
        {"role": "user", "content": "now place it on the tray"}]


def _checkpoint_tokenizer(folder, template_in_config: bool = True, template: str = QWEN_FORM):
    """A byte-level BPE trained here on a few lines, with the chat's special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # 256 bytes, the specials and one merge: every id below the tiny model's vocabulary of 260.
    trainer = trainers.BpeTrainer(vocab_size=260, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["pick the red cube", "place it on the tray", "system user assistant"], trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    if template_in_config or not isinstance(template, str):
        config["chat_template"] = template
    else:
        (folder / TEMPLATE_FILE).write_text(template)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _transformers_ids(folder, messages) -> list[int]:
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast.from_pretrained(str(folder))
    ids = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("in_config", [True, False], ids=["tokenizer_config", "chat_template.jinja"])
def test_a_chat_renders_to_the_ids_transformers_gives(tmp_path, in_config):
    folder = _checkpoint_tokenizer(tmp_path, template_in_config=in_config)
    tok = load_tokenizer(folder)
    ids = tok.encode_chat(CHAT)
    assert ids == _transformers_ids(folder, CHAT)
    text = tok.chat_template.render(CHAT)
    assert text.startswith("<|im_start|>system\nYou are a helpful robot.<|im_end|>\n<|im_start|>user\n")
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # The template's special tokens are single ids, not their characters.
    assert ids.count(tok._tok.token_to_id("<|im_start|>")) == 5


def test_a_template_that_raises_answers_with_its_message(tmp_path):
    tok = load_tokenizer(_checkpoint_tokenizer(tmp_path))
    with pytest.raises(InvalidArgument, match="unknown role robot: the template takes"):
        tok.encode_chat([{"role": "robot", "content": "hi"}])


@pytest.mark.parametrize("messages, why", [([], "at least one message"), ([{"content": "hi"}], "has no role"),
                                           ([{"role": "user"}], "has no text content")])
def test_malformed_messages_are_refused_before_the_template_runs(tmp_path, messages, why):
    tok = load_tokenizer(_checkpoint_tokenizer(tmp_path))
    with pytest.raises(InvalidArgument, match=why):
        tok.encode_chat(messages)


def test_the_template_runs_in_a_sandbox(tmp_path):
    """A template is the checkpoint author's code: it cannot reach the process."""
    template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = load_tokenizer(_checkpoint_tokenizer(tmp_path, template=template))
    with pytest.raises(InvalidArgument, match="chat template"):
        tok.encode_chat(CHAT)


def test_a_template_that_does_not_compile_refuses_chats_and_prompts_still_work(tmp_path):
    tok = load_tokenizer(_checkpoint_tokenizer(tmp_path, template="{% for %}"))
    with pytest.raises(InvalidArgument, match="does not compile"):
        tok.encode_chat(CHAT)
    assert tok.encode("pick the red cube")


def test_a_generation_block_renders_its_body(tmp_path):
    """transformers' training-mask tag: a template that uses it renders as transformers renders it."""
    template = ("{%- for m in messages %}{%- if m['role'] == 'assistant' %}{% generation %}"
                "{{ m['content'] }}{% endgeneration %}{%- else %}{{ m['content'] }}{%- endif %}{%- endfor %}")
    folder = _checkpoint_tokenizer(tmp_path, template=template)
    assert load_tokenizer(folder).encode_chat(CHAT) == _transformers_ids(folder, CHAT)


def test_without_a_template_a_chat_is_refused_and_a_prompt_still_works(tmp_path):
    folder = _checkpoint_tokenizer(tmp_path)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(folder)
    with pytest.raises(InvalidArgument, match="no chat template"):
        tok.encode_chat(CHAT)
    assert tok.encode("pick the red cube")
    with pytest.raises(InvalidArgument, match="embedded default has no chat template"):
        load_tokenizer("").encode_chat(CHAT)


def test_of_named_templates_the_default_is_taken(tmp_path):
    named = [{"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
             {"name": "default", "template": "{{ messages[0]['content'] }}"}]
    tok = load_tokenizer(_checkpoint_tokenizer(tmp_path, template=named))
    assert tok.chat_template.render([{"role": "user", "content": "hi"}]) == "hi"


def test_a_generate_goal_takes_chat_messages_over_dds(ros_context, tmp_path):
    """The goal's messages rendered by the checkpoint's template: the same tokens as the goal
    of their ids; a message the template refuses fails the goal and leaves the state alone."""
    pytest.importorskip("rclpy")
    from flashrt_ros.msg import ChatMessage
    from flashrt_ros.runtime import ModelConfig
    from flashrt_ros.runtime.weights import save_checkpoint, seeded_weights
    from ros_harness import Harness, wait_future

    cfg = ModelConfig.tiny()
    save_checkpoint(tmp_path, cfg, seeded_weights(cfg, seed=3))
    tok = load_tokenizer(_checkpoint_tokenizer(tmp_path))
    h = Harness(ros_context, {"model_path": str(tmp_path)})
    try:
        from flashrt_ros.action import Generate

        def run(**fields):
            assert h.generate_client.wait_for_server(timeout_sec=10)
            handle = wait_future(h.generate_client.send_goal_async(Generate.Goal(max_new_tokens=6, **fields)), 60)
            return wait_future(handle.get_result_async(), 60).result

        mark = h.call("snapshot", lease_s=0.0)
        chat = [ChatMessage(role=m["role"], content=m["content"]) for m in CHAT]
        by_messages = run(messages=chat)
        assert by_messages.success, by_messages.message
        assert h.call("restore", capsule_id=mark.capsule_id).success
        by_ids = run(token_ids=tok.encode_chat(CHAT))
        assert by_ids.success and list(by_ids.tokens) == list(by_messages.tokens)
        assert by_ids.position == by_messages.position

        refused = run(messages=[ChatMessage(role="robot", content="hello")])
        assert not refused.success and refused.error_code == ErrorCode.INVALID_ARGUMENT
        assert "unknown role robot" in refused.message and refused.position == by_ids.position
        both = run(messages=chat, prompt="and a prompt")
        assert not both.success and both.error_code == ErrorCode.INVALID_ARGUMENT
    finally:
        h.close()

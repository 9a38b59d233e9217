"""The one tokenization place (services/tasks/prompting.py): chat templates applied as transformers applies
them, BOS once, raw text for models without a template, the stop tokens of tokenizer, generation
config and template, pad = EOS where a model has none, and one clear line for a template that
cannot be applied. (A real BPE model with its own template: tests/engines/test_real_model.py.)"""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from threepo.services.errors import UserInputError
from threepo.services.model.tokenizer import build_tokenizer
from threepo.services.tasks.prompting import (BOXED_INSTRUCTION, CODE_INSTRUCTION, PromptConfig, PromptEncoder,
                                              generation_eos)

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NO_SYSTEM = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
             "{{ raise_exception('System role not supported') }}{% endif %}"
             "[{{ m['role'] }}]{{ m['content'] }}<end_of_turn>{% endfor %}"
             "{% if add_generation_prompt %}[assistant]{% endif %}")


def _chat_tokenizer(template: str = CHATML, bos: bool = False):
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<end_of_turn>", "<s>"]})
    if bos:
        tok.bos_token = "<s>"
    tok.chat_template = template
    return tok


def test_a_tokenizer_without_a_template_reads_raw_text():
    tok = build_tokenizer()
    enc = PromptEncoder(tok, PromptConfig())
    assert not enc.templated and enc.text("Q: 1+2= A: ") == "Q: 1+2= A: "  # auto: no instruction either
    assert enc.encode("Q: 1+2= A: ") == tuple(tok("Q: 1+2= A: ", add_special_tokens=False)["input_ids"])
    assert enc.stop_ids == (tok.eos_token_id,) and enc.pad_id == tok.pad_token_id


def test_the_chat_template_is_applied_as_transformers_applies_it_with_the_instruction():
    tok = _chat_tokenizer()
    enc = PromptEncoder(tok, PromptConfig(system="be brief"))
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": f"What is 2+3?\n\n{BOXED_INSTRUCTION}"}]
    want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert list(enc.encode("What is 2+3?")) == want
    assert enc.text("What is 2+3?").endswith("<|im_start|>assistant\n")
    assert "boxed" not in enc.text("reach 10 with 2 5", verifier="countdown")  # auto: math items only
    assert enc.messages("def f(x):", verifier="code_tests")[-1]["content"] == f"def f(x):\n\n{CODE_INSTRUCTION}"
    assert "boxed" not in PromptEncoder(tok, PromptConfig(instruction="")).text("x")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert enc.stop_ids == (tok.eos_token_id, im_end)  # the template's end of turn stops a completion


def test_bos_comes_once_where_the_template_puts_it():
    tok = _chat_tokenizer(NO_SYSTEM, bos=True)
    bos = tok.bos_token_id
    ids = PromptEncoder(tok, PromptConfig()).encode("hi")
    assert ids[0] == bos and ids.count(bos) == 1
    assert PromptEncoder(tok, PromptConfig()).stop_ids[-1] == tok.convert_tokens_to_ids("<end_of_turn>")


def test_raw_text_gets_the_tokenizers_own_bos_but_never_an_eos():
    tok = build_tokenizer()
    tok.add_special_tokens({"bos_token": "<s>"})
    core = tok.backend_tokenizer
    core.post_processor = processors.TemplateProcessing(  # a base model's post-processor: BOS ... EOS
        single="<s> $A <eos>", special_tokens=[("<s>", tok.bos_token_id), ("<eos>", tok.eos_token_id)])
    ids = PromptEncoder(tok, PromptConfig(template="none")).encode("ab")
    assert ids == (tok.bos_token_id, *tok("ab", add_special_tokens=False)["input_ids"])


def test_a_template_that_cannot_take_a_system_message_is_one_line_naming_the_key():
    enc = PromptEncoder(_chat_tokenizer(NO_SYSTEM, bos=True), PromptConfig(system="be brief"), source="model m")
    with pytest.raises(UserInputError, match=r"prompt.template='auto': the chat template of model m cannot be "
                                             r"applied with a system message \(prompt.system\): System role not"):
        enc.check()


def test_a_template_file_replaces_the_models_and_a_missing_one_is_named(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(NO_SYSTEM)
    enc = PromptEncoder(_chat_tokenizer(CHATML), PromptConfig(template=str(path), instruction=""))
    assert enc.text("hi") == "[user]hi<end_of_turn>[assistant]"
    with pytest.raises(UserInputError, match="prompt.template='/no/such.jinja': no such file"):
        PromptConfig(template="/no/such.jinja")


def test_stops_include_the_generation_configs_and_pad_falls_back_to_eos(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 9]}))
    assert generation_eos(str(tmp_path)) == (1, 9) and generation_eos(str(tmp_path / "none")) == ()
    core = Tokenizer(models.WordLevel({"a": 0, "b": 1, "</s>": 2}, unk_token="a"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>")  # no pad token
    enc = PromptEncoder(tok, PromptConfig(), generation_eos=(2, 1))
    assert enc.stop_ids == (2, 1) and enc.pad_id == 2

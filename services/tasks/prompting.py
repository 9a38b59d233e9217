"""Prompts as token ids: the one place where a task item's text becomes what a model is asked, and
where a model's stop tokens come from.

Every engine (hf, vLLM, SGLang), evaluation, the bootstrap and the benchmarks take prompt token ids
from a `PromptEncoder`; the learner trains on the ids the engine reports, so the ids a prompt
becomes are the same in every role by construction. What a prompt becomes:
- `template = "auto"` (the default): the model's chat template where its tokenizer has one (instruct
  models), applied to [system message, user message] with `add_generation_prompt`, rendered to text
  and tokenized without the tokenizer's own special tokens — exactly what
  `tokenizer.apply_chat_template(..., tokenize=True)` gives, so BOS appears once, where the template
  puts it; raw text where the tokenizer has no template (the embedded character model, base models);
- `template = "none"`: raw text, tokenized with the tokenizer's special tokens (a base model's
  tokenizer adds its BOS itself; none adds an EOS to a prompt here);
- `template = <path>`: a Jinja chat template file of the user's, applied as the model's own would be.
The user message is the item's prompt, followed by `instruction` after a blank line (`auto`: the usual
boxed-answer instruction for math-verified items and a one-code-block instruction for `code_tests`
items under a chat template, nothing otherwise: a base model reads HumanEval's prompt as code to continue).

Stop tokens: the tokenizer's EOS, every EOS of the checkpoint's `generation_config.json`, and the
chat template's end-of-turn token (the special token the template writes after an assistant turn).
Padding uses the tokenizer's pad token, or the first stop token where a model has none.

Not here: sampling (engines), the items themselves (tasks.py, datasets.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from threepo.services.errors import UserInputError

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
# What `instruction = "auto"` becomes for a GSM8K-shaped file scored by its last number (deploy/config.py):
# on SmolLM2-135M it keeps answers short (~34 tokens) and lifts greedy pass@1 (benchmarks/README.md, issue 39).
NUMBER_INSTRUCTION = "Answer briefly: give the answer as a single number at the end."
CODE_INSTRUCTION = "Write the complete Python solution in one ```python code block."
_TURN_MARK = "\u2063threepo-end-of-turn\u2063"  # a text no template changes, to find what follows a turn


@dataclass(frozen=True)
class PromptConfig:
    """How an item's text becomes the prompt a model reads (services/tasks/prompting.py)."""

    template: str = "auto"
    """`auto`: the tokenizer's chat template where it has one, raw text otherwise; `none`: raw text
    (base models); or the path of a Jinja chat template file to apply instead of the model's."""
    system: str = ""
    """System message of the chat ('' = none given: the template's own default, if it has one)."""
    instruction: str = "auto"
    """Appended to every question after a blank line. `auto`: "Please reason step by step, and put your
    final answer within \\boxed{}." for items scored by the math verifier, "Write the complete Python
    solution in one ```python code block." for `code_tests` items, when a chat template is applied;
    nothing otherwise ('' = nothing). With `data.format=gsm8k` scored by the last number (its default),
    auto is NUMBER_INSTRUCTION ("Answer briefly: give the answer as a single number at the end.")."""

    def __post_init__(self) -> None:
        if self.template not in ("auto", "none") and not os.path.isfile(self.template):
            raise UserInputError(f"prompt.template={self.template!r}: no such file; expected 'auto', 'none' "
                                 "or the path of a Jinja chat template file")


class PromptEncoder:
    """Token ids of prompts for one tokenizer (see the module docstring). `generation_eos`: the
    EOS ids of the checkpoint's generation config; `source` names the model in error messages."""

    def __init__(self, tokenizer, cfg: PromptConfig, *, generation_eos: tuple[int, ...] = (),
                 source: str = "the model") -> None:
        self.tokenizer, self.cfg, self.source = tokenizer, cfg, source
        self.chat_template = (_read(cfg.template) if cfg.template not in ("auto", "none")
                              else tokenizer.chat_template if cfg.template == "auto" else None)
        self.templated = bool(self.chat_template)
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        turn = self._end_of_turn() if self.templated else None
        stops = [*eos, *generation_eos, *([turn] if turn is not None else [])]
        self.stop_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))
        if not self.stop_ids:
            raise UserInputError(f"{source}: the tokenizer has no EOS token and the checkpoint names none in "
                                 "generation_config.json; expected at least one stop token")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        self._cache: dict[tuple[str, str], tuple[int, ...]] = {}

    @classmethod
    def from_path(cls, path: str, cfg: PromptConfig) -> PromptEncoder:
        """The encoder of the checkpoint at `path` (its tokenizer and generation config, offline)."""
        from threepo.services.model.modeling import load_tokenizer

        return cls(load_tokenizer(path), cfg, generation_eos=generation_eos(path), source=f"model {path}")

    def instruction(self, verifier: str) -> str:
        if self.cfg.instruction != "auto":
            return self.cfg.instruction
        if not self.templated:
            return ""
        return {"math": BOXED_INSTRUCTION, "code_tests": CODE_INSTRUCTION}.get(verifier, "")

    def messages(self, prompt: str, verifier: str = "math") -> list[dict]:
        """The chat an item's `prompt` (scored by `verifier`) becomes: the system message if one is
        set, then the question with its instruction (what a chat template renders; TRL takes it so)."""
        instruction = self.instruction(verifier)
        question = f"{prompt}\n\n{instruction}" if instruction else prompt
        return [*([{"role": "system", "content": self.cfg.system}] if self.cfg.system else []),
                {"role": "user", "content": question}]

    def text(self, prompt: str, verifier: str = "math") -> str:
        """What the model reads for an item's `prompt` (scored by `verifier`), as text."""
        messages = self.messages(prompt, verifier)
        return self._render(messages, add_generation_prompt=True) if self.templated else messages[-1]["content"]

    def encode(self, prompt: str, verifier: str = "math") -> tuple[int, ...]:
        """Token ids of an item's `prompt` (scored by `verifier`); cached per (prompt, verifier)."""
        key = (prompt, verifier)
        if key not in self._cache:
            ids = self.tokenizer(self.text(prompt, verifier), add_special_tokens=not self.templated)["input_ids"]
            if not self.templated and ids and ids[-1] in self.stop_ids and len(ids) > 1:
                ids = ids[:-1]  # a tokenizer whose post-processor appends EOS: a prompt never ends a turn
            self._cache[key] = tuple(ids)
        return self._cache[key]

    def check(self) -> None:
        """Raise `UserInputError` unless a prompt can be built (the template applies, with the
        system message if one is set): called before a run starts."""
        self.text("1+1=?", "math")

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except (TemplateError, ValueError, TypeError) as err:
            system = " with a system message (prompt.system)" if self.cfg.system else ""
            raise UserInputError(f"prompt.template={self.cfg.template!r}: the chat template of {self.source} "
                                 f"cannot be applied{system}: {err}; expected a template that renders a "
                                 "system and a user message (or prompt.template=none for raw text)") from None

    def _end_of_turn(self) -> int | None:
        """The special token a template writes right after an assistant turn's text, if any."""
        try:
            rendered = self._render([{"role": "user", "content": "1"}, {"role": "assistant", "content": _TURN_MARK}],
                                    add_generation_prompt=False)
        except UserInputError:
            return None
        after = rendered.partition(_TURN_MARK)[2]
        ids = self.tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
        special = set(self.tokenizer.all_special_ids) | {
            i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special}
        return ids[0] if ids and ids[0] in special else None


def generation_eos(path: str) -> tuple[int, ...]:
    """EOS ids of the checkpoint's generation_config.json (one id or a list), () if it has none."""
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return ()
    with open(file) as f:
        eos = json.load(f).get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (eos,) if isinstance(eos, int) else ()


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()

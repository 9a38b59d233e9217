"""A real pretrained model through the engines: SmolLM2-135M-Instruct (Llama, BPE vocabulary 49,152,
tied head, ChatML template, <|im_end|> as EOS and pad) on hf and on vLLM (one engine start).

The prompt ids are the model's chat template as transformers and vLLM's own chat path make them;
behaviour log-probs equal the learner's forward of the same tokens (at the mean and at a slot, T = 1
and filtered); completions stop at the template's end of turn; the hf engine serves the Llama family
on its lean decoder, C3PO's slots decoded together."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from test_conformance import Learner, _assert_matches_learner

from threepo.services.sampling.engines.base import EngineRequest, SamplerConfig
from threepo.services.tasks.prompting import BOXED_INSTRUCTION, PromptConfig, PromptEncoder
from threepo.services.wire.messages import NoiseSpec, SamplingParams

pytestmark = pytest.mark.slow  # the real SmolLM2 on every engine (the fast tier keeps the tiny models)

QUESTIONS = ("Tom has 12 apples and buys 7 more. How many apples does he have now?",
             "A box holds 6 pens. How many pens are in 3 boxes?")
CFG = dict(batch_size=16, seed=0, max_new_tokens=24)


@pytest.fixture(scope="module")
def encoder(smollm2_path):
    return PromptEncoder.from_path(smollm2_path, PromptConfig())


@pytest.fixture(scope="module")
def learner(smollm2_path):
    return Learner(smollm2_path, sigma=1e-3)  # ~1-5% of the weights' scale: a different policy, still fluent


@pytest.fixture(scope="module", params=["hf", "vllm"])
def engine(request, smollm2_path, learner):
    """The engine holding version 1 of the learner's posterior, serving the mean."""
    import conftest as engines

    backend = request.param
    reason = engines._missing(backend)
    if reason:
        pytest.skip(f"{backend}: {reason}")
    cfg = SamplerConfig(backend=backend, **CFG)
    if backend == "hf":
        from threepo.services.sampling.engines.hf import HFEngine

        eng = HFEngine(smollm2_path, cfg)
        eng.chat_ids = lambda messages: eng.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        eng.load_version(1, *learner.published())
        yield backend, eng
        return
    ray = request.getfixturevalue("ray_session")
    ray.cloudpickle.register_pickle_by_value(sys.modules[engines.__name__])
    actor = ray.remote(engines.EngineHost).options(num_cpus=0).remote(backend, smollm2_path, cfg)
    remote = engines.RemoteEngine(actor)
    remote.chat_ids = lambda messages: ray.get(actor.chat_ids.remote(messages))
    remote.load_version(1, *learner.published())
    yield backend, remote
    ray.kill(actor)


def _requests(encoder, n=2):
    return [EngineRequest(encoder.encode(q), n, 100 + i) for i, q in enumerate(QUESTIONS)]


def _params(encoder, **filters):
    return SamplingParams(max_new_tokens=12, stop_token_ids=encoder.stop_ids, **{"temperature": 1.0, **filters})


def test_prompt_ids_are_the_chat_template_on_every_engine(engine, encoder):
    _, eng = engine
    assert encoder.templated and encoder.stop_ids == (2,) and encoder.pad_id == 2
    for question in QUESTIONS:
        messages = [{"role": "user", "content": f"{question}\n\n{BOXED_INSTRUCTION}"}]
        ids = encoder.encode(question)
        assert list(ids) == eng.chat_ids(messages)
        assert ids[0] == 1 and list(ids).count(1) == 3  # <|im_start|> of system, user and assistant: no BOS twice
        assert encoder.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("seed,filters", [(None, {}), (2026, dict(temperature=0.7, top_k=20, top_p=0.9))],
                         ids=["mean T=1", "slot T=0.7,k=20,p=0.9"])
def test_behaviour_logprobs_equal_the_learners_forward(engine, learner, encoder, seed, filters):
    _, eng = engine
    report = eng.serve(NoiseSpec(1, seed))
    assert report.loaded_ok
    requests = _requests(encoder)
    outputs = eng.generate(requests, _params(encoder, **filters))
    _assert_matches_learner(learner, requests, outputs, seed, filters)


def test_completions_stop_at_the_templates_end_of_turn(engine, encoder):
    _, eng = engine
    eng.serve(NoiseSpec(1, None))
    plain = PromptEncoder(encoder.tokenizer, PromptConfig(instruction=""))  # no worked answer asked for
    samples = eng.generate([EngineRequest(plain.encode("Reply with one word: hello."), 8, 5)],
                           SamplingParams(temperature=0.7, max_new_tokens=24, stop_token_ids=encoder.stop_ids))[0]
    stopped = [s for s in samples if s.finish_reason == "stop"]
    assert stopped, [s.text for s in samples]  # a short answer ends its turn
    for s in stopped:
        assert s.token_ids[-1] == 2 and 2 not in s.token_ids[:-1] and "<|im_end|>" not in s.text
    for s in samples:
        assert len(s.token_ids) == len(s.logprobs) and (s.finish_reason == "stop" or len(s.token_ids) == 24)


def test_the_hf_engine_decodes_llama_slots_together_on_its_lean_decoder(engine, encoder):
    backend, eng = engine
    if backend != "hf":
        pytest.skip("generate_slots is the hf engine's")
    assert eng.lean and eng.slots_together
    params = _params(encoder)
    groups = [(NoiseSpec(1, seed), _requests(encoder, n=1)) for seed in (11, 12)]
    together = eng.generate_slots(groups, params)
    for (noise, requests), (report, unchanged, samples) in zip(groups, together):
        eng.serve(noise)
        alone = eng.generate(requests, params)
        assert report.loaded_ok and unchanged
        assert [[s.token_ids for s in r] for r in samples] == [[s.token_ids for s in r] for r in alone]
        for got, want in zip(samples, alone):
            np.testing.assert_allclose([s.logprobs for s in got[:1]], [s.logprobs for s in want[:1]], atol=1e-4)

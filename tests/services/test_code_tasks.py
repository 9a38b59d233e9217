"""The code task family: deterministic, disjoint splits, alphabet-clean, and every reference
program verifies as ok through the code_output verifier."""

import asyncio
import random
import shutil

import pytest

from threepo.services.model.tokenizer import CHARSET
from threepo.services.tasks.code_tasks import generate_code
from threepo.services.tasks.synthetic import expected_completion, generate_items
from threepo.services.verifiers.base import load_verifier
from threepo.services.wire.messages import VerifyRequest, VerifyStatus


def items(split, n=40, seed=0, difficulty=1):
    return generate_items("code", split, n, seed=seed, difficulty=difficulty)


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_deterministic_disjoint_and_in_the_alphabet(difficulty):
    train, held = items("train", difficulty=difficulty), items("heldout", 15, difficulty=difficulty)
    assert [i.prompt for i in train] == [i.prompt for i in items("train", difficulty=difficulty)]
    assert {i.prompt for i in train}.isdisjoint({i.prompt for i in held})
    assert [i.prompt for i in items("train", seed=1, difficulty=difficulty)] != \
        [i.prompt for i in train]
    for item in train + held:
        assert item.verifier == "code_output" and item.family == "code"
        text = item.prompt + item.answer + item.solution + expected_completion(item)
        assert set(text) <= set(CHARSET), set(text) - set(CHARSET)
        assert item.prompt.startswith("Q: ") and item.prompt.endswith(" A: ")


def test_example_item_and_bad_difficulty():
    _, item = generate_code(random.Random(3), 1)
    assert item.solution.startswith("print(") and item.answer
    with pytest.raises(ValueError, match="difficulty"):
        generate_code(random.Random(0), 4)


@pytest.mark.skipif(shutil.which("bwrap") is None,
                    reason="bubblewrap missing: apt-get install -y bubblewrap")
@pytest.mark.slow
def test_every_reference_solution_verifies_ok():
    verifier = load_verifier("code_output")
    batch = [i for d in (1, 2, 3) for split, n in (("train", 30), ("heldout", 10))
             for i in items(split, n, difficulty=d)]

    async def score_all():
        return await asyncio.gather(*[verifier.verify(VerifyRequest(i, expected_completion(i)))
                                      for i in batch])
    results = asyncio.run(score_all())
    bad = [(i.prompt, i.solution, r.details) for i, r in zip(batch, results)
           if r.status is not VerifyStatus.OK]
    assert not bad
    wrong = asyncio.run(verifier.verify(VerifyRequest(batch[0], "\\boxed{print(-1)}")))
    assert wrong.status is VerifyStatus.WRONG

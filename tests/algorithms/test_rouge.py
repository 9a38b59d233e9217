import random

import pytest
import torch

from threepo.algorithms.rouge import (
    lcs_length,
    lcs_length_dp,
    rouge_l_f1,
    rouge_l_f1_tokens,
    rouge_l_rewards,
    tokenize,
)


def test_tokenize_like_rouge_score_default():
    assert tokenize("The cat's 2 HATS!  x_y") == ["the", "cat", "s", "2", "hats", "x", "y"]
    # non-ASCII letters are separators, as in rouge-score's [^a-z0-9]+ substitution
    assert tokenize("naïve café") == ["na", "ve", "caf"]
    assert tokenize("  ...  ") == []


def test_lcs_hand_cases():
    # classic: ABCBDAB vs BDCABA -> LCS 4 (e.g. BCBA)
    assert lcs_length("ABCBDAB", "BDCABA") == 4
    assert lcs_length_dp("ABCBDAB", "BDCABA") == 4
    assert lcs_length("abc", "abc") == 3
    assert lcs_length("abc", "xyz") == 0
    assert lcs_length("", "abc") == 0 and lcs_length("abc", "") == 0
    # repeated reference tokens: aaa vs aa -> 2
    assert lcs_length("aaa", "aa") == 2 and lcs_length("aa", "aaa") == 2


def test_rouge_l_hand_case():
    # cand "the cat sat on the mat" (6), ref "the cat is on the mat" (6)
    # LCS = the cat on the mat = 5; P = R = 5/6 -> F1 = 5/6
    assert rouge_l_f1("the cat sat on the mat", "The cat is on the mat.") == pytest.approx(5 / 6)
    # cand "a b" (2), ref "a x b y z" (5): LCS 2, P = 1, R = 0.4, F1 = 2·0.4/1.4 = 0.5714...
    assert rouge_l_f1_tokens(["a", "b"], ["a", "x", "b", "y", "z"]) == pytest.approx(0.8 / 1.4)
    assert rouge_l_f1("", "abc") == 0.0 and rouge_l_f1("abc", "!!") == 0.0
    assert rouge_l_f1("x y", "z w") == 0.0


def test_bit_parallel_matches_dp_on_random_sequences():
    rng = random.Random(0)
    for _ in range(300):
        alphabet = rng.randint(1, 6)
        a = [rng.randrange(alphabet) for _ in range(rng.randint(0, 70))]
        b = [rng.randrange(alphabet) for _ in range(rng.randint(0, 70))]
        assert lcs_length(a, b) == lcs_length_dp(a, b), (a, b)
        assert lcs_length(a, b) == lcs_length(b, a)


def test_bit_parallel_long_reference_crosses_word_boundaries():
    rng = random.Random(1)
    a = [rng.randrange(20) for _ in range(300)]
    b = [rng.randrange(20) for _ in range(257)]
    assert lcs_length(a, b) == lcs_length_dp(a, b)


def test_rouge_l_rewards_group():
    ref = "x equals 4 because 2 plus 2"
    cands = ["x equals 4 because 2 plus 2", "so x equals 5", ""]
    got = rouge_l_rewards(cands, ref)
    assert got.dtype == torch.float64 and got.shape == (3,)
    expected = [rouge_l_f1(c, ref) for c in cands]
    assert got.tolist() == pytest.approx(expected)
    # identical -> 1; "so x equals 5": LCS "x equals" = 2, P = 2/4, R = 2/7 -> F1 = 4/11
    assert got[0].item() == pytest.approx(1.0)
    assert got[1].item() == pytest.approx(4 / 11)
    assert got[2].item() == 0.0

"""ROUGE-L F1 for LamPO's semantic reward R_sem (algorithms.md §4.2), without dependencies.

Tokens are the lower-cased runs of ASCII letters and digits, which is what rouge-score's default
tokenizer keeps (no stemming). The LCS length is computed with the bit-parallel algorithm of
Allison & Dix (1986) in the form of Hyyrö (2004): the reference's token positions are the bits of
one Python integer, and each candidate token costs a few big-integer operations, O(|cand|·|ref|/64)
machine words in all, so a 3000×3000-token pair takes milliseconds (benchmarks/rouge_speed.py).
`lcs_length_dp` is the plain O(|cand|·|ref|) table, kept as the test reference.

Not here: combining R_sem with the verifier reward (advantages.combined_reward).

Departure from the spec: §4.2 suggests a C-backed LCS (rapidfuzz, rouge-score-rs); the bit-parallel
integer form is fast enough in pure Python and keeps algorithms/ dependency-free.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence

import torch

_TOKEN_RE = re.compile(r"[a-z0-9]+")


def tokenize(text: str) -> list[str]:
    """rouge-score default tokenization without stemming: lower-case, keep runs of [a-z0-9].

    "The cat's 2 hats!" -> ["the", "cat", "s", "2", "hats"]. Returns a list of str.
    """
    return _TOKEN_RE.findall(text.lower())


def _match_masks(ref: Sequence[Hashable]) -> dict[Hashable, int]:
    """{token: bit mask of its positions in ref}; bit j set iff ref[j] == token."""
    masks: dict[Hashable, int] = {}
    for j, tok in enumerate(ref):
        masks[tok] = masks.get(tok, 0) | (1 << j)
    return masks


def _lcs_from_masks(masks: dict[Hashable, int], ref_len: int, cand: Sequence[Hashable]) -> int:
    full = (1 << ref_len) - 1
    v = full
    for tok in cand:
        u = v & masks.get(tok, 0)
        if u:
            # Hyyrö's row update: the carry of v + u moves each matched bit to the next free column
            v = ((v + u) | (v - u)) & full
    # every zero bit of v is one column that the LCS uses
    return ref_len - v.bit_count()


def lcs_length(cand: Sequence[Hashable], ref: Sequence[Hashable]) -> int:
    """Length of the longest common subsequence, bit-parallel (Allison–Dix / Hyyrö 2004).

    With V ∈ {0,1}^{|ref|} (all ones at start) and PM[x] the positions of x in ref, for each
    candidate token x:  U = V & PM[x];  V = (V + U) | (V − U).  Then LCS = |ref| − popcount(V).
    Args: two sequences of hashable tokens. Returns an int in [0, min(|cand|, |ref|)].
    """
    return _lcs_from_masks(_match_masks(ref), len(ref), cand)


def lcs_length_dp(cand: Sequence[Hashable], ref: Sequence[Hashable]) -> int:
    """Reference LCS by the O(|cand|·|ref|) table L[i][j] = L[i−1][j−1] + 1 if equal else
    max(L[i−1][j], L[i][j−1]); kept for tests. Returns an int."""
    prev = [0] * (len(ref) + 1)
    for x in cand:
        row = [0]
        for j, y in enumerate(ref):
            row.append(prev[j] + 1 if x == y else max(prev[j + 1], row[j]))
        prev = row
    return prev[-1]


def _f1(lcs: int, cand_len: int, ref_len: int) -> float:
    if cand_len == 0 or ref_len == 0 or lcs == 0:
        return 0.0
    precision, recall = lcs / cand_len, lcs / ref_len
    return 2 * precision * recall / (precision + recall)


def rouge_l_f1_tokens(cand: Sequence[Hashable], ref: Sequence[Hashable]) -> float:
    """ROUGE-L F1 on token sequences, algorithms.md §4.2:

        P = LCS/|cand|,  R = LCS/|ref|,  F1 = 2PR/(P+R);  0 when either sequence is empty.
    Returns a float in [0, 1].
    """
    return _f1(lcs_length(cand, ref), len(cand), len(ref))


def rouge_l_f1(candidate: str, reference: str) -> float:
    """ROUGE-L F1 of two texts after `tokenize` (§4.2). Returns a float in [0, 1]."""
    return rouge_l_f1_tokens(tokenize(candidate), tokenize(reference))


def rouge_l_rewards(candidates: Sequence[str], reference: str) -> torch.Tensor:
    """R_sem for a group: ROUGE-L F1 of every candidate trace against one reference solution (§4.2).

    The reference's bit masks are built once and shared by the G candidates.
    Args: candidates (G texts), reference text. Returns float64 [G].
    """
    ref = tokenize(reference)
    masks = _match_masks(ref)
    scores = []
    for text in candidates:
        cand = tokenize(text)
        scores.append(_f1(_lcs_from_masks(masks, len(ref), cand), len(cand), len(ref)))
    return torch.tensor(scores, dtype=torch.float64)

"""Time ROUGE-L F1 (bit-parallel LCS) on 3k-token pairs; prints ms per pair.

Usage: python3 benchmarks/rouge_speed.py [--tokens 3000] [--pairs 20] [--vocab 2000]
Expected on one laptop-class CPU core: a few ms per pair (the O(n·m) DP reference takes seconds).
"""

from __future__ import annotations

import argparse
import random
import time

from threepo.algorithms.rouge import lcs_length_dp, rouge_l_f1_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=3000, help="tokens per candidate and reference")
    parser.add_argument("--pairs", type=int, default=20, help="pairs to time")
    parser.add_argument("--vocab", type=int, default=2000, help="distinct token ids (word-like skew)")
    parser.add_argument("--dp", action="store_true", help="also time one pair with the O(n·m) DP")
    args = parser.parse_args()
    rng = random.Random(0)
    # Zipf-like draws so frequent tokens repeat, as words do in reasoning traces
    weights = [1.0 / (k + 1) for k in range(args.vocab)]
    pairs = [
        (rng.choices(range(args.vocab), weights, k=args.tokens), rng.choices(range(args.vocab), weights, k=args.tokens))
        for _ in range(args.pairs)
    ]
    start = time.perf_counter()
    for cand, ref in pairs:
        rouge_l_f1_tokens(cand, ref)
    per_pair = (time.perf_counter() - start) / args.pairs * 1e3
    print(f"bit-parallel ROUGE-L: {per_pair:.2f} ms per {args.tokens}x{args.tokens}-token pair")
    if args.dp:
        start = time.perf_counter()
        lcs_length_dp(*pairs[0])
        print(f"DP reference:         {(time.perf_counter() - start) * 1e3:.0f} ms per pair")


if __name__ == "__main__":
    main()

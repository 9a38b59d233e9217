"""HF engine tokens/s: batch sizes x torch threads in one process, then single-thread engines in
separate processes side by side (the deployment layout: one sampler actor per core), then a C3PO
step's sampling on one engine — `--slots` posterior samples × `--slot-rows` rows each — served one
slot at a time (`serve` + `generate` per slot) against decoded together (`generate_slots`).

Sampling is T=1 with max_new_tokens 16 (the default sampler config) on distinct train prompts of
the default task; tokens are the generated completion tokens (a sequence stops at EOS). Each
measurement takes one warm-up call, then calls until `--seconds` have passed.

    python3 benchmarks/engine_throughput.py                 # embedded default model
    python3 benchmarks/engine_throughput.py --quick --model tiny
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import time

import _common

MAX_NEW_TOKENS = 16


def measure(engine, prompts: list, seconds: float, deadline: float | None = None) -> tuple[int, float]:
    """(generated tokens, elapsed seconds) of repeated generate calls over `prompts`; with `deadline`
    (a time.time() value) calls run until then instead of for `seconds`."""
    from threepo.services.wire.messages import SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, n=1)
    tokens, calls, start = 0, 0, time.perf_counter()
    while True:
        out = engine.generate(_common.encoded_requests(engine.tokenizer, prompts, seed=calls), params)
        tokens += sum(len(s.token_ids) for per_prompt in out for s in per_prompt)
        calls += 1
        now = time.perf_counter()
        if (time.time() >= deadline) if deadline else (now - start >= seconds):
            return tokens, now - start


def slot_step(engine, prompts: list, slots: int, seconds: float, together: bool) -> tuple[int, float]:
    """(generated tokens, elapsed seconds) of repeated C3PO steps: `slots` seeded slots of the held
    version, each sampling `prompts` once, one slot at a time or all in one `generate_slots` call."""
    from threepo.services.wire.messages import NoiseSpec, SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, n=1)
    tokens, calls, start = 0, 0, time.perf_counter()
    while True:
        groups = [(NoiseSpec(engine.version, seed=100 + s),
                   _common.encoded_requests(engine.tokenizer, prompts, seed=calls)) for s in range(slots)]
        tokens += sample_slots(engine, groups, params, together)
        calls += 1
        if time.perf_counter() - start >= seconds:
            return tokens, time.perf_counter() - start


def sample_slots(engine, groups: list, params, together: bool) -> int:
    """Generated tokens of one call's (slot, requests) `groups`: all in one `generate_slots`, or one
    slot at a time (`serve`, `generate`, `verify`: what a sampler does for an engine without it)."""
    if together:
        out = [samples for _, _, samples in engine.generate_slots(groups, params)]
    else:
        out = []
        for noise, requests in groups:
            engine.serve(noise)
            out.append(engine.generate(requests, params))
            engine.verify()
    return sum(len(s.token_ids) for group in out for per_prompt in group for s in per_prompt)


def make_engine(model: str, threads: int, batch: int, engine_id: int = 0):
    from threepo.services.sampling.engines.base import SamplerConfig
    from threepo.services.sampling.engines.hf import HFEngine

    return HFEngine(model, SamplerConfig(threads=threads, batch_size=batch, max_new_tokens=MAX_NEW_TOKENS),
                    engine_id=engine_id)


def worker(model: str, batch: int, engine_id: int, ready, start_at, results) -> None:
    """One single-thread engine process: warm up, wait for the common start, run until the deadline."""
    engine = make_engine(model, threads=1, batch=batch, engine_id=engine_id)
    prompts = [it.prompt for it in _common.task_prompts(batch, seed=engine_id)]
    measure(engine, prompts, seconds=0.0)
    ready.put(engine_id)
    begin, end = start_at.get()
    while time.time() < begin:
        time.sleep(0.005)
    results.put((engine_id, *measure(engine, prompts, 0.0, deadline=end)))


def side_by_side(model: str, batch: int, processes: int, seconds: float) -> list[tuple[int, int, float]]:
    """(engine id, tokens, elapsed) of `processes` single-thread engines running at the same time."""
    ctx = mp.get_context("spawn")
    ready, start_at, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(model, batch, i, ready, start_at, results)) for i in range(processes)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=600)
    begin = time.time() + 0.5
    for _ in procs:
        start_at.put((begin, begin + seconds))
    out = sorted(results.get(timeout=600 + seconds) for _ in procs)
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"engine process exited with code {p.exitcode}")
    return out


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256], help="engine batch sizes")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads of one engine")
    p.add_argument("--processes", type=int, default=2, help="single-thread engines side by side")
    p.add_argument("--pair-batch", type=int, default=64, help="batch size of the side-by-side engines "
                                                                "(the default sampler.batch_size)")
    p.add_argument("--seconds", type=float, default=8.0, help="measuring time per configuration")
    p.add_argument("--slots", type=int, default=4, help="C3PO slots per step (algo.n_slots)")
    p.add_argument("--slot-rows", type=int, default=32, help="rows per slot per step (8 prompts x 16 / 4 slots)")
    args = p.parse_args()
    if args.quick:
        args.batches, args.seconds = [16, 64], 1.0
    model = _common.model_path(args)
    import torch

    rows, results = [], {"model": model, "max_new_tokens": MAX_NEW_TOKENS, "single_process": [], "side_by_side": {}}
    engine = make_engine(model, threads=1, batch=max(args.batches))
    for batch in args.batches:
        prompts = [it.prompt for it in _common.task_prompts(batch)]
        engine.cfg = dataclasses.replace(engine.cfg, batch_size=batch)  # generate() batches by cfg
        for threads in args.threads:
            torch.set_num_threads(threads)
            measure(engine, prompts, seconds=0.0)  # warm-up
            tokens, elapsed = measure(engine, prompts, args.seconds)
            rate = tokens / elapsed
            rows.append([batch, threads, 1, tokens, rate, rate / threads])
            results["single_process"].append({"batch": batch, "threads": threads, "tokens": tokens,
                                              "seconds": elapsed, "tokens_per_s": rate})
    pair = side_by_side(model, args.pair_batch, args.processes, args.seconds)
    aggregate = sum(tokens / elapsed for _, tokens, elapsed in pair)
    rows.append([args.pair_batch, 1, args.processes, sum(t for _, t, _ in pair), aggregate, aggregate / args.processes])
    results["side_by_side"] = {"batch": args.pair_batch, "processes": args.processes, "tokens_per_s": aggregate,
                               "per_engine": [{"engine": i, "tokens": t, "seconds": s} for i, t, s in pair]}
    _common.table(f"HF engine tokens/s (T=1, max_new_tokens {MAX_NEW_TOKENS}, {args.seconds:.0f}s each)",
                  ["batch", "threads", "processes", "tokens", "tokens/s", "tokens/s/core"], rows)
    one = next((r for r in results["single_process"] if r["batch"] == args.pair_batch and r["threads"] == 1), None)
    if one:
        print(f"{args.processes} single-thread engines side by side: {aggregate:,.0f} tokens/s = "
              f"{aggregate / one['tokens_per_s']:.2f}x one engine at batch {args.pair_batch}")
    import numpy as np

    from threepo.algorithms.weight_checks import weights_checksum

    engine = make_engine(model, threads=1, batch=args.pair_batch)
    mean = {n: p.detach().numpy().copy() for n, p in engine._params.items()}
    engine.load_version(1, mean, {n: np.full(a.shape, 0.01, dtype=np.float32) for n, a in mean.items()},
                        weights_checksum((n, torch.from_numpy(a)) for n, a in mean.items()))
    prompts = [it.prompt for it in _common.task_prompts(args.slot_rows)]
    torch.set_num_threads(1)
    slot_rows, rates = [], {}
    for together in (False, True):
        slot_step(engine, prompts, args.slots, 0.0, together)  # warm-up
        tokens, elapsed = slot_step(engine, prompts, args.slots, args.seconds, together)
        label = "decoded together" if together else "one slot at a time"
        rates[label] = tokens / elapsed
        slot_rows.append([label, args.slots, args.slot_rows, tokens, tokens / elapsed])
    _common.table(f"C3PO step on one engine (batch {args.pair_batch}, 1 thread)",
                  ["slots", "S", "rows/slot", "tokens", "tokens/s"], slot_rows)
    ratio = rates["decoded together"] / rates["one slot at a time"]
    print(f"slots decoded together: {ratio:.2f}x one slot at a time")
    results["slots"] = {"slots": args.slots, "rows_per_slot": args.slot_rows, "tokens_per_s": rates, "ratio": ratio}
    _common.write_results("engine_throughput", {**results, "args": vars(args)})


if __name__ == "__main__":
    main()

"""What a C3PO sampler's memory is made of (issue 38): the hf engine alone in this process, on
SmolLM2-135M-Instruct in bf16 (or `--model`), stage by stage — the engine loaded, a version's m and
σ received (here: this process's own arrays; in a run they are Ray's shared objects, not the
sampler's), four slots' weights built and decoded together (`generate_slots`, 64 rollouts), and each
slot's KL measured (`slot_kl`, 4 rows of 64 tokens each, fp32 compute). Each stage: own memory after
it (PSS less shared memory) and its peak during it (sampled every 50 ms), and the bank's rows.

    python3 benchmarks/sampler_memory.py            # ~2 min
"""

from __future__ import annotations

import os
import threading
import time

import _common


def own_mib() -> float:
    with open("/proc/self/smaps_rollup") as f:
        rollup = {p[0][:-1]: int(p[1]) for p in (line.split() for line in f) if p[0].endswith(":") and len(p) > 1}
    return (rollup["Pss"] - rollup.get("Pss_Shmem", 0)) / 1024


class Stages:
    """Own memory at the end of each stage and its peak during it."""

    def __init__(self) -> None:
        self.peak, self.rows = own_mib(), []
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while True:
            self.peak = max(self.peak, own_mib())
            time.sleep(0.05)

    def end(self, stage: str) -> None:
        time.sleep(0.2)
        now = own_mib()
        self.rows.append([stage, now, max(self.peak, now)])
        self.peak = now


def main() -> None:
    import numpy as np
    import torch

    from threepo.algorithms.noise_mask import NoiseConfig, noised_names
    from threepo.algorithms.weight_checks import weights_checksum
    from threepo.services.sampling.engines.base import EngineRequest, SamplerConfig
    from threepo.services.sampling.engines.hf import HFEngine
    from threepo.services.wire.messages import NoiseSpec, SamplingParams

    args = _common.parser(__doc__).parse_args()
    if args.model:
        path = _common.model_path(args)
    else:
        from threepo.services.model.modeling import smollm2_checkpoint

        path = smollm2_checkpoint(os.environ.get("THREEPO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "threepo"))
    stages = Stages()
    engine = HFEngine(path, SamplerConfig(dtype="bfloat16", batch_size=32, threads=1), dtype="bfloat16")
    stages.end("engine loaded")
    mean = {n: p.detach().float().numpy().copy() for n, p in engine._params.items()}
    noised = set(noised_names(list(mean), NoiseConfig().modules, NoiseConfig().layers))
    sigma = {n: np.full(a.shape, 1e-3, np.float32) for n, a in mean.items() if n in noised}
    engine.load_version(1, mean, sigma, weights_checksum((n, torch.from_numpy(a)) for n, a in mean.items()))
    stages.end(f"version taken (m {sum(a.nbytes for a in mean.values()) >> 20} MiB, σ "
               f"{sum(a.nbytes for a in sigma.values()) >> 20} MiB: shared objects in a run)")
    prompts = [tuple(engine.tokenizer.encode(f"Question {i}: what is {i} + {2 * i}? Answer:")) for i in range(8)]
    slots = [NoiseSpec(1, seed=100 + k, scale=1.0) for k in range(4)]
    params = SamplingParams(temperature=1.0, max_new_tokens=64, stop_token_ids=[])
    groups = [(s, [EngineRequest(p, 8, seed=i) for i, p in enumerate(prompts[2 * k:2 * k + 2])])
              for k, s in enumerate(slots)]
    out = engine.generate_slots(groups, params)
    stages.end(f"4 slots built, 64 rollouts decoded (bank {engine.bank.rows.shape[0]} rows x "
               f"{engine.bank.set_bytes >> 20} MiB)")
    engine.generate_slots(groups, params)
    stages.end("the same call again (slots resident)")
    rows = [(p, s.token_ids) for p, samples in zip(prompts[:2], out[0][2]) for s in samples][:4]
    for slot in slots:
        engine.slot_kl(slot, rows, 64, 1.0)
    stages.end("each slot's KL measured (4 rows x 64 tokens, fp32)")
    _common.table("A C3PO sampler's own memory (MiB), hf engine, bf16", ["stage", "after", "peak during"], stages.rows)


if __name__ == "__main__":
    main()

"""Bytes sent per posterior version per engine against the number of slots N (issue 4: must not
grow with N).

An engine receives the fp32 mean m and σ of a version once and regenerates every slot's noise
z(seed) locally, so a version costs 2 x 4 bytes x parameters whatever N. Two measurements per N:
- server: publish one version (the checkpoint as mean, IVON's initial σ) through a PosteriorServer
  planning C3PO with N slots and read `bytes_of(version)`;
- run: a short real C3PO run with algo.n_slots=N; each sampler's own count of the bytes it loaded
  per version (`Sampler.stats()`: sync_bytes / updates, read at the end of the run) — what every
  engine received.
For contrast, the table also gives what shipping each slot's perturbed weights would cost (N x m).

    python3 benchmarks/sync_bytes.py [--slots 1 2 4 8] [--steps 3] [section.field=value ...]
"""

from __future__ import annotations

import _common


def server_bytes(model: str, cfg, n_slots: int) -> int:
    """bytes_of the first version of a PosteriorServer planning C3PO with `n_slots` slots."""
    import torch

    from threepo.algorithms.weight_checks import weights_checksum
    from threepo.services.posterior import PosteriorConfig, PosteriorServer
    from threepo.services.wire.messages import PublishedVersion

    mean, sigma = _common.posterior_arrays(model, cfg)
    checksum = weights_checksum((n, torch.from_numpy(a)) for n, a in mean.items())
    server = PosteriorServer(PosteriorConfig(kind="c3po", group_size=cfg.algo.group_size, n_slots=n_slots,
                                             equal_compute=True, base_seed=cfg.seed))
    published = server.publish(PublishedVersion(learner_step=0, reason="start", mean=mean, sigma=sigma,
                                                mean_checksum=checksum))
    if len(published.plan.slots) != n_slots:
        raise RuntimeError(f"the plan has {len(published.plan.slots)} slots, expected {n_slots}")
    return server.bytes_of(published.version)


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--slots", type=int, nargs="+", default=[1, 2, 4, 8], help="values of N")
    p.add_argument("--steps", type=int, default=3, help="learner steps of each real run")
    p.add_argument("--group-size", type=int, default=8, help="G (a multiple of every N)")
    args = p.parse_args()
    run_slots = [min(args.slots), max(args.slots)] if args.quick else args.slots
    if args.quick:
        args.steps = 2
    model = _common.model_path(args)
    common = ["algo.exploration=c3po", f"algo.group_size={args.group_size}", "runtime.prompts_per_step=2",
              *args.overrides, f"runtime.steps={args.steps}"]
    cfg = _common.config(model, common)
    mean, _ = _common.posterior_arrays(model, cfg)
    mean_bytes = sum(a.nbytes for a in mean.values())
    rows, results = [], []
    for n in args.slots:
        served = server_bytes(model, cfg, n)
        sent = []
        if n in run_slots:
            run = _common.train_run(model, [*common, f"algo.n_slots={n}"], f"N={n}")
            sent = [st["sync_bytes"] // st["updates"] for st in run["sampler_stats"] if st["updates"]]
        run_text = "-" if not sent else (f"{sent[0]:,}" if len(set(sent)) == 1 else f"{min(sent):,}..{max(sent):,}")
        rows.append([n, f"{served:,}", run_text, len(sent), f"{n * mean_bytes:,}"])
        results.append({"n_slots": n, "server_bytes_of": served, "run_sync_bytes_per_engine": sent,
                        "per_slot_weights_bytes": n * mean_bytes})
    _common.table(f"Bytes per version per engine ({sum(a.size for a in mean.values()):,} parameters, fp32)",
                  ["N", "server bytes_of", "run bytes/engine/version", "engines", "N x weights (contrast)"], rows)
    served = {r["server_bytes_of"] for r in results}
    sent = {b for r in results for b in r["run_sync_bytes_per_engine"]}
    print(f"grows with N: {'no' if len(served) == 1 and len(sent) <= 1 else 'YES'} "
          f"(server {sorted(served)}, runs {sorted(sent)}; m + σ = {2 * mean_bytes:,} bytes)")
    _common.write_results("sync_bytes", {"model": model, "mean_bytes": mean_bytes, "by_n": results,
                                         "args": vars(args)})


if __name__ == "__main__":
    main()

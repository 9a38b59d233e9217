"""The transformers sampler engine: the CPU default behind the engine protocol (engines/base.py).

Decoding is our own loop (engines/decoding.py): exact behaviour log-probs of the sampling
distribution, a counter stream per request seed, any of the call's stop tokens ends a row. Two paths. On the families the lean decoder implements (engines/lean_decoder.py: Llama, Mistral,
Qwen2, Qwen3) the model's parameters are views of one flat weight set holding the mean, each slot
θ̂ is built into a row of a `SlotBank` (engines/slot_bank.py, bounded in bytes) holding the tensors σ
covers (those a slot perturbs: `lean_decoder.slot_names`), the rest read from the mean set, and
`generate_slots` decodes a call's several slots in shared forward passes, each row under its own
slot. A prompt repeated under one slot (a request's n samples) is prefilled once. On other
architectures (the MoE model of VP2O, for one) a slot is written into the model's parameters in
place and decoded with transformers' forward, one slot at a time.

A LoRA version (`load_version(..., lora=(r, α))`: the adapters' m and σ alone) is served over the
base weights the engine loaded, kept once as a weight set of their own: on the lean path each slot
is its adapter sample stacked beside the shared base (`Adapters.slot_terms`; no weight set per
slot), a call's slots decoded together and a single slot the same way; on the other path a slot's
merged weights W0 + s · B̂ Â are written into the parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from threepo.algorithms import weight_checks
from threepo.algorithms.noise_scale import policy_kl
from threepo.services.model.modeling import load_model, load_tokenizer, trainable_named_parameters
from threepo.services.sampling.engines import lean_decoder
from threepo.services.sampling.engines.base import EngineRequest, SamplerConfig, ServeReport, WeightsMismatch
from threepo.services.sampling.engines.decoding import completion_logits, generate, generate_slots
from threepo.services.sampling.engines.lean_decoder import LeanDecoder, WeightLayout
from threepo.services.sampling.engines.slot_bank import Adapters, SlotBank, write_slot
from threepo.services.wire.messages import GeneratedSample, NoiseSpec, SamplingParams


class HFEngine:
    """Serves a local HF checkpoint's versions on the CPU or one CUDA device (`sampler.device`): one
    policy per `generate`, several slots per `generate_slots` where `slots_together`."""

    def __init__(self, model_path: str, cfg: SamplerConfig, *, engine_id: int = 0, dtype: str = "float32"):
        torch.set_num_threads(cfg.threads)
        torch.set_flush_denormal(True)  # as the learner: denormal softmax tails are slow on CPU
        self.cfg, self.engine_id = cfg, engine_id
        self.dtype = getattr(torch, dtype if cfg.dtype == "auto" else cfg.dtype)
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"engine {engine_id}: sampler.device=cuda, but torch sees no CUDA device here")
        self.model = load_model(model_path, dtype=str(self.dtype).removeprefix("torch.")).to(self.device).eval()
        self.tokenizer = load_tokenizer(model_path)
        self.lean = lean_decoder.supports(self.model)
        if self.lean:  # parameters become views of one flat weight set: the mean, held once
            self.layout = WeightLayout.of(self.model, list(dict(self.model.named_parameters())))
            self._mean_set = torch.empty(1, self.layout.numel, dtype=self.dtype, device=self.device)
            lean_decoder.bind(self.model, self.layout, self._mean_set[0])
            self.bank: SlotBank | None = None  # the slots' own tensors, laid out anew by each σ's names
            self._lay_out_bank([])  # before any σ: a slot is the mean, every tensor read from its set
        self._params = dict(trainable_named_parameters(self.model))
        # m, which slots are built from: until the first version the parameters as the model holds them
        # (before it no noised slot is served: version 0 has no σ), then the published fp32 arrays (views
        # of the object Ray hands in, no copy of its own), except where the parameters always hold m
        # (the lean path in fp32)
        self._mean = {n: p.detach() for n, p in self._params.items()}
        self._sigma: dict[str, torch.Tensor] | None = None
        self._adapters: Adapters | None = None  # a LoRA version's adapters (load_version)
        self._base: dict[str, torch.Tensor] | None = None  # under LoRA: the weights as loaded, kept once
        self._pristine = True  # the parameters hold the checkpoint as loaded (no full version taken)
        self._terms = None  # on the lean path under LoRA: the served slot's (adapter terms, fingerprint)
        self.noise_rank = 0  # the held version's (load_version)
        self.version, self.mean_checksum = 0, weight_checks.weights_checksum(self._mean.items())
        self._mean_fingerprint = weight_checks.value_fingerprint(self.model.parameters())
        self._serving = NoiseSpec(posterior_version=0, seed=None)
        self.report = self.serve(self._serving)

    def load_version(self, version: int, mean: Mapping[str, np.ndarray],
                     sigma: Mapping[str, np.ndarray] | None, mean_checksum: str, noise_rank: int = 0,
                     lora: tuple[int, float] | None = None) -> None:
        if lora is not None:
            return self._load_adapters(version, mean, sigma, mean_checksum, noise_rank, lora)
        missing = sorted(set(self._params) - set(mean))
        if missing:
            raise WeightsMismatch(f"posterior version {version}: mean lacks parameters {missing[:5]}")
        received = {n: _tensor(mean[n], self.device) for n in self._params}
        checksum = self._checked(version, received, mean_checksum)
        with torch.no_grad():
            for n, p in self._params.items():
                p.copy_(received[n])  # the served weights (on the lean path in fp32: m itself)
        if not (self.lean and self.dtype == torch.float32):
            self._mean = received
        self._adapters, self._base, self._pristine = None, None, False  # the parameters no longer hold the base
        stray = sorted(set(sigma or {}) - set(self._params))
        if stray:
            raise WeightsMismatch(f"posterior version {version}: sigma names tensors the model does not train: {stray[:5]}")
        self._taken(version, checksum, noise_rank,
                    None if sigma is None else {n: _tensor(a, self.device) for n, a in sigma.items()})

    def _load_adapters(self, version: int, mean: Mapping[str, np.ndarray], sigma: Mapping[str, np.ndarray] | None,
                       mean_checksum: str, noise_rank: int, lora: tuple[int, float]) -> None:
        """A LoRA version (`lora` = (r, α)): `mean` and `sigma` are the adapters' alone, served over the
        base weights this engine loaded (kept once, the first time: the base never travels again)."""
        received = {n: _tensor(a, self.device) for n, a in mean.items()}
        checksum = self._checked(version, received, mean_checksum)
        if self._base is None:
            if not self._pristine:
                raise WeightsMismatch(f"engine {self.engine_id}: LoRA version {version} arrived after a full "
                                      "version: the base weights it adapts are gone")
            if self.lean:  # the base as a weight set of its own: adapter slots decode over it
                self._base_set = self._mean_set.clone()
                self._base = self.layout.views(self._base_set[0])
                self._base_fingerprint = self._base_now()
            else:
                self._base = {n: p.detach().clone() for n, p in self._params.items()}
        rank, alpha = lora
        try:
            adapters = Adapters(self._base, received, None if sigma is None else
                                {n: _tensor(a, self.device) for n, a in sigma.items()}, alpha / rank)
        except KeyError as error:
            raise WeightsMismatch(f"engine {self.engine_id}, version {version}: {error.args[0]}") from None
        if not self.lean:  # the parameters serve the merged mean (on the lean path the base set serves)
            with torch.no_grad():
                for n, p in self._params.items():
                    p.copy_(adapters.weight(n, None) if n in adapters.pairs else self._base[n])
        self._adapters, self._mean = adapters, self._base
        self._taken(version, checksum, noise_rank, None if sigma is None else {})

    def _checked(self, version: int, received: Mapping[str, torch.Tensor], mean_checksum: str) -> str:
        checksum = weight_checks.weights_checksum(received.items())
        if checksum != mean_checksum:
            raise WeightsMismatch(f"engine {self.engine_id}: the mean of version {version} has checksum "
                                  f"{checksum}, the learner published {mean_checksum}")
        return checksum

    def _taken(self, version: int, checksum: str, noise_rank: int, sigma: dict | None) -> None:
        self.version, self.mean_checksum, self.noise_rank = version, checksum, noise_rank
        self._sigma = sigma  # read only; {} under LoRA: the adapters hold σ
        if not self._adapter_slots:  # adapter slots check the base set and their terms instead
            self._mean_fingerprint = weight_checks.value_fingerprint(self.model.parameters())
        if self.lean and sigma is not None:
            self._lay_out_bank(list(sigma))
        self.serve(NoiseSpec(posterior_version=version, seed=None))

    def _lay_out_bank(self, noised: list[str]) -> None:
        """A new version's slots: the bank emptied, laid out afresh where σ covers other tensors than
        the last version's; the fingerprint of the mean set's tensors the slots read from it (kept in
        `_shared_fingerprint`)."""
        names = lean_decoder.slot_names(self.layout, noised)
        if self.bank is None or list(self.bank.layout.spans) != names:
            self.bank = SlotBank(WeightLayout.of(self.model, names), self.dtype, self.cfg.slot_cache_mb << 20,
                                 self.device)
        self.bank.clear()
        self._shared_fingerprint = self._shared_now()

    def _shared_now(self) -> tuple[int, int]:
        """The fingerprint of the mean set's tensors that slots read from it (those the bank does not hold)."""
        views = self.layout.views(self._mean_set[0])
        return weight_checks.value_fingerprint(views[n] for n in views if n not in self.bank.layout.spans)

    def _shared_intact(self) -> bool:
        """Do the mean set's tensors that slots read from it still hold what they held at the version's
        load (lean path)?"""
        return self._shared_now() == self._shared_fingerprint

    def serve(self, noise: NoiseSpec) -> ServeReport:
        self._check_slot(noise)
        self._serving = noise
        if self._adapter_slots:
            terms, fed, ratios = self._adapters.slot_terms([(noise.seed, noise.scale)], self.dtype, self.noise_rank)
            self._terms = (terms, fed[0])
            ok, ratio = self.verify(), ratios[0]
        elif noise.seed is None:
            if not self.lean:
                self._write_model(noise)
            ok, ratio = self.verify(), 1.0
        elif self.lean:
            row = self._rows([noise])[0]
            if not self.bank.holds(row):  # changed since it was built: serving loads it afresh
                self.bank.forget((noise.seed, noise.scale))
                row = self._rows([noise])[0]
            ok = self.bank.loaded(row) and self.bank.holds(row) and self._shared_intact()
            ratio = self.bank.ratio(row)
        else:
            ratio, fed = self._write_model(noise)
            ok = weight_checks.value_fingerprint(self.model.parameters()) == fed
            self._slot_fingerprint = fed
        self.report = ServeReport(self.version, noise.seed, self.mean_checksum, ok, ratio, scale=noise.scale)
        return self.report

    def _check_slot(self, noise: NoiseSpec) -> None:
        if noise.posterior_version != self.version:
            raise ValueError(f"engine {self.engine_id} holds version {self.version}, asked to serve "
                             f"{noise.posterior_version}: load_version first")
        if noise.seed is not None and self._sigma is None:
            raise ValueError(f"engine {self.engine_id}: a seeded slot needs σ, but version "
                             f"{self.version} was published without one")

    def _write_model(self, noise: NoiseSpec) -> tuple[float, tuple[int, int]]:
        """Without a lean decoder: θ̂ written into the model's parameters (the mean rebuilt from m)."""
        frozen = [p for n, p in self.model.named_parameters() if n not in self._params]
        ratio, fed = write_slot({n: p.data for n, p in self._params.items()}, self._mean, self._sigma or {},
                                noise.seed, noise.scale, self.noise_rank, self._adapters)
        return ratio, weight_checks.combined_fingerprint([fed, weight_checks.value_fingerprint(frozen)])

    @property
    def _adapter_slots(self) -> bool:
        """Are slots adapter samples decoded over the shared base set (a LoRA version, lean path)?"""
        return self.lean and self._adapters is not None

    def _base_now(self) -> tuple[int, int]:
        """The base set's fingerprint now (in pieces: the int32 working copies stay small)."""
        return weight_checks.value_fingerprint(self._base_set[0].split(1 << 22))

    def _adapter_decoder(self, terms: dict) -> LeanDecoder:
        return LeanDecoder(self.model, self.layout, self._base_set, terms, self._adapters.scaling)

    def _rows(self, slots: Sequence[NoiseSpec]) -> list[int]:
        """Bank rows of `slots`, built where not resident (lean path)."""
        def build(key, views):
            return write_slot(views, self._mean_by_layout(), self._sigma or {}, *key, self.noise_rank, self._adapters)
        return self.bank.place([(s.seed, s.scale) for s in slots], build)

    def _mean_by_layout(self) -> dict[str, torch.Tensor]:
        """m for every name of the bank's layout (frozen parameters: as the model holds them)."""
        params = dict(self.model.named_parameters())
        return {n: self._mean[n] if n in self._mean else params[n].detach() for n in self.bank.layout.spans}

    def _slot_decoder(self, rows: Sequence[int]) -> LeanDecoder:
        """A decoder over the bank's `rows`, each slot's own tensors, and the mean set for the rest."""
        return LeanDecoder(self.model, self.layout, self._mean_set, slots=(self.bank.layout, self.bank.sets(rows)))

    def generate_slots(self, groups: Sequence[tuple[NoiseSpec, Sequence[EngineRequest]]],
                       params: SamplingParams) -> list[tuple[ServeReport, bool, list[list[GeneratedSample]]]]:
        """Sample each (slot, requests) group under its own slot in shared forward passes (as many
        slots per pass as the bank holds). Per group: the `ServeReport` that `serve` would give,
        whether its weights were unchanged after sampling, and the samples. What `serve` serves is
        left as it was. Only where `slots_together` (the lean decoder's families)."""
        if not self.slots_together:
            raise ValueError(f"engine {self.engine_id}: {type(self.model).__name__} has no lean decoder to "
                             "decode several slots together; serve and generate them one at a time")
        for noise, _ in groups:
            self._check_slot(noise)
        if self._adapter_slots:
            return self._generate_adapter_slots(groups, params)
        checks: dict[int, tuple[bool, bool, float]] = {}  # group -> (loaded, unchanged, ratio)

        def decoder(indices: tuple[int, ...]) -> LeanDecoder:
            rows = self._rows([groups[i][0] for i in indices])
            decoder.rows = rows
            return self._slot_decoder(rows)

        def after(indices: tuple[int, ...]) -> None:  # before a later pass may reuse the rows
            shared = self._shared_intact()
            for i, row in zip(indices, decoder.rows):
                held = checks.get(i, (True, True, 1.0))
                checks[i] = (held[0] and self.bank.loaded(row), held[1] and shared and self.bank.holds(row),
                             self.bank.ratio(row))
                if not all(checks[i][:2]):
                    self.bank.forget((groups[i][0].seed, groups[i][0].scale))  # built afresh next time

        samples = generate_slots(self.model, self.tokenizer, [r for _, r in groups], decoder, params,
                                 batch_size=self.cfg.batch_size, max_slots=self.bank.capacity, after=after)
        return self._slot_results(groups, checks, samples)

    def _slot_results(self, groups, checks: dict, samples: list) -> list:
        """`generate_slots`'s answer from each group's (loaded, unchanged, ratio) and samples."""
        return [(ServeReport(self.version, noise.seed, self.mean_checksum, checks[i][0], checks[i][2],
                             scale=noise.scale), checks[i][1], samples[i]) for i, (noise, _) in enumerate(groups)]

    def _generate_adapter_slots(self, groups, params: SamplingParams) -> list:
        """`generate_slots` for a LoRA version: each pass's slots are adapter samples stacked over the
        base set (no weight set per slot, so no bank bounds the slots of a pass)."""
        checks: dict[int, tuple[bool, bool, float]] = {}

        def decoder(indices: tuple[int, ...]) -> LeanDecoder:
            terms, fed, ratios = self._adapters.slot_terms([(groups[i][0].seed, groups[i][0].scale) for i in indices],
                                                           self.dtype, self.noise_rank)
            decoder.built = (terms, fed, ratios)
            for i, stacked, want, ratio in zip(indices, self._adapters.held(terms), fed, ratios):
                checks[i] = (stacked == want, True, ratio)
            return self._adapter_decoder(terms)

        def after(indices: tuple[int, ...]) -> None:
            terms, fed, _ = decoder.built
            base_ok = self._base_now() == self._base_fingerprint
            for i, now, want in zip(indices, self._adapters.held(terms), fed):
                checks[i] = (checks[i][0], base_ok and now == want, checks[i][2])

        samples = generate_slots(self.model, self.tokenizer, [r for _, r in groups], decoder, params,
                                 batch_size=self.cfg.batch_size, max_slots=len(groups), after=after)
        return self._slot_results(groups, checks, samples)

    @property
    def slots_together(self) -> bool:
        """Can `generate_slots` decode several slots in shared passes (the lean decoder applies)?"""
        return self.lean

    def generate(self, requests: Sequence[EngineRequest], params: SamplingParams) -> list[list[GeneratedSample]]:
        lean = None
        if self._adapter_slots:
            lean = self._adapter_decoder(self._terms[0])
        elif self.lean:
            lean = (LeanDecoder(self.model, self.layout, self._mean_set) if self._serving.seed is None
                    else self._slot_decoder(self._rows([self._serving])))
        return generate(self.model, self.tokenizer, requests, params, batch_size=self.cfg.batch_size, lean=lean)

    def slot_kl(self, noise: NoiseSpec, rows: Sequence[tuple[Sequence[int], Sequence[int]]], positions: int,
                temperature: float) -> list[tuple[float, int]]:
        """Per (prompt ids, completion ids) row: Σ_t KL(π_θ̂ ‖ π_m) over its first `positions` completion
        tokens, and how many, θ̂ the slot `noise` as served and m the held version's mean, both at
        `temperature` (algorithms/noise_scale.policy_kl). The rows are teacher-forced through both; on
        the lean path in fp32 over the served weights (bf16 rounding of the logits alone measured a
        KL of ~0.001 between two forwards of one policy), otherwise in the served dtype. What is
        served is left as it was."""
        self._check_slot(noise)
        mean = NoiseSpec(noise.posterior_version, None)
        prompts, completions = [p for p, _ in rows], [c for _, c in rows]
        if self.lean:
            slot_p, mean_p = (completion_logits(self._measuring_decoder(spec), self.model, prompts, completions,
                                                positions) for spec in (noise, mean))
        else:  # the slot, then the mean, written into the parameters in turn; what was served, again
            slot_p = self._model_logits(noise, prompts, completions, positions)
            mean_p = self._model_logits(mean, prompts, completions, positions)
            self.serve(self._serving)
        kl = policy_kl(slot_p, mean_p, temperature)
        counts = [min(len(c), positions) for c in completions]
        return [(float(part.sum()), n) for part, n in zip(kl.split(counts), counts)]

    def _measuring_decoder(self, noise: NoiseSpec) -> LeanDecoder:
        """A lean decoder of slot `noise` (seed None: the mean) computing in fp32."""
        if self._adapter_slots:
            terms = self._adapters.slot_terms([(noise.seed, noise.scale)], self.dtype, self.noise_rank)[0]
            return LeanDecoder(self.model, self.layout, self._base_set, terms, self._adapters.scaling,
                               compute=torch.float32)
        if noise.seed is None:
            return LeanDecoder(self.model, self.layout, self._mean_set, compute=torch.float32)
        return LeanDecoder(self.model, self.layout, self._mean_set, compute=torch.float32,
                           slots=(self.bank.layout, self.bank.sets(self._rows([noise]))))

    def _model_logits(self, noise: NoiseSpec, prompts, completions, positions: int) -> torch.Tensor:
        self._write_model(noise)
        return completion_logits(None, self.model, prompts, completions, positions)

    def served(self) -> dict[str, torch.Tensor]:
        """The weights decoded with now, by parameter name (views: read, do not write; under a LoRA
        version on the lean path, the merged W0 + s · B̂ Â of the served slot, built for the asking)."""
        if self._adapter_slots:
            a = self._adapters
            noise = self._serving
            return {n: a.weight(n, noise.seed, noise.scale, self.noise_rank).to(self.dtype) if n in a.pairs else a.base[n]
                    for n in self._params}
        if self.lean and self._serving.seed is not None:
            own = self.bank.layout.views(self.bank.rows[self._rows([self._serving])[0]])
            return {n: own.get(n, view) for n, view in self.layout.views(self._mean_set[0]).items()}
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def verify(self) -> bool:
        """The served weights against the fingerprint of what was written for them."""
        if self._adapter_slots:
            terms, fed = self._terms
            return (self._adapters.held(terms) == [fed]
                    and self._base_now() == self._base_fingerprint)
        if self._serving.seed is None:
            return weight_checks.value_fingerprint(self.model.parameters()) == self._mean_fingerprint
        if self.lean:
            return self.bank.holds(self._rows([self._serving])[0]) and self._shared_intact()
        return weight_checks.value_fingerprint(self.model.parameters()) == self._slot_fingerprint

    def close(self) -> None:
        self.model = None


def _tensor(array, device: torch.device) -> torch.Tensor:
    """A fp32 tensor of `array` on `device`; on the CPU no copy when it already is fp32 (Ray hands
    read-only views of the published object: the engine only reads them; m is copied into the
    served weights and, unless those always hold m, kept as it is, as σ is)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only arrays: never written through
        return torch.from_numpy(np.asarray(array, dtype=np.float32)).to(device)

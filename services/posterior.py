"""The posterior server: published posterior versions, the exploration plan of each, and how long
each version stays available (architecture.md §2.1; algorithms.md §1.6).

The learner owns the training state and publishes (m, σ) in fp32 as a new version; the server keeps
a read-only copy, makes that version's plan (`algorithms.exploration.make_plan`, with the slots' seeds
and σ scale the learner's noise control chose when it sends them) and hands every
engine (m, σ) once per version — one transfer whatever the number of slots, since engines
regenerate the noise from the plan's seeds. A version stays available while rollouts sampled from it
are in flight (reference counts, which the driver's ledger takes and drops) or while it is the
current one; others are dropped. Each version carries the exact checksum of its mean as the learner
published it: engines check the mean they receive against it, and the driver checks every completion's reported mean
checksum against it — the server never rebuilds perturbed models (that work is the engines', on
their own devices).

Not here: IVON state and steps (the learner), scheduling slots on engines (the driver), Ray.
Departures: we publish σ rather than (h, λ, δ) — σ = 1/sqrt(λ(h + δ)) is computed once by the
learner (`param_noise.posterior_sigma`), so engines need no IVON hyperparameters.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np

from threepo.algorithms.exploration import ExplorationPlan, Slot, make_plan
from threepo.services.wire.messages import PublishedVersion


@dataclass(frozen=True)
class PosteriorConfig:
    """What the posterior server plans every version with: the run's `[algo]` plan settings and its
    global seed, which own and validate them (deploy/actors.py `posterior_config` copies them here; a
    run has no `[posterior]` section). `make_plan` checks the combination at each publish."""

    kind: str
    """algo.exploration: "none", "b3po", "m3po" or "c3po" (algorithms/exploration.py)."""
    group_size: int
    """algo.group_size: G, rollouts per advantage group."""
    n_slots: int
    """algo.n_slots: perturbation slots per version (N of C3PO, M of M3PO, 1 otherwise)."""
    equal_compute: bool
    """algo.equal_compute: M3PO's G/M rollouts per slot (true) or G (false)."""
    base_seed: int
    """The global seed: the root of every plan seed (slot seeds are hashed from it and the version)."""


@dataclass(frozen=True)
class VersionPlan:
    """Posterior server -> driver, one message per publish (Ray only: it carries the plan): the
    version's exploration plan (its number, slots and seeds), the learner step that published it
    (staleness is measured from it), and the checksum every completion sampled from it must report."""

    plan: ExplorationPlan
    learner_step: int
    mean_checksum: str
    reason: str

    @property
    def version(self) -> int:
        return self.plan.version


@dataclass
class _Version:
    mean: dict[str, np.ndarray]
    sigma: dict[str, np.ndarray] | None
    plan: ExplorationPlan
    learner_step: int
    reason: str
    mean_checksum: str
    noise_rank: int = 0
    lora: tuple | None = None


def _frozen_fp32(arrays: Mapping[str, np.ndarray], what: str) -> dict[str, np.ndarray]:
    """The arrays as read-only fp32, without a copy where they already are fp32 (a published version
    is 8 bytes a parameter: a 135M model's is 1.1 GB; through Ray they are views of the published
    object, which stays as long as the server keeps the version)."""
    out = {}
    for name, value in arrays.items():
        array = np.asarray(value, dtype=np.float32).view()
        array.setflags(write=False)  # callers share these arrays: nobody may change a published version
        out[name] = array
    if not out:
        raise ValueError(f"{what}: expected at least one named array, got none")
    return out


class PosteriorServer:
    """Holds published posterior versions and their plans; see the module docstring."""

    def __init__(self, cfg: PosteriorConfig, state: dict | None = None):
        self.cfg = cfg
        self._versions: dict[int, _Version] = {}
        self._refs: dict[int, int] = {}
        self._current = -1
        if state is not None:
            self._load(state)

    # --- publishing and reading versions ---------------------------------------------------------

    def publish(self, pv: PublishedVersion, hold: bool = False) -> VersionPlan:
        """Store `pv` as the next version (the current one + 1; the first is 0) and return its plan.
        The server numbers versions: it is their one owner. `hold`: the version starts with one
        reference, its publisher's (the driver's ledger holds the version it admits at until it has
        taken in a newer one, so a version published meanwhile cannot drop it)."""
        version = self._current + 1
        mean = _frozen_fp32(pv.mean, f"version {version}: mean")
        sigma = None if pv.sigma is None else _frozen_fp32(pv.sigma, f"version {version}: sigma")
        for name, s in (sigma or {}).items():
            if name not in mean or s.shape != mean[name].shape:
                got = mean[name].shape if name in mean else "absent"
                raise ValueError(f"version {version}: sigma[{name!r}] has shape {s.shape}, "
                                 f"expected the mean's shape ({got})")
        cfg = self.cfg
        plan = make_plan(cfg.kind, version=version, base_seed=cfg.base_seed, group_size=cfg.group_size,
                         n_slots=cfg.n_slots, equal_compute=cfg.equal_compute)
        if pv.slots is not None:  # the learner's noise control chose the seeds and the σ scale
            plan = plan.with_slots(pv.slots)
        if sigma is None and cfg.kind != "none":
            raise ValueError(f"version {version}: sigma is None, but the {cfg.kind} plan has seeded "
                             "slots (publish σ, or use kind='none')")
        self._versions[version] = _Version(mean, sigma, plan, pv.learner_step, pv.reason, pv.mean_checksum,
                                           pv.noise_rank, None if pv.lora is None else tuple(pv.lora))
        self._refs[version] = self._refs.get(version, 0) + int(hold)
        self._current = version
        self._evict()
        return self.version_plan(version)

    def version_plan(self, version: int) -> VersionPlan:
        """The plan, publishing learner step, mean checksum and reason of `version`."""
        entry = self._get(version)
        return VersionPlan(entry.plan, entry.learner_step, entry.mean_checksum, entry.reason)

    def current_version(self) -> int:
        """The newest published version."""
        if self._current < 0:
            raise LookupError("no posterior version has been published yet")
        return self._current

    def weights(self, version: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None, str]:
        """(mean, σ, mean checksum) of `version`, read-only fp32 arrays: what each engine pulls once
        per version."""
        entry = self._get(version)
        return entry.mean, entry.sigma, entry.mean_checksum

    def noise_rank(self, version: int) -> int:
        """The rank of `version`'s slot noise per matrix (0: full noise), as the learner published it."""
        return self._get(version).noise_rank

    def published(self, version: int) -> PublishedVersion:
        """`version` as the learner published it (a restored run's samplers read it); its slots are
        in its plan (`version_plan`)."""
        entry = self._get(version)
        return PublishedVersion(entry.learner_step, entry.reason, entry.mean, entry.sigma, entry.mean_checksum,
                                noise_rank=entry.noise_rank, lora=entry.lora)

    def bytes_of(self, version: int) -> int:
        """Bytes of mean + σ (a LoRA version's: the adapters') : what one engine receives per version,
        whatever the number of slots."""
        entry = self._get(version)
        return sum(a.nbytes for part in (entry.mean, entry.sigma or {}) for a in part.values())

    # --- lifetime ---------------------------------------------------------------------------------

    def acquire(self, version: int, n: int = 1) -> None:
        """Keep `version` available for `n` more holders: the ledger takes one per admitted group."""
        self._get(version)
        if n < 1:
            raise ValueError(f"acquire n: expected >= 1, got {n}")
        self._refs[version] += n

    def release(self, version: int, n: int = 1) -> None:
        """Drop `n` references to `version`; an old version without references is dropped."""
        self._get(version)
        if not 1 <= n <= self._refs[version]:
            raise ValueError(f"release n: expected 1..{self._refs[version]} (the references version "
                             f"{version} holds), got {n}")
        self._refs[version] -= n
        self._evict()

    def _evict(self) -> None:
        for version in [v for v in self._versions if v != self._current and self._refs[v] == 0]:
            del self._versions[version], self._refs[version]

    def _get(self, version: int) -> _Version:
        if version not in self._versions:
            raise KeyError(f"posterior version {version} is not available (dropped or never published); "
                           f"available: {sorted(self._versions)}")
        return self._versions[version]

    # --- checkpoint -------------------------------------------------------------------------------

    def state(self) -> dict:
        """Everything to restore this server: numpy arrays and plain values only."""
        return {
            "config": asdict(self.cfg),
            "current": self._current,
            "versions": [
                {"version": v, "mean": e.mean, "sigma": e.sigma, "learner_step": e.learner_step,
                 "reason": e.reason, "mean_checksum": e.mean_checksum, "refcount": self._refs[v],
                 "noise_rank": e.noise_rank, "lora": None if e.lora is None else list(e.lora),
                 "plan": _plan_state(e.plan)}
                for v, e in sorted(self._versions.items())
            ],
        }

    @classmethod
    def from_state(cls, state: dict, cfg: PosteriorConfig | None = None) -> PosteriorServer:
        """A server restored from `state()`; `cfg` (default: the saved one) plans future versions."""
        return cls(cfg or PosteriorConfig(**state["config"]), state=state)

    def _load(self, state: dict) -> None:
        for saved in state["versions"]:
            # a restored plan is the saved one, not re-derived: in-flight rollouts keep their seeds
            # even when the config of future versions changed
            sigma = saved["sigma"]
            self._versions[saved["version"]] = _Version(
                _frozen_fp32(saved["mean"], "state mean"),
                None if sigma is None else _frozen_fp32(sigma, "state sigma"),
                _plan_from_state(saved["plan"]), saved["learner_step"], saved["reason"], saved["mean_checksum"],
                saved.get("noise_rank", 0), None if saved.get("lora") is None else tuple(saved["lora"]))
            self._refs[saved["version"]] = saved["refcount"]
        self._current = state["current"]
        if self._versions and self._current not in self._versions:
            raise ValueError(f"state: current version {self._current} is not among the saved versions")


def save_posterior(server: PosteriorServer, directory: str) -> None:
    """Write the server's state into a checkpoint directory: posterior.safetensors (every version's
    m and σ) and posterior.json (config, plans, steps, reasons, checksums)."""
    from threepo.services.checkpoint import save_tensors

    state, tensors = server.state(), {}
    for v in state["versions"]:
        for part in ("mean", "sigma"):
            for name, array in (v[part] or {}).items():
                tensors[f"v{v['version']}/{part}/{name}"] = array
        v["has_sigma"], v["names"] = v["sigma"] is not None, sorted(v["mean"])
        del v["mean"], v["sigma"]
    save_tensors(os.path.join(directory, "posterior.safetensors"), tensors)
    with open(os.path.join(directory, "posterior.json"), "w") as f:
        json.dump(state, f)


def load_posterior(directory: str, cfg: PosteriorConfig | None = None) -> PosteriorServer:
    """The server `save_posterior` wrote. Reference counts start at zero: whatever was in flight at
    the checkpoint is regenerated on resume, so nothing old needs to stay alive for it."""
    from threepo.services.checkpoint import load_tensors

    tensors = load_tensors(os.path.join(directory, "posterior.safetensors"))
    with open(os.path.join(directory, "posterior.json")) as f:
        state = json.load(f)
    for v in state["versions"]:
        n = v["version"]
        v["mean"] = {name: tensors[f"v{n}/mean/{name}"] for name in v["names"]}
        # σ of the tensors it was published for (the noise mask's: a subset of the mean's names)
        v["sigma"] = ({name: tensors[f"v{n}/sigma/{name}"] for name in v["names"] if f"v{n}/sigma/{name}" in tensors}
                      if v["has_sigma"] else None)
        v["refcount"] = 0
    return PosteriorServer.from_state(state, cfg)


def _plan_state(plan: ExplorationPlan) -> dict:
    out = asdict(plan)
    out["slots"] = [[s["index"], s["seed"], s["scale"]] for s in out["slots"]]
    return out


def _plan_from_state(saved: dict) -> ExplorationPlan:
    """The saved plan (fields the plan no longer has, e.g. an older checkpoint's gradient_seed, are left out)."""
    slots = tuple(Slot(int(i), None if s is None else int(s), float(c[0]) if c else 1.0)  # older: no scale
                  for i, s, *c in saved["slots"])
    known = {f.name for f in dataclasses.fields(ExplorationPlan)}
    return ExplorationPlan(**{k: v for k, v in saved.items() if k in known and k != "slots"}, slots=slots)

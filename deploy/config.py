"""The run configuration: one frozen dataclass per component, composed here into `RunConfig`.

Each component declares its own `XConfig` (with a docstring per field) next to its code; this file
only composes them. A run's config is built from the defaults, then a recipe file (TOML, tables
named like the sections: `[sampler]`, `[algo]`, ...; `deploy/configs/*.toml` ship with the package),
then command-line overrides `section.field=value`. Values are parsed as TOML (`3`, `0.5`, `true`,
`"text"`, `[1, 2]`; a bare word is a string). An unknown key or a value of the wrong type is rejected
with a message naming the key and what was expected; range checks live in each config's
`__post_init__`. The resolved config is written into every run directory (`config.toml`), and that
file is itself a valid recipe.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from threepo.algorithms.noise_mask import NoiseConfig
from threepo.deploy.runtime_config import RuntimeConfig
from threepo.services.bootstrap import BootstrapConfig
from threepo.services.errors import UserInputError
from threepo.services.evaluation import EvalConfig
from threepo.services.learner.config import AlgoConfig, LearnerConfig, VP2OConfig
from threepo.services.learner.optim_config import OptimConfig, SyncConfig
from threepo.services.model.lora import LoRAConfig, check_lora
from threepo.services.model.modeling import ModelConfig
from threepo.services.sampling.engines.base import SamplerConfig
from threepo.services.tasks.datasets import MAX_NEW_TOKENS, DataConfig
from threepo.services.tasks.prompting import NUMBER_INSTRUCTION, PromptConfig
from threepo.services.tasks.synthetic import TaskConfig, max_new_tokens_for
from threepo.services.verifiers.pool import VerifierConfig
from threepo.services.verifiers.sandbox_config import RemoteSandboxConfig

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")


@dataclass(frozen=True)
class RunConfig:
    """Everything one `threepo` command needs."""

    name: str = "threepo"
    """Run name; the run directory is `<runs_dir>/<name>-<command>-<timestamp>`."""
    runs_dir: str = "runs"
    """Parent directory of run directories."""
    seed: int = 0
    """The run's seed: the prompt order, the exploration plans' slot seeds and `threepo eval`'s
    sampling, and the default of every role's own seed (`task.seed`, `sampler.seed` for the rollouts,
    `algo.seed` for the learner's θ̂′, `vp2o.seed`, `verifier.seed`, `sandbox.seed`), each of which may
    be set apart; not `bootstrap.seed` (the embedded default's warm start is one starting checkpoint
    for every run seed). Every stream is labelled by its role, so equal integers draw unrelated values."""
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    bootstrap: BootstrapConfig = field(default_factory=BootstrapConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    vp2o: VP2OConfig = field(default_factory=VP2OConfig)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    sandbox: RemoteSandboxConfig = field(default_factory=RemoteSandboxConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        from threepo.services.learner.config import check_combination, check_learner

        check_combination(self.algo, self.optim, self.model.kind)
        check_learner(self.learner, self.algo, self.optim)
        check_lora(self.lora, self.algo, self.learner)
        _check_sampler(self.sampler, self.runtime)
        if self.runtime.eval_gpus == "auto":  # a whole GPU for an evaluator that decodes on one
            object.__setattr__(self, "runtime", dataclasses.replace(
                self.runtime, eval_gpus=1.0 if self.eval.device == "cuda" else 0.0))
        if (self.runtime.eval_gpus > 0) != (self.eval.device == "cuda"):
            raise ValueError(f"runtime.eval_gpus={self.runtime.eval_gpus} with eval.device={self.eval.device}: the "
                             "evaluator decodes on a GPU share only with eval.device=cuda, and needs one then")
        if self.sampler.max_new_tokens == "auto":  # the generation limit follows the task tier or the data format
            limit = (MAX_NEW_TOKENS[self.data.format] if self.data.path
                     else max_new_tokens_for(self.task.family, self.task.difficulty))
            object.__setattr__(self, "sampler", dataclasses.replace(self.sampler, max_new_tokens=limit))
        if self.data.path and self.data.format == "gsm8k":
            # GSM8K's own scoring is its flexible extraction, the last number (a boxed answer still wins), and
            # then the instruction asks for a number, not a box (SmolLM2 boxes wrong numbers)
            if not any((verifier, option) == ("math", "answer") for verifier, option, _ in self.verifier.options):
                object.__setattr__(self, "verifier", dataclasses.replace(
                    self.verifier, options=(*self.verifier.options, ("math", "answer", "last_number"))))
            if self.prompt.instruction == "auto" and ("math", "answer", "last_number") in self.verifier.options:
                object.__setattr__(self, "prompt", dataclasses.replace(self.prompt, instruction=NUMBER_INSTRUCTION))


def _check_sampler(sampler: SamplerConfig, runtime: RuntimeConfig) -> None:
    """What a sampler's engine can do: GPUs asked of Ray per sampler against what the engine uses,
    and sampling settings whose behaviour log-probs the engine reports exactly."""
    if sampler.batch_invariant and not (sampler.backend == "vllm" and runtime.sampler_gpus > 0):
        raise ValueError("sampler.batch_invariant: switches on vLLM's batch-invariant GPU kernels; it needs "
                         "sampler.backend=vllm with runtime.sampler_gpus > 0")
    if sampler.backend == "sglang" and (sampler.top_k or sampler.top_p < 1):
        raise ValueError("sampler.top_k/top_p: SGLang 0.5.23 reports log-probs before top-k/top-p truncation, "
                         "not those of the truncated distribution; leave them off with sglang, or use vllm or hf")
    gpus, tp = runtime.sampler_gpus, sampler.tensor_parallel_size
    if sampler.device == "cuda" and sampler.backend != "hf":
        raise ValueError(f"sampler.device=cuda: applies to the hf engine only; {sampler.backend} places itself "
                         "(give its actor GPUs with runtime.sampler_gpus)")
    if sampler.backend == "hf" and tp != 1:
        raise ValueError(f"sampler.tensor_parallel_size={tp}: the hf engine runs on one device; use vllm or sglang")
    if sampler.backend == "hf" and sampler.device == "cuda" and gpus < 1:
        raise ValueError(f"sampler.device=cuda needs runtime.sampler_gpus >= 1 (got {gpus})")
    short = tp > 1 and gpus < tp  # one whole GPU per rank; a fraction of one serves tensor_parallel_size 1
    if sampler.backend == "sglang" and (gpus <= 0 or short):
        raise ValueError(f"sampler.backend=sglang runs on CUDA only: runtime.sampler_gpus must cover "
                         f"sampler.tensor_parallel_size ({tp}), got {gpus}")
    if sampler.backend == "vllm" and gpus > 0 and short:
        raise ValueError(f"runtime.sampler_gpus={gpus} does not cover sampler.tensor_parallel_size={tp} "
                         "(one GPU per tensor-parallel rank; 0 = vLLM's CPU build)")


class ConfigError(UserInputError):
    """A recipe or override that does not fit the schema; the message names the key."""


# the sections whose own `seed` follows the run's `seed` unless given (RunConfig.seed says which not)
ROLE_SEEDS = ("task", "sampler", "algo", "vp2o", "verifier", "sandbox")
# values that were renamed, (key, old value) -> the new value and why
RENAMED_VALUES = {("algo.exploration", "grpo"): '"none" (no parameter-space exploration: rollouts at the mean; '
                                                 '"grpo" names the advantage, algo.advantage)'}
# settings that moved, old key -> new: a recipe or a run directory from before names them
MOVED = {f"verifier.{name}": f"sandbox.{name}" for name in (
    "endpoints", "auth_env", "auth_header", "compile_timeout_s", "run_timeout_s", "memory_limit_mb",
    "request_margin_s", "queue_timeout_s", "max_attempts", "unhealthy_after", "cooldown_s", "outage_s")}


def load_config(recipe: str | None = None, overrides: typing.Sequence[str] = (),
                schema: type = RunConfig) -> Any:
    """Defaults <- recipe file <- `section.field=value` overrides, validated into `schema`; for a
    `RunConfig`, each role's seed not given is the run's `seed` (`ROLE_SEEDS`)."""
    tree: dict[str, Any] = {}
    if recipe:
        path = resolve_recipe(recipe)
        try:
            with open(path, "rb") as f:
                tree = tomllib.load(f)
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: not valid TOML: {err}") from None
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r}: expected section.field=value")
        _set_path(tree, key.strip().split("."), _parse_value(raw.strip()))
    if schema is RunConfig and "seed" in tree:
        for section in ROLE_SEEDS:
            if isinstance(tree.get(section, {}), dict):
                tree.setdefault(section, {}).setdefault("seed", tree["seed"])
    return build(schema, tree, prefix="")


def resolve_recipe(recipe: str) -> str:
    """A path to a TOML file, or the name of a shipped recipe in deploy/configs (without .toml)."""
    if os.path.isfile(recipe):
        return recipe
    shipped = os.path.join(CONFIG_DIR, recipe if recipe.endswith(".toml") else recipe + ".toml")
    if os.path.isfile(shipped):
        return shipped
    names = sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".toml"))
    raise ConfigError(f"recipe {recipe!r}: no such file, and not a shipped recipe (one of {names})")


def build(cls: type, tree: dict[str, Any], prefix: str) -> Any:
    """Instantiate dataclass `cls` from a nested dict, checking every key and value type."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(tree) - set(fields))
    if unknown:
        if prefix + unknown[0] in MOVED:
            raise ConfigError(f"{prefix + unknown[0]}: moved to {MOVED[prefix + unknown[0]]} (the remote sandbox's "
                              "settings are the [sandbox] section)")
        raise ConfigError(f"unknown config key {prefix + unknown[0]!r}: expected one of "
                          f"{[prefix + n for n in fields]}")
    kwargs = {}
    for name, value in tree.items():
        kind = hints[name]
        if dataclasses.is_dataclass(kind):
            if not isinstance(value, dict):
                raise ConfigError(f"{prefix + name}: expected a table of {kind.__name__} fields")
            kwargs[name] = build(kind, value, prefix=f"{prefix}{name}.")
        else:
            kwargs[name] = _check_type(f"{prefix}{name}", value, kind)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as err:
        raise ConfigError(str(err)) from None


def _check_type(key: str, value: Any, kind: Any) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Literal:
        if (key, value) in RENAMED_VALUES:
            raise ConfigError(f"{key}={value}: renamed {RENAMED_VALUES[key, value]}")
        if value not in args:
            raise ConfigError(f"{key}: expected one of {list(args)}, got {value!r}")
        return value
    if origin in (types.UnionType, typing.Union):
        for option in args:
            try:
                return _check_type(key, value, option)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {' or '.join(_describe(option) for option in args)}, got {value!r}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        return tuple(_check_type(f"{key}[{i}]", v, inner) for i, v in enumerate(value))
    if kind is Any or kind is type(None) and value is None:
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind in (int, float) and isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"{key}: expected {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def _describe(kind: Any) -> str:
    if typing.get_origin(kind) is Literal:
        return " or ".join(repr(v) for v in typing.get_args(kind))
    return "none" if kind is type(None) else getattr(kind, "__name__", str(kind))


def _parse_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # a bare word: a string


def _set_path(tree: dict[str, Any], keys: list[str], value: Any) -> None:
    for k in keys[:-1]:
        node = tree.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{'.'.join(keys)}: {k!r} is a value, not a section")
        tree = node
    tree[keys[-1]] = value


def sections(cfg: Any) -> list[tuple[str, Any, list[dataclasses.Field]]]:
    """('', cfg, its scalar fields), then (name, section, its scalar fields) for each section of `cfg`,
    in declaration order: the walk every writer of a config (TOML, the settings reference) takes."""
    def scalars(obj: Any) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(obj) if not dataclasses.is_dataclass(getattr(obj, f.name))]
    return [("", cfg, scalars(cfg))] + [(f.name, getattr(cfg, f.name), scalars(getattr(cfg, f.name)))
                                        for f in dataclasses.fields(cfg) if dataclasses.is_dataclass(getattr(cfg, f.name))]


def to_toml(cfg: Any, comments: Callable[[Any, str | None], list[str]] | None = None) -> str:
    """The resolved config as TOML (scalars at the top, one table per section). `comments(section,
    field name)` gives comment lines to write above a value (`None` for the name: above a table)."""
    out = []
    for name, section, scalars in sections(cfg):
        if name:
            out += ["", f"[{name}]", *(comments(section, None) if comments else [])]
        for f in scalars:
            out += [*(comments(section, f.name) if comments else []), f"{f.name} = {toml_value(getattr(section, f.name))}"]
    return "\n".join(out) + "\n"


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if value == value and abs(value) != float("inf") else (
            "nan" if value != value else ("inf" if value > 0 else "-inf"))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if value is None:
        raise ConfigError("None cannot be written to TOML: give the field a non-None default")
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'

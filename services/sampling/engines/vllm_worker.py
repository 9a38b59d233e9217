"""The worker extension threepo mixes into every vLLM worker (`LLM(worker_extension_cls=...)`).

vLLM builds its worker class with this one as an extra base, so these methods run inside each worker
process (one per tensor-parallel rank), next to the model on the worker's device, and are called
through `LLM.collective_rpc`. A version's fp32 m and σ stay in host memory the worker does not own:
the arrays the engine was handed (one worker in the engine's process: by reference), or a
safetensors file the engine staged (several workers in their own processes: mapped read-only and
shared, since vLLM 0.33's multiprocess `collective_rpc` sends its arguments as msgpack, in which
numpy arrays arrive as lists the workers cannot use). Each slot's θ̂ = m + c · σ ⊙ z(seed, name) (c
the slot's σ multiplier; `algorithms.param_noise`, exactly as the learner builds it, z drawn on the
device) is built tensor by tensor on the worker's device and streamed into vLLM's own reload path
(`Worker.reload_weights` with checkpoint-format tensors, which loads from the iterator as it goes):
on the device the worker holds nothing of threepo's beyond one tensor in flight, so its memory is the
served weights, whatever the tensor-parallel size. Fusing q/k/v and gate/up, sharding across ranks,
vocabulary padding and the CPU backend's oneDNN re-packing are vLLM's business, not ours.

The weight check: the mean's exact checksum is recomputed here on receipt; after each load, a
layout-invariant fingerprint (`weight_checks.value_fingerprint`) of what the model now holds is
compared with the fingerprint of the tensors fed to it (exact on one rank; with tensor parallelism
replicated tensors are counted once per rank, so only the unchanged-since-load check applies), and
`threepo_verify` re-reads the served weights and compares them with the fingerprint taken at load.
Weights the CPU backend packed into oneDNN (its fp32 Linear layers keep an empty `weight`; a tied
lm_head keeps its weight and a packed copy) are read back through the layer's own matmul with an
identity matrix — exact in fp32, and cheap only for the small models one serves on CPU. vLLM's
reload skips a tied lm_head, whose packed copy would then keep the old weights (logits of the
previous policy): `_repack_tied_cpu_weights` re-packs it, and the check compares every packed copy
with its weight.

Not here: scheduling, sampling or versions (services/sampling/engines/vllm_engine.py). Importing this module
imports only torch and threepo.algorithms (vLLM imports it inside every worker).
"""

from __future__ import annotations

import numpy as np
import torch

from threepo.algorithms import param_noise, weight_checks
from threepo.services.sampling.engines.staging import mapped_safetensors


class ThreepoWorkerExtension:
    """Methods added to vLLM's worker; state lives in `_threepo_*` attributes of the worker."""

    def threepo_load_version(self, version: int, mean: dict | str, sigma: dict | None, mean_checksum: str,
                             noise_rank: int = 0) -> str:
        """Take (m, σ) of `version` (arrays by name, or the path of a staged file holding `m/<name>` and
        `s/<name>`, then `sigma` is None; slots of rank-`noise_rank` noise) and serve the mean; return the checksum of the mean as
        received. A mean whose checksum differs from `mean_checksum` is not taken (the worker keeps
        what it held); the caller raises."""
        if isinstance(mean, str):
            staged = mapped_safetensors(mean)
            held = {n[2:]: t for n, t in staged.items() if n.startswith("m/")}
            sigma_held = {n[2:]: t for n, t in staged.items() if n.startswith("s/")} or None
        else:
            held = {n: torch.from_numpy(np.asarray(a, dtype=np.float32)) for n, a in mean.items()}
            sigma_held = None if sigma is None else {
                n: torch.from_numpy(np.asarray(a, dtype=np.float32)) for n, a in sigma.items()}
        received = weight_checks.weights_checksum(held.items())
        if received != mean_checksum:
            return received
        self._threepo_mean, self._threepo_sigma, self._threepo_version = held, sigma_held, version
        self._threepo_rank = noise_rank
        self.threepo_serve(None)
        return received

    def threepo_serve(self, seed: int | None, scale: float = 1.0) -> dict:
        """Load θ̂ = m + c · σ ⊙ z(seed), c = `scale` (seed None: the mean) through vLLM's reload path,
        built and streamed tensor by tensor; report whether the model holds exactly what was fed, and
        the served / intended noise energies."""
        fed, energy = [], [0.0, 0.0]
        weights = param_noise.iter_served(self._threepo_mean, self._threepo_sigma or {}, seed, scale, self.device,
                                          self.model_config.dtype, fed, energy if seed is not None else None,
                                          self._threepo_rank)
        self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        _repack_tied_cpu_weights(self.model_runner.get_model())
        expected = weight_checks.combined_fingerprint(fed)
        self._threepo_loaded = self._threepo_fingerprint()
        single_rank = self.parallel_config.tensor_parallel_size == 1
        matches = self._threepo_loaded[:2] == expected if single_rank else True
        return {"loaded_ok": matches and self._threepo_loaded[2],
                "noise_served": energy[0], "noise_intended": energy[1]}

    def threepo_hold_base(self) -> None:
        """Take the fingerprint of the weights as loaded (the base a LoRA run's adapters are served
        over: nothing is reloaded), which `threepo_verify` then compares with."""
        self._threepo_loaded = self._threepo_fingerprint()

    def threepo_lora_fingerprint(self, lora_id: int) -> tuple[int, int] | None:
        """Fingerprint of LoRA adapter `lora_id` as this worker holds it — every lora_a and lora_b of
        its `LoRAModel`, whose scaling vLLM folded into lora_b when it loaded it — or None if it is
        not loaded (vLLM loads an adapter at the first request naming it)."""
        adapters = self.model_runner.lora_manager._adapter_manager._registered_adapters
        if lora_id not in adapters:
            return None
        tensors = []
        for layer in adapters[lora_id].loras.values():
            for part in (layer.lora_a, layer.lora_b):
                tensors += [t for t in (part if isinstance(part, list) else [part]) if t is not None]
        return weight_checks.value_fingerprint(tensors)

    def threepo_held_bytes(self) -> dict:
        """Bytes of threepo's own state this worker holds beside the served weights: on its device
        (none between calls: θ̂ is streamed), and in host memory it maps or references (m and σ)."""
        held = [*self._threepo_mean.values(), *(self._threepo_sigma or {}).values()]
        return {"parameters": sum(t.numel() for t in self._threepo_mean.values()),
                "device": sum(t.numel() * t.element_size() for t in held if t.device.type != "cpu"),
                "host_mapped": sum(t.numel() * t.element_size() for t in held if t.device.type == "cpu")}

    def threepo_verify(self) -> bool:
        """Are the served weights still exactly those loaded by the last `threepo_serve`?"""
        now = self._threepo_fingerprint()
        return now[2] and now == self._threepo_loaded

    def _threepo_fingerprint(self) -> tuple[int, int, bool]:
        """Fingerprint of the served weights as the forward pass uses them, and whether every CPU
        packed copy of a readable weight (a tied lm_head's oneDNN copy) still equals that weight."""
        tensors, seen, consistent = [], set(), True
        for module in self.model_runner.get_model().modules():
            for pname, p in module.named_parameters(recurse=False):
                packed = pname == "weight" and hasattr(module, "cpu_linear")
                if packed and p.numel():  # a tied lm_head: its packed copy must equal the weight
                    consistent &= torch.equal(_packed_weight(module, p.dtype, p.shape[1]), p.detach())
                if id(p) in seen:
                    continue  # tied weights count once, as in the fed checkpoint
                seen.add(id(p))
                tensors.append(_packed_weight(module, p.dtype, module.input_size_per_partition)
                               if packed and p.numel() == 0 else p)
        return (*weight_checks.value_fingerprint(tensors), consistent)


def _repack_tied_cpu_weights(model: torch.nn.Module) -> None:
    """vLLM's reload skips a tied lm_head (its weight is the embedding's, already loaded), so on CPU
    its oneDNN copy would keep the old values: re-run the layer's post-load step for every CPU layer
    that keeps a readable weight next to a packed copy."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and weight is not None and weight.numel():
            module.quant_method.process_weights_after_loading(module)


@torch.inference_mode()
def _packed_weight(layer: torch.nn.Module, dtype: torch.dtype, in_features: int) -> torch.Tensor:
    """W [N, K] as a CPU layer's own matmul sees it (vLLM packs fp32 Linear weights into oneDNN and
    leaves `weight` empty): the matmul of I_K gives I · Wᵀ = Wᵀ exactly (products with 1 and sums
    with 0 are exact in floating point)."""
    eye = torch.eye(in_features, dtype=dtype)
    return layer.cpu_linear(eye, layer.weight, None).t()

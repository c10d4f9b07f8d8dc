"""Generation backends behind one interface (``base.Generator``), chosen by ``sampling.backend``.

``transformers`` (``hf.HFGenerator``) generates with the policy's own model in this
process; ``vllm`` (``vllm.VLLMGenerator``) runs a vLLM engine on the policy's model folder.
vLLM is imported only when it is chosen.
"""

from __future__ import annotations

from pathlib import Path

from p2prl.config import Config, ConfigError
from p2prl.policy.backends.base import Generator
from p2prl.policy.model import Policy, load_policy, model_folder


def make_generator(policy_or_path: Policy | str | Path, cfg: Config) -> Generator:
    """The generator ``cfg.sampling.backend`` names, over a loaded policy or a local model folder.

    The vLLM engine loads the folder itself: a policy passed here must be unchanged since it
    was loaded from its folder (later versions reach the engine through ``load``).
    """
    s = cfg.sampling
    if s.backend == "vllm":
        if cfg.model.lora_rank:
            raise ConfigError("sampling.backend='vllm' with model.lora_rank > 0: LoRA versions are adapter tensors, "
                              "which the vLLM backend does not load yet; use sampling.backend='transformers'")
        from p2prl.policy.backends.vllm import VLLMGenerator

        if isinstance(policy_or_path, Policy):
            folder = Path(policy_or_path.model.name_or_path)
        else:
            folder = model_folder(policy_or_path)
        return VLLMGenerator(folder, kv_cache_gib=s.vllm_kv_cache_gib, dtype=s.vllm_dtype, seed=cfg.train.seed)
    from p2prl.policy.backends.hf import HFGenerator

    return HFGenerator(policy_or_path if isinstance(policy_or_path, Policy) else load_policy(policy_or_path))

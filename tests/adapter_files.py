"""LoRA adapters for the compress-adapters tests: read back with safetensors' torch API, and written by ``peft``
itself on a small Llama built here (no download). Planted ones come from mpiscale.adapters.planted, which writes
them as a user's script would (safetensors' numpy API and a JSON adapter_config.json)."""

from pathlib import Path

import numpy as np


def read_adapter(directory: Path) -> dict[str, np.ndarray]:
    import torch
    from safetensors.torch import load_file

    return {
        key: value.to(torch.float64).numpy()
        for key, value in load_file(directory / "adapter_model.safetensors").items()
    }


def peft_adapters(root: Path, count: int, rank: int = 4, safe_serialization: bool = True) -> Path:
    """A tiny Llama saved in ``root``/base and ``count`` random LoRA adapters of it saved by peft (task-N); with
    ``safe_serialization=False`` as PyTorch pickles (adapter_model.bin), as PEFT saved them before 0.6."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(settings).save_pretrained(root / "base")
    for index in range(count):
        torch.manual_seed(10 + index)
        base = LlamaForCausalLM.from_pretrained(root / "base")
        lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        get_peft_model(base, lora).save_pretrained(root / "adapters" / f"task-{index}",
                                                   safe_serialization=safe_serialization)  # fmt: skip
    return root / "adapters"

"""Synthetic LoRA adapters with a known shared subspace, written as PEFT writes them (for examples and benchmarks).

Each adapter's A rows and B columns are random combinations of ``shared``
fixed directions per module, plus Gaussian noise; the angle between those
directions and the components found scores a compression.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .files import write_adapter

MODULES = ("base_model.model.model.layers.0.self_attn.q_proj", "base_model.model.model.layers.0.self_attn.v_proj")


def lora_config(rank: int, **changes: object) -> dict:
    """An adapter_config.json as peft writes it for a LoRA of ``rank`` (the keys compression reads)."""
    return {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"],
            "base_model_name_or_path": "tiny-llama", "use_dora": False} | changes  # fmt: skip


def write_planted(
    root: Path,
    count: int,
    rank: int = 4,
    inputs: int = 64,
    outputs: int = 48,
    shared: int = 6,
    noise: float = 1e-3,
    seed: int = 1,
    modules: tuple[str, ...] = MODULES,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``count`` float32 adapters in ``root``/task-N; returns each module's planted bases (shared x in, x out)."""
    rng = np.random.default_rng(seed)
    bases = {m: (np.linalg.qr(rng.standard_normal((inputs, shared)))[0].T,
                 np.linalg.qr(rng.standard_normal((outputs, shared)))[0].T) for m in modules}  # fmt: skip
    for index in range(count):
        tensors = {}
        for module, (a_basis, b_basis) in bases.items():
            a = rng.standard_normal((rank, shared)) @ a_basis + noise * rng.standard_normal((rank, inputs))
            b = b_basis.T @ rng.standard_normal((shared, rank)) + noise * rng.standard_normal((outputs, rank))
            tensors[f"{module}.lora_A.weight"] = a.astype(np.float32)
            tensors[f"{module}.lora_B.weight"] = b.astype(np.float32)
        write_adapter(root / f"task-{index}", tensors, lora_config(rank))
    return bases

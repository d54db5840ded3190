"""The transformer encoder ``mpiscale train --model transformer`` fits: rows of integer tokens to classes.

An ``nn.Sequential`` so that the pipeline can cut it like the MLP:
``embed`` (token and learned position embeddings), ``encoder1`` ...
``encoderN`` (pre-norm self-attention blocks, no dropout: a run on any shape
follows the one-process run), ``norm``, ``pool`` (the mean over the
sequence) and ``output``. The names are the ones ``collect --layers`` takes;
``pool`` gives one row of WIDTH numbers per sequence.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class TokenEmbedding(torch.nn.Module):
    """Each token's embedding plus its position's (both learned)."""

    def __init__(self, vocab: int, length: int, width: int) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, width)
        self.positions = torch.nn.Parameter(torch.randn(length, width) * 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tokens(tokens) + self.positions[: tokens.shape[1]]


class MeanOverTokens(torch.nn.Module):
    """(batch, length, width) -> (batch, width)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


def build_encoder(spec: dict) -> torch.nn.Sequential:
    """The encoder of ``spec``: vocab, length, width, heads, layers, classes."""
    width = spec["width"]
    layers: OrderedDict[str, torch.nn.Module] = OrderedDict(embed=TokenEmbedding(spec["vocab"], spec["length"], width))
    for index in range(1, spec["layers"] + 1):
        layers[f"encoder{index}"] = torch.nn.TransformerEncoderLayer(
            width, spec["heads"], dim_feedforward=4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
    layers["norm"] = torch.nn.LayerNorm(width)
    layers["pool"] = MeanOverTokens()
    layers["output"] = torch.nn.Linear(width, spec["classes"])
    return torch.nn.Sequential(layers)

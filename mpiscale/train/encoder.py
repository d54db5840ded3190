"""The transformer encoder ``mpiscale train --model transformer`` fits: rows of integer tokens to classes.

An ``nn.Sequential`` so that the pipeline can cut it like the MLP:
``embed`` (token and learned position embeddings), ``encoder1`` ...
``encoderN`` (pre-norm self-attention blocks, no dropout: a run on any shape
follows the one-process run), ``norm``, ``pool`` (the mean over the
sequence) and ``output``. The names are the ones ``collect --layers`` takes;
``pool`` gives one row of WIDTH numbers per sequence.

A spec with ``ragged`` takes sequences of varying length, padded with -1
(``PAD``): the padding travels with the activations as one more channel (a
``Sequential`` passes one tensor, and a pipeline stage sends one), every
attention ignores it, and ``pool`` averages only the real tokens, so a
sequence's result does not depend on how much padding its batch has.
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


PAD = -1  # the token id that pads a ragged sequence


class PaddedEmbedding(TokenEmbedding):
    """As ``TokenEmbedding``, for tokens padded with PAD: (batch, length) -> (batch, length, width + 1), the last
    channel 1 where a position is padding."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        padding = tokens == PAD
        embedded = super().forward(tokens.masked_fill(padding, 0))
        return torch.cat([embedded, padding.unsqueeze(-1).to(embedded.dtype)], dim=-1)


def _split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(activations, padding mask) of a padded activation."""
    return x[..., :-1], x[..., -1] > 0.5


class PaddedEncoderLayer(torch.nn.TransformerEncoderLayer):
    """An encoder layer whose attention skips the padded positions (the mask is the input's last channel)."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # type: ignore[override]
        values, padding = _split(x)
        out = super().forward(values, src_key_padding_mask=padding)
        return torch.cat([out.masked_fill(padding.unsqueeze(-1), 0.0), x[..., -1:]], dim=-1)


class PaddedNorm(torch.nn.LayerNorm):
    """LayerNorm of the activations, the padding channel passed on."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([super().forward(x[..., :-1]), x[..., -1:]], dim=-1)


class MeanOverRealTokens(torch.nn.Module):
    """(batch, length, width + 1) -> (batch, width): the mean over the positions that are not padding."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values, padding = _split(x)
        real = (~padding).unsqueeze(-1).to(values.dtype)
        return (values * real).sum(dim=1) / real.sum(dim=1).clamp(min=1.0)


def build_encoder(spec: dict) -> torch.nn.Sequential:
    """The encoder of ``spec``: vocab, length, width, heads, layers, classes (and ``ragged``)."""
    width, ragged = spec["width"], spec.get("ragged", False)
    embed = (PaddedEmbedding if ragged else TokenEmbedding)(spec["vocab"], spec["length"], width)
    layers: OrderedDict[str, torch.nn.Module] = OrderedDict(embed=embed)
    for index in range(1, spec["layers"] + 1):
        layers[f"encoder{index}"] = (PaddedEncoderLayer if ragged else torch.nn.TransformerEncoderLayer)(
            width, spec["heads"], dim_feedforward=4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
    layers["norm"] = (PaddedNorm if ragged else torch.nn.LayerNorm)(width)
    layers["pool"] = MeanOverRealTokens() if ragged else MeanOverTokens()
    layers["output"] = torch.nn.Linear(width, spec["classes"])
    return torch.nn.Sequential(layers)

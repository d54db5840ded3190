"""Image patches of the photos scikit-learn ships: real signals for dictionary learning, with no download.

Both sample photos (``china.jpg`` and ``flower.jpg``) are turned to grey levels
in [0, 1]; random square patches are cut from them, and each patch loses its
mean (dictionary learning on natural images models the texture, not the
brightness). The same seed cuts the same patches on every rank.
"""

from __future__ import annotations

import numpy as np

SAMPLE_IMAGES = ("china.jpg", "flower.jpg")


def sample_image_patches(side: int = 8, per_image: int = 20_000, seed: int = 0) -> np.ndarray:
    """Mean-removed ``side`` x ``side`` patches of each sample photo, one per row (``per_image`` of each).

    Needs scikit-learn and pillow, which read the photos (both in the ``test`` and ``bench`` extras).
    """
    from sklearn.datasets import load_sample_image
    from sklearn.feature_extraction.image import extract_patches_2d

    if side < 1 or per_image < 1:
        raise ValueError(f"patches need a side and a count of at least 1, got side {side}, {per_image} per image")
    rows = []
    for offset, name in enumerate(SAMPLE_IMAGES):
        grey = load_sample_image(name).mean(axis=2) / 255.0
        cut = extract_patches_2d(grey, (side, side), max_patches=per_image, random_state=seed + offset)
        rows.append(cut.reshape(len(cut), -1))
    patches = np.concatenate(rows)
    return patches - patches.mean(axis=1, keepdims=True)

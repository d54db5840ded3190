"""Turn scikit-learn's bundled sample photos into an HDF5 data set of image patches (no download).

    launch/mpiscale-run -n 2 -- python examples/image_patches.py patches.h5
    launch/mpiscale-run -n 2 -- mpiscale dictlearn --data patches.h5:/patches --atoms 256 --sparsity 8 \\
        --iterations 500 --out patches-results.h5
    .venv/bin/mpiscale inspect patches-results.h5 --plot patches-atoms.png

Both photos (``china.jpg`` and ``flower.jpg``) are turned to grey levels in
[0, 1]; random square patches are cut from them, and each patch loses its mean
(dictionary learning on natural images models the texture, not the brightness).
Every rank cuts the same patches and writes its block of rows, collectively.
The file's config names the patch shape, so ``mpiscale inspect --plot`` draws
the learned atoms as a grid of small images.
"""

import argparse

import numpy as np
from sklearn.datasets import load_sample_image
from sklearn.feature_extraction.image import extract_patches_2d

import mpiscale
from mpiscale.io import rank_rows, write_dataset

IMAGES = ("china.jpg", "flower.jpg")


def patches(side: int, per_image: int, seed: int) -> np.ndarray:
    """Mean-removed ``side`` x ``side`` patches of every sample image, one per row."""
    rows = []
    for offset, name in enumerate(IMAGES):
        grey = load_sample_image(name).mean(axis=2) / 255.0
        cut = extract_patches_2d(grey, (side, side), max_patches=per_image, random_state=seed + offset)
        rows.append(cut.reshape(len(cut), -1))
    rows = np.concatenate(rows)
    return rows - rows.mean(axis=1, keepdims=True)


async def main(system) -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("out", help="the HDF5 file to write (dataset /patches)")
    options.add_argument("--side", type=int, default=8, help="patch side in pixels (default: 8)")
    options.add_argument("--per-image", type=int, default=20_000, help="patches cut from each photo (default: 20000)")
    options.add_argument("--seed", type=int, default=0, help="where the patches are cut (default: 0)")
    args = options.parse_args()
    rows = patches(args.side, args.per_image, args.seed)
    start, stop = rank_rows(len(rows), system.size, system.rank)
    config = {"patch_shape": [args.side, args.side], "images": list(IMAGES), "seed": args.seed}
    shapes = write_dataset(args.out, {"patches": rows[start:stop]}, system.world, config=config)
    if system.rank == 0:
        print(
            f"wrote {args.out}: /patches {shapes['patches']} ({args.side}x{args.side} patches of {len(IMAGES)} photos)"
        )


mpiscale.run(main)

"""Turn scikit-learn's bundled sample photos into an HDF5 data set of image patches (no download).

    launch/mpiscale-run -n 2 -- python examples/image_patches.py patches.h5
    launch/mpiscale-run -n 2 -- mpiscale dictlearn --data patches.h5:/patches --atoms 256 --sparsity 8 \\
        --iterations 500 --out patches-results.h5
    .venv/bin/mpiscale inspect patches-results.h5 --plot patches-atoms.png

The patches are ``mpiscale.dictlearn.sample_image_patches``: random square
patches of both photos in grey levels, each less its own mean. Every rank cuts
the same patches and writes its block of rows, collectively. The file's config
names the patch shape, so ``mpiscale inspect --plot`` draws the learned atoms
as a grid of small images.
"""

import argparse

import mpiscale
from mpiscale.dictlearn import SAMPLE_IMAGES, sample_image_patches
from mpiscale.io import rank_rows, write_dataset


async def main(system) -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("out", help="the HDF5 file to write (dataset /patches)")
    options.add_argument("--side", type=int, default=8, help="patch side in pixels (default: 8)")
    options.add_argument("--per-image", type=int, default=20_000, help="patches cut from each photo (default: 20000)")
    options.add_argument("--seed", type=int, default=0, help="where the patches are cut (default: 0)")
    args = options.parse_args()
    rows = sample_image_patches(args.side, args.per_image, args.seed)
    start, stop = rank_rows(len(rows), system.size, system.rank)
    config = {"patch_shape": [args.side, args.side], "images": list(SAMPLE_IMAGES), "seed": args.seed}
    shapes = write_dataset(args.out, {"patches": rows[start:stop]}, system.world, config=config)
    if system.rank == 0:
        photos = f"{args.side}x{args.side} patches of {len(SAMPLE_IMAGES)} photos"
        print(f"wrote {args.out}: /patches {shapes['patches']} ({photos})")


mpiscale.run(main)

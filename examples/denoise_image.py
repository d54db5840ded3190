"""Image denoising with a dictionary learned from the noisy image's own patches (Elad and Aharon, 2006).

    python examples/denoise_image.py prepare denoise --sigma 20        # noisy image and its 8x8 patches
    launch/mpiscale-run -n 2 -- mpiscale dictlearn --data denoise/noisy.h5:/patches --remove-mean \\
        --atoms 256 --sparsity 16 --max-residual 184 --iterations 400 --out denoise/dictionary.h5
    launch/mpiscale-run -n 2 -- mpiscale encode --dictionary denoise/dictionary.h5 \\
        --data denoise/noisy.h5:/patches --sparsity 32 --max-residual 184 --out denoise/codes.h5
    python examples/denoise_image.py rebuild denoise                   # PSNR of the denoised image
    python examples/denoise_image.py sklearn denoise                   # scikit-learn's pipeline, same settings

``prepare`` cuts a grey square of scikit-learn's ``china.jpg`` (no download),
adds Gaussian noise of ``--sigma`` grey levels, and writes every overlapping
8x8 patch of the noisy image, one per row, as they are: ``--remove-mean``
takes each patch's mean away and ``encode`` keeps it (``/mean``). It prints the
error target K-SVD denoising codes to, 1.15 sigma sqrt(64). ``rebuild`` puts the
coded patches back in place, averages where they overlap, and prints the PSNR
against the clean image. ``sklearn`` runs scikit-learn's own pipeline on the
same patches with the same settings (``MiniBatchDictionaryLearning`` with as
many atoms, its atoms coded by its ``orthogonal_mp_gram`` to the same target)
and prints its PSNR and time beside ours.
"""

import argparse
import json
import time
from pathlib import Path

import h5py
import numpy as np
from sklearn.datasets import load_sample_image
from sklearn.feature_extraction.image import extract_patches_2d, reconstruct_from_patches_2d

from mpiscale.dictlearn import load_codes

SIDE = 8
GAIN = 1.15  # the error target's factor over the noise (Elad and Aharon)


def psnr(image: np.ndarray, clean: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB, for grey levels 0-255."""
    return float(10 * np.log10(255.0**2 / np.mean((image - clean) ** 2)))


def prepare(folder: Path, sigma: float, size: int, seed: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    grey = load_sample_image("china.jpg").mean(axis=2)
    top, left = (grey.shape[0] - size) // 2, (grey.shape[1] - size) // 2
    clean = grey[top : top + size, left : left + size]
    noisy = clean + sigma * np.random.default_rng(seed).standard_normal(clean.shape)
    patches = extract_patches_2d(noisy, (SIDE, SIDE)).reshape(-1, SIDE * SIDE)
    target = GAIN * sigma * SIDE
    with h5py.File(folder / "noisy.h5", "w") as file:
        file["patches"] = patches
        file["clean"], file["noisy"] = clean, noisy
        file.attrs["config"] = json.dumps({"patch_shape": [SIDE, SIDE], "sigma": sigma, "max_residual": target})
    print(f"wrote {folder / 'noisy.h5'}: /patches {patches.shape} of a {size}x{size} image at sigma {sigma:g} "
          f"(PSNR {psnr(noisy, clean):.2f} dB); code to --max-residual {target:g}")  # fmt: skip


def rebuild(folder: Path) -> None:
    with h5py.File(folder / "noisy.h5", "r") as file:
        clean, noisy = file["clean"][()], file["noisy"][()]
    codes = load_codes(str(folder / "codes.h5"))
    denoised = reconstruct_from_patches_2d(codes.signals().reshape(-1, SIDE, SIDE), clean.shape)
    np.save(folder / "denoised.npy", denoised)
    per_patch = np.diff(codes.indptr).mean()
    print(f"noisy {psnr(noisy, clean):.2f} dB -> denoised {psnr(denoised, clean):.2f} dB ({per_patch:.2f} atoms a "
          f"patch; the image in {folder / 'denoised.npy'})")  # fmt: skip


def with_scikit_learn(folder: Path, iterations: int) -> None:
    """scikit-learn's pipeline with the same settings: as many atoms and mini-batches, the same target."""
    from sklearn.decomposition import MiniBatchDictionaryLearning
    from sklearn.linear_model import orthogonal_mp_gram

    with h5py.File(folder / "noisy.h5", "r") as file:
        clean, patches = file["clean"][()], file["patches"][()]
        settings = json.loads(file.attrs["config"])
    with h5py.File(folder / "dictionary.h5", "r") as file:
        learned = json.loads(file.attrs["config"])
    means = patches.mean(axis=1, keepdims=True)
    signals = patches - means
    began = time.perf_counter()
    model = MiniBatchDictionaryLearning(n_components=learned["atoms"], batch_size=learned["batch_size"],
                                        max_iter=-(-iterations * learned["batch_size"] // len(signals)),
                                        random_state=0).fit(signals)  # fmt: skip
    atoms = model.components_ / np.linalg.norm(model.components_, axis=1, keepdims=True)
    target = settings["max_residual"]
    codes = orthogonal_mp_gram(atoms @ atoms.T, atoms @ signals.T, tol=target**2,
                               norms_squared=(signals**2).sum(axis=1)).T  # fmt: skip
    denoised = reconstruct_from_patches_2d((codes @ atoms + means).reshape(-1, SIDE, SIDE), clean.shape)
    print(f"scikit-learn: denoised {psnr(denoised, clean):.2f} dB in {time.perf_counter() - began:.1f} s "
          f"({np.count_nonzero(codes) / len(codes):.2f} atoms a patch)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    steps = parser.add_subparsers(dest="step", required=True)
    made = steps.add_parser("prepare", help="the noisy image and its patches")
    made.add_argument("folder", type=Path)
    made.add_argument("--sigma", type=float, default=20.0, help="noise, in grey levels 0-255 (default: 20)")
    made.add_argument("--size", type=int, default=256, help="side of the square cut from the photo (default: 256)")
    made.add_argument("--seed", type=int, default=0, help="of the noise (default: 0)")
    steps.add_parser("rebuild", help="the denoised image from codes.h5, and its PSNR").add_argument("folder", type=Path)
    compared = steps.add_parser("sklearn", help="scikit-learn's pipeline on the same patches, same settings")
    compared.add_argument("folder", type=Path)
    compared.add_argument("--iterations", type=int, default=400, help="mini-batches (default: 400, as dictlearn)")
    args = parser.parse_args()
    if args.step == "prepare":
        prepare(args.folder, args.sigma, args.size, args.seed)
    elif args.step == "rebuild":
        rebuild(args.folder)
    else:
        with_scikit_learn(args.folder, args.iterations)


if __name__ == "__main__":
    main()

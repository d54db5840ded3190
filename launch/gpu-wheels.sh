#!/usr/bin/env bash
# Fill gpu-wheels/ with what a GPU machine without network needs beside its own Python (run here, with network):
#   bash launch/gpu-wheels.sh [PYTHON_VERSION]     (default 3.12, the GPU image's python3)
# The GPU image has torch with CUDA, mpi4py, h5py, numba and numba-cuda; mpiscale needs these too. numpy stays
# below 2.5 for numba-cuda 0.30, whose CUDA target did not load under numpy 2.5 on the first real-GPU run.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
version="${1:-3.12}"
python="$repo/.venv/bin/python"
[[ -x "$python" ]] || python=python3
platforms=()
for tag in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 any; do
    platforms+=(--platform "$tag")
done
rm -rf "$repo/gpu-wheels"
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$version" "${platforms[@]}" \
    -d "$repo/gpu-wheels" "aiomqtt>=2.0" "paho-mqtt>=2.0" "crc32c>=2.4" "numpy>=2.0,<2.5"
ls "$repo/gpu-wheels"

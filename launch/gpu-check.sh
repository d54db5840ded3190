#!/usr/bin/env bash
# make gpu-check's steps: the CUDA tests on the real GPU (they fail, not skip, without one), then the GPU columns of
# the benchmarks. On a machine set up by launch/setup.sh it runs with .venv; on a GPU machine without network it
# runs with that machine's own python3 (CUDA torch, mpi4py, h5py, numba-cuda), adding the wheels of gpu-wheels/
# (launch/gpu-wheels.sh fills it where there is network; carry it along) under .gpu-site. The benchmarks' JSON
# goes to $OUT when it is set, else to the current directory. docs/hpc.md says how it is run.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    python=python3
    [[ -x .venv/bin/python ]] && python=.venv/bin/python
fi
if [[ "$python" != .venv/bin/python ]] && compgen -G "gpu-wheels/*.whl" >/dev/null; then  # the machine's own python
    rm -rf .gpu-site
    "$python" -m pip install --quiet --no-index --no-deps --target .gpu-site gpu-wheels/*.whl
    export PYTHONPATH="$repo/.gpu-site:$repo${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
fi
out="${OUT:-.}"
mpiscale=("$python" -m mpiscale.cli)
"$python" -c "import torch, numba, mpiscale; print('gpu-check:', torch.__version__, 'numba', numba.__version__, \
'GPUs', torch.cuda.device_count())"
MPISCALE_REQUIRE_GPU=1 "$python" -m pytest -q -rs -p no:cacheprovider -k real_gpu tests/unit/test_omp_cuda.py \
    tests/unit/test_memstore_cuda.py tests/mpi/test_dictlearn.py tests/mpi/test_train.py \
    tests/mpi/test_pipeline_train.py tests/mpi/test_adapters.py tests/mpi/test_circuits.py
"${mpiscale[@]}" bench omp --json "$out/bench-omp-gpu.json"
launch/mpiscale-run -n 1 -- "${mpiscale[@]}" bench dictlearn --json "$out/bench-dictlearn-gpu.json"
launch/mpiscale-run -n 1 -- "${mpiscale[@]}" bench memstore --json "$out/bench-memstore-gpu.json"
"${mpiscale[@]}" bench adapters --sizes 4096x100 --dir "${TMPDIR:-/tmp}/mpiscale-bench" --json "$out/bench-adapters-gpu.json"
launch/mpiscale-run -n 1 -- "${mpiscale[@]}" bench ddp --device cuda --json "$out/bench-ddp-gpu.json"

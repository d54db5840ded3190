#!/usr/bin/env bash
# From a trained model to its features and their top inputs, on N ranks (default 2):
#   train an MLP on the bundled handwritten digits -> collect its first hidden layer's activations
#   -> learn a dictionary of them -> list, for each atom, the digits that use it most.
#
#   bash examples/features_of_a_model.sh OUTDIR [RANKS]
# Set MPISCALE to the command to run (default: mpiscale on the PATH).
set -euo pipefail
out="${1:?usage: $0 OUTDIR [RANKS]}"
ranks="${2:-2}"
here="$(cd "$(dirname "$0")/.." && pwd)"
run() { "$here/launch/mpiscale-run" -n "$ranks" -- ${MPISCALE:-mpiscale} "$@"; }
mkdir -p "$out"

run train --epochs 6 --out "$out/model.h5" --progress-every 0
run collect --model "$out/model.h5" --layers relu1 --out "$out/activations.h5"
run dictlearn --data "$out/activations.h5:/relu1" --atoms 20 --sparsity 3 --iterations 150 \
    --out "$out/features.h5" --progress-every 0
${MPISCALE:-mpiscale} inspect "$out/features.h5" --top-inputs 5 --atoms 20

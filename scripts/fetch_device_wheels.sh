#!/usr/bin/env bash
# Download into .whl/ (git-ignored) the Python wheels an offline H200 machine lacks, for Python 3.12 on
# manylinux x86_64. That machine has Python 3.12, torch, torchvision, numpy, Pillow, pyarrow, pandas and
# most small libraries, but newer transformers / tokenizers / huggingface_hub / accelerate than we pin and
# no datasets; simplejpeg (the fast pipelines' JPEG decoder) is
# fetched too, so the device decodes as we do here. The benchmark installs these with
# `pip install --target /tmp/site` and puts that folder first on PYTHONPATH, so they shadow its copies.
#
#   bash scripts/fetch_device_wheels.sh        # then carry .whl to the device
#
# Pins come from requirements.txt; dill and multiprocess are datasets' own needs, pinned to the versions
# our CPU stack runs with. Only wheels of these names are replaced in .whl/: pip installs all of .whl/*.whl
# at once and stops when it meets two versions of one package.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
FROM_REQUIREMENTS=(transformers tokenizers huggingface_hub datasets evaluate accelerate simplejpeg)
EXTRA_PINS=(dill==0.4.1 multiprocess==0.70.19)

pin_of() {  # the name==version line of requirements.txt for a package
    local line
    line=$(grep -iE "^$1==" requirements.txt | head -n 1 || true)
    if [[ -z "$line" ]]; then
        echo "requirements.txt has no '$1==VERSION' pin" >&2
        exit 1
    fi
    echo "${line%%[[:space:]]*}"
}

pins=()
for name in "${FROM_REQUIREMENTS[@]}"; do pins+=("$(pin_of "$name")"); done
pins+=("${EXTRA_PINS[@]}")

staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$staging" "${pins[@]}"

mkdir -p .whl
for wheel in "$staging"/*.whl; do
    dist=$(basename "$wheel" | cut -d- -f1)  # wheel file names use the normalised distribution name
    rm -f .whl/"$dist"-*.whl
    mv "$wheel" .whl/
done
echo "wheels for the device in .whl/ ($(du -sh .whl | cut -f1)):"
ls -1 .whl

#!/usr/bin/env sh
# `make bench` builds .venv with PyPI's torch (a CUDA build), which knows nothing of HPUs. On a Gaudi node,
# inside Habana's PyTorch container, the benchmark must run on the container's own torch instead: refuse,
# naming what gave the container away, and say what to run there. Exit status 2 when refusing.
reason=""
if command -v hl-smi >/dev/null 2>&1; then
    reason="hl-smi is on PATH"
elif [ -d /usr/lib/habanalabs ]; then
    reason="/usr/lib/habanalabs exists"
elif "${PYTHON:-python3}" -c "import habana_frameworks" >/dev/null 2>&1; then
    reason="${PYTHON:-python3} imports habana_frameworks"
fi
[ -z "$reason" ] && exit 0
cat >&2 <<MSG
make bench: this looks like a Habana Gaudi machine ($reason). make bench would install PyPI's torch
into .venv, which cannot use the HPUs. Inside Habana's PyTorch container, keep its torch and run:
    pip install -r requirements-gaudi.txt && pip install --no-deps -e .
    python -m bridgetower_bench.tools.gaudi_check        # first: what works on this node
    python -m bridgetower_bench.tools.bench               # the sweep on the embedded default
MSG
exit 2

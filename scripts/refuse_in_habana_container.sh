#!/usr/bin/env sh
# `make bench` and `make test` build .venv with PyPI's torch (a CUDA build), which knows nothing of HPUs. On a Gaudi
# node, inside Habana's PyTorch container, the benchmark must run on the container's own torch instead, and the test
# suite (CPU, with stand-ins for Habana's software) belongs on a machine without it: refuse, naming what gave the
# container away, and say what to run there. The make goal is the first argument (default: bench). Exit status 2
# when refusing.
goal="${1:-bench}"
reason=""
if command -v hl-smi >/dev/null 2>&1; then
    reason="hl-smi is on PATH"
elif [ -d /usr/lib/habanalabs ]; then
    reason="/usr/lib/habanalabs exists"
elif "${PYTHON:-python3}" -c "import habana_frameworks" >/dev/null 2>&1; then
    reason="${PYTHON:-python3} imports habana_frameworks"
fi
[ -z "$reason" ] && exit 0
if [ "$goal" = bench ]; then
    cat >&2 <<MSG
make bench: this looks like a Habana Gaudi machine ($reason). make bench would install PyPI's torch
into .venv, which cannot use the HPUs. Inside Habana's PyTorch container, keep its torch and run:
    pip install -r requirements-gaudi.txt && pip install --no-deps -e .
    PT_HPU_LAZY_MODE=1 python -m bridgetower_bench.tools.gaudi_check     # first: what works on this node
    PT_HPU_LAZY_MODE=1 python -m bridgetower_bench.tools.bench            # the sweep on the embedded default
MSG
else
    cat >&2 <<MSG
make $goal: this looks like a Habana Gaudi machine ($reason). make $goal would install PyPI's torch
into .venv, which cannot use the HPUs; the test suite runs on CPU with stand-ins for Habana's software and
belongs on a machine without it. On this node, keep the container's torch and check it instead:
    pip install -r requirements-gaudi.txt && pip install --no-deps -e .
    PT_HPU_LAZY_MODE=1 python -m bridgetower_bench.tools.gaudi_check     # what works on this node
MSG
fi
exit 2

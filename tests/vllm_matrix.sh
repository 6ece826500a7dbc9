#!/usr/bin/env bash
# The connector's tests on every supported vLLM release but the default, each in a venv of
# its own (`make .venv-vllm-X/.deps-installed`, tests/vllm_venv.sh), removed after its run:
#   tests/vllm_matrix.sh [--beside COMMAND] VERSION...
#
# The next release's venv is built while this one's tests run (a build waits on pip and the
# disk, the tests on the engines), so at most two venvs are on the disk at once; the first
# one while COMMAND runs, if given (.ci/run: `make test`). A venv built before, and still
# newer than what makes it, is used as it is.
set -euo pipefail
builder="" building=""

start_build() {
    building=$1
    # a session of its own, so that the trap below stops pip with it
    setsid nice -n 10 make --no-print-directory ".venv-vllm-$1/.deps-installed" \
        >".venv-vllm-$1.log" 2>&1 &
    builder=$!
}

finish_build() {
    if ! wait "$builder"; then
        cat ".venv-vllm-$building.log" >&2
        echo "tests/vllm_matrix.sh: making the venv of vLLM $building failed (above)" >&2
        exit 1
    fi
    builder=""
}

trap '[[ -z $builder ]] || kill -- "-$builder" 2>/dev/null || true' EXIT
beside=""
if [[ ${1:-} == --beside ]]; then
    beside=$2
    shift 2
fi
versions=("$@")
start_build "${versions[0]}"
[[ -z $beside ]] || $beside
for index in "${!versions[@]}"; do
    version=${versions[$index]}
    finish_build
    next=${versions[$((index + 1))]:-}
    [[ -z $next ]] || start_build "$next"
    make --no-print-directory test-vllm VLLM="$version"
    rm -rf ".venv-vllm-$version" ".venv-vllm-$version.log"
done

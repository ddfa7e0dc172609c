# Helpers for .ci/run (sourced): each pass in a new virtual environment, run to its end whatever an earlier pass did.
# A pass prints its versions before its tests and its time last; `finish` names the passes that failed and fails.

PASS_ENVS="${PASS_ENVS:-$(mktemp -d)}"
mkdir -p "$PASS_ENVS"
FAILED_PASSES=()

new_env() {  # a new, empty virtual environment, activated (in the pass's subshell); VENV_OPTIONS: python3 -m venv's
    # shellcheck disable=SC2086
    python3 -m venv ${VENV_OPTIONS:-} "$PASS_ENVS/$1"
    # shellcheck disable=SC1091
    source "$PASS_ENVS/$1/bin/activate"
}

run_pass() {  # run_pass NAME TITLE FUNCTION [ARG...]: FUNCTION ARG... in a subshell with `set -e`, in a new environment
    # whose folder also holds the pass's temporary files (TMPDIR: pytest's, inductor's cache and precompiled headers,
    # AOTInductor's extracted packages) and uv's cache, so that a pass starts from none and leaves none on the disk
    local name=$1 title=$2 body=$3 start=$SECONDS status
    shift 3
    echo "== $name: $title ($(free_disk) free)"
    set +e  # the subshell's own `set -e` holds only where its exit status is not tested (no `||`, no `if`)
    ( set -euo pipefail; new_env "$name"; echo "== $name: $(python --version) in $PASS_ENVS/$name"
      export TMPDIR="$PASS_ENVS/$name/tmp" UV_CACHE_DIR="$PASS_ENVS/$name/uv-cache"
      mkdir -p "$TMPDIR"
      "$body" "$@" )
    status=$?
    echo "== $name: its folder took $(du -sh "$PASS_ENVS/$name" | cut -f1) ($(free_disk) free)"
    rm -rf "${PASS_ENVS:?}/$name"  # a CUDA build of torch takes several GB
    if [ "$status" -ne 0 ]; then
        FAILED_PASSES+=("$name")
        echo "== $name: FAILED (exit $status) after $((SECONDS - start)) s"
    else
        echo "== $name: passed in $((SECONDS - start)) s"
    fi
}

free_disk() {  # the space left where the passes write
    df -h --output=avail "$PASS_ENVS" | tail -1 | tr -d ' '
}

finish() {  # the verdict: exit 1 naming every failed pass, else 0
    rm -rf "$PASS_ENVS"
    if [ "${#FAILED_PASSES[@]}" -ne 0 ]; then
        echo "== CI FAILED: ${FAILED_PASSES[*]} (of $1 passes)"
        return 1
    fi
    echo "== CI passed: $1 passes"
}

versions() {  # what the pass tests with, printed before its tests
    python - "$@" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
def v(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return "-"
print("== versions:", ", ".join(f"{name} {v(name)}" for name in sys.argv[1:]))
PY
}

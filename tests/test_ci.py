"""`.ci/run`'s passes: a failing pass lets the later ones run, each prints its time and keeps its temporary files in
its own folder, and the script fails at the end naming the failed passes (the helpers in .ci/passes.sh, driven with
stand-in passes)."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
set -uo pipefail
source .ci/passes.sh
broken() { echo "step 1"; false; echo "never printed"; }
fine() { python -c "import os, sys, tempfile; print('in', sys.prefix, 'with', sys.argv[1:])
print('temporary files in', tempfile.mkdtemp(), 'uv cache in', os.environ['UV_CACHE_DIR'])" "$@"; }
run_pass first "a pass that fails half-way" broken
run_pass second "a pass after it" fine "2.6" "two words"
run_pass third "another failing pass" false
finish 3
"""


def test_a_failing_pass_lets_the_later_ones_run_and_fails_the_script(tmp_path):
    proc = subprocess.run(["bash", "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PASS_ENVS": str(tmp_path / "envs"),
                               "VENV_OPTIONS": "--without-pip"})  # no pass here installs: 5 s less a pass
    out = proc.stdout
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "step 1" in out and "never printed" not in out  # `set -e` inside a pass ends that pass
    # the next pass ran, in its own new environment, given its arguments
    assert f"in {tmp_path / 'envs' / 'second'} with ['2.6', 'two words']" in out
    # its temporary files and uv's cache in its folder, which goes after it
    assert f"temporary files in {tmp_path / 'envs' / 'second' / 'tmp'}/tmp" in out
    assert f"uv cache in {tmp_path / 'envs' / 'second' / 'uv-cache'}\n" in out
    assert re.search(r"== second: its folder took \S+ \(\S+ free\)", out)
    assert "== first: FAILED (exit 1) after" in out and "== second: passed in" in out
    assert "== third: FAILED" in out
    assert out.strip().splitlines()[-1] == "== CI FAILED: first third (of 3 passes)"
    assert not (tmp_path / "envs").exists()  # environments deleted


def test_the_first_pass_runs_the_readmes_test_command_verbatim():
    """The README's test command (its fenced block after "Run the tests") stands in `.ci/run`'s first pass as written,
    line for line."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("Run the tests", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    command = [line.strip() for line in block.strip().splitlines()]
    assert "pytest" in command[-1]
    newest = (ROOT / ".ci" / "run").read_text().split("newest() {", 1)[1].split("\n}", 1)[0]
    lines = [line.strip() for line in newest.splitlines()]
    start = lines.index(command[0])
    assert lines[start:start + len(command)] == command


def test_a_failing_run_names_the_releases_outside_the_tested_versions():
    """The tested-versions table of docs/development.md, as conftest's summary of a failing run reads it: every row,
    its lowest and newest release; an installed release above the newest (or below the lowest) is named, one in range
    is not, and the packages CI prints all have a row."""
    from helpers import tested_versions, untested_releases

    tested = tested_versions((ROOT / "docs" / "development.md").read_text(encoding="utf-8"))
    ci_packages = re.search(r"PACKAGES=\(([^)]*)\)", (ROOT / ".ci" / "run").read_text())[1].split()
    assert set(ci_packages) - {"numpy"} <= set(tested), set(ci_packages) - set(tested)
    lowest, newest = tested["transformers"]
    above = f"{newest.rsplit('.', 1)[0]}.{int(newest.rsplit('.', 1)[1]) + 1}"
    installed = {"transformers": above, "torch": tested["torch"][1] + "+cpu", "peft": "0.1.0"}.get
    assert untested_releases(tested, installed) == [
        f"transformers {above} is newer than the newest release tested ({newest})",
        f"peft 0.1.0 is older than the lowest release tested ({tested['peft'][0]})"]

"""`.ci/find-python`, which `make` uses to pick the virtualenv's interpreter on a fresh machine.

Every interpreter here is a fake shell script whose exit status answers the finder's version
check, so the test controls what "usable" means and does not depend on the Pythons installed.
The PATH holds only the fakes and a directory with `bash` (and `make`), so no real python3 can be found.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FINDER = REPO / ".ci" / "find-python"

FAILING_SHIM = '#!/bin/sh\necho "pyenv: $0: command not found" >&2\nexit 127\n'
TOO_OLD = "#!/bin/sh\nexit 1\n"  # what `sys.exit(sys.version_info < (3, 12))` returns on 3.11
USABLE = "#!/bin/sh\nexit 0\n"


def _script(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture
def machine(tmp_path):
    """A PATH with a failing `python3.12` pyenv shim and a too-old `python3`; an empty pyenv root."""
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "bash").symlink_to(shutil.which("bash"))
    shims = tmp_path / "shims"
    _script(shims / "python3.12", FAILING_SHIM)
    _script(shims / "python3", TOO_OLD)
    pyenv_root = tmp_path / "pyenv"
    _script(pyenv_root / "versions" / "3.11.7" / "bin" / "python3", TOO_OLD)
    env = {"PATH": f"{shims}:{tools}", "PYENV_ROOT": str(pyenv_root), "HOME": str(tmp_path)}
    return shims, pyenv_root, env


def _find(env) -> subprocess.CompletedProcess:
    return subprocess.run([str(FINDER)], env=env, capture_output=True, text=True, timeout=30)


def test_a_failing_shim_does_not_count_and_pyenv_is_searched(machine):
    shims, pyenv_root, env = machine
    python312 = _script(pyenv_root / "versions" / "3.12.1" / "bin" / "python3", USABLE)
    _script(pyenv_root / "versions" / "3.13.0" / "bin" / "python3", USABLE)
    result = _find(env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(python312)  # the lowest usable: 3.12 is the tested version


def test_a_newer_python_on_the_path_wins_over_pyenv(machine):
    shims, pyenv_root, env = machine
    _script(pyenv_root / "versions" / "3.12.1" / "bin" / "python3", USABLE)
    python313 = _script(shims / "python3.13", USABLE)
    result = _find(env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(python313)


def test_none_usable_says_what_to_install_and_names_the_override(machine):
    result = _find(machine[2])
    assert result.returncode == 1
    assert result.stdout == ""
    assert "Python 3.12 or newer" in result.stderr and "PYTHON=" in result.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("usable", [True, False])
def test_make_install_uses_the_finder(machine, tmp_path, usable):
    shims, pyenv_root, env = machine
    if usable:
        python = _script(pyenv_root / "versions" / "3.12.1" / "bin" / "python3", USABLE)
    (Path(env["PATH"].split(":")[1]) / "make").symlink_to(shutil.which("make"))
    result = subprocess.run(["make", "-n", "install", f"VENV={tmp_path / 'venv'}"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    if usable:
        assert f"{python} -m venv {tmp_path / 'venv'}" in result.stdout
    else:
        assert 'test -n ""' in result.stdout  # the recipe stops there when run
        assert "PYTHON=" in result.stderr

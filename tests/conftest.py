import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run(args: list[str], cwd: Path, torchrun: int = 0, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run a script of the repo (first arg) as a user would: `python x.py ...` or `torchrun ... x.py ...`."""
    script = str(ROOT / args[0]) if args[0].endswith(".py") else args[0]
    launcher = [sys.executable]
    if torchrun:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(launcher + [script, *args[1:]], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def fixed_length_dataset(tmp_path: Path) -> Path:
    """Two-digit additions: every prompt has the same token length, so per-prompt rollouts stack."""
    path = tmp_path / "train.jsonl"
    rows = [{"prompt": f"{a}+{b}", "answer": str(a + b)} for a in range(10, 100, 7) for b in range(10, 100, 9)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path

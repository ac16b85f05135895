import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# One thread a process: pytest.ini runs the suite on 2 workers (pytest-xdist -n 2), each running its tests'
# trainings in-process or in subprocesses (which inherit this); two runs of 2 threads each on 2 cores would
# fight. Set before torch is imported (its thread pool reads them); torchrun gives each rank 1 thread too.
# The learning tests' numbers were measured so.
os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def default_sigint() -> None:
    """A child's Ctrl-C as a user's (preexec_fn): a shell that starts the suite in the background without job control
    has it ignored (SIG_IGN), which children inherit, and Python installs its KeyboardInterrupt only where it is not."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run(
    args: list[str],
    cwd: Path,
    torchrun: int = 0,
    timeout: int = 1800,
    python: str = sys.executable,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run a script of the repo (first arg) as a user would: `python x.py ...` or `torchrun ... x.py ...`, with
    `python` (another environment's) and `env` added to the environment.
    The timeout only stops a run that hangs: it is several times the longest run's time on a loaded machine."""
    script = str(ROOT / args[0]) if args[0].endswith(".py") else args[0]
    launcher = [python]
    if torchrun:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        launcher + [script, *args[1:]], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def record_batch_sizes(monkeypatch, module) -> list[int]:
    """Wrap `module.compute_advantages` so that each step's batch size (completions trained on) is recorded."""
    sizes, real = [], module.compute_advantages

    def compute_advantages(rewards, *args, **kwargs):
        sizes.append(len(rewards))
        return real(rewards, *args, **kwargs)

    monkeypatch.setattr(module, "compute_advantages", compute_advantages)
    return sizes


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# Every algorithm file; the shared tests run on each.
ALGORITHMS = ["grpo", "dapo", "cispo", "gvpo", "ppo", "drgrpo", "gspo", "rloo", "sapo", "dppo"]


@pytest.fixture
def fixed_length_dataset(tmp_path: Path) -> Path:
    """Two-digit additions: every prompt has the same token length."""
    path = tmp_path / "train.jsonl"
    rows = [{"prompt": f"{a}+{b}", "answer": str(a + b)} for a in range(10, 100, 7) for b in range(10, 100, 9)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def mixed_dataset(tmp_path_factory) -> Path:
    """Prompts whose 4 pinned completions (tests/pinned_run.py) under the default model are partly right
    and partly wrong: no group carries zero signal, so DAPO's dynamic sampling keeps every group of the
    first round and 1 process, 2 ranks and k micro-batches train on the very same batch."""
    import torch
    from pinned_run import pinned_generate

    from common import correctness_reward, format_prompt
    from harness import DEFAULT_MODEL, load_model, load_tokenizer

    tokenizer = load_tokenizer(DEFAULT_MODEL)
    model = load_model(DEFAULT_MODEL, "float32", torch.device("cpu"), tokenizer)
    rows = []
    for a in range(10, 100, 3):
        for b in range(10, 100, 11):
            texts = pinned_generate(model, tokenizer, [format_prompt(tokenizer, f"{a}+{b}", True)], 4, 8, 1.0).texts
            if 0 < correctness_reward(texts, [str(a + b)] * 4, exact_match=False).sum() < 4:
                rows.append({"prompt": f"{a}+{b}", "answer": str(a + b)})
    assert len(rows) >= 40, len(rows)
    path = tmp_path_factory.mktemp("data") / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def bf16_model(tmp_path_factory) -> Path:
    """The default model as a bf16 checkpoint (config.json's dtype bfloat16), as Qwen's are."""
    import torch
    from transformers import AutoModelForCausalLM

    from harness import DEFAULT_MODEL, load_tokenizer

    folder = tmp_path_factory.mktemp("bf16") / "model"
    AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.bfloat16).save_pretrained(folder)
    load_tokenizer(DEFAULT_MODEL).save_pretrained(folder)
    return folder


def pytest_collection_modifyitems(config, items):
    """The long tests first, so that the 2 workers end together on short ones instead of one waiting for the
    other's last training run: the slow tests without vLLM, then vLLM's (whose environment the background
    build below has had minutes to finish), then the rest. A stable sort: each group in its files' order."""

    def rank(item) -> int:
        if "vllm_python" in getattr(item, "fixturenames", ()):
            return 1
        return 0 if item.get_closest_marker("slow") else 2

    items.sort(key=rank)


def pytest_collection_finish(session):
    """Where vLLM tests are to run and vLLM's CPU environment is not built yet, start its build now, in the
    background (tests/vllm_env.py, 1-3 minutes, mostly downloads), so that it overlaps the tests before
    them; their fixture waits for it on the build's file lock. Each xdist worker may start one: the second
    waits on the lock and finds the environment complete."""
    from vllm_env import is_complete

    if any("vllm_python" in getattr(item, "fixturenames", ()) for item in session.items) and not is_complete():
        subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "vllm_env.py")],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

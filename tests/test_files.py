"""Every algorithm file keeps grpo.py's skeleton and shared lines: `diff grpo.py dapo.py` shows only the
algorithm; and every file's --help shows the same flag groups. The checks run on each file listed in
conftest.ALGORITHMS.

What may differ between two files:
- the module docstring, and the names imported (the import block, up to the "1. Config" banner);
- the Algorithm group of the flags (the class AlgorithmFlags);
- section 2, the algorithm's functions (from the "2. Algorithm" banner to the "3. Training" one);
- inside `main`, the spans marked in the file itself, from a `# --- algorithm: <what> ---` line to the
  next `# ---` line (and the blank lines after it). A change in one file must lie in a span of that
  file and, where it replaces or removes grpo.py's lines, in a span of grpo.py: every other line of
  every file is grpo.py's.
"""

import ast
import dataclasses
import difflib
import importlib
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ALGORITHMS, ROOT
from harness import cli

SECTIONS = [  # (first line, line that ends the section) of the parts a file may write its own way
    (r'"""', r"import "),  # the module docstring
    (r"import |from ", r"# 1\. Config"),  # the imports
    (r"class AlgorithmFlags:$", r"@dataclass$"),  # the Algorithm group of the flags
    (r"# 2\. Algorithm$", r"# 3\. Training$"),  # the algorithm's functions
]
OPEN, CLOSE = re.compile(r"\s*# --- algorithm: \S"), re.compile(r"\s*# ---$")


def free_lines(lines: list[str]) -> set[int]:
    """Indices of the lines a file may write its own way: its sections and its marked spans, marks included."""
    free = set()
    for first, end in SECTIONS:
        start = next(i for i, line in enumerate(lines) if re.match(first, line))
        stop = next(i for i in range(start + 1, len(lines)) if re.match(end, lines[i]))
        free.update(range(start, stop))
    opened = None
    for i, line in enumerate(lines):
        if OPEN.match(line):
            assert opened is None, f"line {i + 1}: a span opens inside the span of line {opened + 1}"
            opened = i
        elif CLOSE.match(line):
            assert opened is not None, f"line {i + 1}: '# ---' closes no span"
            end = i + 1
            while end < len(lines) and not lines[end].strip():  # and the blank lines after it
                end += 1
            free.update(range(opened, end))
            opened = None
    assert opened is None, f"line {opened + 1}: the span is never closed"
    return free


def changes_outside_spans(base: list[str], other: list[str]) -> list[str]:
    """Each change from grpo.py's lines to the other file's that is not inside a span (or section) of both."""
    base_free, other_free = free_lines(base), free_lines(other)
    outside = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, base, other, autojunk=False).get_opcodes():
        if tag != "equal" and not (set(range(i1, i2)) <= base_free and set(range(j1, j2)) <= other_free):
            outside.append(f"grpo.py:{i1 + 1}-{i2} -> {''.join(other[j1:j2]) or '(deleted)'}")
    return outside


def read(name: str) -> list[str]:
    return (ROOT / name).read_text().splitlines(keepends=True)


@pytest.mark.parametrize("algo", [a for a in ALGORITHMS if a != "grpo"])
def test_shared_lines_are_identical_to_grpo(algo):
    assert changes_outside_spans(read("grpo.py"), read(f"{algo}.py")) == []


def test_the_readme_counts_each_files_diff_against_grpo():
    """README's table says how many lines `diff grpo.py <file>` shows (lines removed and added): the size of what a
    reader compares. They drifted once, unnoticed (gvpo's 280 was 373), so they are checked."""
    table = {
        m[1]: int(m[2])
        for m in re.finditer(r"^\| `(\w+)\.py` \|.*?\| (\d+) \| \[", (ROOT / "README.md").read_text(), re.M)
    }
    counted = {}
    for file in ALGORITHMS[1:]:
        diff = subprocess.run(["diff", "grpo.py", f"{file}.py"], cwd=ROOT, capture_output=True, text=True).stdout
        counted[file] = sum(line.startswith(("<", ">")) for line in diff.splitlines())
    assert table == counted


def test_most_of_grpo_is_shared():
    """The spans are the exception: most of grpo.py's lines are checked."""
    base = read("grpo.py")
    assert len(free_lines(base)) / len(base) < 0.5


def test_the_shared_code_stays_within_its_sizes():
    """The project's budgets, in lines as `ruff format` writes them: common.py, the reading path (what the loop calls
    for its data flow), at most 1,000 whatever is added: a new feature's set-up goes to harness.py (flags, data files,
    models, the run folder, checkpoints, the logger: no ceiling), multi-turn to episodes.py, the vLLM engine to
    vllm_engine.py. benchmarks/ at most 1,500 (their run flags built by `benchmarks.as_flags`; 1,457 before the lab's
    off-policy grid). grpo.py's main, the loop a reader reads top to bottom, at most 231 lines with its def line (131
    before formatting, where a call with many arguments was one line; 221 before --off-policy-steps and --anchor, 226
    before the staleness measured under --anchor behaviour)."""
    assert len(read("common.py")) <= 1000
    assert sum(len(path.read_text().splitlines()) for path in (ROOT / "benchmarks").glob("*.py")) <= 1500
    base = read("grpo.py")
    start = base.index("def main(args: Args) -> None:\n")
    end = next(i for i in range(start + 1, len(base)) if base[i].strip() and not base[i].startswith((" ", "\n")))
    assert len("".join(base[start:end]).rstrip("\n").splitlines()) <= 231


PROJECT_MODULES = ("common", "harness", "episodes", "vllm_engine")


def imported_modules(path) -> set[str]:
    """The project modules a file imports, at load or inside a function: import statements, and the modules
    harness.companion() imports by name (only with their flag)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "companion":
            found.add(node.args[0].value)
    return found & set(PROJECT_MODULES)


def test_the_shared_modules_import_each_other_in_one_direction():
    """common.py imports no project module (it calls the engine or environment it is given); harness.py imports
    common.py, and episodes.py and vllm_engine.py only through `companion`, with their flag; the companions import
    common.py alone. No circle, at load or lazily."""
    imports = {module: imported_modules(ROOT / f"{module}.py") for module in PROJECT_MODULES}
    assert imports == {
        "common": set(),
        "harness": {"common", "episodes", "vllm_engine"},
        "episodes": {"common"},
        "vllm_engine": {"common"},
    }


def python_files() -> list:
    return sorted(path for path in ROOT.rglob("*.py") if ".git" not in path.parts)


def test_the_code_is_formatted_and_clean_under_ruff():
    """`ruff format --check` and `ruff check` (ruff.toml at the root) pass on the whole tree, as CI runs them."""
    for command in (["format", "--check"], ["check"]):
        result = subprocess.run([sys.executable, "-m", "ruff", *command, str(ROOT)], capture_output=True, text=True)
        assert result.returncode == 0, f"ruff {' '.join(command)}:\n{result.stdout[-3000:]}{result.stderr[-1000:]}"


def compressed_lines(source: str) -> list[str]:
    """Where code is compressed rather than written out: a tuple built as a statement (`a(), b()`) and a conditional
    expression inside another."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Tuple):
            found.append(f"line {node.lineno}: a tuple-expression statement")
        if isinstance(node, ast.IfExp):
            parts = (node.test, node.body, node.orelse)
            if any(isinstance(inner, ast.IfExp) for part in parts for inner in ast.walk(part)):
                found.append(f"line {node.lineno}: a conditional expression inside another")
    return found


def test_no_line_is_compressed():
    compressed = {str(path.relative_to(ROOT)): compressed_lines(path.read_text()) for path in python_files()}
    assert {path: lines for path, lines in compressed.items() if lines} == {}
    assert compressed_lines("random.seed(1), np.random.seed(1)\nx = 1 if a else 2 if b else 3\n") == [
        "line 1: a tuple-expression statement",
        "line 2: a conditional expression inside another",
    ]


def test_the_check_catches_a_changed_shared_line():
    base = read("grpo.py")
    changed = [line.replace("trained, tokenizer, rank", "policy, tokenizer, rank") for line in base]  # step 7
    changed = [line.replace("                trained,\n", "                policy,\n") for line in changed]
    assert len(changes_outside_spans(base, changed)) == 2  # the periodic and the final save
    at = base.index("    for step in range(start_step, args.num_steps):\n")
    inserted = base[:at] + ["    print0('hello')\n"] + base[at:]  # a line of its own, not marked
    assert len(changes_outside_spans(base, inserted)) == 1
    marked = base[:at] + ["    # --- algorithm: a greeting ---\n", "    print0('hello')\n", "    # ---\n"] + base[at:]
    assert changes_outside_spans(base, marked) == []  # the same line, marked as the algorithm's
    span = next(i for i, line in enumerate(base) if line.strip() == "# --- algorithm: the GRPO loss ---")
    removed_mark = base[:span] + base[span + 1 :]  # the loss call left in place, its opening mark removed
    with pytest.raises(AssertionError, match="closes no span"):
        changes_outside_spans(base, removed_mark)
    assert changes_outside_spans(base, base) == []


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_help_shows_the_flag_groups_and_each_default_once(algo, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # one line per flag, or nearly
    module = importlib.import_module(algo)
    with pytest.raises(SystemExit) as stop:
        cli(module.Args, ["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    groups = {"Experiment", "Model & data", "Rollout", "Optimization", "Algorithm"}
    assert set(re.findall(r"([A-Z][a-z]+(?: & [a-z]+)?) options", out)) == groups  # boxed on a terminal
    flags = [
        f for group in module.Args.__mro__[1:] if dataclasses.is_dataclass(group) for f in dataclasses.fields(group)
    ]
    assert out.count("(default:") == len(flags)  # tyro's, once per flag: no docstring states a default of its own


# A codebase that has packages of its own under names that plumbing modules often take.
HOST_PACKAGES = {"models": "class Net:\n    pass\n", "data": "def load():\n    return []\n"}


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_an_algorithm_file_and_common_py_run_when_copied_into_another_codebase(tmp_path, ranks):
    """dapo.py, common.py, harness.py and tiny_model/ copied into a folder that also holds a `models` and a `data`
    package run as `python dapo.py --num-steps 2 --eval-every 0` (and under torchrun with 2 ranks), importing nothing
    from the host's packages and nothing from this repository; --env without episodes.py beside them is one line."""
    host = tmp_path / "host"
    for package, source in HOST_PACKAGES.items():
        (host / package).mkdir(parents=True)
        (host / package / "__init__.py").write_text(source)
    shutil.copy(ROOT / "dapo.py", host)
    shutil.copy(ROOT / "common.py", host)
    shutil.copy(ROOT / "harness.py", host)
    shutil.copytree(ROOT / "tiny_model", host / "tiny_model")
    launcher = (
        [sys.executable]
        if ranks == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    )
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # the repository is not on it
    result = subprocess.run(
        [*launcher, "dapo.py", "--num-steps", "2", "--eval-every", "0"],
        cwd=host,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (host / "runs").iterdir()
    assert (run_dir / "final" / "model.safetensors").is_file()
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    if ranks == 1:
        multi_turn = [sys.executable, "dapo.py", "--env", "guess.py:Guess", "--output-dir", "other"]
        result = subprocess.run(multi_turn, cwd=host, env=env, capture_output=True, text=True, timeout=600)
        assert (result.returncode, result.stderr) == (
            2,
            "error: --env needs episodes.py, beside harness.py: copy it too.\n",
        )

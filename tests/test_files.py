"""Every algorithm file keeps grpo.py's skeleton and shared lines: `diff grpo.py dapo.py` shows only
the algorithm. The check runs on each file listed in conftest.ALGORITHMS."""

import difflib

import pytest

from conftest import ALGORITHMS, ROOT

# Regions of grpo.py that another algorithm may change, as (first line, line that ends the region).
# Everything else (imports, the experiment / model / rollout / optimization flags, start-up checks,
# data, the evaluation, logging and checkpoint steps, the end of the run) must be byte-identical.
ALGORITHM_REGIONS = [
    ('"""GRPO:', "import time"),  # the docstring
    ("from torch.nn.parallel import", "from common import ("),  # a third-party import of its own
    ("from common import (", ")"),  # the names imported from common.py
    ("    # Algorithm", "    # Computed at runtime"),  # the Algorithm block of Args
    ("# 2. Algorithm", "# 3. Training"),  # the pure functions
    ("    if args.group_size < 2:", "    if args.fsdp and args.world_size < 2:"),  # its own start-up checks
    ("    # Same seed on every rank while loading", "    for step in range(start_step, args.num_steps):"),  # models
    ("        # 1. sample prompts", "        # 7. log, evaluate, checkpoint"),  # sampling to the update
]


def regions(lines: list[str]) -> list[tuple[int, int]]:
    spans = []
    for first, end in ALGORITHM_REGIONS:
        start = next(i for i, line in enumerate(lines) if line.startswith(first))
        stop = next(i for i in range(start + 1, len(lines)) if lines[i].startswith(end))
        spans.append((start, stop))
    return spans


def changes_outside_regions(base: list[str], other: list[str]) -> list[str]:
    spans = regions(base)
    outside = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, base, other, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        inside = any(start <= i1 and i2 <= stop for start, stop in spans)
        if not inside:
            outside.append(f"grpo.py:{i1 + 1}-{i2} -> {''.join(other[j1:j2]) or '(deleted)'}")
    return outside


@pytest.mark.parametrize("algo", [a for a in ALGORITHMS if a != "grpo"])
def test_shared_lines_are_identical_to_grpo(algo):
    base = (ROOT / "grpo.py").read_text().splitlines(keepends=True)
    other = (ROOT / f"{algo}.py").read_text().splitlines(keepends=True)
    assert changes_outside_regions(base, other) == []


def test_the_check_catches_a_changed_shared_line():
    base = (ROOT / "grpo.py").read_text().splitlines(keepends=True)
    changed = [line.replace("trained, tokenizer, rank", "policy, tokenizer, rank") for line in base]  # step 7
    assert len(changes_outside_regions(base, changed)) == 2  # the periodic and the final save
    at = base.index("import time\n") + 1
    inserted = base[:at] + ["import os\n"] + base[at:]  # among the shared imports
    assert len(changes_outside_regions(base, inserted)) == 1
    assert changes_outside_regions(base, base) == []

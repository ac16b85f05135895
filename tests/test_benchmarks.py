"""The benchmark scripts run (at tiny shapes) and print their figures; the figures themselves are
measured by running the scripts, not asserted here."""

from conftest import ROOT, run


def test_logprob_memory_benchmark_runs(tmp_path):
    result = run(["benchmarks/logprob_memory.py", "--batch", "2", "--seq", "32", "--vocab", "1000", "--hidden", "16"],
                 cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "chunked get_logprobs, forward + backward:" in result.stdout
    assert "naive fp32 log-softmax, forward + backward:" in result.stdout

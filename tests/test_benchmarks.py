"""The benchmark scripts run (at tiny shapes) and print their figures; the figures themselves are
measured by running the scripts, not asserted here."""

from conftest import ROOT, run


def test_logprob_memory_benchmark_runs(tmp_path):
    result = run(["benchmarks/logprob_memory.py", "--batch", "2", "--seq", "32", "--vocab", "1000", "--hidden", "16"],
                 cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "chunked get_logprobs, forward + backward:" in result.stdout
    assert "naive fp32 log-softmax, forward + backward:" in result.stdout


def test_memory_fit_table_and_one_measurement_run(tmp_path):
    result = run(["benchmarks/memory_fit.py"], cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "| 7B | 7.61B |" in result.stdout and "141 GB cards" in result.stdout
    result = run(["benchmarks/memory_fit.py", "--one", "1", "32", "64", "2", "16", "1"], cwd=ROOT)
    assert result.returncode == 0, result.stderr
    measured, predicted, params = result.stdout.split()[-3:]
    assert float(measured) > 0 and float(predicted) > 0 and int(params) > 0


def test_memory_formula_counts_parameters_like_the_model():
    import torch  # noqa: F401
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from benchmarks.memory_fit import Shape

    config = Qwen3Config(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config)
    shape = Shape("t", 3, 64, 96, 4, 2, vocab=100)
    # Qwen3 adds a q/k norm per layer (2 x head_dim) that Qwen2.5's shapes do not have
    assert shape.params == sum(p.numel() for p in model.parameters()) - 3 * 2 * 16


def test_step_time_benchmark_runs():
    result = run(["benchmarks/step_time.py", "--steps", "3", "--files", "grpo", "--no-scaling", "--extra",
                  "--prompts-per-step", "4", "--group-size", "4"], cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[3].startswith("| grpo.py | ")

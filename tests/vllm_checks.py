"""Checks of the vLLM engine that need vLLM in this process, run by tests/test_vllm.py with the vLLM
environment's python: `python tests/vllm_checks.py CHECK OUT_JSON [ARGS...]`.

tied-head:    after the weights change, vLLM's log-probs of its own samples against the trainer's, when a push
              leaves out the LM head tied to the embeddings (as a `save_pretrained` state dict does), and
              when it is `VllmEngine.push`.
prefix-cache: the same for prompts longer than a KV block, sampled once before the change, when the push
              keeps the prefix cache and when it is `VllmEngine.push` (which empties it).
stale:        grpo.py whose engine gets the weights once, at its first call: `main`'s flags follow.
release:      what release_kv_cache_memory answers after a call, at sleep level 0 alone and in
              `VllmEngine.sleep` (an empty step first). A CPU has no sleep mode: where the engine core
              accepts the release, the CPU worker refuses the discard itself, and the answer says which refused.
pushes:       a file's run (its name, then `main`'s flags), recording in order each optimizer step, each
              sampling call of the engine and each push of the weights into it.
rollouts:     a file's run (its name, then `main`'s flags), each training rollout's tensors saved, in order, to
              OUT_JSON's name without .json: rollout_<i>.safetensors."""

import importlib
import json
import sys
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import format_prompt, generate, get_logprobs, unwrap  # noqa: E402
from harness import DEFAULT_MODEL, load_model, load_tokenizer, plain_weights  # noqa: E402
from vllm_engine import VllmEngine  # noqa: E402


def gap(engine: VllmEngine, model, tokenizer, prompts: list[str], push: bool) -> float:
    """The largest |sampler - trainer| log-prob over 4 completions of each prompt, sampled after `push`ing
    the weights (else with the engine as it is)."""
    engine.stale = push
    rollout = generate(model, tokenizer, prompts, 4, 8, 1.0, vllm=engine)
    trainer, _ = get_logprobs(
        model, rollout.input_ids, rollout.attention_mask, rollout.prompt_length, 1.0, entropy=False
    )
    return ((trainer - rollout.sampler_logprobs).abs() * rollout.response_mask).max().item()


def change(model, optimizer) -> None:
    """New weights, by an optimizer step (SGD, lr 1) on a random gradient larger than training's, so that a
    stale part is plain to see."""
    torch.manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 0.05
    optimizer.step()


def tied_head() -> dict:
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    model = load_model(DEFAULT_MODEL, "float32", torch.device("cpu"), tokenizer)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    prompts = [format_prompt(tokenizer, p, True) for p in ("1+2", "45+67", "99+9")]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    engine = VllmEngine(DEFAULT_MODEL, torch.float32, 0, optimizer, plain_weights)
    out = {"before": gap(engine, model, tokenizer, prompts, push=True)}
    change(model, optimizer)
    without_head = [(k, v) for k, v in unwrap(model).state_dict().items() if k != "lm_head.weight"]
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": without_head})
    engine.llm.reset_prefix_cache()
    out["head_left_out"] = gap(engine, model, tokenizer, prompts, push=False)
    out["push"] = gap(engine, model, tokenizer, prompts, push=True)
    return out


def prefix_cache(folder: str) -> dict:
    """A model like the default one with 1,024 positions (random weights), and prompts of ~300 tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(DEFAULT_MODEL)
    config.max_position_embeddings = 1024
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    load_tokenizer(DEFAULT_MODEL).save_pretrained(folder)
    tokenizer = load_tokenizer(folder)
    model = load_model(folder, "float32", torch.device("cpu"), tokenizer)
    prompts = ["+".join(str(i) for i in range(k, k + 100)) for k in (1, 7)]
    assert min(len(tokenizer(p).input_ids) for p in prompts) > 2 * 128  # two KV blocks of vLLM's CPU backend
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    engine = VllmEngine(folder, torch.float32, 0, optimizer, plain_weights)
    out = {"before": gap(engine, model, tokenizer, prompts, push=True)}  # the prompts' blocks are cached
    change(model, optimizer)
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(model.state_dict().items())})
    out["cache_kept"] = gap(engine, model, tokenizer, prompts, push=False)
    out["push"] = gap(engine, model, tokenizer, prompts, push=True)
    return out


def stale(flags: list[str]) -> dict:
    import grpo
    from harness import cli

    real, pushes = VllmEngine.push, []

    def once(self, model):  # the first call only: the engine then samples from the initial weights
        if not pushes:
            real(self, model)
        pushes.append(1)

    VllmEngine.push = once
    grpo.main(cli(grpo.Args, args=flags))
    return {"pushes": len(pushes)}


def release() -> dict:
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    model = load_model(DEFAULT_MODEL, "float32", torch.device("cpu"), tokenizer)
    engine = VllmEngine(DEFAULT_MODEL, torch.float32, 0, torch.optim.SGD(model.parameters(), lr=0.0), plain_weights)
    prompts = [format_prompt(tokenizer, "1+2", True)]
    out = {}
    generate(model, tokenizer, prompts, 2, 8, 1.0, vllm=engine)
    engine.llm.sleep(level=0)
    try:
        engine.llm.release_kv_cache_memory()
    except RuntimeError as error:
        out["level_0"] = str(error)
    engine.llm.wake_up(tags=["scheduling"])
    generate(model, tokenizer, prompts, 2, 8, 1.0, vllm=engine)
    engine.gpu = True  # the GPU's path of VllmEngine.sleep
    try:
        engine.sleep()
    except RuntimeError as error:
        out["sleep"] = str(error)
    return out


def pushes(algo: str, flags: list[str]) -> dict:
    from harness import cli

    events, real_push, real_generate = [], VllmEngine.push, VllmEngine.generate

    def push(self, model):
        events.append("push")
        real_push(self, model)

    def generate(self, *args, **kwargs):
        events.append("generate")
        return real_generate(self, *args, **kwargs)

    VllmEngine.push, VllmEngine.generate = push, generate
    register_optimizer_step_post_hook(lambda *_: events.append("step"))  # every optimizer's
    module = importlib.import_module(algo)
    module.main(cli(module.Args, args=flags))
    return {"events": events}


def rollouts(algo: str, flags: list[str], folder: Path) -> dict:
    from safetensors.torch import save_file

    from harness import cli

    module = importlib.import_module(algo)
    real_generate, count = module.generate, []

    def recording(model, tokenizer, prompts, group_size, *args, **kwargs):
        rollout = real_generate(model, tokenizer, prompts, group_size, *args, **kwargs)
        if group_size > 1:  # training's (an evaluation samples one completion a prompt)
            fields = ["input_ids", "attention_mask", "response_mask", "sampler_logprobs"]
            tensors = {name: getattr(rollout, name).contiguous() for name in fields}
            tensors["prompt_length"] = torch.tensor(rollout.prompt_length)
            save_file(tensors, folder / f"rollout_{len(count)}.safetensors")
            count.append(1)
        return rollout

    folder.mkdir(parents=True, exist_ok=True)
    module.generate = recording
    module.main(cli(module.Args, args=flags))
    return {"rollouts": len(count)}


def stop() -> dict:
    """Greedy responses of 12 prompts from the engine, without and with the stop string '1'."""
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    model = load_model(DEFAULT_MODEL, "float32", torch.device("cpu"), tokenizer)
    engine = VllmEngine(DEFAULT_MODEL, torch.float32, 0, torch.optim.SGD(model.parameters(), lr=0.0), plain_weights)
    prompts = [tokenizer(format_prompt(tokenizer, f"{a}+{a + 7}", True)).input_ids for a in range(10, 130, 10)]
    whole, _ = engine.generate(model, tokenizer, prompts, 1, 8, 1.0, greedy=True)
    stopped, _ = engine.generate(model, tokenizer, prompts, 1, 8, 1.0, greedy=True, stop=["1"])
    return {"whole": whole, "stopped": stopped, "texts": [tokenizer.decode(ids) for ids in whole]}


if __name__ == "__main__":
    check, out_file, *rest = sys.argv[1:]
    result = {
        "tied-head": lambda: tied_head(),
        "prefix-cache": lambda: prefix_cache(*rest),
        "stale": lambda: stale(rest),
        "release": release,
        "stop": stop,
        "pushes": lambda: pushes(rest[0], rest[1:]),
        "rollouts": lambda: rollouts(rest[0], rest[1:], Path(out_file).with_suffix("")),
    }[check]()
    Path(out_file).write_text(json.dumps(result))

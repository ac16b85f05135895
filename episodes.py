"""Multi-turn episodes (--env), beside common.py and imported only with that flag (`harness.load_task` builds the
`MultiTurn` that `common.generate` is given): a copy of an algorithm file with common.py and harness.py runs
everything else without it. The rules an environment follows: docs/environments.md.

`MultiTurn` (the environment and its limits), `run_episodes` (each turn sampled, answered, appended as tokens),
`env_output` (everything the environment gives, checked here and nowhere else), `message_ids` (messages as the chat
template renders them), `stop_strings`, `cut_at_stop` (a turn ends at its stop string)
"""

import bisect
import contextlib
import copy
import dataclasses
import math
import numbers
import re

import torch
import transformers

from common import (
    Rollout,
    UsageError,
    all_reduce,
    current_device,
    format_prompt,
    is_message,
    pack,
    sample_hf,
    stop_ids,
)


@dataclasses.dataclass
class MultiTurn:
    """An environment (--env, `GUESS`), made by a class or function from each episode's row: `step(action) ->
    (observation, reward, done)`, optional `stop` (strings that end a turn: '</calc>') and `reset()` (`env_output`)."""

    env_class: type
    spec: str  # --env, for messages
    max_turns: int
    chat_template: bool = True
    prompt_limit: tuple = (math.inf, "")  # fit_prompts' rule (tokens, why), for the first message

    def run(
        self,
        model,
        tokenizer,
        rows: list[dict],
        group_size: int,
        max_new_tokens: int,
        temperature: float,
        greedy: bool,
        vllm,
    ) -> Rollout:
        """`group_size` episodes of each row in this environment (`run_episodes`): what `common.generate` does."""
        return run_episodes(model, tokenizer, rows, group_size, max_new_tokens, temperature, greedy, vllm, self)


def run_episodes(
    model,
    tokenizer,
    rows: list[dict],
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    greedy: bool,
    vllm,
    env: MultiTurn,
) -> Rollout:
    """`group_size` episodes of each row: each turn those still going sample as a batch, each text goes to its `step`,
    the observation is appended as tokens (sampled ones never decoded and encoded again), until `done`, --max-turns or
    --max-new-tokens. Every rank runs as many turns (a dummy one where its episodes ended): collective forwards."""
    rows = [copy.deepcopy(row) for row in rows for _ in range(group_size)]  # each episode's own: an env may write it
    envs = [env_output(env, "__init__", env.env_class, row) for row in rows]
    messages, prompts = [], []  # each episode's conversation so far, and the tokens of its first messages
    for episode_env, row in zip(envs, rows):
        reset = getattr(episode_env, "reset", lambda: None)
        first_messages, first_ids = env_output(env, "reset", reset, row=row, tokenizer=tokenizer)
        messages.append(first_messages)
        prompts.append(first_ids)
    # Each episode's tokens after its prompt: the policy's turns and the observations between them
    responses = [[] for _ in rows]
    masks = [[] for _ in rows]  # 1 on the policy's tokens, 0 on the observations'
    logprobs = [[] for _ in rows]  # the sampler's (0 on the observations)
    said = [[] for _ in rows]  # the policy's turns as text (the actions)
    returns = [0.0] * len(rows)  # the rewards summed over the turns
    turns = [0] * len(rows)
    ended = [False] * len(rows)
    truncated = [False] * len(rows)  # ended by --max-new-tokens or --max-turns, not by the environment
    eos_ids = stop_ids(model, tokenizer)
    stop = stop_strings(tokenizer, env_output(env, "stop", lambda: [getattr(e, "stop", []) for e in envs]))
    sample = vllm.generate if vllm is not None else sample_hf  # as `generate` samples, without packing the turn
    for turn in range(env.max_turns):
        going = [i for i in range(len(rows)) if not ended[i]]
        if not all_reduce(torch.tensor(len(going), device=current_device()), "max"):
            break
        room = [max_new_tokens - len(responses[i]) for i in going]  # each episode's tokens left
        contexts = [prompts[i] + responses[i] for i in going] or prompts[:1]  # a dummy turn where none is going
        new, new_logprobs = sample(model, tokenizer, contexts, 1, max(room, default=1), temperature, greedy, stop)
        for k, i in enumerate(going):
            ids, at_stop = cut_at_stop(tokenizer, new[k][: room[k]], stop, prompts[i] + responses[i])
            responses[i] += ids
            masks[i] += [1] * len(ids)
            logprobs[i] += new_logprobs[k][: len(ids)]
            turns[i] = turn + 1
            at_eos = ids[-1] in eos_ids
            action = tokenizer.decode(ids[:-1] if at_eos else ids, skip_special_tokens=True)
            said[i].append(action)
            if not (at_eos or at_stop):  # cut by --max-new-tokens within the turn: no action to take
                ended[i] = truncated[i] = True
                continue
            observation, reward, done = env_output(env, "step", envs[i].step, action)
            returns[i] += reward
            last_turn = turn == env.max_turns - 1
            if done or last_turn:
                ended[i] = True
                truncated[i] = not done  # not ended by the environment: cut by --max-turns
                continue
            messages[i] += [{"role": "assistant", "content": action}, observation]
            refused = (
                f"--env {env.spec}: turn {turn + 1}: the chat template refuses the conversation with the "
                f"environment's {observation['role']} message"
            )
            closing_eos = ids[-1] if at_eos else None  # (None: at a stop string, the template's own closes the turn)
            obs = message_ids(tokenizer, messages[i], len(messages[i]) - 1, closing_eos, env.chat_template, refused)
            if len(responses[i]) + len(obs) >= max_new_tokens:  # no room left for a turn
                ended[i] = truncated[i] = True
                continue
            responses[i] += obs
            masks[i] += [0] * len(obs)
            logprobs[i] += [0.0] * len(obs)
    texts = ["\n".join(turn_texts) for turn_texts in said]
    return pack(tokenizer, prompts, responses, masks, logprobs, texts, truncated, env_return=returns, turns=turns)


A_MESSAGE = "a message {'role': text, 'content': text}"


def env_output(env: MultiTurn, what: str, fn, *args, row: dict | None = None, tokenizer=None):
    """fn(*args), a call into the environment, and what it gave checked here and nowhere else, as run_episodes takes
    it: `what` is 'class', '__init__', 'stop', 'reset' or 'step'. An exception or a wrong value stops with one line."""
    try:
        value = fn(*args)
    except SystemExit as e:  # (a code tool running what the policy wrote: exit()) would end the run, status 0
        raise UsageError(
            f"--env {env.spec}: {what} called sys.exit({e.code!r}). An environment must return its "
            "values; to stop the run, raise an exception."
        ) from None
    except Exception as e:
        raise UsageError(f"--env {env.spec}: {what} raised {type(e).__name__}: {e}") from None

    def wrong(must: str, got: str) -> UsageError:
        return UsageError(f"--env {env.spec}: {what}: must {must}, got {got[:200]}.")

    if what in ("class", "__init__"):  # what makes, or is, an environment
        if not callable(getattr(value, "step", None)):
            raise wrong("have a step(action) method", repr(value))
        return value
    if what == "stop":  # the episodes' stop strings: one list, as a batch's turns end at any of them
        stops = []
        for episode_stop in value:  # a string, or a list or tuple of them
            if isinstance(episode_stop, str):
                episode_stop = [episode_stop]
            elif isinstance(episode_stop, (list, tuple)):
                episode_stop = list(episode_stop)
            stops.append(episode_stop)
        first = stops[0]
        valid = stops == [first] * len(stops) and isinstance(first, list)
        if not (valid and all(isinstance(s, str) for s in first) and "" not in first):
            shown = " and ".join(dict.fromkeys(map(repr, stops)))
            raise wrong("be a non-empty string (one stop string) or a list of them, the same in every episode", shown)
        return first
    if what == "reset":  # (the first messages, their tokens), in fit_prompts' limit; None: the row's prompt
        messages = value
        if value is None:
            messages = row["prompt"]
        elif is_message(value):
            messages = [value]
        if isinstance(messages, str):  # text: one user message
            messages = [{"role": "user", "content": messages}]
        if not (isinstance(messages, list) and messages and all(map(is_message, messages)) and messages[0]["content"]):
            must = f"return the first message: text, not empty, {A_MESSAGE} or a list of them (None: the row's prompt)"
            raise wrong(must, repr(value))
        refused = f"--env {env.spec}: reset: the chat template refuses the first messages"
        ids = message_ids(tokenizer, messages, 0, None, env.chat_template, refused)
        if len(ids) > env.prompt_limit[0]:
            raise UsageError(
                f"--env {env.spec}: reset: the first message of row {row['prompt'][:40]!r}'s episodes is "
                f"{len(ids)} tokens, {env.prompt_limit[1]}. Return a shorter one."
            )
        return list(messages), ids
    # step: (observation, reward, done); the observation is read only where the episode goes on
    valid = isinstance(value, tuple) and len(value) == 3
    valid = valid and isinstance(value[1], numbers.Real) and math.isfinite(value[1])
    valid = valid and type(value[2]).__name__ in ("bool", "bool_")  # (numpy's bool too)
    if not (valid and (bool(value[2]) or isinstance(value[0], str) or is_message(value[0]))):
        raise wrong(f"return (observation: text or {A_MESSAGE}, reward: a finite number, done: a bool)", repr(value))
    observation, reward, done = value
    if isinstance(observation, str):
        observation = {"role": "user", "content": observation}
    return observation, float(reward), bool(done)


def stop_strings(tokenizer, stop: list[str]) -> list[str]:
    """The `stop` strings some token completes (transformers refuses the others: no text holds them)."""
    kept = []
    for string in stop:
        with contextlib.suppress(ValueError):  # raised where no token completes it
            transformers.StopStringCriteria(tokenizer, [string])
            kept.append(string)
    return kept


def cut_at_stop(tokenizer, ids: list[int], stop: list[str], context: list[int] = ()) -> tuple[list[int], bool]:
    """`ids` up to the first token that completes a `stop` string, and whether one did (by decoding prefixes): in the
    text after `context` (the prompt and earlier turns), as model.generate sees it, so that a stop string that begins
    before the turn (a '\n' that closes the assistant's header) ends the turn at its first token."""
    tail = list(context)[len(context) - max(map(len, stop), default=0) :]  # a token is a character or more
    start = len(tokenizer.decode(tail))

    def stops_at(n: int) -> bool:  # whether ids[: n + 1] complete a stop string that ends after the context
        text = tokenizer.decode(tail + ids[: n + 1])
        return any(text.find(s, max(0, start - len(s) + 1)) >= 0 for s in stop)

    if not ids or not stops_at(len(ids) - 1):
        return ids, False
    n = bisect.bisect_left(range(len(ids)), True, key=stops_at)
    return ids[: n + 1], True


def message_ids(
    tokenizer,
    messages: list[dict],
    new: int,
    eos_id: int | None,
    chat_template: bool,
    refused: str = "the chat template refuses the messages",
) -> list[int]:
    """The tokens of messages[new:] (the first ones, or an observation) and the next header: the chat template's text
    of all less that of those before, from where the policy's turn closes (after its EOS `eos_id`, or the template's;
    no template: the contents, after BOS); first messages that end with the assistant's continue it (a prefill). A
    content is text only: an environment's '<|im_end|>' forges no turn. A template's refusal: one line, `refused`."""
    marked = messages[:new] + [{**m, "content": f"\0{k}\0"} for k, m in enumerate(messages[new:])]  # index marks
    start = 0  # where the text of messages[new:] begins
    if not (chat_template and tokenizer.chat_template):  # the contents alone, the first ones after BOS
        text = "".join(m["content"] for m in marked[new:])
        if new == 0:
            text = (tokenizer.bos_token or "") + text
    else:
        try:  # (roles that must alternate, meeting a tool's message; a system role some templates refuse)
            if new == 0:  # the first messages, rendered as a dataset's prompt is (a last assistant message continued)
                text = format_prompt(tokenizer, marked, True)
            else:  # all the messages and the next header, and the text of those before, to take off
                text = tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False)
                before = tokenizer.apply_chat_template(messages[:new], tokenize=False)
        except Exception as error:
            raise UsageError(f"{refused}: {error}") from None
        if new:
            close = tokenizer.decode([eos_id]) if eos_id is not None else tokenizer.eos_token
            end = before.rfind(close)  # where the policy's last turn closes
            start = end + len(close) if eos_id is not None else end  # after the EOS it sampled, or at the template's
            if end < 0 or not text.startswith(before) or not before[:end].endswith(messages[new - 1]["content"]):
                raise UsageError(
                    "--chat-template: the tokenizer's chat template renders the turns so far differently once "
                    "a message is added (e.g. it strips earlier thinking): no observation can follow the "
                    "sampled tokens. Use a template that keeps earlier turns, or --no-chat-template."
                )
    pieces = re.split("\0([0-9]+)\0", text[start:])  # the template's text, a mark's index, text, ...
    ids = []
    for k, piece in enumerate(pieces):
        if k % 2:  # a message's content: text only, its special tokens split
            content = messages[new + int(piece)]["content"]
            ids += tokenizer(content, add_special_tokens=False, split_special_tokens=True).input_ids
        else:  # the template's own text
            ids += tokenizer(piece, add_special_tokens=False, split_special_tokens=False).input_ids
    return ids

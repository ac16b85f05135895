"""The vLLM engine of --vllm, beside common.py and imported only with that flag (`harness.load_vllm` builds it): the
algorithm files, common.py and harness.py run everything else without it, and without vLLM installed (it needs an
environment of its own: pip install -r requirements-vllm.txt)."""

import os
import warnings

import torch
import torch.distributed as dist

from common import UsageError, stop_ids


class VllmEngine:
    """A vLLM engine on this rank's device, in this process, that samples for `generate` (--vllm): paged attention
    and continuous batching, for long completions on a GPU. It starts with dummy weights and gets the policy's at a
    call when `optimizer` has stepped since it last got them, from `weights(model, dtype)`: (name, tensor) pairs as
    transformers names them (`harness.plain_weights`). Sampling is plain softmax(logits / T), as in
    `sample_hf`. Its random stream is its own (seeded per rank), not in checkpoints: a resumed run samples other
    completions. On a GPU it sleeps between calls, freeing its KV cache for the update, and its weights too unless
    `keep_weights` (then pushed again at every call). Its KV cache is planned for `max_model_len`, the longest
    sequence the run makes (None: the model's whole context)."""

    def __init__(
        self,
        name: str,
        dtype: torch.dtype,
        seed: int,
        optimizer: torch.optim.Optimizer,
        weights,
        gpu_memory_utilization: float = 0.3,
        keep_weights: bool = True,
        max_model_len: int | None = None,
        lm_head_fp32: bool = False,
    ):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: weights in memory
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        try:
            import vllm
        except ImportError:
            raise UsageError(
                "--vllm needs vLLM, in an environment of its own: pip install -r requirements-vllm.txt (see the README)"
            ) from None
        self.vllm, self.gpu = vllm, torch.cuda.is_available()
        self.dtype = dtype  # the policy's compute dtype (--dtype): the engine's, and its pushes'
        self.weights = weights
        # On a GPU: vLLM 0.34's extensible KV cache (on by default on CUDA) caps the whole process's PyTorch memory
        # after warm-up (torch.cuda.set_per_process_memory_fraction, in v1/worker/extensible_kv_cache.py) and keeps the
        # cap while the engine sleeps, so the update in this process would get the GPU less the KV cache: off. The
        # cache is then planned, within gpu_memory_utilization of the GPU, by profiling at start-up.
        gpu = {"gpu_memory_utilization": gpu_memory_utilization, "enable_extensible_kv_cache": False}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning)
            self.llm = vllm.LLM(
                name,
                dtype=str(self.dtype).removeprefix("torch."),
                seed=seed,
                load_format="dummy",
                generation_config="vllm",
                logprobs_mode="processed_logprobs",
                max_model_len=max_model_len,
                enforce_eager=not self.gpu,
                enable_sleep_mode=self.gpu,
                **(gpu if self.gpu else {}),
                distributed_executor_backend="external_launcher" if dist.is_initialized() else None,
                **({"hf_overrides": {"head_dtype": "float32"}} if lm_head_fp32 else {}),
            )  # vLLM's fp32 LM head
        self.keep_weights, self.stale = keep_weights, True  # stale: its weights are not the policy's
        optimizer.register_step_post_hook(lambda *_: setattr(self, "stale", True))  # a step changes the policy's
        self.sleep()

    def sleep(self) -> None:
        """On a GPU, between calls: the KV cache freed, and the weights kept (sleep level 0, then the cache
        released), or freed too (level 2: nothing kept, so the next call pushes them)."""
        if self.gpu and self.keep_weights:
            # One empty step first: the requests that just finished stay in this in-process engine's scheduler
            # until its next step, and until then release_kv_cache_memory refuses ("requires a completed pause").
            self.llm.llm_engine.step()
            self.llm.sleep(level=0)
            self.llm.release_kv_cache_memory()
        elif self.gpu:
            self.llm.sleep(level=2)
            self.stale = True

    def push(self, model) -> None:
        """The model's weights into the engine, one tensor at a time (`weights`) in the engine's dtype (the
        policy's are held in fp32), the LM head included where it is tied to the embeddings; then the prefix cache
        emptied: it holds keys and values of the old weights, which prompts longer than a block would reuse."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": self.weights(model, self.dtype)})
        self.llm.reset_prefix_cache()
        self.stale = False

    @torch.no_grad()
    def generate(
        self,
        model,
        tokenizer,
        prompt_ids: list[list[int]],
        group_size: int,
        max_new_tokens: int,
        temperature: float,
        greedy: bool = False,
        stop: list[str] = (),
    ) -> tuple[list[list[int]], list[list[float]]]:
        """`group_size` responses of each prompt (up to EOS, included, or up to the token that completes a `stop`
        string: vLLM ends the request there, and its token ids are those sampled) and their sampler log-probs, as
        `sample_hf`."""
        if self.gpu and not self.keep_weights:  # memory for the weights first, then the weights
            self.llm.wake_up(tags=["weights"])
        if self.stale:
            self.push(model)
        if self.gpu:
            self.llm.wake_up(tags=["kv_cache"])
        params = self.vllm.SamplingParams(
            n=group_size,
            temperature=0.0 if greedy else temperature,
            logprobs=0,
            max_tokens=max_new_tokens,
            stop_token_ids=stop_ids(model, tokenizer),
            stop=list(stop),
            include_stop_str_in_output=True,
            detokenize=bool(stop),
        )
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        self.sleep()
        outputs = [out for request in outputs for out in request.outputs]  # group_size of each prompt, in order
        return [list(out.token_ids) for out in outputs], [
            [lp[t].logprob * (not greedy) for t, lp in zip(out.token_ids, out.logprobs)] for out in outputs
        ]

"""Loading models and tokenizers (any Hugging Face causal LM, by name or local folder), checking that
log-probs can be recomputed from them, and sharding them with FSDP2."""

import contextlib
import json
import pickle
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from common import UsageError, output_logits, print0

DEFAULT_MODEL = str(Path(__file__).parent / "tiny_model")  # made by make_tiny_model.py


def check_model_name(name: str, flag: str = "--model") -> None:
    """Fail at once on a local-looking path that does not exist, rather than asking the Hub for it, and on
    a local folder whose config.json is not a JSON object."""
    path = Path(name).expanduser()
    if not path.exists() and (name.startswith((".", "/", "~")) or name.count("/") > 1):
        raise UsageError(f"{flag} {name!r}: no such folder. Pass an existing folder or a Hugging Face model name.")
    if (path / "config.json").is_file():
        try:
            config = json.loads((path / "config.json").read_text())
        except (ValueError, UnicodeDecodeError) as e:
            config = e
        if not isinstance(config, dict):
            what = f"not valid JSON ({config})" if isinstance(config, Exception) else f"a JSON {type(config).__name__}"
            raise UsageError(f"{flag} {name!r}: its config.json is {what}, not a JSON object. Restore the model's "
                             "config.json (copy it again from where the model came from).")


def from_pretrained(auto_class, name: str, flag: str = "--model", **kwargs):
    """`auto_class.from_pretrained(name, **kwargs)` that never runs code from the model's folder or repository:
    every config, tokenizer and model of this project is loaded through here. A model whose architecture
    transformers does not have (its config names a Python file in `auto_map`) stops with one line instead
    of transformers' question "Do you wish to run the custom code?", which a `yes |` would answer."""
    try:
        return auto_class.from_pretrained(name, trust_remote_code=False, **kwargs)
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise UsageError(f"{flag} {name!r}: it needs code from the model's folder or repository (auto_map), and code "
                         "from a model is never run here. Use a model whose architecture transformers has.") from None


def load_tokenizer(name: str, flag: str = "--model"):
    """Left padding (prompts end where generation starts) and a pad token distinct from EOS, so that
    masking padding can never mask the real EOS token, which is an action and gets gradient."""
    check_model_name(name, flag)
    try:
        tokenizer = from_pretrained(AutoTokenizer, name, flag)
    except UsageError:
        raise
    except (OSError, ValueError) as e:
        raise UsageError(f"{flag} {name!r}: cannot load its tokenizer ({str(e).splitlines()[0]}). "
                         "Pass a local folder or a Hugging Face model name reachable from this machine.") from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
    return tokenizer


def load_model(name: str, dtype: str, device: torch.device, tokenizer, auto_class=AutoModelForCausalLM,
               flag: str = "--model"):
    """Any causal LM (or, with `auto_class`, e.g. `AutoModel`, its backbone) by Hugging Face name or local
    path, every form of dropout off, in `dtype` ("auto": fp32 on CPU, bf16 on GPU), its embeddings grown if
    `load_tokenizer` added a pad token.

    Log-probs must be a deterministic function of the weights, also in train mode (which
    --gradient-checkpointing needs): dropout is zeroed in the config before the model is built (attention
    dropout is applied functionally from it, with no module to switch off; the saved config.json says 0,
    as trained) and in every dropout module. A causal LM is then checked to return the logits that
    `get_logprobs` recomputes from its last hidden state (`check_output_logits`)."""
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    check_model_name(name, flag)
    try:
        config = from_pretrained(AutoConfig, name, flag)
        _zero_dropout(config)
        backbone = auto_class is not AutoModelForCausalLM  # e.g. a critic: a causal LM's head is left unused
        with transformers_quiet(backbone):
            model, info = from_pretrained(auto_class, name, flag, config=config, dtype=getattr(torch, dtype),
                                          output_loading_info=True)
        missing = info["missing_keys"] or info["mismatched_keys"]
        if backbone and missing:  # the report that was silenced, when it says something worth saying
            print0(f"warning: {flag} {name!r}: weights not in the checkpoint, left as initialised: "
                   f"{sorted(map(str, missing))[:5]}")
    except UsageError:
        raise
    except SafetensorError as e:
        raise UsageError(f"{flag} {name!r}: cannot read its weights ({e}). A file is damaged or incomplete (an "
                         "interrupted download or copy?): copy the model again.") from None
    except pickle.UnpicklingError:  # torch.load(weights_only=True) met something other than tensors
        raise UsageError(f"{flag} {name!r}: its weights file holds pickled data other than tensors. Refused without "
                         "running it: use the model's safetensors weights, or a copy you trust.") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"{flag} {name!r}: cannot load it ({str(e).splitlines()[0]}). "
                         "Pass a local folder or a Hugging Face model name reachable from this machine.") from None
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))  # a pad token was added
    model.config.pad_token_id = tokenizer.pad_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    for module in model.modules():  # also dropout modules built with a rate of their own, not the config's
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
    model = model.to(device)
    if model.get_output_embeddings() is not None:
        check_output_logits(model, name, flag)
    return model


@contextlib.contextmanager
def transformers_quiet(quiet: bool = False):
    """transformers' progress bars off while loading or saving a model (one bar per rank under torchrun), and
    with `quiet` its warnings too: loading a backbone from a causal LM checkpoint, the load report lists the
    unused LM head (`lm_head.weight | UNEXPECTED`) as if something were wrong. Both are restored after."""
    level, bars = transformers.utils.logging.get_verbosity(), transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    if quiet:
        transformers.utils.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.utils.logging.set_verbosity(level)
        if bars:
            transformers.utils.logging.enable_progress_bar()


def _zero_dropout(config) -> None:
    """Every dropout-like rate of a model config (attention_dropout, resid_pdrop, layerdrop, ...) set to 0,
    in nested configs too."""
    for key, value in vars(config).items():
        if "drop" in key and isinstance(value, float):
            setattr(config, key, 0.0)
        elif isinstance(value, transformers.PretrainedConfig):
            _zero_dropout(value)


def shard_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """FSDP2, in place: each decoder layer (the model's `_no_split_modules` classes) and then the rest
    (embeddings, final norm, LM head or value head) are sharded over all ranks; each forward all-gathers
    one layer at a time, each backward reduce-scatters (averages) its gradients. On GPU the shards are
    fp32 master weights and the compute is bf16, with gradients reduced in fp32."""
    if device.type == "cuda":
        model.float()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    layer_classes = set()
    for module in model.modules():
        layer_classes |= set(getattr(module, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, mp_policy=mp)
    return fully_shard(model, mp_policy=mp)


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """`clip_grad_norm_` that returns the total norm as a plain tensor, also for FSDP's sharded gradients."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm




@torch.no_grad()
def check_output_logits(model, name: str, flag: str = "--model") -> None:
    """Fail at load time unless `output_logits` reproduces the model's own logits on a few tokens:
    `get_logprobs` projects hidden states itself (in chunks, to bound memory), so an architecture whose
    forward changes the logits in a way it does not know would be trained on another distribution than
    the one sampled. Tolerance: 1e-4 of the largest logit in fp32, 2e-2 in 16-bit (rounding of the
    model's own transform)."""
    ids = torch.arange(8, device=model.device)[None] % model.config.get_text_config().vocab_size
    out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    theirs = out.logits.float()
    ours = output_logits(model, out.hidden_states[-1]).float()
    tolerance = (1e-4 if model.dtype == torch.float32 else 2e-2) * theirs.abs().max().clamp(min=1)
    difference = (ours - theirs).abs().max()
    if not difference <= tolerance:
        raise UsageError(f"{flag} {name!r}: its forward changes the LM head's logits in a way get_logprobs does not "
                         f"reproduce (largest difference {difference.item():.3g}). Supported: a plain LM head, "
                         "final_logit_softcapping, logit_scale, logits_scaling; add its transform to "
                         "common.output_logits.")

"""The run around an algorithm, beside common.py: where a run writes and what it leaves, what a user who copies an
algorithm file replaces with their own infrastructure. Nothing here is in the loop's data flow (common.py is).

1. Run folder: `prepare_run_dir`, `claim_run_dir`, `resume_hint` (the rules: docs/checkpoints.md)
2. Checkpoints: `save_checkpoint`, `load_checkpoint` (torch.distributed.checkpoint, safetensors only)
3. A step that cannot be taken: `clip_grad_norm` (a gradient that is not finite stops the run, saying how to go on)
"""

import fcntl
import functools
import json
import os
import random
import re
import shlex
import shutil
import socket
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dcp_state
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from common import (
    Rollout,
    UsageError,
    checkpoint_dtype,
    current_device,
    is_lora,
    plain_weights,
    print0,
    unwrap,
    whole,
)

# 1. Run folder --------------------------------------------------------------------------------------------------
CHECKPOINT_INFO = "checkpoint.json"  # in every checkpoint folder: the file, step, ranks and flags that wrote it
TRAINING_STATE = "training_state"  # the resumable state: torch.distributed.checkpoint's safetensors shards
warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP's, at each save on one process
RUN_LOCK = ".run.lock"  # in every run folder; locked (flock) by the process that writes into the folder
NOT_COMPARED = ("resume", "run_name", "output_dir")  # flags that differ between a run and its resumption
_held_locks = {}  # run folder -> its open lock file, held by this process until it ends


def prepare_run_dir(run_info: dict, rank: int) -> tuple[Path, Path | None]:
    """(run folder, checkpoint to resume from or None) on every rank, writing nothing; run_info: {"algorithm": the
    file, "config": asdict(args)}. <output-dir>/<run-name>, or <run> for --resume <run>/step_N, its newest, alone."""
    return _on_rank_0(_find_run_dir, rank, run_info)


def claim_run_dir(run_dir: Path, checkpoint: Path | None, rank: int) -> None:
    """Take run_dir, created and locked (flock: a second run there stops), metrics.jsonl cut to the checkpoint's step
    (the rest moved aside), seen by every rank; from here a Ctrl-C prints how to go on, not a traceback."""
    token = _on_rank_0(_claim, rank, run_dir, checkpoint)
    _every_rank_sees(run_dir, token)
    sys.excepthook = functools.partial(_explain_interrupt, sys.excepthook, run_dir, rank)


def _every_rank_sees(run_dir: Path, token: str) -> None:
    """Stop (on every rank) unless every rank reads in run_dir's lock file the `token` rank 0 wrote there: each rank
    writes its shards of a checkpoint into rank 0's run folder and reads them back on --resume, so the nodes of a
    run need one filesystem they all see there (not a disk of each node's own)."""
    if not dist.is_initialized():
        return
    deadline = time.monotonic() + 10  # a network filesystem may show a new file to another node a little late
    while not (sees := (run_dir / RUN_LOCK).is_file() and (run_dir / RUN_LOCK).read_text() == token):
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, sees)
    blind = [str(rank) for rank, sees in enumerate(seen) if not sees]
    if blind:
        raise UsageError(f"--output-dir {run_dir.parent}: rank{'s' * (len(blind) > 1)} {', '.join(blind)} cannot see "
                         f"rank 0's run folder {token.split(' ', 2)[2]}. Checkpoints need one "
                         "filesystem that every node sees there: each rank writes its shards into it and reads them "
                         "back on --resume. Pass an --output-dir on a disk the nodes share.")


def _claim(run_dir: Path, checkpoint: Path | None) -> str:
    run_dir.mkdir(parents=True, exist_ok=True)
    if str(run_dir.resolve()) not in _held_locks:  # (else an earlier run in this process holds it)
        lock = open(run_dir / RUN_LOCK, "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(f"--run-name {run_dir.name}: {run_dir} is in use by another run that is still going. "
                             "Wait for it to end, or choose another --run-name.") from None
        _held_locks[str(run_dir.resolve())] = lock
    _refuse_a_finished_run(run_dir, checkpoint)  # again under the lock: another run may have written since
    step, metrics = _read_info(checkpoint)["step"] if checkpoint else 0, run_dir / "metrics.jsonl"
    logged = checkpoint.parent / "metrics.jsonl" if checkpoint else metrics  # the checkpoint's run's, if any
    kept = [line for line in (logged.read_text().splitlines(keepends=True) if logged.exists() else [])
            if line.endswith("\n") and json.loads(line)["step"] < step]
    lines = metrics.read_text().splitlines(keepends=True) if metrics.exists() else []
    if kept != lines:  # the new file first, so that a full disk leaves the old one as it was
        (tmp := metrics.with_name("metrics.jsonl.tmp")).write_text("".join(kept))
        if lines:
            print(f"{run_dir}: this run logs from step {step}; the metrics that were there are kept in "
                  f"{_move_aside(metrics)}", flush=True)
        tmp.rename(metrics)
    token = f"{os.getpid()} {time.time_ns()} {socket.gethostname()}:{run_dir.resolve()}"  # for `_every_rank_sees`
    lock = _held_locks[str(run_dir.resolve())]
    lock.truncate(0)
    lock.write(token)
    lock.flush()
    return token


def _explain_interrupt(excepthook, run_dir: Path, rank: int, kind, value, traceback) -> None:
    """Ctrl-C: instead of a traceback (of every rank), one line from rank 0 on how to go on."""
    if not issubclass(kind, KeyboardInterrupt):
        return excepthook(kind, value, traceback)
    if rank == 0:
        print(f"\nstopped (Ctrl-C). {resume_hint(run_dir)}", file=sys.stderr, flush=True)


def resume_hint(run_dir: Path) -> str:
    """Where the run can go on from, and the command that does it (this process's own flags)."""
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        return f"No checkpoint was written (see --save-every): the run cannot be resumed. Its metrics are in {run_dir}."
    argv, replaced = sys.argv[1:], ("--resume", "--run-name", "--output-dir", "--run_name", "--output_dir")
    kept = [a for i, a in enumerate(argv)
            if a.split("=")[0] not in replaced and (i == 0 or argv[i - 1] not in replaced)]
    world_size, nodes = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("GROUP_WORLD_SIZE", 1))
    launcher = ["torchrun", f"--nnodes={nodes}", f"--nproc_per_node={world_size // nodes}"] if world_size > 1 \
        else ["python"]
    command = shlex.join([*launcher, sys.argv[0], *kept, "--output-dir", str(run_dir.parent), "--run-name",
                          run_dir.name, "--resume", "latest"])
    return f"Last checkpoint: {checkpoint}. Go on from it with: {command}" + \
        (" (on every node, with its rendezvous flags)" if nodes > 1 else "")


def _on_rank_0(fn, rank: int, *args):
    """fn(*args) on rank 0, its result (or its usage or OS error, as a UsageError) on every rank."""
    result, error = None, None
    if rank == 0:
        try:
            result = fn(*args)
        except (UsageError, OSError) as stop:
            error = str(stop)
    if dist.is_initialized():
        box = [(result, error)]
        dist.broadcast_object_list(box, src=0)
        result, error = box[0]
    if error:
        raise UsageError(error)
    return result


def _find_run_dir(run_info: dict) -> tuple[Path, Path | None]:
    config = run_info["config"]
    resume, run_name, output = config["resume"], config["run_name"], Path(config["output_dir"])
    run_dir = output / (run_name or  # the process id tells apart runs of a sweep started in the same second
                        f"{Path(run_info['algorithm']).stem}__{config['seed']}__{int(time.time())}__{os.getpid()}")
    checkpoint = None
    if resume == "latest":
        if run_name is None:
            raise UsageError("--resume latest continues the run named by --run-name: pass it.")
        checkpoint = latest_checkpoint(run_dir)
        if checkpoint is None:
            raise UsageError(f"--resume latest: no checkpoint under {run_dir}. Pass the --run-name of a run saved with "
                             "--save-every, or a checkpoint folder; or run it again without --resume.")
    elif resume:
        checkpoint = Path(resume)
        if not _read_info(checkpoint).get("resumable"):
            raise UsageError(f"--resume {resume}: not a resumable checkpoint (no {CHECKPOINT_INFO} of a step one). "
                             "Pass a <run>/step_N folder written by --save-every, or 'latest' with --run-name.")
        if run_name is None and (checkpoint.parent / RUN_LOCK).exists() and _newest(checkpoint.parent, checkpoint):
            run_dir = checkpoint.parent  # a run folder's newest checkpoint: that run goes on
    if checkpoint is not None:
        _check_same_run(checkpoint, run_info)
    _refuse_a_finished_run(run_dir, checkpoint)
    return run_dir, checkpoint


def _newest(run_dir: Path, checkpoint: Path | None) -> bool:
    """Whether `checkpoint` is the newest checkpoint of run_dir: a resume from it goes on in run_dir."""
    newest = latest_checkpoint(run_dir) if checkpoint is not None else None
    return newest is not None and newest.resolve() == checkpoint.resolve()


def _refuse_a_finished_run(run_dir: Path, checkpoint: Path | None) -> None:
    """A run writes into a folder that holds checkpoints or final/ only to go on from its newest checkpoint."""
    if not _newest(run_dir, checkpoint) and (_step_folders(run_dir) or (run_dir / "final").exists()):
        go_on = "Continue it with --resume latest, or choose" if latest_checkpoint(run_dir) else "Choose"
        raise UsageError(f"--run-name {run_dir.name}: {run_dir} already holds a run. {go_on} another --run-name or "
                         "--output-dir.")


def _move_aside(path: Path) -> Path:
    """Rename `path` to the first of `<path>.old`, `<path>.old.2`, ... that does not exist yet."""
    k, aside = 1, path.with_name(f"{path.name}.old")
    while aside.exists():
        k, aside = k + 1, path.with_name(f"{path.name}.old.{k + 1}")
    return path.rename(aside)


def _read_info(checkpoint: Path) -> dict:
    """The checkpoint.json of a checkpoint folder ({} when there is none: not a checkpoint of this project)."""
    file = Path(checkpoint) / CHECKPOINT_INFO
    return json.loads(file.read_text()) if file.is_file() else {}


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The resumable checkpoint of the highest step in run_dir (never a half-written `step_N.tmp`)."""
    return next((p for p in reversed(_step_folders(run_dir)) if _read_info(p).get("resumable")), None)


def _step_folders(run_dir: Path) -> list[Path]:
    """run_dir's step_N folders (never step_N.tmp), by step."""
    found = [p for p in Path(run_dir).glob("step_*") if re.fullmatch(r"step_\d+", p.name)]
    return sorted(found, key=lambda p: int(p.name[5:]))


def _check_same_run(checkpoint: Path, run_info: dict) -> None:
    """Stop if another file or number of ranks wrote the checkpoint, or it is past --num-steps; print changed flags."""
    saved, config = _read_info(checkpoint), run_info["config"]
    if saved["algorithm"] != run_info["algorithm"]:
        raise UsageError(f"--resume {checkpoint}: written by {saved['algorithm']}, resumed by "
                         f"{run_info['algorithm']}. Resume it with {saved['algorithm']}, or start "
                         f"{run_info['algorithm']} from its weights with --model {checkpoint}.")
    if saved["world_size"] != config["world_size"]:
        raise UsageError(f"--resume {checkpoint}: written by {saved['world_size']} rank(s), resumed on "
                         f"{config['world_size']}. Resume with --nproc_per_node={saved['world_size']} (each rank's "
                         f"sampling and algorithm state are its own), or start anew with --model {checkpoint}.")
    if saved["step"] > config["num_steps"]:  # at --num-steps, what is left runs: the final evaluation and final/
        raise UsageError(f"--num-steps {config['num_steps']}: the checkpoint {checkpoint} is at step {saved['step']}. "
                         f"Pass --num-steps {saved['step']} or more to go on from it.")
    changed = [f"--{key.replace('_', '-')} {saved['config'][key]!r} -> {value!r}" for key, value in config.items()
               if key not in NOT_COMPARED and key in saved["config"] and saved["config"][key] != value]
    if changed:
        print(f"--resume {checkpoint}: flags changed since the checkpoint: {', '.join(changed)}", flush=True)


# 2. Checkpoints -------------------------------------------------------------------------------------------------
def save_checkpoint(path: Path, modules: dict[str, torch.nn.Module], tokenizer, rank: int, run_info: dict,
                    optimizer=None, step: int = 0, extra: dict | None = None, keep: int = 0) -> None:
    """Write a checkpoint folder (on every rank): the policy and tokenizer by `save_pretrained` (FSDP: gathered; LoRA:
    adapter/, in final/ merged too), checkpoint.json; with an optimizer the resumable state: weights and optimizer in
    training_state/ (DCP: each rank its shards), each rank's RNG and `extra` in rank_<r>.safetensors. Written into
    `<path>.tmp`, renamed once all is synced (a crash leaves no partial `path`); `keep` > 0: the newest `keep` steps."""
    path, distributed = Path(path), dist.is_initialized()
    tmp = path.with_name(path.name + ".tmp")
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a .tmp folder is always this project's, left by a crash
            tmp.mkdir(parents=True)
        if distributed:
            dist.barrier()  # the folder exists before any rank writes into it
        if optimizer is not None:
            _save_training_state(tmp, modules, optimizer, rank, extra)
        policy, hf_model, lora = modules["policy"], unwrap(modules["policy"]), is_lora(modules["policy"])
        # On rank 0's host, one tensor at a time (FSDP: each gathered, every rank taking part): a LoRA run's adapters,
        # and the model (LoRA: merged, in final/ only) in its checkpoint's dtype, not the fp32 it was trained in
        adapters = {key: whole(value).cpu() for key, value in hf_model.state_dict().items() if ".lora_" in key} \
            if lora else {}
        dtype, weights = checkpoint_dtype(run_info["config"]["model"]), {}
        exported = not lora or optimizer is None  # the model: in final/, and in a step's folder but a LoRA run's
        if exported and (rank == 0 or isinstance(hf_model, FSDPModule)):  # FSDP's gathers: every rank, rank 0 keeps
            weights = {name: value for name, value in plain_weights(policy, dtype, "cpu" if rank == 0 else None)
                       if rank == 0}
        if rank == 0:
            if lora:
                hf_model.save_pretrained(tmp / "adapter", state_dict=adapters)
            if weights:
                plain = hf_model.get_base_model() if lora else hf_model
                plain.save_pretrained(tmp, state_dict=weights)
                plain.config.dtype = dtype  # save_pretrained wrote the dtype of the weights held (fp32) in config.json
                plain.config.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            info = {"algorithm": run_info["algorithm"], "step": step, "resumable": optimizer is not None,
                    "world_size": dist.get_world_size() if distributed else 1, "config": run_info["config"]}
            (tmp / CHECKPOINT_INFO).write_text(json.dumps(info, indent=2, default=str))
            for file in [*tmp.rglob("*"), tmp]:  # on disk before the rename that publishes it
                os.fsync(fd := os.open(file, os.O_RDONLY))
                os.close(fd)
        del weights
        if distributed:
            dist.barrier()  # every rank has written its part
        if rank == 0:
            if path.exists():
                print(f"moved the earlier {path} aside to {_move_aside(path)}", flush=True)
            tmp.rename(path)
    except BaseException as error:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        failures = [f for f, *_ in error.failures.values()] if isinstance(error, dcp.CheckpointException) else []
        if any(isinstance(failure, KeyboardInterrupt) for failure in failures):
            raise KeyboardInterrupt from None  # a Ctrl-C that DCP's writer caught is a Ctrl-C
        failure = (failures or [error])[0]
        if isinstance(failure, OSError) or "(os error" in str(failure):  # (safetensors' I/O errors come from Rust)
            trained = [p for m in modules.values() for p in m.parameters() if p.requires_grad] if optimizer else []
            size = sum(t.numel() * t.element_size() for t in [*modules["policy"].parameters(), *trained * 3])  # Adam: 2
            raise OSError(f"cannot write {path}: {failure} (a checkpoint here takes about {size / 2**20:.1f} MiB; "
                          f"{shutil.disk_usage(path.parent).free / 2**20:.1f} MiB are free)") from None
        raise
    if rank == 0 and keep > 0:
        for old in [p for p in _step_folders(path.parent) if _read_info(p).get("resumable")][:-keep]:
            shutil.rmtree(old)


def _save_training_state(tmp: Path, modules: dict[str, torch.nn.Module], optimizer, rank: int, extra: dict | None):
    state = _training_state(modules, optimizer)
    # A weight and its optimizer state in a file of their own: safetensors builds a whole file in memory
    # before writing it, so a save needs twice the largest weight's state, not the rank's.
    number = {name: i for i, name in enumerate(dict.fromkeys([*state["model"], *state["optimizer"]]), 1)}
    files = {f"model.{name}": number[name] for name in state["model"]}
    files |= {f"optimizer.{name}.{key}": number[name] for name, values in state["optimizer"].items() for key in values}
    writer = dcp.HuggingFaceStorageWriter(str(tmp / TRAINING_STATE), files, save_distributed=dist.is_initialized())
    dcp.save(state, storage_writer=writer, no_dist=not dist.is_initialized())
    own = {"rng": torch.get_rng_state(), "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
           "python_rng": random.getstate(), "numpy_rng": np.random.get_state(), "extra": extra or {}}
    plain = json.dumps(_flatten(own, tensors := {}, "own"))  # the tensors go into `tensors`, the rest stays
    (tmp / f"rank_{rank}.safetensors").write_bytes(safetensors_bytes(tensors, {"state": plain}))


def _training_state(modules: dict[str, torch.nn.Module], optimizer) -> dict:
    """The resumable state: trained weights (LoRA: adapters; FSDP: this rank's shards; tied ones once), optimizer's."""
    model = torch.nn.ModuleDict(modules)  # names the tensors "policy.<...>", "critic.<...>"

    def where(tensor: torch.Tensor) -> tuple | None:  # None for an empty shard
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape)) if local.numel() \
            else None

    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    weights, seen = {}, {where(p) for p in model.parameters() if not p.requires_grad} - {None}
    for name, tensor in dcp_state.get_model_state_dict(model).items():  # a tied or frozen weight under another name too
        if name not in frozen and (where(tensor) is None or where(tensor) not in seen):
            weights[name] = tensor
        seen.add(where(tensor))
    return {"model": weights, "optimizer": dcp_state.get_optimizer_state_dict(model, optimizer)["state"]}


def _flatten(value, tensors: dict, key: str):
    """`value` (lists, dicts, Rollouts) as JSON, each tensor {"tensor": its key in `tensors`}; `_unflatten`: back."""
    if isinstance(value, torch.Tensor):
        tensors[key] = value.detach().cpu().clone()
        return {"tensor": key}
    if isinstance(value, Rollout):
        return {"rollout": _flatten(dict(vars(value)), tensors, key)}
    if isinstance(value, dict):
        return {"dict": {k: _flatten(v, tensors, f"{key}.{k}") for k, v in value.items()}}
    if isinstance(value, (list, tuple)):
        return [_flatten(v, tensors, f"{key}.{i}") for i, v in enumerate(value)]
    return value.tolist() if isinstance(value, np.ndarray) else value  # NumPy's RNG key: 624 integers


def _unflatten(value, tensors: dict):
    if isinstance(value, list):
        return [_unflatten(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    (kind, inner), = value.items()  # {"tensor": key}, {"rollout": fields} or {"dict": items}
    return tensors[inner] if kind == "tensor" else Rollout(**_unflatten(inner, tensors)) if kind == "rollout" else \
        {k: _unflatten(v, tensors) for k, v in inner.items()}


def load_checkpoint(path: Path | None, modules: dict[str, torch.nn.Module], optimizer, rank: int) -> tuple[int, dict]:
    """Restore what `save_checkpoint` wrote, in place, and this rank's RNG: (the step to go on from, its algo state);
    (0, {}) for None. Nothing is unpickled. As many ranks as saved: a rank's sampling and state are its own."""
    if path is None:
        return 0, {}
    model, state, device = torch.nn.ModuleDict(modules), _training_state(modules, optimizer), current_device()
    try:
        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(path / TRAINING_STATE)),
                 no_dist=not dist.is_initialized())
        options = dcp_state.StateDictOptions(strict=False)  # strict would miss the tied weights, saved once
        dcp_state.set_model_state_dict(model, state["model"], options=options)
        groups = dcp_state.get_optimizer_state_dict(model, optimizer)["param_groups"]  # the flags' learning rate, ...
        dcp_state.set_optimizer_state_dict(model, optimizer, {"state": state["optimizer"], "param_groups": groups})
        with safe_open(path / f"rank_{rank}.safetensors", "pt") as opened:  # the RNG states stay on the CPU
            own = _unflatten(json.loads(opened.metadata()["state"]), {key: opened.get_tensor(key).to(
                device if key.startswith("own.extra.") else "cpu") for key in opened.keys()})
    except (Exception, dcp.CheckpointException) as error:  # a shape that does not fit, a damaged file, ...
        if isinstance(error, dcp.CheckpointException) and error.failures:  # DCP gathers each rank's failure
            error = next(iter(error.failures.values()))[0]
        text = " ".join(str(error).split()) or type(error).__name__
        raise UsageError(f"--resume {path}: cannot restore it: {text[:400]}") from None
    torch.set_rng_state(own["rng"])
    version, internal, gauss = own["python_rng"]
    random.setstate((version, tuple(internal), gauss))  # an environment's draws, and code you add
    np.random.set_state(tuple(own.get("numpy_rng", np.random.get_state())))  # (older checkpoints: as seeded)
    if own["cuda_rng"] is not None:
        torch.cuda.set_rng_state(own["cuda_rng"])
    print0(f"resumed from {path}")
    return _read_info(path)["step"], own["extra"]


# 3. A step that cannot be taken -----------------------------------------------------------------------------------
def clip_grad_norm(parameters, max_norm: float, step: int, run_dir: Path) -> torch.Tensor:
    """`clip_grad_norm_`'s total norm (FSDP: whole); not finite (on every rank), the run stops before the step."""
    norm = whole(torch.nn.utils.clip_grad_norm_(parameters, max_norm))
    if not torch.isfinite(norm):
        raise UsageError(f"step {step}: non-finite gradient norm ({norm.item()}); stopped before the optimizer step. "
                         f"Try a lower learning rate, or check --reward-fn. {resume_hint(run_dir)}")
    return norm

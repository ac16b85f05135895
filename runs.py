"""A run's folder: where a run writes (and no other run may), its metrics log, and its checkpoints:
written atomically, each rank its own shards, in safetensors and JSON only (nothing in a checkpoint is
unpickled)."""

import contextlib
import datetime
import errno
import fcntl
import functools
import json
import math
import os
import random
import re
import shlex
import shutil
import stat
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from common import Rollout, UsageError, print0, unwrap
from models import transformers_quiet

CHECKPOINT_INFO = "checkpoint.json"  # in every checkpoint folder: the file, step, ranks and flags that wrote it
TRAINING_STATE = "training_state"  # the resumable state: torch.distributed.checkpoint's safetensors shards
ROOT = Path(__file__).resolve().parent  # the repository: a --model inside it is recorded relative to it
RUN_LOCK = ".run.lock"  # in every run folder; held (fcntl) by the process that writes into the folder
_HELD_LOCKS: dict[str, int] = {}  # run folder -> open lock file: kept open for the life of the process
NOT_COMPARED = ("resume", "run_name", "output_dir")  # flags that differ between a run and its resumption


class Logger:
    """One line per step on stdout, every metric as JSON lines in `<run_dir>/metrics.jsonl` (a NaN or
    infinite value is written as null, so that every line is valid JSON), TensorBoard when installed,
    Weights & Biases with `--track`. A no-op on ranks other than 0."""

    SHOWN = ("reward/mean", "eval/accuracy", "eval/accuracy_greedy", "loss/policy", "policy/clipfrac", "perf/step_s")

    def __init__(self, run_dir: Path, config: dict, rank: int, track: bool = False, num_steps: int | None = None):
        self.enabled, self.num_steps, self.start, self.first_step = rank == 0, num_steps, time.perf_counter(), None
        self.wandb = self.tensorboard = None
        if not self.enabled:
            return
        if track:
            try:
                import wandb
            except ImportError:
                raise UsageError("--track needs wandb: pip install wandb") from None
            self.wandb = wandb.init(name=run_dir.name, config=config)
        replace_file(run_dir / "config.json", json.dumps(recorded(config), indent=2, default=str))
        self.file = open_to_append(run_dir / "metrics.jsonl")  # a resumed run appends (claim_run_dir cut it back)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(run_dir))
        except ImportError:
            pass

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        finite = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, **finite}, allow_nan=False) + "\n")  # NaN/inf: null
        self.file.flush()
        shown = " | ".join(f"{k} {metrics[k]:.4g}" for k in self.SHOWN if k in metrics)
        print(f"step {step:>4}{self._progress(step, shown)}", flush=True)
        if self.tensorboard:
            for key, value in metrics.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb:
            self.wandb.log(metrics, step=step)

    def _progress(self, step: int, shown: str) -> str:
        """'/<num_steps> | <shown> | h:mm:ss elapsed, ETA h:mm:ss', from the mean time of the steps this process ran."""
        if self.num_steps is None:
            return f" | {shown}"
        self.first_step = step if self.first_step is None else self.first_step
        elapsed, done, left = time.perf_counter() - self.start, step + 1 - self.first_step, self.num_steps - step - 1
        eta = f", ETA {datetime.timedelta(seconds=round(elapsed / done * left))}" if left > 0 else ""
        return f"/{self.num_steps} | {shown} | {datetime.timedelta(seconds=round(elapsed))} elapsed{eta}"

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.tensorboard:
                self.tensorboard.close()
            if self.wandb:
                self.wandb.finish()


def prepare_run_dir(run_info: dict, rank: int) -> tuple[Path, Path | None]:
    """(the run's folder, the checkpoint to resume from or None), the same on every rank; nothing is
    written yet (`claim_run_dir` does, once the models are loaded).

    run_info: {"algorithm": the file's name, "config": asdict(args)}. A run writes to
    <output-dir>/<run-name>, with one exception: `--resume <run>/step_N` without `--run-name` goes on in
    <run>, the run that wrote the checkpoint (when <run> is a run folder: a checkpoint copied elsewhere
    starts a new run folder under --output-dir). A checkpoint of another algorithm file, model or number
    of ranks stops here; other changed flags are printed."""
    return _decided_on_rank_0(_find_run_dir, rank, run_info)


def claim_run_dir(run_dir: Path, checkpoint: Path | None, rank: int) -> None:
    """Take run_dir for this process, before it writes anything there. A new folder is created with its
    lock already held (an atomic rename) and an existing one is locked (fcntl, released by the OS when
    the process ends, even killed), so a second run with the same name stops here. A new run takes only
    a folder with no logged step and no checkpoint (a start that failed before step 0 is taken over). A
    resumed run moves what its checkpoint's branch no longer leads to (later checkpoints, `final/`, later
    metrics) aside into <run>/abandoned_after_step_N/, so `--resume latest` and metrics.jsonl follow the
    live run; branching into another folder, that folder starts with the checkpoint's run's earlier
    metrics. Nothing is deleted."""
    _decided_on_rank_0(_claim_run_dir, rank, run_dir, checkpoint)
    sys.excepthook = functools.partial(_explain_interrupt, sys.excepthook, run_dir, rank)


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
    argv, kept = sys.argv[1:], []
    replaced = ("--resume", "--run-name", "--output-dir", "--run_name", "--output_dir")
    for i, arg in enumerate(argv):
        if arg in replaced or arg.startswith(tuple(f"{flag}=" for flag in replaced)) or \
                (i > 0 and argv[i - 1] in replaced):
            continue
        kept.append(arg)
    world_size, nodes = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("GROUP_WORLD_SIZE", 1))
    launcher = ["python"] if world_size == 1 else ["torchrun", f"--nproc_per_node={world_size}"]
    if nodes > 1:  # torchrun's agents, one per node
        launcher = ["torchrun", f"--nnodes={nodes}", f"--nproc_per_node={os.environ['LOCAL_WORLD_SIZE']}"]
    command = shlex.join([*launcher, sys.argv[0], *kept, "--output-dir", str(run_dir.parent), "--run-name",
                          run_dir.name, "--resume", "latest"])
    where = " (on every node, with its rendezvous flags)" if nodes > 1 else ""
    return f"Last checkpoint: {checkpoint}. Go on from it with: {command}{where}"


def _decided_on_rank_0(fn, rank: int, *args):
    """fn(*args) on rank 0, its result (or its usage error, raised) on every rank."""
    result, error = None, None
    if rank == 0:
        try:
            result = fn(*args)
        except UsageError as stop:
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
    resume, run_name = config["resume"], config["run_name"]
    default_name = f"{Path(run_info['algorithm']).stem}__{config['seed']}__{int(time.time())}"
    default_dir = Path(config["output_dir"]) / default_name
    checkpoint = None
    if resume == "latest":
        if run_name is None:
            raise UsageError("--resume latest continues the run named by --run-name: pass it.")
        run_dir = Path(config["output_dir"]) / run_name
        checkpoint = latest_checkpoint(run_dir, strict=True)
        if checkpoint is None:
            again = ("Run it again without --resume: it starts over in that folder (what it logged is kept aside)."
                     if _is_run_dir(run_dir) and not _has_checkpoints(run_dir) else
                     "Pass the --run-name of the run to continue (its checkpoints are written every --save-every "
                     "steps), or a checkpoint folder.")
            raise UsageError(f"--resume latest: no checkpoint under {run_dir}. {again}")
    elif resume:
        checkpoint = Path(resume)
        if not _read_checkpoint_info(checkpoint).get("resumable"):
            raise UsageError(f"--resume {resume}: not a resumable checkpoint (no {CHECKPOINT_INFO} of a step "
                             f"checkpoint). Pass a <run>/step_N folder written by --save-every, or 'latest' with "
                             "--run-name.")
        if run_name is not None:
            run_dir = Path(config["output_dir"]) / run_name
        elif _is_run_dir(checkpoint.parent):
            run_dir = checkpoint.parent
        else:  # a checkpoint copied out of its run: never write among files this project did not write
            run_dir = default_dir
    else:
        run_dir = Path(config["output_dir"]) / run_name if run_name else default_dir
    if checkpoint is not None:
        _check_same_run(checkpoint, run_info)
        _metrics_lines(checkpoint.parent)  # a damaged line stops here, before anything is loaded
    _refuse_links(run_dir)
    if not _continues(run_dir, checkpoint):
        _can_start_in(run_dir)
    return run_dir, checkpoint


def _continues(run_dir: Path, checkpoint: Path | None) -> bool:
    return checkpoint is not None and checkpoint.parent.resolve() == run_dir.resolve()


def _can_start_in(run_dir: Path) -> bool:
    """Whether a new run may write into run_dir, else a stop that says why: it may when the folder is new or
    empty, or a run of this project (it holds the run lock) with no checkpoint and no final/: a start that
    failed, or a run killed before its first checkpoint. True when that run logged steps, which the new run
    sets aside."""
    if not os.path.lexists(run_dir):
        return False
    if not run_dir.is_dir():
        raise UsageError(f"--run-name {run_dir.name}: {run_dir} is a file, not a run folder. Choose another --run-name "
                         "or --output-dir.")
    if not any(run_dir.iterdir()):
        return False
    if not os.path.lexists(run_dir / RUN_LOCK):
        names = sorted(p.name for p in run_dir.iterdir())
        raise UsageError(f"--run-name {run_dir.name}: {run_dir} holds files that are not a run's of this project "
                         f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}). Choose another --run-name or "
                         "--output-dir.")
    if _has_checkpoints(run_dir):
        go_on = "Continue it with --resume latest, or choose" if latest_checkpoint(run_dir) else "Choose"
        raise UsageError(f"--run-name {run_dir.name}: {run_dir} already holds a run. {go_on} another --run-name or "
                         "--output-dir.")
    metrics = run_dir / "metrics.jsonl"
    return metrics.exists() and metrics.stat().st_size > 0


def _has_checkpoints(run_dir: Path) -> bool:
    return bool(_step_folders(run_dir)) or os.path.lexists(run_dir / "final")


def _refuse_links(run_dir: Path) -> None:
    """Stop when run_dir holds a symbolic link: whatever this project would write through it (metrics, config,
    lock, checkpoints) would land wherever it points."""
    for path in run_dir.iterdir() if run_dir.is_dir() else ():
        if path.is_symlink():
            raise UsageError(f"{path} is a symbolic link: a run folder holds none (a write through it would land "
                             "elsewhere). Remove it, or choose another --run-name.")


def _claim_run_dir(run_dir: Path, checkpoint: Path | None) -> None:
    if not _continues(run_dir, checkpoint):
        _can_start_in(run_dir)  # before the lock is created in it: a folder of someone else's stays as it was
    _lock(run_dir)
    _refuse_links(run_dir)  # checked again under the lock: another run may have written since start-up
    if _continues(run_dir, checkpoint):
        step = _read_checkpoint_info(checkpoint)["step"]
        if aside := _set_aside_after(run_dir, step):
            print(f"resuming from step {step}: what the run wrote after it is kept in {aside}", flush=True)
        return
    if _can_start_in(run_dir):
        aside = _set_aside_after(run_dir, 0)
        print(f"{run_dir} holds a run that stopped before its first checkpoint: this run starts over there; what "
              f"that one logged is kept in {aside}", flush=True)
    if checkpoint is not None:  # a new folder, branching off another run: its metrics up to the checkpoint
        step = _read_checkpoint_info(checkpoint)["step"]
        earlier = [line for n, line in _metrics_lines(checkpoint.parent) if n < step]
        replace_file(run_dir / "metrics.jsonl", "".join(earlier))


def _lock(run_dir: Path) -> None:
    """Hold run_dir's lock for the rest of this process (released by the OS when it ends, even killed)."""
    key = str(run_dir.resolve())
    if key in _HELD_LOCKS:
        return
    try:
        if not run_dir.exists():  # create it with the lock already held: there is no moment it is unclaimed
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            claim = run_dir.with_name(f".{run_dir.name}.claim-{os.getpid()}")
            claim.mkdir()
            fd = os.open(claim / RUN_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            try:
                claim.rename(run_dir)
                _HELD_LOCKS[key] = fd
                return
            except OSError:  # another run created it first: that run's lock decides below
                os.close(fd)
                shutil.rmtree(claim)
        fd = os.open(run_dir / RUN_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            _refuse_links(run_dir)
        raise UsageError(f"--output-dir {run_dir.parent}: cannot create the run folder {run_dir}: "
                         f"{error.strerror or error}. Choose a writable --output-dir.") from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):
        os.close(fd)
        raise UsageError(f"--run-name {run_dir.name}: {run_dir} is in use by another run that is still going "
                         "(it holds the folder's lock). Wait for it to end, or choose another --run-name.") from None
    except OSError as error:  # e.g. a file system without locks
        os.close(fd)
        raise UsageError(f"--output-dir {run_dir.parent}: cannot lock {run_dir / RUN_LOCK} ({error.strerror}), so two "
                         "runs could write into one folder. Use an --output-dir on a file system with locks.") from None
    _HELD_LOCKS[key] = fd


def open_to_append(path: Path):
    """A file of the run folder opened to append, never through a link: the path must be a plain file of its
    own (not a symbolic link, nor a hard link that another name shares) or not exist yet."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode) or status.st_nlink > 1:
        os.close(fd)
        raise UsageError(f"{path} is not a plain file of its own (a link, or a device): a run folder holds none. "
                         "Remove it, or choose another --run-name.")
    return os.fdopen(fd, "a", encoding="utf-8")


def replace_file(path: Path, text: str) -> None:
    """Write `text` to a new file beside `path` and rename it to `path`: what was at `path` (even a link) is
    replaced, never written through, and a failed write leaves it as it was."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "w",
                       encoding="utf-8") as file:
            file.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def recorded(config: dict) -> dict:
    """The flags as config.json and checkpoint.json record them: a --model inside this repository (the default,
    tiny_model/) by its path relative to the repository, so that a copied or moved repository resumes its runs."""
    model = Path(config.get("model", "")).expanduser()
    if model.is_absolute() and model.resolve().is_relative_to(ROOT):
        return {**config, "model": str(model.resolve().relative_to(ROOT))}
    return config


def _is_run_dir(path: Path) -> bool:
    return os.path.lexists(path / RUN_LOCK)


def _read_checkpoint_info(path: Path) -> dict:
    """The checkpoint.json of a checkpoint folder ({} when there is none), or a stop naming what is wrong with it."""
    path = Path(path)
    file = path / CHECKPOINT_INFO
    if not file.is_file():
        return {}
    try:
        info = json.loads(file.read_bytes().decode())
    except (OSError, ValueError, RecursionError):
        info = None
    fields = {"algorithm": str, "step": int, "world_size": int, "resumable": bool, "config": dict}
    if not isinstance(info, dict):
        problem = "not a JSON object"
    else:
        problem = next((f"{key!r} missing, or not a {kind.__name__}" for key, kind in fields.items()
                        if not isinstance(info.get(key), kind) or (kind is int and isinstance(info[key], bool))), None)
        if problem is None and not isinstance(info["config"].get("model"), str):
            problem = "its config has no 'model'"
        elif problem is None and re.fullmatch(r"step_\d+", path.name) and path.name != f"step_{info['step']}":
            problem = f"step {info['step']} in the folder {path.name}"
    if problem:
        raise UsageError(f"{file} is damaged ({problem}). Resume from another checkpoint (--resume <run>/step_N), "
                         f"or move {path.name} out of the run folder.")
    return info


def _checkpoint_info(path: Path) -> dict:
    """The checkpoint.json of a checkpoint folder, or {} when it has none or a damaged one."""
    try:
        return _read_checkpoint_info(path)
    except UsageError:
        return {}


def latest_checkpoint(run_dir: Path, strict: bool = False) -> Path | None:
    """The resumable checkpoint of the highest step in run_dir (never a half-written `step_N.tmp`). A damaged
    checkpoint.json is passed over, or with `strict` (what --resume latest reads) stops the run naming it."""
    read = _read_checkpoint_info if strict else _checkpoint_info
    found = [p for p in _step_folders(run_dir) if read(p).get("resumable")]
    return found[-1] if found else None


def _step_folders(run_dir: Path) -> list[Path]:
    """run_dir's step_N folders (never step_N.tmp), by step."""
    found = [p for p in Path(run_dir).glob("step_*") if re.fullmatch(r"step_\d+", p.name)]
    return sorted(found, key=lambda p: int(p.name[5:]))


def _metrics_lines(run_dir: Path) -> list[tuple[int, str]]:
    """(step, line) for each complete line of run_dir's metrics.jsonl (a last line cut short by a crash, with
    no newline, is left out), or a stop naming a line that this project does not write."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = []
    for number, raw in enumerate(path.read_bytes().split(b"\n")[:-1], 1):
        try:
            record = json.loads(raw.decode())
        except (ValueError, RecursionError):
            record = None
        step = record.get("step") if isinstance(record, dict) else None
        if type(step) is not int or step < 0:
            raise UsageError(f"{path}:{number}: not a line this project writes (a JSON object with an integer "
                             f"'step'). Delete the line, or move {path.name} out of the folder (the checkpoints do "
                             "not need it).")
        lines.append((step, raw.decode() + "\n"))
    return lines


def _check_same_run(checkpoint: Path, run_info: dict) -> None:
    """Stop when the checkpoint was written by another algorithm file, model or number of ranks; print the
    other flags that changed (escaped: the values come from a file)."""
    saved, config = _read_checkpoint_info(checkpoint), recorded(run_info["config"])
    saved_config = recorded(saved["config"])
    if saved["algorithm"] != run_info["algorithm"]:
        raise UsageError(f"--resume {checkpoint}: written by {_shown(saved['algorithm'])}, resumed by "
                         f"{run_info['algorithm']}. Resume it with {_shown(saved['algorithm'])}, or start "
                         f"{run_info['algorithm']} from its weights with --model {checkpoint}.")
    if saved_config["model"] != config["model"]:
        trained = saved_config["model"]  # as recorded: one inside this repository relative to it
        trained = str(ROOT / trained) if (ROOT / trained).exists() else _shown(trained)
        raise UsageError(f"--resume {checkpoint}: trained from --model {trained}, resumed with --model "
                         f"{run_info['config']['model']}. Resume with --model {trained}.")
    if saved["world_size"] != config["world_size"]:
        raise UsageError(f"--resume {checkpoint}: written by {saved['world_size']} rank(s), resumed on "
                         f"{config['world_size']}. Resume with --nproc_per_node={saved['world_size']} (each rank's "
                         f"sampling stream and algorithm state are its own), or start a new run from its weights "
                         f"with --model {checkpoint}.")
    changed = [f"--{key.replace('_', '-')} {saved_config[key]!r} -> {value!r}" for key, value in config.items()
               if key not in NOT_COMPARED and key in saved_config and saved_config[key] != value]
    if changed:
        print(f"--resume {checkpoint}: flags changed since the checkpoint: {', '.join(changed)}", flush=True)


def _shown(text: str) -> str:
    """`text` as it is when it prints as itself, else escaped: a value read from a file may hold control codes."""
    return text if text.isprintable() else repr(text)


def _set_aside_after(run_dir: Path, step: int) -> Path | None:
    """Move the checkpoints after `step`, `final/` and the metrics lines from `step` on, which the
    resumed run will write anew, into run_dir/abandoned_after_step_<step>[.k]/. The metrics are written
    first and the folders moved last (a rename needs no space), so a failed write (a full disk) moves nothing."""
    later = [p for p in _step_folders(run_dir) if int(p.name[5:]) > step]
    later += [run_dir / "final"] if (run_dir / "final").exists() else []
    lines = _metrics_lines(run_dir)
    dropped = [line for n, line in lines if n >= step]
    if not later and not dropped:
        return None
    aside = _unused(run_dir / f"abandoned_after_step_{step}")
    try:
        aside.mkdir()
        replace_file(aside / "metrics.jsonl", "".join(dropped))
        replace_file(run_dir / "metrics.jsonl", "".join(line for n, line in lines if n < step))
    except OSError as error:
        shutil.rmtree(aside, ignore_errors=True)
        raise UsageError(f"cannot set aside what the run wrote after step {step} ({error.strerror}: {error.filename}). "
                         "Nothing was moved: free some space and resume again.") from None
    for path in later:
        path.rename(aside / path.name)
    return aside


def _training_state(modules: dict[str, torch.nn.Module], optimizer) -> dict:
    """The resumable state as DCP reads and writes it, tensors only (safetensors holds nothing else): the
    weights of every module, each this rank's own (FSDP: its shards, as DTensors; DDP and one process: the
    full tensors), a weight tied to another (an LM head tied to the embeddings) once; and the optimizer's
    per-parameter state (its hyper-parameters are the flags')."""
    model = torch.nn.ModuleDict(modules)  # names the tensors "policy.<...>", "critic.<...>"
    weights, seen = {}, set()
    for name, tensor in get_model_state_dict(model).items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        where = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape))
        if local.numel() and where in seen:  # tied: restored through the tensor it shares
            continue
        seen.add(where)
        weights[name] = tensor
    return {"model": weights, "optimizer": get_optimizer_state_dict(model, optimizer)["state"]}


def _file_of_each_weight(state: dict) -> dict[str, int]:
    """DCP's key of each tensor -> its file: a weight and its optimizer state in a file of their own, since
    safetensors builds a whole file in memory before writing it (twice its size, for the moment): so a
    save needs twice the largest weight's state, not twice the rank's."""
    files = {name: i for i, name in enumerate(state["model"], 1)}
    keys = {f"model.{name}": i for name, i in files.items()}
    for name, values in state["optimizer"].items():
        for key in values:
            keys[f"optimizer.{name}.{key}"] = files.setdefault(name, len(files) + 1)
    return keys


def _flatten(value, tensors: dict, key: str):
    """`value` (an algorithm's state: numbers, text, tensors, Rollouts, in lists and dicts) as JSON, each tensor
    replaced by {"tensor": its key in `tensors`}; `_unflatten` reverses it."""
    if isinstance(value, torch.Tensor):
        tensors[key] = value.detach().cpu().clone()
        return {"tensor": key}
    if isinstance(value, Rollout):
        return {"rollout": _flatten(dict(vars(value)), tensors, key)}
    if isinstance(value, dict):
        return {"dict": {k: _flatten(v, tensors, f"{key}.{k}") for k, v in value.items()}}
    if isinstance(value, (list, tuple)):
        return [_flatten(v, tensors, f"{key}.{i}") for i, v in enumerate(value)]
    return value


def _unflatten(value, tensors: dict):
    if isinstance(value, list):
        return [_unflatten(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    (kind, inner), = value.items()
    if kind == "tensor":
        return tensors[inner]
    if kind == "rollout":
        return Rollout(**_unflatten(inner, tensors))
    return {k: _unflatten(v, tensors) for k, v in inner.items()}


def save_checkpoint(path: Path, modules: dict[str, torch.nn.Module], tokenizer, rank: int, run_info: dict,
                    optimizer=None, step: int = 0, extra: dict | None = None, keep: int = 0) -> None:
    """Write a checkpoint folder; call on every rank. It holds:

    - the policy (modules["policy"]) and tokenizer in `save_pretrained` format, so it loads anywhere
      with `from_pretrained`; under FSDP the weights are gathered to rank 0's CPU memory for this;
    - checkpoint.json: the algorithm file, the step, the number of ranks and every flag (run_info);
    - with an optimizer, the resumable state (`load_checkpoint`): the weights of every module and the
      optimizer state in training_state/, written with torch.distributed.checkpoint as safetensors (each
      rank writes only its own shards: no rank ever holds the full optimizer state), and
      rank_<r>.safetensors with each rank's RNG states (torch, CUDA, Python) and its algorithm state
      `extra` (tensors, and the rest as JSON in its header).

    Everything is written into `<path>.tmp`, fsync'd, and renamed to `path` only when every rank has
    written its part, so a crash never leaves a partial folder under `path`. A failed write (disk full,
    no permission) removes the .tmp folder and stops with the path and the cause; earlier checkpoints
    are untouched. A folder already at `path` is moved aside, never deleted. With `keep` > 0, only the
    newest `keep` step checkpoints are kept after the save. A Ctrl-C while it writes removes the .tmp
    folder too, and stops the run as a Ctrl-C anywhere else does, never as a failed write."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        _write_checkpoint(path, tmp, modules, tokenizer, rank, run_info, optimizer, step, extra, keep)
    except KeyboardInterrupt:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_checkpoint(path: Path, tmp: Path, modules: dict[str, torch.nn.Module], tokenizer, rank: int,
                      run_info: dict, optimizer, step: int, extra: dict | None, keep: int) -> None:
    policy, distributed = modules["policy"], dist.is_initialized()
    error = None
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)  # a .tmp folder is always this project's, left by a crash
            tmp.mkdir(parents=True)
        except OSError as exc:
            error = exc
    _stop_if_any_failed(error, path, tmp, rank)  # the folder exists before any rank writes into it
    try:
        if optimizer is not None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                state = _training_state(modules, optimizer)
                writer = HuggingFaceStorageWriter(str(tmp / TRAINING_STATE), _file_of_each_weight(state),
                                                  save_distributed=distributed)
                dcp.save(state, storage_writer=writer, no_dist=not distributed)
            cuda_rng = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
            own, tensors = {"rng": torch.get_rng_state(), "cuda_rng": cuda_rng, "python_rng": random.getstate(),
                            "extra": extra or {}}, {}
            plain = json.dumps(_flatten(own, tensors, "own"))  # the tensors go into `tensors`, the rest stays
            (tmp / f"rank_{rank}.safetensors").write_bytes(safetensors_bytes(tensors, {"state": plain}))
    except (Exception, dcp.CheckpointException) as exc:  # reported with its path below, on every rank
        error = exc
    weights = None
    if isinstance(unwrap(policy), FSDPModule):  # collective: every rank takes part, rank 0 receives the weights
        weights = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0 and error is None:
        try:
            with transformers_quiet():
                unwrap(policy).save_pretrained(tmp, state_dict=weights)
            tokenizer.save_pretrained(tmp)
            info = {"algorithm": run_info["algorithm"], "step": step, "resumable": optimizer is not None,
                    "world_size": dist.get_world_size() if distributed else 1, "config": recorded(run_info["config"])}
            (tmp / CHECKPOINT_INFO).write_text(json.dumps(info, indent=2, default=str))
            _fsync_tree(tmp)
        except Exception as exc:
            error = exc
    del weights
    _stop_if_any_failed(error, path, tmp, rank)  # every rank has written its part
    if rank == 0:
        try:
            if path.exists():
                _move_aside(path)
            tmp.rename(path)
            _fsync(path.parent)
        except OSError as exc:
            error = exc
    _stop_if_any_failed(error, path, tmp, rank)
    if rank == 0 and keep > 0:
        steps = [p for p in _step_folders(path.parent) if _checkpoint_info(p)]
        for old in steps[:-keep]:
            try:
                shutil.rmtree(old)
            except OSError as error:  # rank 0 alone: a warning, never a stop that would leave the others waiting
                print(f"warning: --keep-checkpoints {keep}: could not remove {old} ({error.strerror})", flush=True)


def _stop_if_any_failed(error: BaseException | None, path: Path, tmp: Path, rank: int) -> None:
    """Collective: when a rank's write failed, every rank stops with the path and each failed rank's
    cause, and rank 0 removes the partial .tmp folder; earlier checkpoints are left as they are. A Ctrl-C
    that the writer wrapped (DCP in a CheckpointException, torch.save's interrupted zip writer in the
    error it raises as it closes) is raised as the KeyboardInterrupt it is."""
    if error is not None and _interrupted(error):
        raise KeyboardInterrupt from error
    errors = [None if error is None else _write_error(error)]
    if dist.is_initialized():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, None if error is None else _write_error(error))
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if not failed:
        return
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    where = "; ".join(f"rank {r}: {e}" for r, e in failed) if dist.is_initialized() else failed[0][1]
    previous = latest_checkpoint(path.parent) if path.parent.exists() else None
    kept = f"the last complete checkpoint, {previous}, is untouched" if previous else "there is no earlier checkpoint"
    raise UsageError(f"could not write the checkpoint {path} ({where}). Removed {tmp.name}; {kept}.")


def _interrupted(error: BaseException) -> bool:
    """Whether a KeyboardInterrupt is the failure, or its cause or context, anywhere in the chain."""
    seen = _first_failure(error)
    while seen is not None and not isinstance(seen, KeyboardInterrupt):
        seen = seen.__cause__ or seen.__context__
    return seen is not None


def _write_error(error: Exception) -> str:
    """The cause of a failed write in one line: the OS error and file when there is one, anywhere in the chain."""
    seen = _first_failure(error)
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return f"{seen.strerror}: {seen.filename}" if seen.filename else seen.strerror
        seen = seen.__cause__ or seen.__context__
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[-1] if text else ''}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """Flush every file and folder under `folder` to disk, so the rename that publishes it is durable."""
    for root, _, files in os.walk(folder):
        for name in files:
            _fsync(Path(root) / name)
        _fsync(Path(root))


def _unused(path: Path) -> Path:
    """`path`, or the first of `path.2`, `path.3`, ... that does not exist yet."""
    k = 1
    while os.path.lexists(found := path if k == 1 else path.with_name(f"{path.name}.{k}")):
        k += 1
    return found


def _move_aside(path: Path) -> None:
    aside = _unused(path.with_name(f"{path.name}.old"))
    path.rename(aside)
    print0(f"moved the earlier {path} aside to {aside}")


def _check_training_state(folder: Path) -> None:
    """Every file of the resumable state is a plain file of `folder` (a link would be read wherever it points),
    and every safetensors file has a header that reads; else a ValueError naming the file."""
    if (folder / ".metadata").exists():
        raise ValueError("it was written in torch.distributed.checkpoint's pickled format, which these files no "
                         "longer read. Start a new run from its weights with --model <that checkpoint>.")
    for file in sorted(folder.iterdir()):
        if file.is_symlink() or not file.is_file():
            raise ValueError(f"{folder.name}/{file.name}: a link, or not a plain file")
        if file.suffix == ".safetensors":
            _read_header(file, folder.name)


def _read_header(file: Path, where: str) -> dict:
    """The metadata in a safetensors file's header, or a ValueError naming the file and what is wrong."""
    try:
        with safe_open(file, "pt") as opened:
            return opened.metadata() or {}
    except Exception as error:  # safetensors' own error type: a 0-byte, truncated or other file
        raise ValueError(f"{where}/{file.name}: not a complete safetensors file ({error})") from None


def load_checkpoint(path: Path, modules: dict[str, torch.nn.Module], optimizer, rank: int) -> tuple[int, dict]:
    """Restore what `save_checkpoint` wrote: every module's weights and the optimizer state in place (each
    rank reads only its own shards), and this rank's RNG state. Returns (the step to continue from,
    this rank's algorithm state).

    Nothing in the folder is unpickled: the shards and each rank's state are safetensors files (tensors,
    and JSON in their headers).

    The number of ranks must be the one that saved (`prepare_run_dir` checks it). DCP itself could
    reshard the weights and optimizer state to another count, but each rank's sampling stream and
    algorithm state (GVPO's replayed groups are its own completions) have no counterpart on another
    count, and a resumed run is meant to be the run that stopped, bitwise. To go on with other hardware,
    start a new run from the step's weights (`--model <run>/step_N`)."""
    model, state = torch.nn.ModuleDict(modules), _training_state(modules, optimizer)
    try:
        _check_training_state(path / TRAINING_STATE)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=HuggingFaceStorageReader(str(path / TRAINING_STATE)),
                     no_dist=not dist.is_initialized())
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))  # strict: tied weights
        groups = get_optimizer_state_dict(model, optimizer)["param_groups"]  # the flags' learning rate, ...
        set_optimizer_state_dict(model, optimizer, {"state": state["optimizer"], "param_groups": groups})
    except (Exception, dcp.CheckpointException) as error:  # a damaged file, a shape that does not fit, ...
        raise UsageError(f"--resume {path}: cannot restore it: {_load_error(error)}") from None
    file = path / f"rank_{rank}.safetensors"
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        plain = json.loads(_read_header(file, path.name).get("state", "null"))
        with safe_open(file, "pt") as opened:  # the algorithm's tensors back on the device, the RNG states on CPU
            tensors = {key: opened.get_tensor(key).to(device if key.startswith("own.extra.") else "cpu")
                       for key in opened.keys()}
        own = _unflatten(plain, tensors)
        if not isinstance(own, dict) or not {"rng", "cuda_rng", "python_rng", "extra"} <= own.keys():
            raise ValueError(f"{file.name}: not the RNG and algorithm state this project writes")
    except Exception as error:
        raise UsageError(f"--resume {path}: cannot restore it: {_load_error(error)}") from None
    torch.set_rng_state(own["rng"])
    version, internal, gauss = own["python_rng"]
    random.setstate((version, tuple(internal), gauss))  # unused by these files, kept for code you add
    if own["cuda_rng"] is not None:
        torch.cuda.set_rng_state(own["cuda_rng"])
    return _checkpoint_info(path)["step"], own["extra"]


def _first_failure(error: BaseException) -> BaseException:
    """The exception inside a CheckpointException (DCP gathers each rank's failure, with its traceback)."""
    if isinstance(error, dcp.CheckpointException) and error.failures:
        return next(iter(error.failures.values()))[0]
    return error


def _load_error(error: BaseException) -> str:
    """One line for a failed restore."""
    error = _first_failure(error)
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) < 400 else text[:400] + " ..."



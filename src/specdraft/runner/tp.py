"""Tensor parallelism: the target sharded over the ranks of a ``torch.distributed`` group.

    dec = SpeculativeDecoder.from_pretrained(target, drafter="eagle", tensor_parallel=2)

**The shards** (gpt-fast's ``tp.py``): each rank holds a share of every block's KV heads with
their query heads (``wqkv``: those heads' rows of queries, keys and values) and of the MLP's
hidden units (``w13``: their gate and up rows); shares are as equal as the counts allow
(SmolLM2-135M's 3 KV heads over 2 ranks: 2 and 1); ``wo`` and ``w2`` take their inputs from those
(row-parallel) and their partial products are summed over the ranks (one all-reduce each, so
two per block). The embedding, the norms and the output head are replicated: at the sizes this
project runs (a 49k x 576 head is 57 MB in bfloat16) splitting them would add a gather to every
pass to save little; see docs/tensor-parallel.md. Each rank's KV cache holds its own KV heads.
More ranks than KV heads are refused with the counts named.

**One engine, N ranks** (nano-vllm's model runner): rank 0 runs everything a decoder runs: the
engine, scheduler, drafter (a draft model unsharded, heads on rank 0), acceptance and the server.
Its target runner is a :class:`TensorParallelRunner`: every target pass and every change to the
target's KV cache (reset, rollback, a tree's path moved into place) is broadcast to the other
ranks first, then run on rank 0's own shard; the other ranks run the same pass on theirs
(:func:`follow`) and the ranks meet in the all-reduces. Rank 0 drives rather than every rank
running the engine (SPMD) because the engine's adaptive draft length reads the wall clock and a
server's requests reach rank 0 only: replicated engines would drift apart.

**Exactness**: all-reduce sums the same partial products in the same order on every pass, and
each rank's products keep the runner's row invariance (:mod:`.kernels`), so a verify pass gives
each token the logits its one-token steps give: speculative output equals plain decoding of the
same sharded target. A sharded target rounds differently from the unsharded one (the partial
sums are rounded to the model's dtype before they are added): equal to rounding, not bit for bit.

**Processes**: :func:`start` launches ranks ``1..N-1`` itself (``python -m
specdraft.runner.tp``, gloo on CPU, NCCL on GPUs, rendezvous on 127.0.0.1); under ``torchrun``
the ranks exist already and the ranks other than 0 follow (a :class:`SystemExit` ends them once
rank 0 is done). Rank 0 hands each rank its shard of the weights (the other ranks never load
the checkpoint). Its messages travel on a gloo group of their own with no practical time limit
(an idle server sends none); a pass's collectives time out (:func:`pass_timeout`). A rank that
exits, or rank 0 failing partway through a pass, ends the others with one line; Ctrl-C reaches
rank 0, whose exit ends the others.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from .base import RunnerBase
from .model import ModelArgs, SpecdraftModel, rope_inv_freq

def pass_timeout() -> datetime.timedelta:
    """How long a pass's collective may wait for a rank before it fails: 10 minutes, or
    ``SPECDRAFT_TP_TIMEOUT`` seconds (a rank that died is seen sooner: its connections close)."""
    value = os.environ.get("SPECDRAFT_TP_TIMEOUT", "600")
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ConfigError(f"SPECDRAFT_TP_TIMEOUT must be a number of seconds > 0, got {value!r}")
    return datetime.timedelta(seconds=seconds)


#: the other ranks wait for rank 0's next message on a group of their own (gloo, on the CPU) with
#: no practical time limit: a server with no requests sends nothing for as long as it is idle
#: (a rank that dies is seen by the watchers, not by a timeout)
IDLE = datetime.timedelta(days=365)


def _control_group():
    """After init_process_group, on every rank: the group rank 0's messages travel on."""
    return dist.new_group(backend="gloo", timeout=IDLE)


def shares(n: int, world: int) -> list[tuple[int, int]]:
    """``(start, size)`` of each rank's part of ``n`` things, as equal as they can be (the first get one more)."""
    base, extra = divmod(n, world)
    sizes = [base + (r < extra) for r in range(world)]
    return [(sum(sizes[:r]), sizes[r]) for r in range(world)]


def check_shardable(args: ModelArgs, world: int) -> None:
    """ConfigError unless each of ``world`` ranks can take at least one KV head (with its query heads)."""
    if world > args.n_kv_heads:
        raise ConfigError(f"tensor_parallel={world} is more ranks than this model's {args.n_kv_heads} KV heads "
                          f"({args.n_heads} attention heads): each rank needs a KV head and its query heads; "
                          f"choose at most {args.n_kv_heads}")


def shard_args(args: ModelArgs, rank: int, world: int) -> ModelArgs:
    """Rank ``rank``'s shapes: its KV heads (as equal a share as can be) with their query heads, and its MLP units."""
    kv = shares(args.n_kv_heads, world)[rank][1]
    return dataclasses.replace(args, n_heads=kv * (args.n_heads // args.n_kv_heads), n_kv_heads=kv,
                               intermediate_size=shares(args.intermediate_size, world)[rank][1])


def shard_state(model: SpecdraftModel, rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s weights of an unpacked, unquantized ``model``, on the CPU (replicated ones shared)."""
    a = model.args
    q, kv, group = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_heads // a.n_kv_heads
    first, heads = shares(a.n_kv_heads, world)[rank]  # this rank's KV heads, and their query heads
    q_part = (first * group * a.head_dim, heads * group * a.head_dim)
    kv_part = (first * a.head_dim, heads * a.head_dim)
    units = shares(a.intermediate_size, world)[rank]

    def rows(t: torch.Tensor, *parts: tuple[int, int]) -> torch.Tensor:
        return torch.cat([t[start: start + size] for start, size in parts])

    def columns(t: torch.Tensor, part: tuple[int, int]) -> torch.Tensor:
        return t[:, part[0]: part[0] + part[1]]

    state = {}
    for name, t in model.state_dict().items():
        t = t.detach()
        if name.endswith(("attention.wqkv.weight", "attention.wqkv.bias")):  # [q ; k ; v] rows: this rank's heads
            t = rows(t, q_part, (q + kv_part[0], kv_part[1]), (q + kv + kv_part[0], kv_part[1]))
        elif name.endswith("attention.wo.weight"):  # its inputs: this rank's query heads
            t = columns(t, q_part)
        elif name.endswith("feed_forward.w13.weight"):  # [gate ; up] rows: this rank's units
            t = rows(t, units, (a.intermediate_size + units[0], units[1]))
        elif name.endswith("feed_forward.w2.weight"):
            t = columns(t, units)
        else:
            state[name] = t.cpu()
            continue
        state[name] = t.contiguous().cpu().clone()
    return state


class AllReduce(nn.Module):
    """A row-parallel linear layer: this rank's part of the product, summed over the ranks."""

    def __init__(self, linear: nn.Module, group=None) -> None:
        super().__init__()
        self.linear = linear
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        dist.all_reduce(y, group=self.group)
        return y


def build_shard(args: ModelArgs, rank: int, world: int, state: dict[str, torch.Tensor], device,
                quantize: str | None):
    """Rank ``rank``'s :class:`SpecdraftModel` from its ``state`` (:func:`shard_state`) on ``device``,
    quantized and packed as an unsharded target would be (:func:`~.runner.finish_model`)."""
    from .runner import finish_model

    with torch.device("meta"):
        model = SpecdraftModel(shard_args(args, rank, world))
    model.load_state_dict(state, assign=True, strict=True)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.rope_inv_freq = rope_inv_freq(args)
    model.requires_grad_(False).eval().to(device)
    for block in model.layers:
        block.attention.wo = AllReduce(block.attention.wo)
        block.feed_forward.w2 = AllReduce(block.feed_forward.w2)
    return finish_model(model, quantize)


def _tensors(obj, fn):
    """``obj`` (a pass's arguments: tensors in tuples, lists and dicts) with ``fn`` applied to its tensors."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: _tensors(v, fn) for k, v in obj.items()}
    return obj


def _broadcast(control, msg=None):
    """Rank 0 sends ``msg`` to every rank over the ``control`` group; the others return what it sent."""
    box = [_tensors(msg, torch.Tensor.cpu)]  # what crosses to the other ranks lives on the CPU
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


#: cache methods that change what the cache holds: run on every rank (the rest are read on rank 0)
CACHE_CHANGES = ("reset", "reserve", "fit", "set_lengths", "move", "keep_paths", "save_block", "load_block", "drop_block")


class _MirroredCache:
    """Rank 0's view of a target runner's cache: every change runs on every rank's cache."""

    def __init__(self, runner: "TensorParallelRunner") -> None:
        self._runner = runner

    def __getattr__(self, name: str):
        value = getattr(self._runner.local.cache, name)
        if name not in CACHE_CHANGES:
            return value

        def change(*args, **kwargs):
            return self._runner._everywhere(("cache", name), args, kwargs)

        return change


class TensorParallelRunner(RunnerBase):
    """Rank 0's target runner: the runner interface of :class:`~.runner.ModelRunner` (``forward``,
    ``cache``, ``warm_up``), each pass and cache change run on every rank's shard."""

    implementation = "specdraft"
    supports_tree = True

    def __init__(self, group: "Group", key: int, local) -> None:
        self.group, self.key, self.local = group, key, local
        self.model = local.model
        self.compiled, self.quantization = local.compiled, local.quantization
        self.cache = _MirroredCache(self)
        self._closed = False

    @property
    def compile_seconds(self) -> float:
        return self.local.compile_seconds

    @property
    def info(self) -> dict:
        return {**super().info, "tensor_parallel": self.group.world}

    def _everywhere(self, what: tuple[str, str], args, kwargs):
        with self.group.lock:
            if self._closed:
                raise ConfigError("this decoder's tensor-parallel runner was closed (close()); make a new decoder")
            try:
                self.group.send(("call", self.key, what, args, kwargs))
                return _call(self.local, what, args, kwargs)
            except Exception as exc:  # (Ctrl-C on the main thread ends the command: rank 0's exit ends them)
                if not self.group.alive:  # stopped on purpose (the program is ending): nothing went out
                    raise
                # The other ranks got the message: a rank 0 that stops partway leaves them inside the
                # pass, and the next message would meet their collectives. A rank that died says so;
                # otherwise the ranks are out of step, which ends the command too (one line each).
                self.group.end_if_a_rank_died(wait=2.0)
                self.group.fail(f"rank 0 failed partway through {what[1]} ({_first_line(exc)}), so the ranks "
                                "are out of step")

    def forward(self, tokens: torch.Tensor, **kwargs):
        """:meth:`ModelRunner.forward <specdraft.runner.runner.ModelRunner.forward>` on every rank."""
        return self._everywhere(("runner", "forward"), (tokens,), kwargs)

    def warm_up(self, rows: int, widths) -> None:
        self._everywhere(("runner", "warm_up"), (rows, list(widths)), {})

    def close(self) -> None:
        """Free the other ranks' runner (its KV cache); this runner is not used again."""
        if not self._closed and self.group.alive:
            self._closed = True
            with self.group.lock:
                self.group.send(("drop", self.key))


def _call(runner, what: tuple[str, str], args, kwargs):
    owner = runner.cache if what[0] == "cache" else runner
    return getattr(owner, what[1])(*args, **kwargs)


class Group:
    """Rank 0's side of the ranks: what it sends them, the shards it handed out, their processes."""

    def __init__(self, world: int, device: torch.device, procs: list[subprocess.Popen]) -> None:
        self.world, self.device, self.procs = world, device, procs
        self.control = None  # the group its messages travel on, once the process group has formed
        self.lock = threading.RLock()  # a message and the work it starts on rank 0 go together
        self.alive = True
        self._keys = itertools.count()
        #: each transformers model's shard on rank 0 (and its key on the other ranks), per quantization
        self._shards: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()

    def send(self, msg) -> None:
        if not self.alive:
            raise ConfigError("the tensor-parallel ranks have been stopped")
        _broadcast(self.control, msg)

    def runner(self, hf_model, quantize: str | None = None) -> TensorParallelRunner:
        """A target runner for ``hf_model`` sharded over the ranks (each model is sharded once)."""
        from .convert import from_transformers
        from .runner import ModelRunner

        if quantize == "gguf":
            raise ConfigError("quantize='gguf' runs in one process: drop tensor_parallel, or use quantize='int8'")
        with self.lock:
            shards = self._shards.setdefault(hf_model, {})
            if quantize not in shards:
                model, reason = from_transformers(hf_model)
                if model is None:
                    raise ConfigError(f"tensor_parallel needs specdraft's own model code, which this model "
                                      f"cannot use: {reason}")
                check_shardable(model.args, self.world)
                key = next(self._keys)
                self.send(("model", key, model.args, quantize))
                for rank in range(1, self.world):  # one rank's weights at a time: held (and pickled) once
                    dist.send_object_list([shard_state(model, rank, self.world)], dst=rank, group=self.control)
                args, state = model.args, shard_state(model, 0, self.world)
                del model  # the unsharded copy goes before rank 0's shard is built
                shards[quantize] = (key, build_shard(args, 0, self.world, state, self.device, quantize))
                del state
                release_freed_memory()
            model_key, shard = shards[quantize]
            key = next(self._keys)
            self.send(("runner", key, model_key))
            return TensorParallelRunner(self, key, ModelRunner(shard, quantization=quantize))

    def fail(self, why: str) -> None:
        """One line, the other ranks killed, and this process ends (status 1)."""
        print(f"specdraft: error: tensor-parallel {why}; ending the other ranks", file=sys.stderr, flush=True)
        for other in self.procs:
            if other.poll() is None:
                other.kill()
                other.wait()
        os._exit(1)

    def end_if_a_rank_died(self, wait: float = 0.0) -> None:
        """If a rank this process started has exited (looking for up to ``wait`` seconds) while the
        group is alive: one line, the other ranks killed, and this process ends (status 1)."""
        deadline = time.monotonic() + wait
        while self.alive:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and self.alive:
                    self.fail(f"rank {rank} exited (status {code})")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.1)

    def stop(self) -> None:
        """End the other ranks (they leave their loop) and the process group."""
        with self.lock:
            if not self.alive:
                return
            try:
                _broadcast(self.control, None)
            finally:
                self.alive = False
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        dist.destroy_process_group()


_GROUP: Group | None = None


def check_size(size) -> int:
    """``tensor_parallel`` as a positive int (ConfigError otherwise)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"tensor_parallel must be an integer >= 1 (ranks the target is sharded over), got {size!r}")
    return size


def launched_rank() -> int | None:
    """This process's rank when a launcher (torchrun) started it, else None."""
    rank = os.environ.get("RANK")
    return int(rank) if rank is not None and "WORLD_SIZE" in os.environ else None


def start(world: int, device) -> Group:
    """Rank 0's group of ``world`` ranks, started on first use (and reused after).

    Started here: ranks ``1..world-1`` are new processes on this machine. Under torchrun: the
    launcher's ranks; a rank other than 0 follows rank 0 and then ends with :class:`SystemExit`."""
    global _GROUP
    world = check_size(world)
    device = torch.device(device)
    if _GROUP is not None and _GROUP.alive:
        if _GROUP.world != world:
            raise ConfigError(f"this process already runs a tensor-parallel group of {_GROUP.world} ranks; "
                              f"tensor_parallel={world} cannot start another (one group per process)")
        if _GROUP.device.type != device.type or (device.index is not None and device != _GROUP.device):
            raise ConfigError(f"this process already runs a tensor-parallel group on {_GROUP.device}; a target "
                              f"on {device} cannot join it (one group per process): load it on {_GROUP.device}")
        return _GROUP
    backend, timeout = "nccl" if device.type == "cuda" else "gloo", pass_timeout()
    if launched_rank() is not None:
        size = int(os.environ["WORLD_SIZE"])
        if size != world:
            raise ConfigError(f"tensor_parallel={world}, but the launcher started {size} ranks (WORLD_SIZE); "
                              "make them equal")
        rank = launched_rank()
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
            torch.cuda.set_device(device)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
        control = _control_group()
        if rank != 0:
            try:
                follow(device, control)
            except Exception as exc:  # noqa: BLE001 - one line, as from a rank this process started
                print(f"specdraft: error: tensor-parallel rank {rank}: {_first_line(exc)}", file=sys.stderr,
                      flush=True)
                raise SystemExit(1) from None
            dist.destroy_process_group()
            raise SystemExit(0)
        _GROUP = Group(world, device, [])
        _GROUP.control = control
    else:
        if device.type == "cuda":
            if device.index is None:
                device = torch.device("cuda", 0)
            if device.index + world > torch.cuda.device_count():
                raise ConfigError(f"tensor_parallel={world} from {device} needs {world} GPUs from there; "
                                  f"this machine has {torch.cuda.device_count()}")
        elif device.type != "cpu":
            raise ConfigError(f"tensor_parallel runs on CPU (gloo) or CUDA (NCCL), not {device.type}")
        if device.type == "cpu":  # the ranks share the cores: each gets its part
            torch.set_num_threads(max(1, torch.get_num_threads() // world))
        else:
            torch.cuda.set_device(device)  # rank 0's collectives run on its own GPU
        port = _free_port()
        procs = [subprocess.Popen([sys.executable, "-m", "specdraft.runner.tp", str(rank), str(world), str(port),
                                   device.type, str((device.index or 0) + rank), str(torch.get_num_threads()),
                                   str(os.getpid())], stdin=subprocess.DEVNULL)
                 for rank in range(1, world)]
        group = Group(world, device, procs)
        # watched from the start: a rank that fails while the group forms ends the command at once
        threading.Thread(target=_watch, args=(group,), name="specdraft-tp-watch", daemon=True).start()
        try:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world,
                                    timeout=timeout)
            group.control = _control_group()
        except BaseException:
            group.alive = False
            for proc in procs:
                proc.kill()
                proc.wait()
            raise
        _GROUP = group
    return _GROUP


def follow_if_worker(tensor_parallel, device=None) -> None:
    """Under torchrun, a rank other than 0 asked for a sharded target: follow rank 0 (no model
    loaded here: rank 0 hands out the shards), then end the process (SystemExit(0))."""
    if check_size(tensor_parallel) > 1 and launched_rank() not in (None, 0):
        from ..models import resolve_device

        start(tensor_parallel, resolve_device(device))


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``; nothing elsewhere):
    the unpickled weights a shard was built from are freed, but glibc would keep them resident."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else repr(exc)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _watch(group: Group) -> None:
    """Rank 0: a rank that exits while the group is alive ends the command with one line."""
    while group.alive:
        group.end_if_a_rank_died()
        time.sleep(0.2)


@atexit.register
def _stop_at_exit() -> None:
    if _GROUP is not None and _GROUP.alive:
        try:
            _GROUP.stop()
        except Exception:  # noqa: BLE001 - a rank already gone: nothing left to end
            pass


def follow(device: torch.device, control) -> None:
    """A rank other than 0: run what rank 0 sends over ``control`` (shards, runners, passes, cache
    changes) until it stops."""
    from .runner import ModelRunner

    shards: dict[int, SpecdraftModel] = {}
    runners: dict[int, ModelRunner] = {}
    with torch.inference_mode():
        while True:
            msg = _broadcast(control)
            if msg is None:
                return
            kind = msg[0]
            if kind == "call":
                _, key, what, args, kwargs = msg
                _call(runners[key], what, *_tensors((args, kwargs), lambda t: t.to(device)))
            elif kind == "model":
                _, key, args, quantize = msg
                box = [None]
                dist.recv_object_list(box, src=0, group=control)
                shards[key] = (build_shard(args, dist.get_rank(), dist.get_world_size(), box[0], device, quantize), quantize)
                del box
                release_freed_memory()
            elif kind == "runner":
                _, key, model_key = msg
                shard, quantize = shards[model_key]
                runners[key] = ModelRunner(shard, quantization=quantize)
            elif kind == "drop":
                runners.pop(msg[1], None)


def _main(argv: list[str]) -> int:
    """A rank started by :func:`start`: ``RANK WORLD PORT DEVICE_TYPE DEVICE_INDEX THREADS PARENT_PID``."""
    rank, world, port = int(argv[0]), int(argv[1]), int(argv[2])
    device = torch.device(argv[3], int(argv[4])) if argv[3] == "cuda" else torch.device(argv[3])
    torch.set_num_threads(int(argv[5]))
    parent = int(argv[6])
    # Ctrl-C and SIGTERM are rank 0's to handle (a server drains on SIGTERM, and a service manager
    # signals every process of the service): rank 0's exit ends this rank
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def orphaned() -> None:  # rank 0 gone without a word (killed): end too
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=orphaned, daemon=True).start()
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world, timeout=pass_timeout())
        follow(device, _control_group())
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - one line; rank 0 reports this rank's exit too
        if os.getppid() == parent:
            print(f"specdraft: error: tensor-parallel rank {rank}: {_first_line(exc)}", file=sys.stderr, flush=True)
        return 1
    return 0


__all__ = ["AllReduce", "Group", "TensorParallelRunner", "build_shard", "check_shardable", "shares", "follow", "shard_args",
           "shard_state", "start"]

if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

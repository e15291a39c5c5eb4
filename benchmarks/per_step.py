"""Per training step and per validation batch, for each 2-process runner of benchmarks/throughput.py (its small task,
3 epochs): the collectives (DDP's gradient-bucket all-reduces, and the others: blocking or async), the host reads of
tensor values (on a GPU each one of a GPU tensor waits for the GPU), and the time per step outside forward, backward
and the optimizer's step. Prints a table and writes benchmarks/results/per_step.json (`--out FILE`: there instead).

    .venv/bin/python benchmarks/per_step.py [--out FILE]   # needs .venv (fastai v1) and .venv2 (fastai v2)

Each rank (in notebook mode a worker: a fastai callback starts the counters in whichever process runs the fit) splits
its fit in training steps and validation batches, each from the fetch of its batch from a torch DataLoader (else from
the model's outermost forward) to the next's. Epochs 0 and 1 are counted, under torch.profiler and a
TorchFunctionMode; epoch 2 is timed without them.
"""
import argparse
import functools
import importlib.util
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import time
from bisect import bisect_right
from collections import Counter
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
ROOT = BENCHMARKS.parent
sys.path[:0] = [str(ROOT), str(BENCHMARKS)]  # ddipp from this checkout, throughput's runners
import throughput  # noqa: E402

COUNTED_EPOCHS, EPOCHS = 2, 3  # epochs 0 and 1 counted (1: what comes once an epoch), the last one timed
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__format__",
              "__array__")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
               "broadcast_object_list", "barrier", "monitored_barrier", "gather", "gather_object", "scatter",
               "scatter_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
               "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv")
NEVER_WAITS = ("isend", "irecv", "batch_isend_irecv")
C10D_KINDS = {"c10d::allreduce_": "all_reduce", "c10d::allreduce_coalesced_": "all_reduce",
              "c10d::allgather_": "all_gather", "c10d::_allgather_base_": "all_gather",
              "c10d::allgather_coalesced_": "all_gather", "c10d::allgather_into_tensor_coalesced_": "all_gather",
              "c10d::broadcast_": "broadcast", "c10d::barrier": "barrier", "c10d::gather_": "gather",
              "c10d::scatter_": "scatter", "c10d::reduce_": "reduce", "c10d::reduce_scatter_": "reduce_scatter",
              "c10d::_reduce_scatter_base_": "reduce_scatter", "c10d::alltoall_base_": "all_to_all",
              "c10d::alltoall_": "all_to_all", "c10d::send": "send", "c10d::recv_": "recv"}
DTYPE_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4, "short int": 2,
               "signed char": 1, "unsigned char": 1, "bool": 1}
MARK = "per_step|"  # the profiler's ranges and markers of the counters: forward|<segment>, fetch, read|, python|
_recorder = None  # this process's Recorder while a fit is recorded


class Recorder:
    """One rank's record of a fit: its segments (a training step or a validation batch: from its batch's fetch, else
    the model's outermost forward), the collectives and host reads in each (epochs before COUNTED_EPOCHS), their
    time in forward, backward, the optimizer's step and torch.distributed's calls."""

    def __init__(self, out: Path):
        import torch
        self.out, self.segments, self.epoch, self.counting = out, [], -1, True
        self.outer, self.forward_started, self.step_started = None, 0.0, 0.0
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
        self.reads, self.restore = _host_reads_mode(), []

    def start(self) -> None:
        import torch
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        from torch.utils.data.dataloader import _BaseDataLoaderIter
        hooks = [register_module_forward_pre_hook(self._forward_starts),
                 register_module_forward_hook(self._forward_ends),
                 register_optimizer_step_pre_hook(self._step_starts),
                 register_optimizer_step_post_hook(self._step_ends)]
        self.restore = [h.remove for h in hooks] + [_replace(torch.autograd, "backward", self._timed("backward")),
                                                    _replace(_BaseDataLoaderIter, "__next__", self._fetch)]
        fastai_optimizer = sys.modules.get("fastai.optimizer")  # fastai v2's own optimizers are not torch's
        if fastai_optimizer and hasattr(fastai_optimizer, "Optimizer"):
            self.restore.append(_replace(fastai_optimizer.Optimizer, "step", self._timed("step")))
        self.restore += [_replace(torch.distributed, name, self._python_call(name))
                         for name in COLLECTIVES if hasattr(torch.distributed, name)]
        self.profiler.start()
        self.reads.__enter__()

    def stop_counting(self) -> None:
        if self.counting:
            self.reads.__exit__(None, None, None)
            self.profiler.stop()
            self.counting = False

    def _forward_starts(self, module, args) -> None:
        """A module with parameters whose forward starts outside any other's: the model (DDP's, if it has one)."""
        if self.outer is None and next(module.parameters(), None) is not None:
            self.outer = module
            self._new_segment("train" if module.training else "valid")
            self.forward_started = time.perf_counter()

    def _forward_ends(self, module, args, output) -> None:
        if module is self.outer:
            self.segments[-1]["forward"] += time.perf_counter() - self.forward_started
            self.outer = None

    def _new_segment(self, phase: str) -> None:
        if phase == "train" and (not self.segments or self.segments[-1]["phase"] != "train"):
            self.epoch += 1
            if self.epoch == COUNTED_EPOCHS:
                self.stop_counting()
        _mark(f"forward|{len(self.segments)}", self.counting)
        self.segments.append(dict(phase=phase, epoch=self.epoch, start=time.perf_counter(), forward=0.0,
                                  backward=0.0, step=0.0, collectives_s=0.0, collectives=[], host_reads=[]))

    def _step_starts(self, *_) -> None:
        self.step_started = time.perf_counter()

    def _step_ends(self, *_) -> None:
        self._add("step", time.perf_counter() - self.step_started)

    def _add(self, part: str, seconds: float) -> None:
        if self.segments:
            self.segments[-1][part] += seconds

    def _timed(self, part: str):
        """A wrapper of a function that adds its time to the current segment's `part`."""
        def wrap(call):
            @functools.wraps(call)
            def timed(*args, **kwargs):
                started = time.perf_counter()
                try:
                    return call(*args, **kwargs)
                finally:
                    self._add(part, time.perf_counter() - started)
            return timed
        return wrap

    def _fetch(self, original):
        """A wrapper of a torch DataLoader iterator's __next__ that marks where a batch is fetched."""
        @functools.wraps(original)
        def fetch(loader_iter):
            _mark("fetch", self.counting)
            return original(loader_iter)
        return fetch

    def _python_call(self, name: str):
        """A wrapper of torch.distributed's function `name` that adds its time to the current segment's and, while
        counting, runs it in a profiler range naming it, whether its caller waits for it (not async_op) and who."""
        def wrap(original):
            signature, timed = inspect.signature(original), self._timed("collectives_s")(original)

            @functools.wraps(original)
            def called(*args, **kwargs):
                import torch
                if not self.counting:
                    return timed(*args, **kwargs)
                waits = name not in NEVER_WAITS and not signature.bind(*args, **kwargs).arguments.get("async_op", False)
                site = _site(_outside_torch(sys._getframe(1)))
                with torch.profiler.record_function(f"{MARK}python|{name}|{'blocking' if waits else 'async'}|{site}"):
                    return timed(*args, **kwargs)
            return called
        return wrap

    def finish(self) -> None:
        """Stop, and write this rank's segments to `out`/per_step_rank<rank>.json."""
        import torch.distributed as dist
        self.stop_counting()
        for restore in self.restore:
            restore()
        before_first = dict(collectives=[], host_reads=[])
        for index, kind, record in self._counted():
            (self.segments[index] if index >= 0 else before_first)[kind].append(record)
        rank = dist.get_rank() if dist.is_initialized() else 0
        (self.out / f"per_step_rank{rank}.json").write_text(json.dumps(dict(
            rank=rank, ddipp=importlib.util.find_spec("ddipp").origin, before_first=before_first,
            segments=self.segments)))

    def _counted(self) -> list:
        """(segment, "collectives" or "host_reads", record) of each collective and host read the profiler saw. A
        collective: how it was called, its kind, its bytes (the tensors this rank gives gloo) and who called."""
        forwards, fetches, ranges, counted, gloo = [], [], [], [], {}
        for e in self.profiler.profiler.kineto_results.events():  # raw: prof.events() takes 10 s per 60,000
            name = e.name()
            if name.startswith(f"{MARK}forward|"):
                forwards.append(e.start_ns())
            elif name == f"{MARK}fetch":
                fetches.append(e.start_ns())
            elif name.startswith(f"{MARK}read|"):
                kind, site = name[len(f"{MARK}read|"):].split("|", 1)
                counted.append((e.start_ns(), "host_reads", dict(kind=kind, site=site)))
            elif name.startswith((f"{MARK}python|", "autograd::engine", "DistributedDataParallel")):
                ranges.append(e)
            elif name in C10D_KINDS:
                counted.append((e.start_ns(), "collectives", e))
            elif name.startswith("gloo:"):
                gloo.setdefault(name[len("gloo:"):], []).append(e)
        for runs in gloo.values():
            runs.sort(key=lambda e: e.start_ns())
        starts = _segment_starts(sorted(forwards), sorted(fetches))
        found = []
        for at, kind, record in sorted(counted, key=lambda c: c[0]):
            if kind == "collectives":
                collective = C10D_KINDS[record.name()]
                ran = gloo[collective].pop(0) if gloo.get(collective) else None
                record = dict(kind=collective, bytes=ran and _bytes(ran), **_caller(record, ranges))
            found.append((bisect_right(starts, at) - 1, kind, record))
        return found


def _segment_starts(forwards: list, fetches: list) -> list:
    """Where each segment starts: at the last batch fetched since the previous forward, else at its forward."""
    starts = []
    for i, forward in enumerate(forwards):
        since = [f for f in fetches if (i == 0 or forwards[i - 1] < f) and f < forward]
        starts.append(since[-1] if since else forward)
    return starts


def _mark(name: str, counting: bool) -> None:
    """A marker `name` in the profiler's record, while counting."""
    if counting:
        import torch
        with torch.profiler.record_function(f"{MARK}{name}"):
            pass


def _host_reads_mode():
    """A TorchFunctionMode that marks each host read of a tensor value it sees called from outside torch (torch's
    own, such as Adam's step count, read tensors that stay on the host)."""
    import torch
    from torch.overrides import TorchFunctionMode
    reads = {getattr(torch.Tensor, name): name for name in HOST_READS}

    class HostReads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            kind = reads.get(func) or (func is torch.Tensor.to and _to_cpu(args, kwargs) and "to(cpu)")
            caller = _caller_frame()
            if kind and not _in_torch(caller):
                _mark(f"read|{kind}|{_site(caller)}", True)
            return func(*args, **kwargs)
    return HostReads()


def _caller_frame():
    """The frame that called the tensor method being counted (past torch's Python methods that pass it on)."""
    frame = sys._getframe(2)
    while frame.f_code.co_filename.endswith(("torch/overrides.py", "torch/_tensor.py")):
        frame = frame.f_back
    return frame


def _outside_torch(frame):
    """`frame`, or the first frame below it outside torch."""
    while _in_torch(frame):
        frame = frame.f_back
    return frame


def _in_torch(frame) -> bool:
    import torch
    return frame.f_code.co_filename.startswith(str(Path(torch.__file__).parent))


def _to_cpu(args, kwargs) -> bool:
    """Whether a call of Tensor.to with `args`, `kwargs` names the CPU."""
    import torch
    device = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
    return device is not None and device.type == "cpu"


def _replace(owner, name: str, wrap):
    """Replace `owner.name` by `wrap(owner.name)`; a function that puts it back."""
    original = getattr(owner, name)
    setattr(owner, name, wrap(original))
    return lambda: setattr(owner, name, original)


def _caller(event, ranges: list) -> dict:
    """How the collective profiled as `event` was called: blocking or async, from the outermost torch.distributed call
    around it (`ranges`: the profiler's ranges of those, autograd's engine and DDP); else a DDP bucket, when
    autograd's engine runs it; else C++ (in DDP's forward, or elsewhere)."""
    around = sorted((r for r in ranges if r.start_thread_id() == event.start_thread_id()
                     and r.start_ns() <= event.start_ns() and event.end_ns() <= r.end_ns()), key=lambda r: r.start_ns())
    python = [r.name() for r in around if r.name().startswith(f"{MARK}python|")]
    if python:
        api, how, site = python[0][len(f"{MARK}python|"):].split("|", 2)
        return dict(how=how, api=api, site=site)
    if any(r.name().startswith("autograd::engine") for r in around):
        return dict(how="DDP bucket", api="", site="DDP's reducer")
    return dict(how="C++", api="", site=around[0].name() if around else "")


def _bytes(event) -> int:
    """The bytes of the tensors a gloo event was given."""
    return sum(math.prod(shape) * DTYPE_BYTES.get(dtype, 0) for shape, dtype in zip(event.shapes(), event.dtypes()))


def _site(frame) -> str:
    """`frame`'s function with its file, then the next two outside torch and this file: who called."""
    names = [f"{frame.f_code.co_filename.split('site-packages/')[-1].replace(str(ROOT) + '/', '')}:"
             f"{frame.f_code.co_name}"]
    frame = frame.f_back
    while frame and len(names) < 3:
        if not (_in_torch(frame) or frame.f_code.co_filename == __file__):
            names.append(frame.f_code.co_name)
        frame = frame.f_back
    return " < ".join(names)


def start(out: Path) -> None:
    """Record the fit this process runs from now on (once: a second call while it records does nothing)."""
    global _recorder
    if _recorder is None:
        _recorder = Recorder(out)
        _recorder.start()


def finish() -> None:
    global _recorder
    if _recorder is not None:
        _recorder.finish()
        _recorder = None


def add_counting(learn, version: int, out: Path) -> None:
    """Give `learn` a callback that records its fit in whichever process runs it (a notebook's worker: callbacks go
    there with the learner)."""
    if version == 1:
        from fastai.basic_train import LearnerCallback

        class Counting(LearnerCallback):
            def on_train_begin(self, **kwargs):
                start(out)

            def on_train_end(self, **kwargs):
                finish()
        learn.callbacks.append(Counting(learn))
        return
    from fastai.callback.core import Callback

    class Counting(Callback):
        def before_fit(self):
            start(out)

        def after_fit(self):
            finish()
    learn.add_cb(Counting())


def rank(runner: str, workload: str, out: Path) -> None:
    """One process of `runner`: the torch loop recorded from its start, a fastai fit by its callback."""
    import torch
    torch.set_num_threads(1)
    throughput.EPOCHS = EPOCHS
    widths = throughput.WIDTHS[workload]
    if runner == "torch DDP loop":
        start(out)
        throughput.torch_loop(widths, out)
        finish()
    else:
        version = throughput.RUNNERS[runner][0]
        throughput.fastai_run(runner, widths, out, prepare=lambda learn: add_counting(learn, version, out))


# The main process: run each runner, then count per step from its ranks' segments.


def common(segments: list, of: str) -> tuple:
    """What every one of `segments` (one phase) has of `of` (collectives, host reads), by key: as a Counter, and as
    records (with the bytes of the first segment's)."""
    keyed = [Counter(_key(r) for r in s[of]) for s in segments]
    shared = functools.reduce(lambda a, b: a & b, keyed)
    records, left = [], Counter(shared)
    for r in segments[0][of]:
        if left[_key(r)] > 0:
            left[_key(r)] -= 1
            records.append(r)
    return shared, records


def beyond(segments: list, of: str, shared: Counter) -> tuple:
    """What `segments` have beyond `shared` (a segment's last ones of a key), and whether only the first and last
    segment have any (else the counts per step or batch are not alike)."""
    extra, alike = [], True
    for i, s in enumerate(segments):
        keyed = Counter(_key(r) for r in s[of])
        for key, n in (keyed - shared).items():
            extra += [r for r in s[of] if _key(r) == key][-n:]
            alike = alike and i in (0, len(segments) - 1)
    return extra, alike


def _key(record: dict) -> tuple:
    """A collective or host read, its bytes aside (a short last batch gathers fewer)."""
    return tuple(record.get(k) for k in ("how", "api", "kind", "site"))


def summarize(got: dict) -> dict:
    """A rank's collectives and host reads per training step and validation batch (what every one has, in the epochs
    before COUNTED_EPOCHS), what each epoch has beyond them, where steps or batches other than a phase's first and last
    differ ("unlike"); its median ms per training step of the last epoch outside forward, backward and step."""
    counted = [s for s in got["segments"] if s["epoch"] < COUNTED_EPOCHS]
    mine = dict(ddipp=got["ddipp"], before_first_step=got["before_first"])
    for phase, unit in (("train", "step"), ("valid", "batch")):
        segments = [s for s in counted if s["phase"] == phase]
        mine[f"{unit}s per epoch"] = [sum(s["epoch"] == e for s in segments) for e in range(COUNTED_EPOCHS)]
        for of in ("collectives", "host_reads"):
            shared, mine[f"{of} per {unit}"] = common(segments, of)
            for epoch in range(COUNTED_EPOCHS):
                extra, alike = beyond([s for s in segments if s["epoch"] == epoch], of, shared)
                mine.setdefault(f"{of} in epoch {epoch} beyond its steps and batches", []).extend(extra)
                if not alike and epoch > 0:  # epoch 0 has a fit's one-offs: DDP rebuilds its buckets at step 2
                    mine.setdefault("unlike", []).append(f"{phase} {of}, epoch {epoch}")
    timed = [(a, b) for a, b in zip(got["segments"], got["segments"][1:])
             if a["epoch"] == b["epoch"] == EPOCHS - 1 and a["phase"] == b["phase"] == "train"]
    mine["ms per step in torch.distributed calls"] = statistics.median(a["collectives_s"] * 1000 for a, _ in timed)
    mine["ms per step in Python, outside forward, backward, step, torch.distributed calls"] = statistics.median(
        (b["start"] - a["start"] - a["forward"] - a["backward"] - a["step"] - a["collectives_s"]) * 1000
        for a, b in timed)
    return mine


def run(runner: str, out: Path) -> dict:
    for stale in out.glob("per_step_rank*.json"):
        stale.unlink()
    throughput.run_one(runner, "small", 2, out, script=__file__)
    ranks = [json.loads(f.read_text()) for f in sorted(out.glob("per_step_rank*.json"))]
    if len(ranks) < 2:
        sys.exit(f"{runner}: {len(ranks)} ranks wrote their counts")
    return {f"rank {got['rank']}": summarize(got) for got in ranks}


def _size(n) -> str:
    return "?" if n is None else f"{n} B" if n < 1000 else f"{n / 1000:.1f} KB"


def collectives(records: list, hows=None) -> str:
    """`records` (those called `hows`, if given) as 'kind×count (bytes), ...'."""
    got = Counter((r["api"] or r["kind"], r["how"], r["bytes"]) for r in records if hows is None or r["how"] in hows)
    return ", ".join(f"{api}×{n} ({_size(size)}{'' if hows else ', ' + how})" for (api, how, size), n in got.items()) \
        or "0"


def reads(records: list, to_cpu: bool = False) -> str:
    """The host reads of `records` (or their `to(cpu)`s) as 'count (kind×count, ...)'."""
    got = Counter(r["kind"] for r in records if (r["kind"] == "to(cpu)") == to_cpu)
    kinds = f" ({', '.join(f'`{k}`×{n}' for k, n in got.items())})" if got and not to_cpu else ""
    return f"{sum(got.values())}{kinds}"


def table(results: dict) -> str:
    rows = ["| runner | blocking collectives / training step | DDP bucket all-reduces / step | async collectives / "
            "step | collectives / validation batch | collectives / epoch | host reads / training step | host reads / "
            "validation batch | to(cpu) / step, batch | ms / step outside forward, backward, step: Python + "
            "torch.distributed calls (median) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for runner, ranks in results.items():
        r = ranks["rank 0"]
        step, batch, epoch = (r["collectives per step"], r["collectives per batch"],
                              r["collectives in epoch 1 beyond its steps and batches"])
        buckets = [c["bytes"] for c in step if c["how"] == "DDP bucket"]
        rows.append(f"| {runner} | {collectives(step, ('blocking', 'C++'))} | {len(buckets)} "
                    f"({', '.join(_size(b) for b in buckets)}) | {collectives(step, ('async',))} | "
                    f"{collectives(batch)} | {collectives(epoch)} | {reads(r['host_reads per step'])} | "
                    f"{reads(r['host_reads per batch'])} | {reads(r['host_reads per step'], True)}, "
                    f"{reads(r['host_reads per batch'], True)} | "
                    f"{r['ms per step in Python, outside forward, backward, step, torch.distributed calls']:.2f} + "
                    f"{r['ms per step in torch.distributed calls']:.2f} |")
    return "\n".join(rows)


def sources(results: dict) -> str:
    """Where each runner's collectives and host reads of a training step come from (rank 0's)."""
    said = []
    for runner, ranks in results.items():
        step = ranks["rank 0"]
        got = Counter(f"`{r.get('api') or r['kind']}` ({r.get('how', 'read')}) from {r['site']}"
                      for r in step["collectives per step"] + step["host_reads per step"] if r["kind"] != "to(cpu)")
        said.append(f"- {runner}: " + "; ".join(f"{n}× {what}" for what, n in got.items()))
    return "\n".join(said)


def irregular(results: dict) -> str:
    """A line per rank whose steps or batches count unlike each other (beyond the first and last of a phase), and per
    rank that counts unlike rank 0."""
    said = []
    for runner, ranks in results.items():
        first = _per_unit(ranks["rank 0"])
        for name, r in ranks.items():
            if "unlike" in r:
                said.append(f"- {runner}, {name}: steps or batches unlike each other in {r['unlike']}")
            said += [f"- {runner}, {name} counts unlike rank 0 per {what}: {collectives(r[f'collectives per {what}'])}"
                     f"; host reads {reads(r[f'host_reads per {what}'])}" for what in ("step", "batch")
                     if _per_unit(r)[what] != first[what]]
    return "\n".join(said)


def _per_unit(rank: dict) -> dict:
    return {what: Counter(map(_key, rank[f"collectives per {what}"] + rank[f"host_reads per {what}"]))
            for what in ("step", "batch")}


def commit() -> str:
    said = subprocess.run(["git", "describe", "--always", "--dirty=+uncommitted changes", "--abbrev=7"], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()
    return said.replace("+", " (+ ") + (")" if "+" in said else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=BENCHMARKS / "results" / "per_step.json")
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    out = Path("/tmp/ddipp-bench-per-step")
    out.mkdir(exist_ok=True)
    started, results = time.time(), {}
    for runner in throughput.RUNNERS:
        results[runner] = run(runner, out)
        print(runner, f"{time.time() - started:.0f} s", flush=True)
    said = commit()
    print(f"\nCommit {said}; {time.time() - started:.0f} s\n\n{table(results)}\n\nFrom (a training step):\n"
          f"{sources(results)}\n\n{irregular(results) or 'Every step and every batch count alike, on both ranks.'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(commit=said, results=results), indent=1) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank-of"]:
        import per_step  # this file by its module name, as a notebook's worker imports what the callback calls
        per_step.rank(sys.argv[2], sys.argv[3], Path(sys.argv[4]))
    else:
        main()

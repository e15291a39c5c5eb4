"""A notebook's learner bound to a worker group: its `learn.fit` runs there, through the adapter's fit function."""
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import AbstractSet, Any, Callable, Dict, List, Optional, Tuple

import torch

from ..checkpoint import steps as checkpoint_steps
from ..options import Options
from ..resume import progress
from ..sharding import part_sizes
from .group import WorkerDied, WorkerGroup, _groups, group_for
from .wire import pickled_data


@dataclass
class Binding:
    """Where a bound learner's fits run and with which adapter's fitting module, its to_ddp `options` (the callbacks'
    there, the timeout, how many times a fit whose worker died restarts), and the training loader's batch size whose
    global batch it said last."""
    devices: Tuple[str, ...]
    options: Options
    fitting: str
    said_bs: Optional[int] = None

    def say_global_batch(self, bs: Optional[int]) -> None:
        """Say the global batch that the loader's `bs` makes, unless it is the one this binding said last."""
        if bs != self.said_bs:
            say_global_batch(bs, len(self.devices), self.options.split_batches)
            self.said_bs = bs


def say_global_batch(bs: Optional[int], processes: int, split_batches: bool) -> None:
    """Print the global batch a notebook's learner now trains with: bs per process, or bs split (split_batches)."""
    if not bs:
        return
    if split_batches:
        parts = " + ".join(map(str, part_sizes(bs, processes)))
        print(f"ddipp: global batch {bs} kept: {parts} over {processes} processes")
    else:
        print(f"ddipp: global batch {bs * processes} = {bs} per process x {processes} (an epoch takes 1/{processes} "
              f"of the steps of one process with bs={bs}); add split_batches=True to keep bs={bs} as the global "
              "batch: one process's training, faster")


def bind(learn: Any, devices: Tuple[str, ...], options: Options, fit_on_group: Callable, fitting: str) -> None:
    """Run `learn`'s fits on the group on `devices` (started now if not running) with `fit_on_group(learn, ...)`; its
    workers run them with the adapter's module named `fitting` (`adapter.Fitting`) and `options`; a fit whose worker
    dies starts a new group and resumes there, up to `options.restarts` times."""
    if "ddp" in vars(learn):
        unbind(learn)
    group_for(devices, options.timeout, fitting).learners[id(learn)] = learn
    learn.ddp = Binding(devices, options, fitting)
    learn.fit = FitOnGroup(learn, fit_on_group)  # what fit_one_cycle, lr_find, fine_tune ... call


def unbind(learn: Any) -> bool:
    """Fit `learn` locally again; stop its group if no other learner uses it (True if that stopped it)."""
    binding = vars(learn).pop("ddp")
    for name in [name for name, value in vars(learn).items() if isinstance(value, OfBinding)]:
        delattr(learn, name)
    group = _groups.get(binding.devices)
    if group is None:
        return False
    group.learners.pop(id(learn), None)
    if group.learners:
        return False
    group.stop()
    return True


def group_of(learn: Any, after: WorkerGroup = None, attempt: int = 0) -> WorkerGroup:
    """The running group of a bound learner (a new one if the last fit's failure stopped it, the `attempt`-th restart
    of `after`'s fit if given)."""
    binding = learn.ddp
    group = group_for(binding.devices, binding.options.timeout, binding.fitting, after, attempt)
    group.learners[id(learn)] = learn
    return group


def fit_on_group(learn: Any, data_attr: str, call: Callable[[AbstractSet[str]], bytes], mirror: Any,
                 apply_results: Callable[[List[bytes]], None], kept: Callable[[], Tuple[int, int]],
                 untrained: Callable[[], None] = lambda: None,
                 from_checkpoint: Callable[[dict, int], Optional[Tuple[dict, Path]]] = lambda fit, after: None) -> None:
    """Run a bound learner's fit of its data (its attribute `data_attr`) on its group: each rank's request made by
    `call` for the tensors that rank holds (`_calls`), its progress shown by `mirror`; then `apply_results` puts rank
    0's results on the learner, as a local fit would leave it. A failed fit keeps what was trained up to the failure
    (`kept()`: its epoch and step, said), or its Checkpoint's file where that is newer (`from_checkpoint`, `_failed`),
    or, if nothing was, leaves the learner as it was (`untrained()` then does what a local fit that failed would); an
    interrupted one raises KeyboardInterrupt after keeping what was trained, as Ctrl-C in a local fit. A fit whose
    worker died runs again on a new group, the restart of the last, with the same seed (a Checkpoint in the fit resumes
    it), up to the binding's `restarts` times."""
    group, restarts, lost, data = group_of(learn), 0, 0.0, None
    fit = dict(run_id=group.launch_id, fit=group.fits + 1)  # what its Checkpoint's file names it by, in every restart
    generator = torch.get_rng_state()  # what the call draws its seed from: a restart draws the same
    earlier, died = None, None  # what rank 0 trained before the last restart (if it lived to send it), and why
    while True:
        try:
            if died is not None:  # here, where an interrupt still keeps what was trained
                print(f"ddipp: {str(died).splitlines()[0]}\nddipp: restart {restarts} of "
                      f"{learn.ddp.options.restarts}: a new group runs the fit again, from its Checkpoint if it has "
                      "one", file=sys.stderr, flush=True)
                failed, died = time.monotonic(), None
                group = group_of(learn, after=group, attempt=restarts)
                group.wait_ready()
                lost += time.monotonic() - failed
            data = data or pickled_data(getattr(learn, data_attr), f"learn.{data_attr}")  # while workers start
            results, interrupted = group.fit(data, _calls(call, group, generator), learn.ddp.options, mirror)
            break
        except BaseException as e:
            if isinstance(e, WorkerDied) and restarts < learn.ddp.options.restarts:
                restarts, earlier, died = restarts + 1, group.trained or earlier, e
                continue
            _failed(group, apply_results, kept, untrained, earlier, lambda after: from_checkpoint(fit, after),
                    restarts > 0)
            raise
    apply_results(results)
    if restarts:
        print(f"ddipp: the fit completed after {restarts} restart{'s' * (restarts > 1)} (new groups started in "
              f"{lost:.1f} s; the batches after each last checkpoint ran again)", flush=True)
    if interrupted:
        raise KeyboardInterrupt


def _calls(call: Callable[[AbstractSet[str]], bytes], group: WorkerGroup, generator: torch.Tensor) -> List[bytes]:
    """Each rank's fit request, rank order: `call(held)` made once for each distinct set of tensors the ranks hold
    (DDP's ranks hold the same: one), so a rank's names only its own as digests; each draws its seed from the torch
    generator state `generator`, so every rank gets the same seed."""
    made: Dict[frozenset, bytes] = {}
    for rank in range(len(group.devices)):
        held = group.held.get(rank, frozenset())
        if held not in made:
            torch.set_rng_state(generator)
            made[held] = call(held)
    return [made[group.held.get(rank, frozenset())] for rank in range(len(group.devices))]


def _failed(group: WorkerGroup, apply_results: Callable[[List[bytes]], None], kept: Callable[[], Tuple[int, int]],
            untrained: Callable[[], None], earlier: Optional[List[bytes]],
            from_checkpoint: Callable[[int], Optional[Tuple[dict, Path]]], restarted: bool) -> None:
    """After a failed fit: the learner keeps the newest of what rank 0 trained (else what it trained before the last
    restart, `earlier`: the restart failed or was interrupted before training anything) and the fit's Checkpoint file
    (`from_checkpoint(after)` puts it on the learner if it holds more than `after` steps), said, or is left as it
    was."""
    results, steps = (group.trained if group.trained is not None else earlier), -1
    if results is not None:
        apply_results(results)
        epoch, steps = kept()
        if group.trained is not None and not restarted:  # rank 0 wrote every file of this fit, after steps it holds
            group.say_kept(epoch, steps)
            return
    found = from_checkpoint(steps)
    if found is not None:
        state, file = found
        print(f"ddipp: the learner keeps the state of the fit's Checkpoint file {file}, written after "
              f"{progress(state['epoch'], state.get('step', 0))} (step {checkpoint_steps(state)} of the fit): "
              + ("rank 0 sent nothing back" if results is None else
                 f"newer than what rank 0 trained{' before the restart' if group.trained is None else ''} "
                 f"(step {steps})"), file=sys.stderr)
    elif group.trained is not None:
        group.say_kept(epoch, steps)
    elif earlier is not None:
        print(f"ddipp: the restarted fit did not train; the learner keeps what rank 0 trained before the restart, up "
              f"to its last completed step (step {steps} of the fit, in epoch {epoch})", file=sys.stderr)
    else:
        print("ddipp: the fit did not complete; the learner here is as it was before it", file=sys.stderr)
        untrained()


class OfBinding:
    """A method of a bound learner, set on it as an attribute (fastai calls `self.fit`), that unbind takes away; it
    holds the learner weakly, so an abandoned learner is freed and leaves its group."""

    def __init__(self, learn: Any):
        self.learn = weakref.ref(learn)


class FitOnGroup(OfBinding):
    """`learn.fit` of a bound learner."""

    def __init__(self, learn: Any, fit_on_group: Callable):
        super().__init__(learn)
        self.fit_on_group = fit_on_group

    def __call__(self, *args, **kwargs) -> None:
        self.fit_on_group(self.learn(), *args, **kwargs)

"""ddipp's GPU paths on a host with one GPU in one command: `make gpu-check` (or `.venv/bin/python tools/gpu_check.py`).

Prints one line per check, `PASS <check>: <numbers>`, `FAIL <check>: <why>` or `SKIP <check>: no CUDA`, and exits 1 if
a check failed. Only one GPU is used, cuda:0 (CUDA_VISIBLE_DEVICES is narrowed to the first visible GPU). fastai v1
runs in .venv, fastai v2 in .venv2; the workers are tools/gpu_check/*_worker.py.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import traceback
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path
from typing import NamedTuple

import torch

ROOT = Path(__file__).resolve().parents[1]
WORKERS = {1: ROOT / "tools" / "gpu_check" / "fastai1_worker.py", 2: ROOT / "tools" / "gpu_check" / "fastai2_worker.py"}
PYTESTS = [(1, "tests/fastai1/test_cuda.py", None), (1, "tests/fastai1/notebook/test_shipping.py", "cuda"),
           (1, "tests/fastai1/test_apps.py", "fp16"), (2, "tests/fastai2/test_cuda.py", None)]  # fastai, file, -k
TIMEOUT = 600  # seconds one command may run
TAIL = 30  # lines of a failed command's output shown on stderr
BN_TOL = 1e-4  # weights, running statistics, validation numbers against one plain GPU process (cuDNN's sums differ)
GC_MIN_RELEASE = 256 * 2**20  # bytes GCCallback must give back after a fit that cached about 1 GiB of activations
OVERHEAD_TARGET = 2.0  # % per step, world-size-1 NCCL under ddipp against plain fastai
ROUNDS = 3  # interleaved (plain, launched) pairs of the overhead check
ONE_RANK_TOL = 1e-6  # a --gpus 0 rank with shard=True against one plain GPU process: the same kernels, 0 expected
SHARD_TOL = 1e-5  # weights of 2 sharded ranks against one plain GPU process (cuBLAS sums 16 + 16 rows, not 32)
SHARD_HELD = 0.55  # of DDP's bytes of parameters, gradients and optimizer state a rank holds with shard=True on 2
# ranks: 1/2 + 5 % (FSDP2 pads dim 0 to a multiple of the ranks; the wide MLP needs no padding)
SHARD_PEAK = 0.75  # of DDP's training peak (max_memory_allocated) a rank reaches with shard=True on 2 ranks: DDP
# holds 5 model sizes (parameters, gradients, Adam's 2 states, its buckets), shard=True 2 and a unit or two gathered
# whole for its forward and backward: about 0.5 expected
RECOMPUTE_TOL = 1e-6  # parameters and BatchNorm buffers of a fit with Recompute against the same fit without it:
# the same deterministic cuDNN kernels run again in backward, 0 expected
BF16_TOL = 0.05  # |bf16 run's update - fp32's| / |fp32's|: bf16 rounds each weight and activation to 8 significant
# bits (0.2 %), with float32 sums in the matmuls and an fp32 reduction, so a step's gradient is within about 1 % of
# fp32's and SGD's update is linear in it; a reduction that summed instead of averaged, or none, is off by 100 %


class Verdict(NamedTuple):
    """One line of the report (PASS, FAIL or SKIP, the check, its numbers or why), and output to show under it."""
    status: str
    check: str
    words: str
    tail: str = ""


class CheckFailed(Exception):
    """A check's failure: why (one line), and the end of the output that shows it."""

    def __init__(self, why: str, tail: str = ""):
        super().__init__(why)
        self.tail = tail


@dataclass(frozen=True)
class Setup:
    """The interpreters of .venv (fastai v1) and .venv2 (fastai v2), and a folder for the runs' results."""
    pythons: tuple[str, str]
    tmp: Path

    def python(self, fastai: int) -> str:
        python = self.pythons[fastai - 1]
        if not Path(python).is_file():
            raise CheckFailed(f"no {python}: create it with `make {Path(python).parents[1].name}/.installed`")
        return python


def expect(condition: bool, why: str) -> None:
    """CheckFailed(why) unless `condition`."""
    if not condition:
        raise CheckFailed(why)


def execute(cmd: list[str], what: str) -> subprocess.CompletedProcess:
    """Run `cmd` in the repository root, its output captured; CheckFailed if it runs over TIMEOUT."""
    try:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"{what} ran over {TIMEOUT} s") from None


def worker(setup: Setup, name: str, fastai: int, mode: str, launch: tuple[str, ...] = ()) -> list[dict]:
    """What each rank of a worker run saved: plain, or under `python -m ddipp.launch` with the options `launch`."""
    out = setup.tmp / name
    out.mkdir(exist_ok=True)  # a reference that failed in one check is run again by the next
    python = setup.python(fastai)
    proc = execute([python, *(["-m", "ddipp.launch", *launch] if launch else []), str(WORKERS[fastai]), mode, str(out)],
                   name)
    if proc.returncode:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-TAIL:])
        raise CheckFailed(f"{name} exited with status {proc.returncode} (the end of its output follows)", tail)
    return [torch.load(path) for path in sorted(out.glob("rank*.pt"))]


def pytest_label(fastai: int, path: str, keyword: str | None) -> str:
    return f"pytest-v{fastai} {path}" + (f" -k {keyword}" if keyword else "")


def pytest_verdicts(setup: Setup, fastai: int, path: str, keyword: str | None) -> list[Verdict]:
    """Run the selected tests with pytest: one verdict per test (its seconds, its failure, or its skip reason)."""
    label = pytest_label(fastai, path, keyword)
    report = setup.tmp / f"{label.replace('/', '_').replace(' ', '_')}.xml"
    proc = execute([setup.python(fastai), "-m", "pytest", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
                    f"--junitxml={report}", path, *(["-k", keyword] if keyword else [])], label)
    cases = list(ElementTree.parse(report).iter("testcase")) if report.is_file() else []
    if not cases:
        raise CheckFailed(f"pytest exited with status {proc.returncode} and ran no test",
                          "\n".join((proc.stdout + proc.stderr).splitlines()[-TAIL:]))
    return [case_verdict(case, fastai) for case in cases]


def case_verdict(case: ElementTree.Element, fastai: int) -> Verdict:
    """PASS, FAIL or SKIP of one pytest node in a JUnit report, with its seconds or the first line of its message."""
    node = f"pytest-v{fastai} {case.get('file')}::{case.get('name')}"
    outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
    if outcome is None:
        return Verdict("PASS", node, f"{float(case.get('time')):.1f} s")
    first_line = (outcome.get("message") or outcome.tag).splitlines()[0]
    if outcome.tag == "skipped":
        return Verdict("SKIP", node, first_line)
    return Verdict("FAIL", node, f"{outcome.tag}: {first_line} (the end of its traceback follows)",
                   "\n".join((outcome.text or "").splitlines()[-TAIL:]))


@cache
def plain_bn(setup: Setup) -> dict:
    """The BatchNorm CNN fitted by one plain GPU process with batch 32: the reference of two checks."""
    return worker(setup, "bn-plain", 1, "bn")[0]


def gaps(got: dict, want: dict) -> str:
    """The largest differences between two BatchNorm fits, in words; CheckFailed if one is above BN_TOL."""
    def most(a, b) -> float:
        return max(float((x - y).abs().max()) for x, y in zip(a, b))
    weights, stats, valid = most(got["params"], want["params"]), most(got["running"], want["running"]), most(
        [got["valid"]], [want["valid"]])
    words = (f"max |diff| from one plain GPU process: weights {weights:.1e}, BatchNorm running stats {stats:.1e}, "
             f"valid loss and accuracy {valid:.1e} (tol {BN_TOL:.0e})")
    expect(max(weights, stats, valid) <= BN_TOL, words)
    return words


def one_rank_bn(setup: Setup) -> str:
    """A `--gpus 0` rank with to_ddp(sync_bn=True) trains as one plain GPU process: a group of one rank has no DDP and
    no SyncBatchNorm (gloo-two-ranks-one-gpu runs torch's SyncBatchNorm on CUDA)."""
    [got] = worker(setup, "bn-nccl", 1, "bn", ("--gpus", "0"))
    expect((got["backend"], got["device"]) == ("nccl", "cuda:0"), f"ran on {got['backend']}, {got['device']}")
    expect(got["during"] == ["BatchNorm2d"] and got["after"] == "BatchNorm2d",
           f"BatchNorm layers {got['during']} during the fit, {got['after']} after it")
    return f"{gaps(got, plain_bn(setup))}; BatchNorm2d during the fit and after, as one process"


def mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def gc_release(setup: Setup, fastai: int) -> str:
    """GCCallback gives the CUDA cache back: memory_reserved() drops by GC_MIN_RELEASE or more across its hook."""
    [got] = worker(setup, f"gc-v{fastai}", fastai, "gc")
    hook = "on_train_end" if fastai == 1 else "after_fit"
    released = got["before"] - got["after"]
    words = (f"memory_reserved {mib(got['before'])} before GCCallback's {hook}, {mib(got['after'])} after the fit "
             f"(allocated {mib(got['allocated'])}): released {mib(released)}, need >= {mib(GC_MIN_RELEASE)}")
    expect(released >= GC_MIN_RELEASE, words)
    return words


def overhead(setup: Setup) -> str:
    """ms per step of plain fastai and of a `--gpus 0` NCCL rank under to_ddp(), in interleaved rounds; CheckFailed
    if ddipp's median is more than OVERHEAD_TARGET % above plain fastai's."""
    plain, ddp = [], []
    for round_ in range(ROUNDS):
        plain.append(worker(setup, f"steps-plain-{round_}", 1, "steps")[0])
        ddp.append(worker(setup, f"steps-nccl-{round_}", 1, "steps", ("--gpus", "0"))[0])
    expect(all(run["backend"] == "nccl" for run in ddp), f"the launched runs ran on {ddp[0]['backend']}")
    base, under = (statistics.median(ms for run in runs for ms in run["ms"]) for runs in (plain, ddp))
    percent = 100 * (under / base - 1)
    words = (f"plain fastai {base:.3f} ms/step, --gpus 0 with to_ddp() {under:.3f} ms/step (medians of "
             f"{sum(len(run['ms']) for run in plain)} epochs of {plain[0]['timed_steps']} steps each, {ROUNDS} "
             f"interleaved rounds): {percent:+.1f}% against a target of <= {OVERHEAD_TARGET:.0f}%")
    expect(percent <= OVERHEAD_TARGET, words)
    return words


def gloo_pair(setup: Setup) -> str:
    """2 ranks on cuda:0 over gloo (`--nproc 2`, each rank joining gloo on the GPU itself) train the BatchNorm CNN with
    to_ddp(sync_bn=True), batch 16 each, as one plain GPU process with 32; ddipp's collectives on CUDA tensors."""
    ranks = worker(setup, "bn-gloo", 1, "bn-gloo", ("--nproc", "2"))
    places = [(r["backend"], r["world_size"], r["device"]) for r in ranks]
    expect(places == [("gloo", 2, "cuda:0")] * 2, f"ranks ran on {places}")
    expect(all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"])), "the ranks' weights differ")
    expect(all(r["sync_calls"] > 0 for r in ranks), "torch's SyncBatchNorm never merged the ranks' statistics")
    expect(all(torch.equal(r["gathered"], torch.tensor([[0.0, 0.0], [1.0, 1.0]])) and r["summed"] == 2.0
               for r in ranks), f"all_gather and reduce_sum gave {[(r['gathered'], r['summed']) for r in ranks]}")
    return (f"{gaps(ranks[0], plain_bn(setup))}; SyncBatchNorm merged the ranks' statistics {ranks[0]['sync_calls']} "
            "times; ddipp.all_gather and reduce_sum right on CUDA tensors (ranks set DDIPP_DEVICES=0,0 and join gloo "
            "themselves: ddipp.launch gives CUDA ranks NCCL, one GPU each)")


@cache
def plain_shard(setup: Setup) -> dict:
    """The digits MLP fitted by one plain GPU process with batch 32: the reference of the sharded checks."""
    return worker(setup, "shard-plain", 2, "shard")[0]


def weights_gap(got: dict, want: dict, tol: float) -> str:
    """The largest weight difference from one plain GPU process, in words; CheckFailed above `tol` or when the
    weights are not plain parameters after the fit."""
    expect(got["plain"], "the model's parameters are not plain nn.Parameters after the fit")
    gap = max(float((a - b).abs().max()) for a, b in zip(got["params"], want["params"]))
    words = f"weights max |diff| from one plain GPU process {gap:.1e} (tol {tol:.0e})"
    expect(len(got["params"]) == len(want["params"]) and gap <= tol, words)
    return words


def shard_one_rank(setup: Setup) -> str:
    """A `--gpus 0` rank (NCCL, world size 1) with fastai v2's to_ddp(shard=True) says it trains whole, and does:
    the weights of one plain GPU process."""
    [got] = worker(setup, "shard-nccl", 2, "shard", ("--gpus", "0"))
    expect((got["backend"], got["world_size"], got["device"]) == ("nccl", 1, "cuda:0"),
           f"ran on {got['backend']}, {got['world_size']} rank(s), {got['device']}")
    expect("trains as one process" in got["said"], f"to_ddp(shard=True) printed {got['said']!r}")
    return f"{weights_gap(got, plain_shard(setup), ONE_RANK_TOL)}; to_ddp said: {got['said'].strip()}"


def shard_gloo_pair(setup: Setup) -> str:
    """2 ranks on cuda:0 over gloo with fastai v2's to_ddp(shard=True), batch 16 each, train as one plain GPU
    process with 32; both end with the same whole weights."""
    ranks = worker(setup, "shard-gloo", 2, "shard-gloo", ("--nproc", "2"))
    places = [(r["backend"], r["world_size"], r["device"]) for r in ranks]
    expect(places == [("gloo", 2, "cuda:0")] * 2, f"ranks ran on {places}")
    expect(all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"])), "the ranks' weights differ")
    return (f"{weights_gap(ranks[0], plain_shard(setup), SHARD_TOL)}; both ranks whole and equal after the fit "
            "(fastai's SGD with momentum, 2 epochs)")


def shard_memory(setup: Setup) -> str:
    """torch.cuda.max_memory_allocated per rank while 2 ranks sharing cuda:0 over gloo train the 33.6 M-parameter MLP
    in DDP and with shard=True; CheckFailed above SHARD_PEAK of DDP's peak, or SHARD_HELD of what it holds."""
    ddp, sharded = (worker(setup, f"memory-{kind}", 2, f"memory-{kind}", ("--nproc", "2")) for kind in ("ddp", "shard"))
    expect(all(len(ranks) == 2 and r["device"] == "cuda:0" for ranks in (ddp, sharded) for r in ranks),
           f"ran on {[r['device'] for r in ddp]} and {[r['device'] for r in sharded]}")
    peak = max(s["peak"] / d["peak"] for s, d in zip(sharded, ddp))
    held = max(s["held"] / d["held"] for s, d in zip(sharded, ddp))
    words = (f"training peak per rank (max_memory_allocated): DDP {', '.join(mib(r['peak']) for r in ddp)}, "
             f"shard=True {', '.join(mib(r['peak']) for r in sharded)}: {peak:.2f} of DDP's (need <= {SHARD_PEAK}); "
             f"parameters + gradients + Adam state held per rank: DDP {mib(ddp[0]['held'])}, shard=True "
             f"{', '.join(mib(r['held']) for r in sharded)}: {held:.3f} (need <= {SHARD_HELD}); "
             f"{ddp[0]['n_params'] / 1e6:.1f} M parameters, fastai's Adam")
    expect(peak <= SHARD_PEAK and held <= SHARD_HELD, words)
    return words


def fsdp_bf16(setup: Setup) -> str:
    """Plain torch FSDP2 on 2 ranks sharing cuda:0 over gloo: MixedPrecisionPolicy(param_dtype=bfloat16,
    reduce_dtype=float32) computes in bf16, keeps float32 weights, and its SGD update is within BF16_TOL of fp32's."""
    ranks = worker(setup, "fsdp-bf16", 2, "fsdp-bf16", ("--nproc", "2"))
    places = [(r["backend"], r["world_size"], r["device"]) for r in ranks]
    expect(places == [("gloo", 2, "cuda:0")] * 2, f"ranks ran on {places}")
    fp32, bf16 = ranks[0]["runs"]["fp32"], ranks[0]["runs"]["bf16"]
    expect((fp32["computed"], bf16["computed"], fp32["stored"], bf16["stored"])
           == ("torch.float32", "torch.bfloat16", "torch.float32", "torch.float32"),
           f"computed in {fp32['computed']} and {bf16['computed']}, weights stored in {fp32['stored']} and "
           f"{bf16['stored']}")
    expect(all(torch.equal(a, b) for a, b in zip(fp32["start"], bf16["start"])), "the two runs began apart")
    expect(all(torch.equal(a, b) for run in ("fp32", "bf16")
               for a, b in zip(ranks[0]["runs"][run]["params"], ranks[1]["runs"][run]["params"])),
           "the ranks' gathered weights differ")

    def update(run: dict) -> torch.Tensor:
        return torch.cat([(p - s).flatten() for p, s in zip(run["params"], run["start"])])
    apart = float((update(bf16) - update(fp32)).norm() / update(fp32).norm())
    gap = max(float((a - b).abs().max()) for a, b in zip(bf16["params"], fp32["params"]))
    words = (f"bf16 weights' update {apart:.2%} apart from fp32's (need > 0 and <= {BF16_TOL:.0%}), weights max "
             f"|diff| {gap:.1e}; computed in bfloat16, weights kept in float32 ({ranks[0]['world_size']} ranks, "
             "digits MLP, 20 SGD steps)")
    expect(0 < apart <= BF16_TOL, words)
    return words


def recompute_memory(setup: Setup) -> str:
    """fastai v2's fit of a convnet on cuda:0 with ddipp.Recompute of its blocks peaks lower (max_memory_allocated)
    than without it, and ends with its parameters and BatchNorm buffers within RECOMPUTE_TOL."""
    [got] = worker(setup, "recompute", 2, "recompute")
    plain, recomputed = got["plain"], got["Recompute"]
    apart = {k: float((v.double() - recomputed["state"][k].double()).abs().max()) for k, v in plain["state"].items()}
    params = max(v for k, v in apart.items() if k in plain["params"])
    buffers = max(v for k, v in apart.items() if k not in plain["params"])
    words = (f"training peak (max_memory_allocated) {mib(plain['peak'])} plain, {mib(recomputed['peak'])} with "
             f"Recompute ({recomputed['peak'] / plain['peak']:.2f}; need < 1); max |diff| parameters {params:.1e}, "
             f"BatchNorm buffers {buffers:.1e} (tol {RECOMPUTE_TOL:.0e}); 3-block convnet, 3x64x64, batch 128")
    expect(recomputed["peak"] < plain["peak"] and max(params, buffers) <= RECOMPUTE_TOL, words)
    return words


def bs_find_limit(setup: Setup) -> str:
    """fastai v2's learn.bs_find() on cuda:0 under set_per_process_memory_fraction finds a batch size whose training
    steps run there and whose double runs out of memory (torch.OutOfMemoryError)."""
    [got] = worker(setup, "bs-find", 2, "bs-find")
    found = got["found"]
    words = (f"under a {mib(got['limit'])} memory fraction of cuda:0 bs_find found {found} (of {got['items']} items): "
             f"2 training steps at {found} {'ran' if got['at_found'] else 'ran out of memory'}, at {2 * found} "
             f"{'ran' if got['at_double'] else 'ran out of memory'}; small_cnn on 3x64x64 images, fastai's Adam")
    expect(got["at_found"] and not got["at_double"], words)
    return words


def checks(setup: Setup) -> list[tuple[str, Callable[[], list[Verdict]]]]:
    """(name, run) of every check in order; run returns its verdicts or raises CheckFailed."""
    def single(name, check):
        return name, lambda: [Verdict("PASS", name, check(setup))]
    return [(pytest_label(*test), partial(pytest_verdicts, setup, *test)) for test in PYTESTS] + [
        single("bn-one-rank-nccl", one_rank_bn), single("gc-release-v1", partial(gc_release, fastai=1)),
        single("gc-release-v2", partial(gc_release, fastai=2)), single("nccl-overhead-ws1", overhead),
        single("gloo-two-ranks-one-gpu", gloo_pair), single("shard-one-rank-nccl-v2", shard_one_rank),
        single("shard-gloo-two-ranks-one-gpu-v2", shard_gloo_pair), single("shard-memory-v2", shard_memory),
        single("fsdp2-bf16-fp32-reduce", fsdp_bf16), single("recompute-memory-v2", recompute_memory),
        single("bs-find-memory-fraction-v2", bs_find_limit)]


def one_gpu() -> None:
    """Let this process and its children see one GPU, the first visible one, as cuda:0."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = "0" if visible is None else visible.split(",")[0]


def main(argv: list[str] | None = None) -> int:
    """Run every check (SKIP each without CUDA), one verdict a line; 1 if any failed, else 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python1", default=str(ROOT / ".venv" / "bin" / "python"), help="fastai v1's interpreter")
    parser.add_argument("--python2", default=str(ROOT / ".venv2" / "bin" / "python"), help="fastai v2's interpreter")
    args = parser.parse_args(argv)
    one_gpu()
    cuda, failed = torch.cuda.is_available(), False
    with tempfile.TemporaryDirectory(prefix="ddipp-gpu-check-") as tmp:
        pythons = str(Path(args.python1).absolute()), str(Path(args.python2).absolute())  # the checks run in ROOT
        for name, run in checks(Setup(pythons, Path(tmp))):
            try:
                verdicts = run() if cuda else [Verdict("SKIP", name, "no CUDA")]
            except CheckFailed as e:
                verdicts = [Verdict("FAIL", name, str(e), e.tail)]
            except Exception as e:  # a bug of the check itself: said, and the other checks still run
                verdicts = [Verdict("FAIL", name, f"the check raised {type(e).__name__}: {e}", traceback.format_exc())]
            for verdict in verdicts:
                print(f"{verdict.status} {verdict.check}: {verdict.words}", flush=True)
                if verdict.tail:
                    print(verdict.tail, file=sys.stderr, flush=True)
                failed |= verdict.status == "FAIL"
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""fastai's to_bf16 on a CPU group (workers/extras_worker.py's 2 launched ranks): its MixedPrecision builds CUDA's
autocast, so the fit trains in float32, and ddipp says so once."""
import pytest

from compare import max_diff

LINE = "ddipp: fastai's MixedPrecision (to_bf16/to_fp16) is CUDA-only: this fit on CPU trains in float32"


@pytest.mark.slow
def test_to_bf16_on_cpu_trains_in_float32_and_rank0_says_so_once(extras_ranks):
    (r0, r1), out = extras_ranks
    assert max_diff(r0["bf16"], r0["no_throughput"]) == 0 and max_diff(r1["bf16"], r1["no_throughput"]) == 0
    rank0, rank1 = ((out / f"stdout{r}.txt").read_text() for r in range(2))
    assert rank0.count(LINE) == 1 and LINE not in rank1

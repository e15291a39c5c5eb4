"""What both adapters' tests make and check alike, written once: made-up data sets, a batch-dependent metric, the
notebook group's pids, a file that runs code when unpickled, the check of a recompute story, a model answering as
fastai's RNNs. No fastai here: what depends on its version stays in that adapter's tests."""
import numpy as np
import pandas as pd
import torch

from ddipp.core.group.group import _groups

TOPICS, WORDS = 4, 24


def topic_docs(n: int, seed: int, lengths=(20, 120), keep=0.85) -> pd.DataFrame:
    """`n` documents of words w0..w23: the next word follows the document's topic cycle with probability `keep`."""
    cycles = [np.random.RandomState(100 + t).permutation(WORDS) for t in range(TOPICS)]
    succ = [dict(zip(c, np.roll(c, -1))) for c in cycles]
    rng, texts, labels = np.random.RandomState(seed), [], []
    for _ in range(n):
        topic, cur = rng.randint(TOPICS), rng.randint(WORDS)
        words = [cur]
        for _ in range(rng.randint(*lengths) - 1):
            nxt = succ[topic][cur] if rng.rand() < keep else rng.randint(WORDS)
            cur = nxt if nxt != cur else succ[topic][cur]  # no word repeated (fastai would rewrite it)
            words.append(cur)
        texts.append(" ".join(f"w{w}" for w in words))
        labels.append(f"t{topic}")
    return pd.DataFrame({"label": labels, "text": texts})


def tabular_frame(n: int = 3000, seed: int = 0) -> pd.DataFrame:
    """Two categorical and three continuous columns (one with missing values); the label is a noisy rule on all."""
    rng = np.random.RandomState(seed)
    df = pd.DataFrame({"shop": rng.choice(list("abcdef"), n), "day": rng.choice(["mon", "tue", "wed", "thu"], n),
                       "x1": rng.randn(n), "x2": rng.randn(n) * 3 + 1, "x3": rng.rand(n)})
    shop = df.shop.map(dict(zip("abcdef", [-2, -1, 0, 0.5, 1, 2])))
    day = df.day.map({"mon": 1, "tue": -1, "wed": 0.5, "thu": -0.5})
    logit = 1.5 * df.x1 - 0.6 * df.x2 + shop + day + 2 * np.sin(6 * df.x3) + 0.6
    df["label"] = np.where(logit + rng.randn(n) * 0.5 > 0, "yes", "no")
    df.loc[rng.rand(n) < 0.1, "x1"] = np.nan
    return df


def ratings(n_users: int = 150, n_items: int = 120, n: int = 9000, seed: int = 0) -> pd.DataFrame:
    """Ratings from 4 latent factors per user and item, user and item biases, and noise, clipped to 0.5-5."""
    rng = np.random.RandomState(seed)
    users, items = rng.randn(n_users, 4), rng.randn(n_items, 4)
    u, i = rng.randint(n_users, size=n), rng.randint(n_items, size=n)
    r = 3 + 0.6 * (users[u] * items[i]).sum(1) + 0.5 * rng.randn(n_users)[u] + 0.5 * rng.randn(n_items)[i]
    df = pd.DataFrame({"user": u, "item": i, "rating": np.clip(r + 0.3 * rng.randn(n), 0.5, 5.0)})
    return df.drop_duplicates(["user", "item"]).reset_index(drop=True)


def batch_max_prob(out, targ):
    """A metric that depends on how the set is batched: exact only if every batch is the single-process one."""
    return out.softmax(-1).max()


def pids() -> str:
    """The pids of the notebook's 2-CPU worker group, space-separated."""
    return " ".join(str(p.pid) for p in _groups[("cpu", "cpu")].procs)


class RunsCode:
    """What an attacker could put in a replaced checkpoint file: unpickling it runs a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def held_bytes(tensors) -> int:
    """The bytes of `tensors` (not scalars) this process holds: a sharded tensor's own part (DTensor.to_local())."""
    total = 0
    for t in tensors:
        if hasattr(t, "dim") and t.dim() > 0:
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


def assert_recomputed_bitwise(story: dict) -> None:
    """A recompute_story's states with Recompute equal those without it, every tensor bit for bit, in each phase; no
    forward left patched after the fits."""
    for phase in story[False]["phases"]:
        plain, recomputed = story[False][phase], story[True][phase]
        assert len(plain) == len(recomputed)
        for i, (a, b) in enumerate(zip(plain, recomputed)):
            assert torch.equal(a, b), (phase, i, (a.float() - b.float()).abs().max().item())
    assert story[True]["patched"] == [] and story[False]["patched"] == []


class RNNLike(torch.nn.Module):
    """`model`'s output as fastai's RNNs give theirs, (output, raw outputs, outputs), with their reset()."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        out = self.model(x)
        return out, [out], [out]

    def reset(self):
        pass

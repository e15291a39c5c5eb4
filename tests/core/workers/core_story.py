"""What the core tests compute in one process (the reference) and core_worker.py computes on 2 launched ranks, in
plain torch: global-batch losses and their gradients, sums of metric states, a BatchNorm model trained with SGD."""
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

N_VALID, BN_BS, BN_EPOCHS = 359, 32, 2  # the digits that validate; the global batch; 1438 train: 44 steps an epoch


# 1. Global-batch losses

def embedding_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def pair_batch(n=24):
    """A global batch: inputs, a second view of them, and 2-d targets whose pairwise distances are to be learnt."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 8, generator=g), torch.randn(n, 2, generator=g)
    return x, x + 0.1 * torch.randn(n, 8, generator=g), y


def sq_distances(a: torch.Tensor) -> torch.Tensor:
    return (a[:, None] - a[None]).pow(2).sum(-1)


def pairwise_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Squared error between the predicted and the target squared distances, over all pairs of the batch."""
    return (sq_distances(out) - sq_distances(target)).pow(2).mean()


def info_nce(z1: torch.Tensor, z2: torch.Tensor, tau: float = 0.5) -> torch.Tensor:
    """Contrastive loss: row i of z1 must pick row i of z2 among all rows of the batch."""
    logits = F.normalize(z1, dim=1) @ F.normalize(z2, dim=1).T / tau
    return F.cross_entropy(logits, torch.arange(len(z1)))


def grads(model: nn.Module):
    return [p.grad.detach().clone() for p in model.parameters()]


def losses_and_grads(model: nn.Module, x, views, y, gather=lambda t: t):
    """{loss name: (value, gradients)} of the pairwise and the InfoNCE loss on `gather`ed outputs."""
    res = {}
    out = model(x)
    loss = pairwise_loss(gather(out), gather(y))
    loss.backward()
    res["pairwise"] = loss.item(), grads(model)
    model.zero_grad()
    z = model(torch.cat([x, views]))  # one forward for both views
    loss = info_nce(gather(z[:len(x)]), gather(z[len(x):]))
    loss.backward()
    res["info_nce"] = loss.item(), grads(model)
    model.zero_grad()
    return res


# 2. Metric states

def features(n=101):
    """n feature vectors, float64: the set whose mean and covariance the ranks compute in parts."""
    return torch.randn(n, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


def moment_sums(x: torch.Tensor):
    return dict(n=torch.tensor(float(len(x)), dtype=x.dtype), sum=x.sum(0), outer=x.T @ x)


def mean_cov(totals):
    mean = totals["sum"] / totals["n"]
    return mean, (totals["outer"] - totals["n"] * torch.outer(mean, mean)) / (totals["n"] - 1)


# 3. SyncBatchNorm

def digits():
    """scikit-learn's digits as 64 features in [0, 1], and their labels."""
    data = load_digits()
    return torch.tensor(data.data / 16, dtype=torch.float32), torch.tensor(data.target)


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))


def bn_train(model: nn.Module, part=slice(None), trained=None, validate=True) -> dict:
    """Train `trained` (default: `model`; a DDP wrapper of it on a rank) with SGD for BN_EPOCHS epochs of sequential
    global batches of BN_BS, taking the `part` of each batch; `model`'s BatchNorm statistics and parameters after, and
    if `validate` its validation loss in eval mode (on a rank: in this process alone, else None)."""
    trained = model if trained is None else trained
    x, y = digits()
    opt = torch.optim.SGD(trained.parameters(), lr=0.1)
    trained.train()
    for _ in range(BN_EPOCHS):
        for start in range(N_VALID, len(x) - BN_BS + 1, BN_BS):
            xb, yb = x[start:start + BN_BS][part], y[start:start + BN_BS][part]
            opt.zero_grad()
            F.cross_entropy(trained(xb), yb).backward()
            opt.step()
    model.eval()
    bn = model[1]
    with torch.no_grad():
        valid_loss = float(F.cross_entropy(model(x[:N_VALID]), y[:N_VALID])) if validate else None
    return dict(running_mean=bn.running_mean.clone(), running_var=bn.running_var.clone(),
                batches_tracked=int(bn.num_batches_tracked), params=[p.detach().clone() for p in model.parameters()],
                valid_loss=valid_loss)


# 4. A fit's whole state through its Strategy

STATE_STEPS, STATE_BS = 3, 16  # Adam steps before the state is read, on global batches of 16


def state_batches():
    """STATE_STEPS + 1 global batches (inputs, targets) for embedding_net: the last is the step after a load."""
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(STATE_BS, 8, generator=g), torch.randn(STATE_BS, 4, generator=g))
            for _ in range(STATE_STEPS + 1)]


def adam(model: nn.Module, lr: float = 0.01) -> torch.optim.Adam:
    return torch.optim.Adam(model.parameters(), lr=lr)


def adam_steps(trained: nn.Module, opt: torch.optim.Optimizer, batches, part=slice(None)) -> None:
    """One Adam step of mean squared error a batch, taking the `part` of each (a rank's half)."""
    for x, y in batches:
        opt.zero_grad()
        F.mse_loss(trained(x[part]), y[part]).backward()
        opt.step()

"""Data and models of the GPU check's workers, in plain torch so that the fastai v1 and v2 workers share them."""
import torch
from sklearn.datasets import load_digits
from torch import nn


def digits_images() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled digits as 1x8x8 images in [0, 1], and their labels."""
    digits = load_digits()
    return torch.tensor(digits.data / 16, dtype=torch.float32).view(-1, 1, 8, 8), torch.tensor(digits.target)


def random_images(n: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` random 3 x size x size images and labels of 10 classes, the same on every call."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, size, size, generator=generator), torch.randint(0, 10, (n,), generator=generator)


def bn_cnn() -> nn.Module:
    """A convolution, a BatchNorm and a linear layer for 1x8x8 images; the same initial weights on every call."""
    torch.manual_seed(0)
    # no bias before the BatchNorm: it would only remove it, so that gradient is float noise Adam would amplify
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 8 * 8, 10))


def small_cnn() -> nn.Module:
    """Three convolution-BatchNorm-ReLU blocks and a linear layer for 3x32x32 images (about 0.1 M parameters)."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
                            nn.MaxPool2d(2)) for c_in, c_out in ((3, 32), (32, 64), (64, 128))]
    return nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))


def wide_cnn() -> nn.Module:
    """Two 64-channel convolutions at full resolution: a batch of 256 3x64x64 images keeps about 1 GiB of
    activations for the backward pass, which the CUDA allocator caches once they are freed."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def digits_mlp() -> nn.Module:
    """An MLP for the digits' 64 pixels (25 K parameters); the same initial weights on every call."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def wide_mlp() -> nn.Module:
    """Eight 2048-wide linear layers and a 10-class one (33.6 M parameters, 134 MB in float32): a rank in DDP holds
    that 4 times over (parameters, gradients, Adam's two states) and DDP's gradient buckets; a batch of 32 holds
    a few MB of activations."""
    torch.manual_seed(0)
    layers = [module for _ in range(8) for module in (nn.Linear(2048, 2048), nn.ReLU())]
    return nn.Sequential(*layers, nn.Linear(2048, 10))

"""How the tests compare a 2-rank number with one process's: lengths and shapes first, then values within TOL."""
import torch

TOL = 1e-5  # how close a 2-rank number must be to the one-process number (float summation order differs)


def max_diff(a, b) -> float:
    """The largest difference between two lists of tensors; an AssertionError naming the mismatch if their lengths or
    shapes differ or they are empty (a comparison must not pass on what it never saw)."""
    a, b = list(a), list(b)
    assert len(a) == len(b) > 0, f"cannot compare {len(a)} tensors with {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.shape == y.shape, f"tensor {i}: shape {tuple(x.shape)} against {tuple(y.shape)}"
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def close(a, b, tol=TOL) -> bool:
    """Equal structure (keys, lengths), numbers within `tol`."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(close(a[k], b[k], tol) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(close(x, y, tol) for x, y in zip(a, b))
    if a is None or isinstance(a, (bool, str)):
        return a == b
    return abs(float(a) - float(b)) <= tol


def assert_same_tensors(a, b) -> None:
    """Two lists of tensors equal to the bit: an AssertionError naming the first mismatch of length, shape or value."""
    a, b = list(a), list(b)
    assert len(a) == len(b), f"{len(a)} tensors against {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.shape == y.shape, f"tensor {i}: shape {tuple(x.shape)} against {tuple(y.shape)}"
        assert torch.equal(x, y), f"tensor {i} differs by up to {float((x.double() - y.double()).abs().max())}"

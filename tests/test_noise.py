"""Chunked noise: any slice is the slice of the whole, in any process (DESIGN.md §3)."""

import hashlib
import subprocess
import sys

import torch

from curvzo_ds.noise import NoiseSource, stable_seed


def test_any_slice_equals_slice_of_whole():
    src = NoiseSource(seed=7, chunk_size=64)
    numel = 1000
    whole = src.slice(3, "layer.weight", numel, 0, numel)
    assert whole.dtype == torch.float32 and whole.shape == (numel,)
    gen = torch.Generator().manual_seed(0)
    cases = [(0, 64), (63, 65), (64, 128), (100, 400), (999, 1000), (960, 1000), (0, 1000), (5, 5)]
    cases += [tuple(sorted(torch.randint(0, numel + 1, (2,), generator=gen).tolist())) for _ in range(50)]
    for lo, hi in cases:
        assert torch.equal(src.slice(3, "layer.weight", numel, lo, hi - lo), whole[lo:hi]), (lo, hi)


def test_noise_depends_on_step_name_and_seed():
    a = NoiseSource(1, 32).slice(0, "w", 100, 0, 100)
    assert not torch.equal(a, NoiseSource(1, 32).slice(1, "w", 100, 0, 100))
    assert not torch.equal(a, NoiseSource(1, 32).slice(0, "v", 100, 0, 100))
    assert not torch.equal(a, NoiseSource(2, 32).slice(0, "w", 100, 0, 100))
    # Roughly standard normal.
    big = NoiseSource(1, 4096).slice(0, "w", 200_000, 0, 200_000)
    assert abs(big.mean().item()) < 5 / 200_000**0.5
    assert abs(big.var().item() - 1) < 0.02


def _digest() -> str:
    src = NoiseSource(seed=123, chunk_size=50)
    h = hashlib.sha256()
    h.update(src.slice(9, "model.layers.0.mlp.up_proj.weight", 777, 33, 500).numpy().tobytes())
    h.update(src.mask_uniforms(9, 17).numpy().tobytes())
    h.update(str(stable_seed(1, "a", 2)).encode())
    return h.hexdigest()


def test_same_values_in_a_fresh_process():
    code = "from tests.test_noise import _digest; print(_digest())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "99", "PATH": "/usr/bin:/bin"}, cwd=_repo_root())
    assert out.stdout.strip().splitlines()[-1] == _digest()


def _repo_root():
    import pathlib

    return str(pathlib.Path(__file__).resolve().parents[1])

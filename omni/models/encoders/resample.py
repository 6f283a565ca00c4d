"""Band-limited resampling of audio clips to a tower's sampling rate (the Whisper-style towers'
processors call it for clips recorded at another rate)."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


#: Above this many filter weights (very unusual rate pairs) resample() gathers taps per output.
_POLYPHASE_MAX_WEIGHTS = 1 << 22


def resample(wave: np.ndarray, orig_sr: int, new_sr: int, zero_crossings: int = 6, rolloff: float = 0.99) -> np.ndarray:
    """Band-limited resampling with a Hann-windowed sinc; returns ceil(n * new_sr / orig_sr) samples.

    Output sample j sits at input time t_j = j * orig_sr / new_sr and is sum_k x[k] h(t_j - k),
    h a low-pass at ``rolloff`` times the lower Nyquist frequency, windowed to
    ``zero_crossings`` zero crossings each side; samples outside the clip count as zero.
    """
    x = torch.as_tensor(np.asarray(wave, dtype=np.float32))
    n = x.numel()
    g = math.gcd(orig_sr, new_sr)
    orig, new = orig_sr // g, new_sr // g
    n_out = -(-n * new // orig)
    fc = 0.5 * rolloff * min(1.0, new / orig)  # cutoff, cycles per input sample
    half = zero_crossings / (2 * fc)  # window half-width in input samples
    k = math.ceil(half)
    offs = torch.arange(-k + 1, k + 1, dtype=torch.int64)
    # t_j = base_j + phase_j / new with phase_j = (j * orig) % new: only `new` distinct filters.
    t = torch.arange(new, dtype=torch.float64)[:, None] / new - offs[None, :].to(torch.float64)
    table = (2 * fc * torch.sinc(2 * fc * t) * torch.cos(math.pi * t / (2 * half)).square() * (t.abs() <= half))
    table = table.to(torch.float32)  # [new, 2k]
    if new * (orig + 2 * k) <= _POLYPHASE_MAX_WEIGHTS:
        # Polyphase: output m*new + i is a stride-`orig` conv of x with phase i's filter.
        weight = torch.zeros(new, orig + 2 * k, dtype=torch.float32)
        shift = torch.arange(new) * orig // new  # whole input samples before phase i's time
        cols = shift[:, None] + torch.arange(2 * k)[None, :]
        weight.scatter_(1, cols, table[torch.arange(new) * orig % new])
        xp = F.pad(x[None, None], (k - 1, k + orig + 1))
        y = F.conv1d(xp, weight[:, None, :], stride=orig)[0]  # [new, n // orig + 1]
        return y.T.reshape(-1)[:n_out].contiguous().numpy()
    out = torch.empty(n_out, dtype=torch.float32)
    step = 1 << 15
    for start in range(0, n_out, step):
        j = torch.arange(start, min(start + step, n_out), dtype=torch.int64)
        idx = (j * orig // new)[:, None] + offs[None, :]
        valid = (idx >= 0) & (idx < n)
        taps = torch.where(valid, x[idx.clamp(0, max(n - 1, 0))], 0.0)
        out[start : start + j.numel()] = (taps * table[j * orig % new]).sum(1)
    return out.numpy()

"""Logits workloads for the step benchmarks: broad rows, peaked rows, and mixes of both.

The model cannot run here, so the shape of its distributions is a knob:

* ``broad``: today's benchmark rows, Gaussian logits (``3 * randn``): the mass is spread over
  thousands of tokens at the schedule's temperatures.
* ``peaked`` with ``k`` in 1..6: at the step's temperature T, the top token holds
  ``1 - 10^-k`` of the mass and the rest follows a Zipf-like tail (``z = -1.1 ln rank`` plus a
  little noise, ranks a per-row permutation of the vocabulary), as for a position the model has
  nearly decided.
* mixes: a fraction of the rows peaked (k cycling 1..6 over them), the others broad, rows in a
  fixed random order; ``trajectory``: request i of n has a fraction i / (n - 1) of its positions
  peaked, as for requests at different points of their denoising (broad early, peaked late).
* ``peaked36``: every row peaked with k in 3..6 only (k = 1, 2 leave 10% / 1% of the mass in a
  heavy tail: no support of 64 tokens holds all but 2^-10 of it, so those rows stay dense);
  ``mix50c``: half the rows peaked, clustered (the first half of each request's positions), so
  that 128-row tiles are all sparse or all dense (the Hopper dense kernel skips only whole
  tiles; ``mix50`` is the interleaved worst case); ``half36``: half the rows peaked with k in
  3..6, interleaved (every peaked row can take the sparse path).

Logits are returned at temperature 1 (``z * T``): the sampler divides by T again.
"""

from __future__ import annotations

import math

import torch

ZIPF = 1.1
FAMILIES = ("broad", "peaked", "mix25", "mix50", "mix75", "trajectory", "peaked36", "mix50c", "half36")


def broad_rows(rows: int, vocab: int, gen: torch.Generator, device) -> torch.Tensor:
    return torch.randn(rows, vocab, device=device, generator=gen) * 3.0


def peaked_rows(ks: torch.Tensor, vocab: int, temperature: float, gen: torch.Generator,
                device) -> torch.Tensor:
    """One row per entry of ``ks`` (int, 1..6): top token ``1 - 10^-k`` of the mass at T."""
    rows = ks.numel()
    out = torch.empty(rows, vocab, device=device)
    tokens = torch.arange(vocab, device=device, dtype=torch.int64)
    chunk = max(1, 2**28 // vocab)  # bounded temporaries
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        n = r1 - r0
        # a per-row bijection of the vocabulary (odd multiplier mod a power of two, else a shift)
        mult = 2 * torch.randint(1, 2**20, (n, 1), device=device, generator=gen) + 1
        shift = torch.randint(0, vocab, (n, 1), device=device, generator=gen)
        if vocab & (vocab - 1) == 0:
            rank = (tokens.unsqueeze(0) * mult + shift) % vocab
        else:
            rank = (tokens.unsqueeze(0) + shift) % vocab
        z = -ZIPF * torch.log1p(rank.float())
        z += 0.05 * torch.randn(n, vocab, device=device, generator=gen)
        top = rank == 0
        tail = torch.logsumexp(torch.where(top, -math.inf, z), dim=1, keepdim=True)
        d = 10.0 ** -ks[r0:r1].to(device=device, dtype=torch.float64).unsqueeze(1)
        head = (torch.log((1 - d) / d) + tail.double()).float()
        z = torch.where(top, head, z)
        out[r0:r1] = z * temperature
    return out


def make_logits(family: str, requests: int, canvas: int, vocab: int, temperature: float,
                gen: torch.Generator, device, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``[requests * canvas, vocab]`` logits of a family and the k of each row (0 = broad)."""
    rows = requests * canvas
    if family == "broad":
        frac = torch.zeros(rows)
    elif family in ("peaked", "peaked36"):
        frac = torch.ones(rows)
    elif family in ("mix50c", "half36"):
        frac = torch.full((rows,), 0.5)
    elif family.startswith("mix"):
        frac = torch.full((rows,), int(family[3:]) / 100.0)
    elif family == "trajectory":
        per_request = torch.linspace(0, 1, requests) if requests > 1 else torch.ones(1)
        frac = per_request.repeat_interleave(canvas)
    else:
        raise ValueError(f"unknown workload {family!r}; one of {FAMILIES}")
    cpu = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen, device=gen.device)))
    if family == "mix50c":
        peaked = (torch.arange(rows) % canvas) < canvas // 2
    elif family.startswith("mix") or family == "half36":
        count = round(float(frac[0]) * rows)
        peaked = torch.zeros(rows, dtype=torch.bool)
        peaked[torch.randperm(rows, generator=cpu)[:count]] = True
    else:
        # within each request, the first frac * canvas positions (in a random order) are peaked
        peaked = torch.zeros(rows, dtype=torch.bool)
        for i in range(requests):
            count = round(float(frac[i * canvas]) * canvas)
            pos = torch.randperm(canvas, generator=cpu)[:count]
            peaked[i * canvas + pos] = True
    ks = torch.zeros(rows, dtype=torch.int64)
    idx = torch.nonzero(peaked).flatten()
    low = 3 if family in ("peaked36", "half36") else 1
    ks[idx] = torch.arange(idx.numel()) % (7 - low) + low
    logits = broad_rows(rows, vocab, gen, device)
    if idx.numel():
        logits[idx.to(device)] = peaked_rows(ks[idx], vocab, temperature, gen, device)
    return logits.to(dtype), ks

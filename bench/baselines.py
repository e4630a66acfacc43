"""The reference paths the fused sampler is measured against.

``materialized_step`` is the all-PyTorch fp32 statistics + self-conditioning pass of a
DiffusionGemma decode step as upstream vLLM wrote it before its row-statistics kernel:
fp32 scaled logits, a same-sized noise tensor, log-softmax, probabilities, entropy,
argmax, Gumbel-max sample, and ``probs.bf16 @ E``. It keeps several ``[rows, V]`` fp32
copies alive, which is the transient memory the product removes. ``compiled_step`` is the
same function under ``torch.compile``.
"""

from __future__ import annotations

import torch


def materialized_step(logits: torch.Tensor, temperature_rows: torch.Tensor, embed: torch.Tensor,
                      normalizer: float):
    t = temperature_rows.clamp(min=1e-10).unsqueeze(1)
    scaled = logits.float() / t
    u = torch.rand_like(scaled).clamp(min=1e-20)
    noisy = scaled - torch.log(-torch.log(u))
    log_probs = scaled.log_softmax(dim=-1)
    probs = log_probs.exp()
    entropy = -torch.where(probs > 0, probs * log_probs, 0.0).sum(dim=-1)
    argmax = scaled.argmax(dim=-1)
    sample = noisy.argmax(dim=-1)
    soft = (probs.to(embed.dtype) @ embed).float() * normalizer
    return argmax, sample, entropy, soft


_compiled = None


def compiled_step(*args):
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(materialized_step, dynamic=False)
    return _compiled(*args)

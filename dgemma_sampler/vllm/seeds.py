"""Per-request seeds for DiffusionGemma through vLLM's API.

vLLM 0.33 and 0.34 reject ``SamplingParams(seed=...)`` for every diffusion model in
``SamplingParams._validate_diffusion`` (a 400 on the server): their sampler draws from torch's
global generator, so a seed could not be honoured. Ours keys every random number by the request's
seed and its own draw counter, so a seed reproduces a generation whatever the batch.
``accept_seed`` wraps that validation so that, for DiffusionGemma only, the seed is left out of
the check; every other parameter it rejects (temperature, min_p, min_tokens, logit_bias,
bad_words, allowed_token_ids) is still rejected, by vLLM's own code and message.

The seed is a parameter vLLM never checks (it stores ``SamplingParams.seed`` in an int64 array,
which turns ``True`` into 1, ``1.5`` into 1 and ``"7"`` into 7, and fails deep in the engine on
a seed past 2^63), so the wrapper checks it (``check_seed``) and refuses anything but an int in
``[-2^63, 2^63)`` with vLLM's own validation error, a 400 on the server.
"""

from __future__ import annotations

import copy
import functools

from ..checks import is_int

SEED_RANGE = (-(2**63), 2**63)  # vLLM keeps request seeds in an int64 array
# The attribute that marks vLLM's validation as wrapped (``accept_seed`` is idempotent).
_WRAPPED_MARK = "_dgemma_accepts_seed"


def check_seed(seed: object) -> None:
    """TypeError / ValueError naming ``SamplingParams.seed`` unless it is None or an int (a Python
    or numpy integer, not a bool) in ``[-2^63, 2^63)``; vLLM itself turns -1 into None."""
    if seed is None:
        return
    if not is_int(seed):
        raise TypeError(f"SamplingParams.seed must be None or an int, got {type(seed).__name__} {seed!r}")
    if not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise ValueError(f"SamplingParams.seed must be in [-2^63, 2^63), got {seed!r}")


def accept_seed(architecture: str) -> bool:
    """Wrap ``SamplingParams._validate_diffusion`` (idempotent) so that models of
    ``architecture`` keep the seed; False where vLLM has no such check to wrap."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    validate = getattr(SamplingParams, "_validate_diffusion", None)
    if validate is None:
        return False
    if getattr(validate, _WRAPPED_MARK, False):
        return True

    @functools.wraps(validate)
    def validate_without_seed(self, model_config):
        if self.seed is None or architecture not in (getattr(model_config, "architectures", None) or ()):
            return validate(self, model_config)
        try:
            check_seed(self.seed)
        except (TypeError, ValueError) as exc:
            raise VLLMValidationError(str(exc), parameter="seed", value=self.seed) from None
        # vLLM's check on a copy whose seed is unset: its verdict on everything else, unchanged.
        unseeded = copy.copy(self)
        unseeded.seed = None
        return validate(unseeded, model_config)

    setattr(validate_without_seed, _WRAPPED_MARK, True)
    SamplingParams._validate_diffusion = validate_without_seed
    return True


"""Speech-token sampling of the CosyVoice3 LLM: RAS, stop masking, silent-run filter, limits.

Pure numpy. Every function takes the request's own ``numpy.random.Generator`` so that a seed
reproduces a request and concurrent requests never share random state.

Sources (FunAudioLLM/CosyVoice, commit ace7c47):

* ``cosyvoice/utils/common.py`` ``ras_sampling``, ``nucleus_sampling``, ``random_sampling``:
  Repetition-Aware Sampling from VALL-E 2.
* ``cosyvoice/llm/llm.py`` ``Qwen2LM.sampling_ids`` / ``inference`` / ``inference_wrapper``:
  per-step log-softmax, stop-token masking below the minimum length, length limits.
* ``cosyvoice/cli/model.py`` ``CosyVoice2Model.llm_job``: the silent-run filter.

Where this module departs from upstream on purpose, the docstring says so.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from .. import constants as C

FloatArray = npt.NDArray[np.floating]


def log_softmax(logits: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """Numerically stable log-softmax over the last axis.

    Args:
        logits: float [..., V] (any float dtype; ``-inf`` entries allowed as long as one
            entry per row is finite).

    Returns:
        float64 [..., V] log-probabilities (``-inf`` where the input was ``-inf``).

    Source: llm.py ``inference_wrapper`` (``self.llm_decoder(...).log_softmax(dim=-1)``).
    """
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - np.max(x, axis=-1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def _probabilities(scores: FloatArray) -> npt.NDArray[np.float64]:
    """Softmax of logits or (possibly masked, unnormalised) log-probabilities, float64 [V].

    ``softmax(log_softmax(x)) == softmax(x)``, so callers may pass either. The exponentials
    are taken in float32 (as upstream's fp32 torch path does; float64 ``exp`` is several times
    slower here), the normalisation in float64.
    """
    x = np.asarray(scores, dtype=np.float32)
    top = np.max(x)
    if not np.isfinite(top):
        raise ValueError("cannot sample: every log-probability is -inf or NaN")
    p = np.exp(x - top).astype(np.float64)
    return np.asarray(p / p.sum(), dtype=np.float64)


def _draw(weights: npt.NDArray[np.float64], rng: np.random.Generator) -> int:
    """Index drawn with probability proportional to ``weights`` (one uniform draw)."""
    cdf = np.cumsum(weights)
    u = rng.random() * cdf[-1]
    index = int(np.searchsorted(cdf, u, side="right"))
    return min(index, weights.shape[0] - 1)


def nucleus_candidates(
    logp: FloatArray, top_p: float = C.RAS_TOP_P, top_k: int = C.RAS_TOP_K
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
    """Token ids and probabilities kept by nucleus (top-p + top-k) filtering.

    Rule of upstream ``nucleus_sampling`` (common.py): take the softmax of ``logp``, sort it in
    descending order with a *stable* sort (equal probabilities keep ascending-id order), then
    walk the sorted list and keep token i while ``sum(kept probs) < top_p`` and
    ``len(kept) < top_k`` *before* adding it. The token whose probability makes the sum cross
    ``top_p`` is therefore included, and at most ``top_k`` tokens are kept. The kept
    probabilities are not renormalised (sampling normalises them).

    Args:
        logp: float [V] log-probabilities (``-inf`` = masked).
        top_p: cumulative-probability bound, in (0, 1].
        top_k: maximum number of kept tokens, >= 1.

    Returns:
        (ids int64 [n], probs float64 [n]) in descending-probability order, 1 <= n <= top_k.

    Raises:
        ValueError: top_p / top_k out of range, or every entry masked.
    """
    return _nucleus(_probabilities(logp), top_p, top_k)


def _nucleus(
    p: npt.NDArray[np.float64], top_p: float, top_k: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
    """:func:`nucleus_candidates` on probabilities ``p`` float64 [V] (sum 1)."""
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be within (0, 1], got {top_p}")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    vocab = p.shape[0]
    k = min(top_k, vocab)
    # candidates: every id whose probability reaches the k-th largest value (ties included),
    # then a stable descending sort of those few, which equals a full stable sort's prefix
    kth_value = np.partition(p, vocab - k)[vocab - k]
    candidates = np.flatnonzero(p >= kth_value)
    order = candidates[np.argsort(-p[candidates], kind="stable")][:k]
    sorted_p = p[order]
    cum_before = np.concatenate(([0.0], np.cumsum(sorted_p[:-1])))
    n_kept = max(1, int(np.count_nonzero(cum_before < top_p)))
    return order[:n_kept].astype(np.int64), sorted_p[:n_kept]


def nucleus_sample(
    logp: FloatArray,
    rng: np.random.Generator,
    top_p: float = C.RAS_TOP_P,
    top_k: int = C.RAS_TOP_K,
) -> int:
    """Sample one token among the nucleus of ``logp`` (see :func:`nucleus_candidates`).

    The kept tokens are drawn with probability proportional to their softmax probability
    (upstream: ``prob.multinomial(1)`` on the kept, unnormalised probabilities).

    Args:
        logp: float [V] log-probabilities (``-inf`` = masked).
        rng: the request's generator (one uniform draw per call).

    Returns:
        the sampled token id.
    """
    ids, probs = nucleus_candidates(logp, top_p, top_k)
    return int(ids[_draw(probs, rng)])


def random_sample(logp: FloatArray, rng: np.random.Generator) -> int:
    """Sample one token from the whole softmax distribution of ``logp``.

    Source: common.py ``random_sampling`` (``softmax().multinomial(1)``).
    """
    return _draw(_probabilities(logp), rng)


def ras_sample(
    logp: FloatArray,
    decoded_tokens: Sequence[int],
    rng: np.random.Generator,
    top_p: float = C.RAS_TOP_P,
    top_k: int = C.RAS_TOP_K,
    win_size: int = C.RAS_WINDOW_TOKENS,
    tau_r: float = C.RAS_TAU_R,
) -> int:
    """Repetition-Aware Sampling (VALL-E 2), as upstream common.py ``ras_sampling`` does it.

    1. Nucleus-sample a token t (:func:`nucleus_sample`).
    2. Count how often t occurs among the last ``win_size`` decoded tokens. If the count is
       ``>= win_size * tau_r`` (10 x 0.1 = 1: t occurs at all in the window), upstream sets
       ``logp[t] = -inf`` and draws with ``random_sampling`` from the *whole* distribution
       (no top-p / top-k) of the remaining tokens. This function does the same: t is banned
       for this draw and the fallback samples among all other tokens by their probabilities.
       If t was the only unmasked token, t is returned.

    Args:
        logp: float [V] log-probabilities of this step (masked entries ``-inf``); not modified.
        decoded_tokens: every token generated so far in this request (the RAS window uses all
            generated tokens, before the silent-run filter).
        rng: the request's generator (one or two uniform draws per call).

    Returns:
        the sampled token id.
    """
    return _ras(_probabilities(logp), decoded_tokens, rng, top_p, top_k, win_size, tau_r)


def _ras(
    p: npt.NDArray[np.float64],
    decoded_tokens: Sequence[int],
    rng: np.random.Generator,
    top_p: float,
    top_k: int,
    win_size: int,
    tau_r: float,
) -> int:
    """:func:`ras_sample` on probabilities ``p`` float64 [V] (sum 1)."""
    ids, kept = _nucleus(p, top_p, top_k)
    token = int(ids[_draw(kept, rng)])
    n_decoded = len(decoded_tokens)
    repeats = sum(
        1 for i in range(max(0, n_decoded - win_size), n_decoded) if decoded_tokens[i] == token
    )
    if repeats >= win_size * tau_r:
        banned = p.copy()
        banned[token] = 0.0  # softmax of logp with logp[token] = -inf, up to normalisation
        if banned.any():
            token = _draw(banned, rng)
    return token


def mask_stop_tokens(
    logp: FloatArray, speech_vocab: int = C.SPEECH_TOKEN_VOCAB
) -> npt.NDArray[np.float64]:
    """Return a copy of ``logp`` with every special id (>= ``speech_vocab``) set to ``-inf``.

    Applied while the step index is below the minimum length so that decoding cannot stop
    early. Deliberate fix: upstream llm.py ``Qwen2LM.sampling_ids`` masks only the single id
    ``speech_token_size`` (6561, which in CosyVoice3LM is SOS, not EOS 6562), while any id in
    ``stop_token_ids`` = 6561..6760 ends decoding, so upstream can stop before ``min_len``.

    Args:
        logp: float [V] log-probabilities, V >= speech_vocab.

    Returns:
        float64 [V].
    """
    masked = np.array(logp, dtype=np.float64, copy=True)
    masked[speech_vocab:] = -np.inf
    return masked


def sample_step(
    logits: FloatArray,
    decoded_tokens: Sequence[int],
    rng: np.random.Generator,
    step: int,
    min_len: int,
    speech_vocab: int = C.SPEECH_TOKEN_VOCAB,
) -> int:
    """One decoding step's choice: log-softmax, stop masking below ``min_len``, RAS.

    Equivalent to ``ras_sample(mask_stop_tokens(log_softmax(logits)) if step < min_len else
    log_softmax(logits), ...)`` with the upstream parameters (top_p 0.8, top_k 25, window 10,
    tau_r 0.1), computed with a single softmax.

    Args:
        logits: float [V] LLM head output of the last position.
        decoded_tokens: tokens generated so far (the RAS window).
        rng: the request's generator.
        step: index of the token being chosen (0 for the first).
        min_len: minimum number of speech tokens (:func:`decode_limits`).

    Returns:
        a token id; ids >= ``speech_vocab`` mean "stop" (only possible when step >= min_len).

    Source: llm.py ``inference_wrapper`` (log_softmax, ``sampling_ids`` with
    ``ignore_eos = i < min_len``).
    """
    scores = np.asarray(logits, dtype=np.float32)
    if step < min_len:
        scores = scores.copy()
        scores[speech_vocab:] = -np.inf
    # softmax(log_softmax(x)) == softmax(x): one exponential pass serves the whole step
    p = _probabilities(scores)
    return _ras(p, decoded_tokens, rng, C.RAS_TOP_P, C.RAS_TOP_K, C.RAS_WINDOW_TOKENS, C.RAS_TAU_R)


def decode_limits(n_tts_text_tokens: int) -> tuple[int, int]:
    """Minimum and maximum number of speech tokens for a text of N tokens.

    ``(int(N * 2.0), int(N * 20.0))``; N counts only the tts-text tokens (prompt text
    excluded; in cross-lingual mode the system prefix is part of the tts text).
    Source: llm.py ``Qwen2LM.inference`` (``min_token_text_ratio``, ``max_token_text_ratio``).

    Raises:
        ValueError: N < 0.
    """
    if n_tts_text_tokens < 0:
        raise ValueError(f"n_tts_text_tokens must be >= 0, got {n_tts_text_tokens}")
    return (
        int(n_tts_text_tokens * C.MIN_TOKEN_TEXT_RATIO),
        int(n_tts_text_tokens * C.MAX_TOKEN_TEXT_RATIO),
    )


class SilentRunFilter:
    """Drops silent tokens beyond a run of ``max_run_tokens`` consecutive ones.

    One instance per request (it counts the current run). Any token of ``silent_tokens``
    extends the run (they need not be equal); any other token resets it. Tokens are only
    dropped from what reaches the flow; the LLM and the RAS window still see every token.

    Source: model.py ``CosyVoice2Model.llm_job`` (``silent_tokens``, ``max_silent_token_num``
    = 5), silent set from ``CosyVoice3Model.__init__``.
    """

    def __init__(
        self,
        silent_tokens: frozenset[int] = C.SILENT_TOKENS,
        max_run_tokens: int = C.MAX_SILENT_RUN_TOKENS,
    ) -> None:
        self._silent = silent_tokens
        self._max_run = max_run_tokens
        self._run = 0

    def accept(self, token: int) -> bool:
        """Return True when ``token`` should be passed on to the flow."""
        if token in self._silent:
            self._run += 1
            return self._run <= self._max_run
        self._run = 0
        return True

    def filter(self, tokens: Sequence[int]) -> list[int]:
        """The accepted subset of ``tokens`` in order (continues the current run)."""
        return [t for t in tokens if self.accept(t)]

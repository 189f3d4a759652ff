"""Per-size dimensions of the synthetic model directories.

The graph *interfaces* always carry the published dimensions of Fun-CosyVoice3-0.5B (hidden 896,
24 layers, 2 KV heads of 64, 6761 speech rows, 80 mel bins, 192-dim speaker embedding; see
:mod:`wyoming_cosyvoice3.engine.constants`); only the *inside* of each graph shrinks. A future
``size="full"`` entry (real Qwen2-0.5B / DiT / HiFT widths, random weights, for benchmarks) is
one more :class:`SyntheticConfig` in :data:`SIZES`.
"""

from __future__ import annotations

from dataclasses import dataclass

from wyoming_cosyvoice3.engine import constants as C


@dataclass(frozen=True)
class SyntheticConfig:
    """Dimensions of one synthetic size.

    Interface dimensions (must match the contract, spec section 1):
        llm_hidden_size, llm_num_layers, llm_num_kv_heads, llm_head_dim,
        speech_embedding_rows, mel_bins, speaker_dim.

    Inner dimensions (free):
        llm_inner_size: width of the residual stream inside the tiny LLM (the 896-wide
            inputs_embeds are projected to it).
        text_table_rows: rows of the fp16 text table; ids are looked up modulo this count.
        speech_table_rows: rows for ordinary speech tokens (id modulo this count); the 200
            special ids (6561..6760) always get their own rows.
        flow_embed_dim: width of the flow encoder's token embedding (upstream 80).
        estimator_time_dim: width of the sinusoidal t features of the estimator.
        hift_channels: channels of the vocoder's conv stack.
        tokenizer_codes: FSQ digits of the speech tokenizer (3**8 = 6561 codes).
    """

    llm_hidden_size: int = C.LLM_HIDDEN_SIZE
    llm_num_layers: int = C.LLM_NUM_LAYERS
    llm_num_kv_heads: int = C.LLM_NUM_KV_HEADS
    llm_head_dim: int = C.LLM_HEAD_DIM
    speech_embedding_rows: int = C.SPEECH_EMBEDDING_ROWS
    mel_bins: int = C.MEL_BINS
    speaker_dim: int = C.SPEAKER_EMBEDDING_DIM
    text_embedding_rows: int = 151936
    """Rows of the real Qwen2 input embedding (all token ids must stay below this)."""

    llm_inner_size: int = 64
    text_table_rows: int = 1031
    speech_table_rows: int = 509
    flow_embed_dim: int = 32
    estimator_time_dim: int = 16
    hift_channels: int = 32
    tokenizer_codes: int = 8

    # --- behaviour of the tiny LLM's end of speech (see llm.py) -------------------------
    eos_tokens_per_text_token: float = 5.0
    """Decode steps the tiny LLM aims for per text token (after the system prompt)."""
    eos_slope: float = 1.0
    """EOS logit gain per decode step past the target."""
    eos_offset: float = 6.0
    """EOS logit at the target (about the largest random speech logit)."""


SIZES: dict[str, SyntheticConfig] = {"tiny": SyntheticConfig(), "tiny-dit": SyntheticConfig()}
"""Known small sizes. ``tiny-dit`` is ``tiny`` with an upstream-structured DiT estimator
(:data:`.build.UPSTREAM_DIT_SIZES`), on which the split and int8 derivations work; the full
sizes (real widths) are in :mod:`.full_config`."""


def get_config(size: str) -> SyntheticConfig:
    """Return the config of ``size``; ``ValueError`` names the known sizes otherwise."""
    try:
        return SIZES[size]
    except KeyError:
        raise ValueError(f"unknown synthetic size {size!r}; known: {sorted(SIZES)}") from None

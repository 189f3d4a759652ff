"""Model constants of Fun-CosyVoice3-0.5B-2512.

Every value names its source: the upstream repository FunAudioLLM/CosyVoice (file and
function) or the model card of the ONNX export ``Masterx/Fun-CosyVoice3-0.5B-2512-ONNX``.
Dimensions that the graphs carry (hidden size, layers, KV heads, head dim, vocab) are read
from the graphs at load time (see :mod:`.model`); the values here are only the published
defaults used to build synthetic models and to check them.
"""

from __future__ import annotations

# --- audio and frame rates (cosyvoice3.yaml) ---------------------------------------------
OUTPUT_SAMPLE_RATE_HZ = 24000
"""Output sample rate of the vocoder; mono (cosyvoice3.yaml ``sample_rate``)."""
SPEECH_TOKEN_RATE_HZ = 25
"""Speech tokens per second (llm.py CosyVoice3LM, 25 Hz FSQ tokenizer)."""
TOKEN_MEL_RATIO = 2
"""Mel frames per speech token (cosyvoice3.yaml ``token_mel_ratio``)."""
MEL_RATE_HZ = SPEECH_TOKEN_RATE_HZ * TOKEN_MEL_RATIO
"""Mel frames per second: 50."""
MEL_BINS = 80
"""Mel channels of the flow and vocoder (cosyvoice3.yaml ``num_mels``)."""
SAMPLES_PER_MEL_FRAME = OUTPUT_SAMPLE_RATE_HZ // MEL_RATE_HZ
"""Hop of the 24 kHz mel, 480 samples (cosyvoice3.yaml ``hop_size``)."""
FEATURE_SAMPLE_RATE_HZ = 16000
"""Rate of the audio fed to the speech tokenizer and speaker encoder (frontend.py)."""

# --- speech vocabulary (llm.py CosyVoice3LM) ----------------------------------------------
SPEECH_TOKEN_VOCAB = 6561
"""FSQ speech tokens 0..6560; every id >= this value is special and stops decoding."""
SPEECH_EMBEDDING_ROWS = 6761
"""Rows of speech_embedding.onnx and columns of the LLM head (6561 + 200 special)."""
SOS_TOKEN = 6561
EOS_TOKEN = 6562
TASK_TOKEN = 6563
FILL_TOKEN = 6564
SPEAKER_EMBEDDING_DIM = 192
"""CAM++ speaker embedding width (campplus.onnx output)."""
LLM_HIDDEN_SIZE = 896
"""Qwen2-0.5B hidden size (published default; read from the graph at load)."""
LLM_NUM_LAYERS = 24
LLM_NUM_KV_HEADS = 2
LLM_HEAD_DIM = 64
LLM_INTERMEDIATE_SIZE = 4864
"""Qwen2-0.5B MLP width (published default; the machine probe's LLM product widths)."""

# --- text prompts (llm.py / cosyvoice.py, model card) -------------------------------------
END_OF_PROMPT = "<|endofprompt|>"
"""Separator token; its id is read from tokenizer.json (151646 in the release), never hard-coded."""
SYSTEM_PROMPT = "You are a helpful assistant." + END_OF_PROMPT
"""Prefix of every prompt text (model card, host side step 2)."""
INSTRUCT_PREFIX = "You are a helpful assistant. "
"""Instruct mode: ``INSTRUCT_PREFIX + instruction + END_OF_PROMPT`` (model card step 2)."""

# --- sampling (common.py ras_sampling, llm.py inference) ---------------------------------
RAS_TOP_P = 0.8
RAS_TOP_K = 25
RAS_WINDOW_TOKENS = 10
RAS_TAU_R = 0.1
MIN_TOKEN_TEXT_RATIO = 2.0
"""Minimum speech tokens per tts-text token (llm.py inference ``min_token_text_ratio``)."""
DEFAULT_MAX_PIECE_TOKENS = 80
"""Upper piece size in text tokens (utils/frontend_utils.py split_paragraph ``token_max_n``)."""
DEFAULT_MERGE_TOKENS = 20
"""Pieces and tails shorter than this are merged (split_paragraph ``merge_len``)."""
MAX_TOKEN_TEXT_RATIO = 20.0
"""Maximum speech tokens per tts-text token (llm.py inference ``max_token_text_ratio``)."""
SILENT_TOKENS = frozenset({1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323})
"""Speech tokens that encode silence (model.py llm_job)."""
MAX_SILENT_RUN_TOKENS = 5
"""At most this many consecutive silent tokens reach the flow (model.py llm_job)."""

# --- flow (flow.py CausalMaskedDiffWithDiT, flow_matching.py CausalConditionalCFM) -------
PRE_LOOKAHEAD_TOKENS = 3
"""Right context of the flow encoder's PreLookaheadLayer (cosyvoice3.yaml)."""
DEFAULT_EULER_STEPS = 10
DEFAULT_CFG_RATE = 0.7
FLOW_NOISE_FRAMES = 15000
"""Length of upstream's fixed N(0,1) noise buffer (flow_matching.py ``rand_noise``)."""

# --- vocoder (hifigan/generator.py CausalHiFTGenerator) ----------------------------------
ISTFT_N_FFT = 16
ISTFT_HOP = 4
HARMONIC_CHANNELS = 9
"""Noise channels of hift.onnx: fundamental + 8 harmonics (generator.py ``nb_harmonics``)."""
MAGNITUDE_CLIP = 100.0
"""Upper clip of the iSTFT magnitude (generator.py ``_istft`` clips at 1e2)."""
AUDIO_LIMIT = 0.99
"""Output clamp (generator.py ``audio_limit``)."""
VOCODER_RIGHT_CONTEXT_FRAMES = 8
"""Mel frames whose samples change when more mel arrives: 3 (conv_pre lookahead) + 4 + 1 (iSTFT)."""
FADE_IN_MS = 20.0
"""Fade-in at the start of an utterance against onset clicks (spec section 6)."""

# --- voice prompts (frontend.py) ----------------------------------------------------------
MAX_PROMPT_SECONDS = 30.0
MIN_PROMPT_SECONDS = 1.0
MIN_PROMPT_SAMPLE_RATE_HZ = 16000

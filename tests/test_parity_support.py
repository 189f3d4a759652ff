"""The parity fixture loader: which set, skip or fail when it is missing, fail when it is
partial; cases, tolerances and flow geometry from the manifest."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import parity_support
import pytest
from parity_support import (
    assert_close,
    assert_identical,
    derived_cache_dir,
    load_parity,
    parity_cases,
    parity_root,
)

SKIPPED = pytest.skip.Exception
FAILED = pytest.fail.Exception


def _outcome(root: Path | None = None) -> tuple[str, str]:
    """``("skip" | "fail" | "ok", message)`` of :func:`load_parity` (a skip raised inside a
    test would otherwise skip the test itself instead of failing it)."""
    try:
        load_parity(root)
    except SKIPPED as exc:
        return "skip", str(exc)
    except FAILED as exc:
        return "fail", str(exc)
    return "ok", ""


def _make_set(root: Path) -> Path:
    """A complete minimal fixture set laid out as ``shared/parity`` (other cases, other
    numbers, other geometry than the real sets)."""
    (root / "model").mkdir(parents=True)
    (root / "refs").mkdir()
    manifest = {
        "files": {
            "features.npz": {
                "de_wav16k": {"meaning": "de-speaker.flac loaded as upstream does"},
                "de_fbank": {"meaning": "fbank"},
            },
            "llm.npz": {"forced_tokens": {"meaning": "tokens"}},
            "flow.npz": {
                "Q_gen_tokens": {"meaning": "tokens"},
                "Q_prompt_mel": {"shape": [120, 80]},
            },
        },
        "tolerances": {"audio": 0.5, "chunk_bounds": "identical"},
        "llm_cases": {"instruct": {"text": "x"}},
        "flow_cases": {
            "Q": {
                "prompt_tokens": 60,
                "stream_full": {"flow_calls": [[24, False, False, 40], [100, True, False, 160]]},
            },
            "R": {"prompt_tokens": 61},
        },
        "seeds": {"request_seed_of_noise_buffers": 7},
        "dims": {"flow": {"euler_steps": 6, "cfg_rate": 0.5, "dit": {"static_chunk_size": 30}}},
    }
    (root / "refs" / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    np.savez(root / "refs" / "features.npz", de_wav16k=np.zeros(3), de_fbank=np.zeros(2))
    np.savez(root / "refs" / "llm.npz", forced_tokens=np.arange(2))
    np.savez(root / "refs" / "flow.npz", Q_gen_tokens=np.arange(4), Q_prompt_mel=np.zeros(1))
    return root


@pytest.fixture
def no_ci(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Neither ``CI`` nor ``COSYVOICE3_REQUIRE_PARITY`` nor an explicit set (as on a laptop)."""
    for name in ("CI", parity_support.REQUIRE_ENV, parity_support.PARITY_DIR_ENV):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_parity_support_reads_cases_and_tolerances_from_the_manifest(tmp_path: Path) -> None:
    root = _make_set(tmp_path / "shared" / "parity")
    parity = load_parity(root)
    assert parity_cases("flow", root) == ["Q", "R"]
    assert parity_cases("llm", root) == ["instruct"]
    assert parity_cases("features", root) == ["de"]
    assert parity.tolerance("audio") == 0.5
    assert parity.tolerance("chunk_bounds") == 0.0
    assert parity.request_seed == 7
    assert (parity.euler_steps, parity.cfg_rate) == (6, 0.5)
    assert parity.feature_clips == {"de": tmp_path / "shared" / "voices" / "de-speaker.flac"}
    np.testing.assert_array_equal(parity.array("flow.npz", "Q_gen_tokens"), np.arange(4))
    with pytest.raises(AssertionError, match="no tolerance"):
        parity.tolerance("mel")


def test_parity_support_derives_the_cache_geometry_from_the_manifest(tmp_path: Path) -> None:
    """Q: 120 prompt mel rows for 60 tokens (2 per token); a non-final call on 24 tokens gave
    40 frames, so 4 lookahead tokens; (60 - 4) x 2 = 112 usable frames -> 3 chunks of 30."""
    parity = load_parity(_make_set(tmp_path / "parity"))
    assert parity.token_mel_ratio("Q") == 2
    assert parity.lookahead_tokens("Q") == 4
    assert parity.cacheable_prompt_frames("Q") == 90


def test_parity_support_voices_are_the_sets_own_when_present(tmp_path: Path) -> None:
    parity = load_parity(_make_set(tmp_path / "a" / "parity"))
    assert parity.voices_dir == tmp_path / "a" / "voices"
    (parity.root / "voices").mkdir()
    assert parity.voices_dir == parity.root / "voices"
    assert parity.feature_clips["de"] == parity.root / "voices" / "de-speaker.flac"


def test_parity_support_chooses_override_then_shared_then_committed(
    tmp_path: Path, no_ci: pytest.MonkeyPatch
) -> None:
    shared, committed = tmp_path / "shared" / "parity", tmp_path / "repo" / "fixtures"
    no_ci.setattr(parity_support, "SHARED_PARITY_DIR", shared)
    no_ci.setattr(parity_support, "COMMITTED_PARITY_DIR", committed)
    assert parity_root() == committed
    _make_set(committed)
    assert parity_cases("flow") == ["Q", "R"]
    assert load_parity().root == committed.resolve()
    _make_set(shared)
    assert parity_root() == shared
    no_ci.setenv(parity_support.PARITY_DIR_ENV, str(tmp_path / "alt"))
    assert parity_root() == tmp_path / "alt"
    assert parity_cases("flow") == ["absent"]
    # an explicitly selected set that is not there fails, CI or not
    outcome, message = _outcome()
    assert outcome == "fail" and "COSYVOICE3_PARITY_DIR" in message


@pytest.mark.parametrize("missing", ["root", "manifest"])
def test_parity_support_skips_a_missing_set(
    tmp_path: Path, no_ci: pytest.MonkeyPatch, missing: str
) -> None:
    root = _make_set(tmp_path / "parity")
    if missing == "root":
        root = tmp_path / "elsewhere"
    else:
        (root / "refs" / "manifest.json").unlink()
    no_ci.setenv("CI", "false")
    outcome, message = _outcome(root)
    assert outcome == "skip" and "parity fixtures not available" in message
    assert parity_cases("flow", root) == ["absent"]


@pytest.mark.parametrize(("name", "value"), [("CI", "true"), ("CI", "1"),
                                             (parity_support.REQUIRE_ENV, "1")])
def test_parity_support_fails_a_missing_set_when_required(
    tmp_path: Path, no_ci: pytest.MonkeyPatch, name: str, value: str
) -> None:
    no_ci.setenv(name, value)
    outcome, message = _outcome(tmp_path / "elsewhere")
    assert outcome == "fail"
    assert re.search(r"not available: .*elsewhere.*required", message), message


@pytest.mark.parametrize("broken", ["model", "refs file", "array", "json"])
def test_parity_support_fails_a_partial_set_even_outside_ci(
    tmp_path: Path, no_ci: pytest.MonkeyPatch, broken: str
) -> None:
    root = _make_set(tmp_path / "parity")
    if broken == "model":
        (root / "model").rmdir()
        match = r"partial: .*model is missing"
    elif broken == "refs file":
        (root / "refs" / "llm.npz").unlink()
        match = r"partial: .*llm\.npz is missing"
    elif broken == "array":
        np.savez(root / "refs" / "flow.npz", Q_gen_tokens=np.arange(4))
        match = r"partial: .*flow\.npz lacks .*Q_prompt_mel"
    else:
        (root / "refs" / "manifest.json").write_text("{not json", encoding="utf-8")
        match = r"partial: .*manifest\.json cannot be read"
    outcome, message = _outcome(root)
    assert outcome == "fail" and re.search(match, message), (outcome, message)


def test_parity_support_one_derived_cache_per_set(tmp_path: Path) -> None:
    first = load_parity(_make_set(tmp_path / "one"))
    second = load_parity(_make_set(tmp_path / "two"))
    path = derived_cache_dir(first)
    assert path.is_dir() and derived_cache_dir(first) == path
    assert derived_cache_dir(second) != path
    assert not path.is_relative_to(first.root)


def test_parity_support_assertions_report_the_error() -> None:
    assert assert_close([1.0, 2.0], [1.0, 2.5], 0.5, "x") == 0.5
    with pytest.raises(AssertionError, match=r"max abs error 0\.5 exceeds .* 0\.1"):
        assert_close([1.0, 2.0], [1.0, 2.5], 0.1, "x")
    with pytest.raises(AssertionError, match="shape"):
        assert_close([1.0], [1.0, 2.0], 1.0, "x")
    assert_identical([3, 4], np.array([3, 4]), "ids")
    with pytest.raises(AssertionError, match="position 1"):
        assert_identical([3, 5, 6], [3, 4, 6], "ids")
    with pytest.raises(AssertionError, match="lengths 2 vs 3"):
        assert_identical([3, 4], [3, 4, 6], "ids")

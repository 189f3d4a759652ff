"""The parity fixture loader: skips without fixtures; cases and tolerances from the manifest."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from parity_support import assert_close, assert_identical, load_parity, parity_cases


def _make_set(root: Path) -> Path:
    """A minimal fixture set laid out as ``shared/parity`` (other cases, other numbers)."""
    (root / "model").mkdir(parents=True)
    (root / "refs").mkdir()
    manifest = {
        "files": {
            "features.npz": {
                "de_wav16k": {"meaning": "de-speaker.flac loaded as upstream does"},
                "de_fbank": {"meaning": "fbank"},
            },
            "flow.npz": {"Q_gen_tokens": {"meaning": "tokens"}},
        },
        "tolerances": {"audio": 0.5, "chunk_bounds": "identical"},
        "llm_cases": {"instruct": {"text": "x"}},
        "flow_cases": {"Q": {"prompt_tokens": 60}, "R": {"prompt_tokens": 61}},
        "seeds": {"request_seed_of_noise_buffers": 7},
    }
    (root / "refs" / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    np.savez(root / "refs" / "flow.npz", Q_gen_tokens=np.arange(4))
    return root


def test_parity_support_reads_cases_and_tolerances_from_the_manifest(tmp_path: Path) -> None:
    root = _make_set(tmp_path / "shared" / "parity")
    parity = load_parity(root)
    assert parity_cases("flow", root) == ["Q", "R"]
    assert parity_cases("llm", root) == ["instruct"]
    assert parity_cases("features", root) == ["de"]
    assert parity.tolerance("audio") == 0.5
    assert parity.tolerance("chunk_bounds") == 0.0
    assert parity.request_seed == 7
    assert parity.feature_clips == {"de": tmp_path / "shared" / "voices" / "de-speaker.flac"}
    np.testing.assert_array_equal(parity.array("flow.npz", "Q_gen_tokens"), np.arange(4))
    with pytest.raises(AssertionError, match="no tolerance"):
        parity.tolerance("mel")


@pytest.mark.parametrize("missing", ["root", "manifest", "model"])
def test_parity_support_skips_without_fixtures(tmp_path: Path, missing: str) -> None:
    root = _make_set(tmp_path / "parity")
    if missing == "root":
        root = tmp_path / "elsewhere"
    elif missing == "manifest":
        (root / "refs" / "manifest.json").unlink()
    else:
        (root / "model").rmdir()
    with pytest.raises(pytest.skip.Exception, match="parity fixtures not available"):
        load_parity(root)
    if missing != "model":
        assert parity_cases("flow", root) == ["absent"]


def test_parity_support_skips_when_a_reference_file_is_missing(tmp_path: Path) -> None:
    parity = load_parity(_make_set(tmp_path / "parity"))
    with pytest.raises(pytest.skip.Exception, match=r"llm\.npz is missing"):
        parity.array("llm.npz", "forced_tokens")


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

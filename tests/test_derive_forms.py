"""The derive-or-fall-back helper (engine/derive/common/forms.py) on a stand-in derivation:
files on disk through the real derive-once sequence, no ONNX. A form that cannot be derived
falls back to the next with exactly one warning; a cached form is reused without deriving; a
result that fails validation is not stored, and the failure is not retried."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from wyoming_cosyvoice3.engine.derive.common.files import derive_once
from wyoming_cosyvoice3.engine.derive.common.forms import Form, load_first
from wyoming_cosyvoice3.engine.errors import ModelLoadError

TAG = "double1"


class Doubling:
    """A derivation that writes the source's bytes twice (its "graph"), with a validation
    that compares the written file against the source, as the real ones do before storing."""

    def __init__(self, source: Path, corrupt: bool = False, structure: bool = True) -> None:
        self.source = source
        self.corrupt = corrupt
        self.structure = structure
        self.calls = 0

    def open(self, cache: Path | None) -> bytes:
        assert cache is not None

        def make(tmps: list[Path]) -> None:
            self.calls += 1
            if not self.structure:
                raise ModelLoadError("no doubling structure in the source")
            data = self.source.read_bytes()
            written = data * 2 + (b"!" if self.corrupt else b"")
            tmps[0].write_bytes(written)
            if written != data + data:  # validation against the source
                raise ModelLoadError("the doubled file differs from the source twice")

        (path,) = derive_once(self.source, cache, [(TAG, ".bin")], make, name="doubled file")
        return path.read_bytes()


def _forms(derivation: Doubling) -> list[Form[bytes]]:
    return [
        Form("doubled file", open=derivation.open,
             warning="doubled file not used (%s); using the source"),
        Form("source", open=lambda _cache: derivation.source.read_bytes(), derived=False),
    ]


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "model" / "graph.onnx"
    path.parent.mkdir()
    path.write_bytes(b"abc")
    return path


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_form_that_cannot_be_derived_falls_back_with_one_warning(
    source: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    derivation = Doubling(source, structure=False)
    with caplog.at_level(logging.WARNING):
        assert load_first(_forms(derivation), source.parent, tmp_path / "cache") == b"abc"
    assert _warnings(caplog) == [
        "doubled file not used (no doubling structure in the source); using the source"
    ]
    assert derivation.calls == 1


def test_a_cached_form_is_reused_without_deriving(
    source: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    first = Doubling(source)
    assert load_first(_forms(first), source.parent, cache) == b"abcabc"
    assert first.calls == 1
    stat = source.stat()
    assert (cache / f"graph.{TAG}-{stat.st_size}-{stat.st_mtime_ns}.bin").is_file()
    again = Doubling(source)
    with caplog.at_level(logging.WARNING):
        assert load_first(_forms(again), source.parent, cache) == b"abcabc"
    assert again.calls == 0 and _warnings(caplog) == []


def test_a_result_failing_validation_is_not_cached(
    source: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    derivation = Doubling(source, corrupt=True)
    for attempt in range(2):  # the second start reads the failure marker: no new attempt
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert load_first(_forms(derivation), source.parent, cache) == b"abc"
        warnings = _warnings(caplog)
        assert len(warnings) == 1 and warnings[0].startswith("doubled file not used (")
        reason = "differs from the source twice" if attempt == 0 else "an earlier attempt"
        assert reason in warnings[0]
        assert derivation.calls == 1
        assert not list(cache.glob("*.bin")) and not list(cache.glob(".*tmp*"))
        assert len(list(cache.glob("*.bin.failed"))) == 1


def test_forms_not_wanted_are_not_tried_and_the_published_errors_are_raised(
    source: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    derivation = Doubling(source)
    unwanted = Form("doubled file", open=derivation.open, wanted=False)
    with caplog.at_level(logging.WARNING):
        assert load_first([unwanted], source.parent, tmp_path / "cache") is None
    assert derivation.calls == 0 and _warnings(caplog) == []
    assert not (tmp_path / "cache").exists()

    def broken(_cache: Path | None) -> bytes:
        raise ModelLoadError("the published file is truncated")

    with pytest.raises(ModelLoadError, match="truncated"):
        load_first([unwanted, Form("source", open=broken, derived=False)], source.parent, None)

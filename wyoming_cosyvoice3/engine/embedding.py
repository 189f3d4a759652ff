"""The LLM's text embedding served from a table instead of its graph.

``text_embedding_fp16.onnx`` is a plain ``Gather`` (+ ``Cast``): the table the derivation
extracts once (:mod:`.derive.llm.embedding_table`) answers the same lookups without a session.
The loader and the derivation both build it, and stages never import each other, so it lives
outside both.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import numpy.typing as npt

from .errors import SynthesisFailed
from .sessions import GraphSpec, run_observer


class TableEmbedding:
    """Embedding lookup with the :class:`~.sessions.Graph` ``run`` interface: the text
    embedding served from the table that ``derive/llm/embedding_table.py`` extracts once from
    ``text_embedding_fp16.onnx`` (a plain ``Gather`` [+ ``Cast``]), typically memory-mapped.

    Args:
        path: the source graph file (for messages).
        spec: the graph's spec (input ``input_ids``, output ``inputs_embeds``).
        table: [rows, hidden] table (fp16 or fp32, typically a read-only memory map).
        out_dtype: dtype of the output (the graph's Cast target; float32).
    """

    def __init__(self, path: Path, spec: GraphSpec, table: np.ndarray, out_dtype: str) -> None:
        self.path = Path(path)
        self.spec = spec
        self.table = table
        self.out_dtype = np.dtype(out_dtype)

    @property
    def rows(self) -> int:
        return int(self.table.shape[0])

    def input_shape(self, name: str) -> list[int | str | None]:
        """Declared shape of ``input_ids``: [1, "sequence_length"]."""
        return [1, "sequence_length"]

    def output_shape(self, name: str) -> list[int | str | None]:
        """Declared shape of ``inputs_embeds``: [1, "sequence_length", hidden]."""
        return [1, "sequence_length", int(self.table.shape[1])]

    def lookup(self, ids: npt.ArrayLike) -> np.ndarray:
        """Rows of ``ids`` (int64, any shape; negative ids count from the end like ONNX
        Gather) as ``out_dtype`` [*ids.shape, hidden].

        Raises:
            SynthesisFailed: an id is outside ``[-rows, rows)`` (the graph fails the same way).
        """
        index = np.asarray(ids, dtype=np.int64)
        if index.size and (index.min() < -self.rows or index.max() >= self.rows):
            raise SynthesisFailed(
                f"{self.spec.file}: token id out of range [-{self.rows}, {self.rows}) in "
                f"input_ids {tuple(index.shape)}"
            )
        return np.asarray(self.table[index], dtype=self.out_dtype)

    def run(
        self, feeds: Mapping[str, np.ndarray], output_names: list[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Like :meth:`.sessions.Graph.run`: ``{"inputs_embeds": lookup(feeds["input_ids"])}``."""
        observer = run_observer()
        started = time.time() if observer is not None else 0.0
        out = {"inputs_embeds": self.lookup(feeds["input_ids"])}
        if observer is not None:
            observer(str(self.path), feeds, started, time.time())
        return out

    def __repr__(self) -> str:
        return f"TableEmbedding({self.spec.file!r}, rows={self.rows})"

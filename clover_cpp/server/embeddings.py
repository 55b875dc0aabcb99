"""``clover serve``: ``POST /v1/embeddings`` (OpenAI's shape), served with ``--embeddings`` as
llama-server serves it; without the flag, llama-server's 501.

The vectors are :meth:`Clover.create_embedding`'s (llama.cpp's pooling over the causal pass, on
an embedding context of its own): one request at a time on it, on a worker thread. That
context reads texts: token-id inputs are embedded as the text they spell when it tokenizes
back to the same ids, else refused.
"""

from __future__ import annotations

import asyncio
import base64
import threading
from typing import Any, Literal, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from .. import Clover, CloverError
from .types import APIError, unsupported

#: OpenAI's limit on the inputs of one request
MAX_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    input: Union[str, list[str], list[int], list[list[int]]]
    model: str | None = None  # (one model is served: any name is it)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    def inputs(self) -> list[Union[str, list[int]]]:
        items = [self.input] if isinstance(self.input, str) or (
            self.input and isinstance(self.input[0], int)) else self.input
        if not items:
            raise APIError(400, "input: at least one text", param="input")
        if len(items) > MAX_INPUTS:
            raise APIError(400, f"input: at most {MAX_INPUTS} inputs per request, got {len(items)}", param="input")
        return items  # type: ignore[return-value]


def not_enabled() -> APIError:
    """llama-server's answer without --embeddings (server-context.cpp: ERROR_TYPE_NOT_SUPPORTED)."""
    return APIError(501, "This server does not support embeddings. Start it with `--embeddings`",
                    kind="not_supported_error")


class Embedder:
    """The model's embedding calls, one at a time (its embedding context is not thread-safe)."""

    def __init__(self, model: Clover, name: str) -> None:
        self.model, self.name, self.lock = model, name, threading.Lock()

    def _create(self, texts: list[str]) -> dict[str, Any]:
        with self.lock:
            return self.model.create_embedding(texts, model=self.name)

    def text_of(self, ids: list[int]) -> str:
        """The text token ids spell, where it tokenizes back to them as the embedding context
        tokenizes a text (BOS as the model adds it, special-token text not parsed): that
        context reads texts, so other ids are refused rather than embedded as something else."""
        n = self.model.n_vocab()
        bad = next((t for t in ids if not 0 <= t < n), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {n})", param="input")
        text = self.model.detokenize_text(ids)
        if self.model.tokenize(text, True, False) != ids:
            raise APIError(400, "input: these token ids are not the tokens of their text as the model tokenizes it "
                                "(BOS included where the model adds one); send the text", param="input")
        return text

    def _texts(self, req: EmbeddingRequest) -> list[str]:
        return [x if isinstance(x, str) else self.text_of(x) for x in req.inputs()]

    async def reply(self, req: EmbeddingRequest) -> dict[str, Any]:
        texts = await asyncio.to_thread(self._texts, req)
        n_embd = self.model.n_embd()
        if req.dimensions is not None and req.dimensions != n_embd:
            raise unsupported("dimensions", f"the model's embeddings have {n_embd} dimensions (send that or leave "
                                            "it out)")
        try:
            r = await asyncio.to_thread(self._create, texts)
        except (CloverError, ValueError) as e:  # (llama-cpp-python's: a text longer than the batch)
            raise APIError(400, str(e).splitlines()[0] if str(e) else type(e).__name__, param="input") from None
        if req.encoding_format == "base64":  # OpenAI's: the float32 vector's bytes, little-endian
            for d in r["data"]:
                d["embedding"] = base64.b64encode(np.asarray(d["embedding"], dtype="<f4").tobytes()).decode()
        return r

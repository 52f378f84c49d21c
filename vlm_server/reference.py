"""Reference generation: one request at a time, plain and obviously right.

This is the correctness oracle. It follows the decode protocols of the model specification
step by step (prefill of BOS + image, prompt, then one position per token or region value) on
a contiguous KV cache; the batched engine must reproduce its greedy output token for token.
Sampling and region decoding use the same functions as the engine (`decoding`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from tokenizers import Tokenizer

from decoding.region_values import coord_from_logits, size_from_logits
from decoding.sampling import sample
from image_pipeline import PreparedImage
from vlm_server import prompts
from vlm_server.config import ModelConfig
from vlm_server.model import MoondreamModel
from vlm_server.model.text import DenseKVCache

FinishReason = Literal["eos", "length", "max_objects", "cancelled"]


@dataclass(frozen=True)
class SamplingSettings:
    """Per-request decode settings (defaults follow the reference implementation)."""

    temperature: float = 0.5
    top_p: float = 0.3
    max_tokens: int = 768
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")


@dataclass
class TextResult:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int


@dataclass
class Point:
    x: float
    y: float


@dataclass
class Box:
    x_min: float
    y_min: float
    x_max: float
    y_max: float


@dataclass
class RegionResult:
    """Points (point task) or boxes (detect task), normalized to [0, 1], origin top-left."""

    points: list[Point] = field(default_factory=list)
    boxes: list[Box] = field(default_factory=list)
    finish_reason: FinishReason = "eos"
    prompt_tokens: int = 0


class ContextOverflow(ValueError):
    """The prompt plus the requested output does not fit the model's context."""


class ReferenceGenerator:
    """Runs one request at a time on a loaded model."""

    def __init__(self, model: MoondreamModel, tokenizer: Tokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config: ModelConfig = model.config
        self.contract = model.config.tokens
        assert self.contract is not None

    # ---- building blocks ------------------------------------------------------------

    @torch.inference_mode()
    def _start(self, image: PreparedImage | None, prompt: list[int], budget: int
               ) -> tuple[DenseKVCache, torch.Tensor, int]:
        """Prefill (image prefix, then prompt); return cache, last hidden [1, D], next pos."""
        m, dev = self.model, self.model.device
        if image is not None:
            prefix_len = self.config.image_prefix_len
        else:
            prefix_len = 0
            prompt = [self.contract.bos_id, *prompt]
        end = prefix_len + len(prompt) + budget
        if end > self.config.text.max_context:
            raise ContextOverflow(
                f"prompt ({prefix_len + len(prompt)} positions) plus output ({budget}) exceeds "
                f"the context of {self.config.text.max_context}")
        cache = DenseKVCache(self.config.text, 1, m.dtype, dev, prefix_len)
        if image is not None:
            crops = image.normalized(m.dtype, dev)
            emb = m.prefix_embeddings(m.image_embeddings(crops, image.tiling))
            m.text(emb, torch.arange(prefix_len, device=dev)[None], cache)
        ids = torch.tensor(prompt, device=dev)[None]
        pos = torch.arange(prefix_len, prefix_len + len(prompt), device=dev)[None]
        hidden = m.text(m.text.embed(ids), pos, cache)
        return cache, hidden[:, -1], prefix_len + len(prompt)

    def _step(self, cache: DenseKVCache, emb: torch.Tensor, pos: int) -> torch.Tensor:
        """Feed one input embedding [1, D] at ``pos``; return the hidden state [1, D]."""
        p = torch.tensor([[pos]], device=emb.device)
        return self.model.text(emb[:, None], p, cache)[:, -1]

    # ---- tasks ------------------------------------------------------------------------

    @torch.inference_mode()
    def generate_text(self, image: PreparedImage | None, prompt: list[int],
                      settings: SamplingSettings,
                      on_token: Callable[[int], bool | None] | None = None) -> TextResult:
        """Sample up to ``max_tokens`` tokens after the prompt; eos is not part of the output.

        ``on_token`` sees each output token as it is sampled; returning True stops generation
        (finish reason "cancelled").
        """
        m, eos = self.model, self.contract.eos_id
        cache, hidden, pos = self._start(image, prompt, settings.max_tokens)
        dev = m.device
        temp = torch.tensor([settings.temperature], device=dev)
        top_p = torch.tensor([settings.top_p], device=dev)
        seed = torch.tensor([settings.seed], device=dev, dtype=torch.int64)
        suppressed = list(self.contract.decode_suppressed_ids)
        out: list[int] = []
        while True:
            logits = m.text.logits(hidden)
            if out and suppressed:  # suppression applies from the second token on
                logits[:, suppressed] = float("-inf")
            step = torch.tensor([len(out)], device=dev, dtype=torch.int64)
            token = int(sample(logits, temp, top_p, seed, step)[0])
            if token == eos:
                reason: FinishReason = "eos"
                break
            out.append(token)
            if on_token is not None and on_token(token):
                reason = "cancelled"
                break
            if len(out) >= settings.max_tokens:
                reason = "length"
                break
            hidden = self._step(cache, m.text.embed(torch.tensor([token], device=dev)), pos)
            pos += 1
        text = self.tokenizer.decode(out)
        return TextResult(text=text, token_ids=out, finish_reason=reason,
                          prompt_tokens=len(prompt))

    def caption(self, image: PreparedImage, length: str = "normal",
                settings: SamplingSettings | None = None,
                on_token: Callable[[int], bool | None] | None = None) -> TextResult:
        prompt = prompts.caption_prompt(self.contract, length)
        return self.generate_text(image, prompt, settings or SamplingSettings(), on_token)

    def query(self, image: PreparedImage | None, question: str,
              settings: SamplingSettings | None = None,
              on_token: Callable[[int], bool | None] | None = None) -> TextResult:
        prompt = prompts.query_prompt(self.contract, self.tokenizer, question)
        return self.generate_text(image, prompt, settings or SamplingSettings(), on_token)

    def boundary_token(self, logits: torch.Tensor) -> int:
        """The greedy decision at an object boundary (the token itself is never fed back)."""
        if self.contract.boundary_rule == "coord_or_eos":
            allowed = torch.full_like(logits, float("-inf"))
            keep = [self.contract.eos_id, self.contract.coord_id]
            allowed[:, keep] = logits[:, keep]
            logits = allowed
        return int(logits.argmax(dim=-1)[0])

    @torch.inference_mode()
    def generate_regions(self, image: PreparedImage, prompt: list[int], with_size: bool,
                         max_objects: int) -> RegionResult:
        """The point/detect loop: x, y (and size) per object, greedy, until eos or the cap.

        Once ``max_objects`` objects exist the answer ends ("max_objects") without a further
        boundary step, since the grammar would allow nothing but eos there.
        """
        if max_objects < 1:
            raise ValueError("max_objects must be >= 1")
        m, eos = self.model, self.contract.eos_id
        per_object = 3 if with_size else 2
        cache, hidden, pos = self._start(image, prompt, per_object * max_objects)
        result = RegionResult(prompt_tokens=len(prompt))
        token = self.boundary_token(m.text.logits(hidden))
        while token != eos:
            x = coord_from_logits(m.region.decode_coord(hidden))
            hidden = self._step(cache, m.region.encode_coord(x), pos)
            y = coord_from_logits(m.region.decode_coord(hidden))
            emb = m.region.encode_coord(y)
            pos += 1
            if with_size:
                hidden = self._step(cache, emb, pos)
                pos += 1
                wh = size_from_logits(m.region.decode_size(hidden), self.contract.size_scale)
                emb = m.region.encode_size(wh)
                cx, cy, w, h = float(x), float(y), float(wh[0, 0]), float(wh[0, 1])
                result.boxes.append(Box(cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2))
            else:
                result.points.append(Point(float(x), float(y)))
            if len(result.points) + len(result.boxes) >= max_objects:
                # Only eos could follow: stop without spending a step on it.
                result.finish_reason = "max_objects"
                break
            hidden = self._step(cache, emb, pos)
            pos += 1
            token = self.boundary_token(m.text.logits(hidden))
        return result

    def point(self, image: PreparedImage, obj: str, max_objects: int = 50) -> RegionResult:
        prompt = prompts.point_prompt(self.contract, self.tokenizer, obj)
        return self.generate_regions(image, prompt, with_size=False, max_objects=max_objects)

    def detect(self, image: PreparedImage, obj: str, max_objects: int = 50) -> RegionResult:
        prompt = prompts.detect_prompt(self.contract, self.tokenizer, obj)
        return self.generate_regions(image, prompt, with_size=True, max_objects=max_objects)

"""Reference generation: one request at a time, plain and obviously right.

This is the correctness oracle. It walks a request's grammar (shared with the engine through
`vlm_server.engine.requests.tasks`) one position at a time on a contiguous KV cache, following
the model specification's protocols: prefill of BOS + image, the prompt, then per step either a
sampled token (masked by the grammar's row when constrained) or a region value decoded from the
hidden state and fed back through its encoder. The batched engine must reproduce its greedy
output token for token. Sampling and region decoding are the engine's own functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tokenizers import Tokenizer

from decoding.grammar_base import GrammarEnd
from decoding.grammars import (
    ObjectGrammar,
    SegmentGrammar,
    StepKind,
    SvgTokenSegmentGrammar,
    TextGrammar,
)
from decoding.mask_table import NO_MASK
from decoding.region_values import coord_from_logits, size_from_logits
from decoding.sampling import sample
from decoding.segment_output import SegmentResult
from decoding.svg_geometry import build_box_segment
from decoding.svg_tokens import decode_items, parse_items
from image_pipeline import PreparedImage
from vlm_server.engine.api import (
    Box,
    EngineError,
    ErrorCode,
    FinishReason,
    GenerationRequest,
    Point,
    Task,
)
from vlm_server.engine.requests.spatial import placeholders
from vlm_server.engine.requests.tasks import BuiltRequest, TaskCompiler
from vlm_server.models import capabilities
from vlm_server.models.interface import AdapterDecoder, DeviceModel, FamilyConfig
from vlm_server.models.kv import DenseKVCache, kv_storage_dtype
from vlm_server.models.lora.spec import AdapterWeights, SingleLora
from vlm_server.models.prompts import query_prompt


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
class RegionResult:
    """Points (point task) or boxes (detect task), normalized to [0, 1], origin top-left."""

    points: list[Point] = field(default_factory=list)
    boxes: list[Box] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.EOS
    prompt_tokens: int = 0


@dataclass
class ReasoningResult:
    """A query with grounded reasoning: the reasoning text, its grounded spans
    ((start_idx, end_idx, points)), and the answer."""

    reasoning: str
    grounding: list[tuple[int, int, list[tuple[float, float]]]]
    reasoning_ids: list[int]
    answer: str
    answer_ids: list[int]
    finish_reason: FinishReason


class ContextOverflow(ValueError):
    """The prompt plus the requested output does not fit the model's context."""


OnToken = Callable[[int], bool | None]


class ReferenceGenerator:
    """Runs one request at a time on a loaded model."""

    def __init__(
        self,
        model: DeviceModel,
        tokenizer: Tokenizer,
        adapter: AdapterWeights | None = None,
        kv_dtype: str = "auto",
    ) -> None:
        """``adapter``: a finetune adapter every request answers with (the reference's
        arithmetic, models/lora/spec.py `SingleLora`; an expert layer's deltas row by row,
        each (token, expert) pair on its own), in the image prefix too. ``kv_dtype``: the KV
        format (`EngineConfig.kv_dtype`), stored and read back as the engine does."""
        self.model = model
        self.kv_storage = kv_storage_dtype(kv_dtype, model.dtype)
        self.lora = None if adapter is None else SingleLora(adapter.to(model.dtype, model.device))
        # The decoder that takes the adapter (None: no adapter asked for).
        self._adapted: AdapterDecoder | None = None
        if adapter is not None:
            self._adapted = capabilities.need(model.capabilities.adapters, "adapter", model)
        self.tokenizer = tokenizer
        self.config: FamilyConfig = model.config
        self.contract = model.config.tokens
        self.tasks = TaskCompiler(model.config, tokenizer)

    # ---- building blocks ------------------------------------------------------------

    def _build(self, req: GenerationRequest) -> BuiltRequest:
        try:
            return self.tasks.build(req)
        except EngineError as err:
            if err.code is ErrorCode.OUT_OF_RANGE:
                raise ContextOverflow(err.message) from err
            raise ValueError(err.message) from err

    @torch.inference_mode()
    def _start(
        self, image: PreparedImage | None, prompt: list[int], budget: int
    ) -> tuple[DenseKVCache, torch.Tensor, int]:
        """Prefill (image prefix, then prompt; BOS is added when there is no image); return
        the cache, the last hidden state [1, D] and the next position."""
        if image is None:
            prompt = [self.contract.bos_id, *prompt]
        return self._prefill(image, prompt, budget)

    @torch.inference_mode()
    def next_logits(self, image: PreparedImage | None, prompt: list[int]) -> torch.Tensor:
        """The logits [1, V] of the token after ``image``'s prefix and ``prompt`` (token ids),
        nothing masked: what numerics checks compare between two models."""
        _, hidden, _ = self._start(image, prompt, 1)
        return self.model.text.logits(hidden)

    def _prefill(
        self,
        image: PreparedImage | None,
        prompt: list[int],
        budget: int,
        refs: tuple[tuple[float, ...], ...] = (),
    ) -> tuple[DenseKVCache, torch.Tensor, int]:
        m, dev = self.model, self.model.device
        prefix_len = self.config.image_prefix_len if image is not None else 0
        if prefix_len + len(prompt) + budget > self.config.text.max_context:
            raise ContextOverflow(
                f"prompt ({prefix_len + len(prompt)} positions) plus output ({budget}) "
                f"exceeds the context of {self.config.text.max_context}"
            )
        cache = DenseKVCache(
            m.kv_shape, self.config.text.max_context, 1, m.dtype, dev, prefix_len, self.kv_storage
        )
        if image is not None:
            crops = image.normalized(m.dtype, dev)
            emb = m.prefix_embeddings(m.image_embeddings(crops, image.tiling))
            self._decoder(emb, torch.arange(prefix_len, device=dev)[None], cache)
        ids = torch.tensor(prompt, device=dev)[None]
        pos = torch.arange(prefix_len, prefix_len + len(prompt), device=dev)[None]
        hidden = self._decoder(self._prompt_embeddings(ids, refs), pos, cache)
        return cache, hidden[:, -1], prefix_len + len(prompt)

    def _prompt_embeddings(
        self, ids: torch.Tensor, refs: tuple[tuple[float, ...], ...]
    ) -> torch.Tensor:
        """Token embeddings [1, T, D]; the spatial references' positions (ids past the
        vocabulary) take their encodings as the reference computes them: every coordinate
        (a box's centre) through the coordinate encoder, every box's (width, height) through
        the size encoder, in the model's dtype, written over the positions in order."""
        m, vocab = self.model, self.config.text.vocab_size
        is_ref = ids >= vocab
        emb = m.text.embed(ids.clamp(max=vocab - 1))
        if not refs:
            return emb
        coords: list[float] = []
        sizes: list[list[float]] = []
        kinds: list[int] = []
        for ref in refs:
            if len(ref) == 2:
                coords += [ref[0], ref[1]]
                kinds += [0, 0]
            else:
                x0, y0, x1, y1 = ref
                coords += [(x0 + x1) / 2, (y0 + y1) / 2]
                sizes.append([x1 - x0, y1 - y0])
                kinds += [0, 0, 1]
        dev, dtype = emb.device, m.dtype
        kind = torch.tensor(kinds, device=dev)
        slots = torch.nonzero(is_ref[0]).flatten()
        assert len(slots) == len(kinds), "placeholders and references disagree"
        emb = emb.clone()
        coord_emb = m.region.encode_coord(torch.tensor(coords, dtype=dtype, device=dev)[:, None])
        emb[0, slots[kind == 0]] = coord_emb.to(emb.dtype)
        if sizes:
            size_emb = m.region.encode_size(torch.tensor(sizes, dtype=dtype, device=dev))
            emb[0, slots[kind == 1]] = size_emb.to(emb.dtype)
        return emb

    def _step(self, cache: DenseKVCache, emb: torch.Tensor, pos: int) -> torch.Tensor:
        """Feed one input embedding [1, D] at ``pos``; return the hidden state [1, D]."""
        p = torch.tensor([[pos]], device=emb.device)
        return self._decoder(emb[:, None], p, cache)[:, -1]

    def _decoder(self, x: torch.Tensor, pos: torch.Tensor, cache: DenseKVCache) -> torch.Tensor:
        if self._adapted is None:
            return self.model.text(x, pos, cache)
        return self._adapted(x, pos, cache, self.lora)

    def _masked(self, logits: torch.Tensor, row: int) -> torch.Tensor:
        if row == NO_MASK:
            return logits
        allowed = torch.from_numpy(self.tasks.table.allowed(row)).to(logits.device)
        return logits.masked_fill(~allowed, float("-inf"))

    def boundary_token(self, logits: torch.Tensor) -> int:
        """The greedy decision at an unmasked object boundary (the first one; every one under
        Moondream 2's rule): the argmax over the whole vocabulary; eos ends the answer, any
        other token means "next object" (it is never fed back). Later boundaries under
        Moondream 3's rule are masked by the grammar's row in `run`."""
        return int(logits.argmax(dim=-1)[0])

    # ---- the generic loop ----------------------------------------------------------------

    @torch.inference_mode()
    def run(
        self, req: GenerationRequest, on_token: OnToken | None = None
    ) -> tuple[BuiltRequest, FinishReason, list[int]]:
        """Walk the request's grammar to the end. Returns the built request (whose grammar
        holds the answer), the finish reason and the output token ids (text tasks).

        Text tasks sample with the request's temperature / top_p / seed; region answers and
        segment paths decode greedily, as the model's protocols do. ``on_token`` sees each text
        token; returning True stops the request ("cancelled").
        """
        built = self._build(req)
        try:
            reason, out = self._walk(req, built, on_token)
        finally:
            built.release()  # one request at a time: nothing else reads its mask rows
        return built, reason, out

    def _walk(
        self, req: GenerationRequest, built: BuiltRequest, on_token: OnToken | None
    ) -> tuple[FinishReason, list[int]]:
        g = built.grammar
        m, dev = self.model, self.model.device
        cache, hidden, pos = self._prefill(
            req.image, built.prompt, g.max_positions, req.spatial_refs
        )
        text = isinstance(g, TextGrammar)
        temp = torch.tensor([req.temperature if text else 0.0], device=dev)
        top_p = torch.tensor([req.top_p if text else 1.0], device=dev)
        seed = torch.tensor([req.seed], device=dev, dtype=torch.int64)
        div = self.contract.coord_divisor
        out: list[int] = []
        while not g.finished:
            kind = g.next_kind
            if kind is StepKind.TOKEN:
                logits = self._masked(m.text.logits(hidden), g.mask_row)
                step = torch.tensor([len(out)], device=dev, dtype=torch.int64)
                token = int(sample(logits, temp, top_p, seed, step)[0])
                feeds = g.feeds_token
                before = len(g.token_ids) if text else 0
                g.advance_token(token)
                if text and len(g.token_ids) > before:
                    out.append(token)
                    if on_token is not None and on_token(token):
                        return "cancelled", out
                if g.finished:
                    break
                if feeds:
                    emb = m.text.embed(torch.tensor([token], device=dev))
                else:  # object boundary: x comes from the same hidden state
                    x = coord_from_logits(m.region.decode_coord(hidden), div)
                    g.advance_value(float(x))
                    emb = m.region.encode_coord(x)
            elif kind is StepKind.COORD_Y:
                y = coord_from_logits(m.region.decode_coord(hidden), div)
                g.advance_value(float(y))
                emb = m.region.encode_coord(y)
            elif kind is StepKind.SIZE:
                wh = size_from_logits(m.region.decode_size(hidden), self.contract.size_scale)
                g.advance_value((float(wh[0, 0]), float(wh[0, 1])))
                emb = m.region.encode_size(wh)
            else:
                raise AssertionError(f"unexpected step kind {kind}")
            if g.finished:
                break
            hidden = self._step(cache, emb, pos)
            pos += 1
        stop = g.finish_reason is GrammarEnd.STOP
        if isinstance(g, ObjectGrammar):
            return FinishReason.EOS if stop else FinishReason.MAX_OBJECTS, out
        return FinishReason.EOS if stop else FinishReason.LENGTH, out

    # ---- tasks ------------------------------------------------------------------------

    def _text(self, req: GenerationRequest, on_token: OnToken | None) -> TextResult:
        built, reason, out = self.run(req, on_token)
        # The task's own prompt tokens: without the BOS a text-only query starts with.
        prompt_tokens = len(built.prompt) - (1 if built.prefix_len == 0 else 0)
        return TextResult(
            text=self.tokenizer.decode(out),
            token_ids=out,
            finish_reason=reason,
            prompt_tokens=prompt_tokens,
        )

    def caption(
        self,
        image: PreparedImage,
        length: str = "normal",
        settings: SamplingSettings | None = None,
        on_token: OnToken | None = None,
    ) -> TextResult:
        s = settings or SamplingSettings()
        return self._text(
            GenerationRequest(
                Task.CAPTION,
                image,
                caption_length=length,
                temperature=s.temperature,
                top_p=s.top_p,
                max_tokens=s.max_tokens,
                seed=s.seed,
            ),
            on_token,
        )

    def query(
        self,
        image: PreparedImage | None,
        question: str,
        settings: SamplingSettings | None = None,
        on_token: OnToken | None = None,
        choices: tuple[str, ...] = (),
        regex: str | None = None,
        history: tuple[tuple[str, str], ...] = (),
    ) -> TextResult:
        s = settings or SamplingSettings()
        return self._text(
            GenerationRequest(
                Task.QUERY,
                image,
                question=question,
                history=history,
                temperature=s.temperature,
                top_p=s.top_p,
                max_tokens=s.max_tokens,
                seed=s.seed,
                choices=choices,
                regex=regex,
            ),
            on_token,
        )

    @torch.inference_mode()
    def reasoning_query(
        self,
        image: PreparedImage | None,
        question: str,
        settings: SamplingSettings | None = None,
        spatial_refs: tuple[tuple[float, ...], ...] = (),
    ) -> ReasoningResult:
        """A query with ``reasoning=True``, by the reference's loop (not the engine's
        grammar): reasoning until the answer marker, the contract's suppressed ids (Moondream
        2: eos and the size token) masked after the first token, the coordinate token grounded
        by the x decoded from the hidden state that chose it; the marker fed, then the
        answer. ``max_tokens`` bounds the reasoning and again the answer, as the reference
        bounds each; a reasoning that spends its budget is followed by the marker and its
        answer. Where the context ends first, the reasoning yields in time for one answer
        token and the answer ends at the context (the engine's rule)."""
        s = settings or SamplingSettings()
        c, m = self.contract, self.model
        assert c.answer_id is not None and c.coord_id is not None and c.size_id is not None
        grounds = (c.start_ground_points_id, c.end_ground_id)
        refs = placeholders(spatial_refs, self.config.text.vocab_size)
        prompt = query_prompt(c, lambda t: self.tokenizer.encode(t).ids, question, refs, True)
        if image is None:
            prompt = [c.bos_id, *prompt]
        used = len(prompt) + (self.config.image_prefix_len if image is not None else 0)
        room = min(2 * s.max_tokens + 1, self.config.text.max_context - used)
        limit = min(s.max_tokens, room - 2)  # the context keeps the marker and one token
        cache, hidden, pos = self._prefill(image, prompt, max(room, s.max_tokens + 1), spatial_refs)
        dev = m.device
        temp = torch.tensor([s.temperature], device=dev)
        top_p = torch.tensor([s.top_p], device=dev)
        seed = torch.tensor([s.seed], device=dev, dtype=torch.int64)

        def pick(logits: torch.Tensor, step: int) -> int:
            at = torch.tensor([step], device=dev, dtype=torch.int64)
            return int(sample(logits, temp, top_p, seed, at)[0])

        chunks: list[list[int]] = [[]]
        coords: list[list[float]] = [[]]
        token, generated = pick(m.text.logits(hidden), 0), 0
        while token != c.answer_id and generated < limit:
            if token in grounds:
                chunks.append([])
                coords.append([])
            chunks[-1].append(token)
            if token == c.coord_id:
                x = coord_from_logits(m.region.decode_coord(hidden), c.coord_divisor)
                coords[-1].append(float(x))
                emb = m.region.encode_coord(x)
            else:
                emb = m.text.embed(torch.tensor([token], device=dev))
            hidden = self._step(cache, emb, pos)
            pos += 1
            logits = m.text.logits(hidden)
            logits[:, list(c.reasoning_suppressed)] = float("-inf")
            generated += 1
            token = pick(logits, generated)
        texts = [self.tokenizer.decode(chunk) for chunk in chunks]
        grounding, start = [], 0
        for text, xs in zip(texts, coords, strict=True):
            if len(xs) > 1:
                points = [(xs[i], xs[i + 1]) for i in range(0, len(xs) - 1, 2)]
                grounding.append((start, start + len(text), points))
            start += len(text)
        reasoning_ids = [t for chunk in chunks for t in chunk]
        answer: list[int] = []
        reason = FinishReason.LENGTH
        # The marker, sampled or (the budget spent) put in its place, is fed; then the answer.
        emb = m.text.embed(torch.tensor([c.answer_id], device=dev))
        hidden = self._step(cache, emb, pos)
        pos += 1
        step = generated + 1  # the engine's sampler counts the marker too
        logits = m.text.logits(hidden)
        budget = min(s.max_tokens, room - 1 - generated)
        while len(answer) < budget:
            token = pick(logits, step + len(answer))
            if token == c.eos_id:
                reason = FinishReason.EOS
                break
            answer.append(token)
            if len(answer) == budget:
                break
            hidden = self._step(cache, m.text.embed(torch.tensor([token], device=dev)), pos)
            pos += 1
            logits = m.text.logits(hidden)
            logits[:, list(c.decode_suppressed_ids)] = float("-inf")
        return ReasoningResult(
            "".join(texts),
            grounding,
            reasoning_ids,
            self.tokenizer.decode(answer),
            answer,
            reason,
        )

    def _regions(
        self, task: Task, image: PreparedImage, obj: str, max_objects: int
    ) -> RegionResult:
        built, reason, _ = self.run(
            GenerationRequest(task, image, object_name=obj, max_objects=max_objects)
        )
        g = built.grammar
        assert isinstance(g, ObjectGrammar)
        result = RegionResult(finish_reason=reason, prompt_tokens=len(built.prompt))
        for obj_values in g.objects:
            if task is Task.POINT:
                result.points.append(Point(*obj_values))
            else:
                result.boxes.append(Box(*obj_values))
        return result

    def point(self, image: PreparedImage, obj: str, max_objects: int = 50) -> RegionResult:
        return self._regions(Task.POINT, image, obj, max_objects)

    def detect(self, image: PreparedImage, obj: str, max_objects: int = 50) -> RegionResult:
        return self._regions(Task.DETECT, image, obj, max_objects)

    def segment(
        self,
        image: PreparedImage,
        obj: str,
        max_tokens: int = 256,
        spatial_refs: tuple[tuple[float, ...], ...] = (),
    ) -> tuple[SegmentResult, FinishReason]:
        """Box, normalized SVG path, polygons and RLE mask at the image's size (Moondream 3:
        also the box-relative path, its stream chunks and the box's centre)."""
        built, reason, _ = self.run(
            GenerationRequest(
                Task.SEGMENT,
                image,
                object_name=obj,
                max_tokens=max_tokens,
                spatial_refs=spatial_refs,
            )
        )
        g, size = built.grammar, (image.width, image.height)
        if isinstance(g, SvgTokenSegmentGrammar):
            # The path read back from its token ids the model author's way (each id decoded
            # on its own), not from the grammar's parse as it committed.
            groups = parse_items(decode_items(self.tokenizer, g.path_ids))
            return build_box_segment(g.center, g.size, groups, size), reason
        assert isinstance(g, SegmentGrammar)
        return g.result(size), reason

"""A request's answer, assembled from its committed steps (CUDA-free).

Every sequence carries an `Output`, made with it from its grammar (`output_for`). The
scheduler's commit hands it each committed row: `commit` advances the grammar by the protocol
of decoding/grammars.py (a token; a boundary token, then x decoded from the same hidden state;
a coordinate; a size) and returns what the row completed to stream (text, or a segment path's
box and commands), if any. Once the grammar finished, `finish` returns the events that end the
request: the text still held back, then `Finished` with the answer and the metrics of its
outputs. An answer heavy to build (a segment's mask at the picture's size) says so
(`answers_later`): its `later` part then runs on the engine's segment finisher, off the
scheduler's thread, before the final event leaves (engine/segment_finisher.py).

The scheduler knows no task: it calls these two methods whatever the request asks. Which
`Output` a grammar answers through is a table keyed by the grammar's type (`register_output`);
this module registers the answers of the project's grammars through it. A family whose token
contract selects a grammar of its own (other regions, regions interleaved with text) brings an
`Output` subclass (overriding `commit` and `answer`) and registers it for that grammar type,
from the engine-side module that builds the grammar: a family's model code sits below the
engine and never imports it.

Called for every row of every step on the scheduler thread, so the hot paths compare phases
with module constants (an enum attribute lookup costs more than the rest of a comparison)
and build no object but the delta a stream needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from decoding.detokenize import StreamDetokenizer
from decoding.grammars import (
    Grammar,
    GrammarEnd,
    ObjectGrammar,
    ReasoningGrammar,
    SegmentGrammar,
    StepKind,
    SvgTokenSegmentGrammar,
    TextGrammar,
)
from decoding.segment_output import SegmentResult
from decoding.vocab import TokenVocab
from vlm_server.engine.api import (
    Box,
    Delta,
    EngineError,
    ErrorCode,
    Finished,
    FinishReason,
    GenerationRequest,
    GroundedSpan,
    PathDelta,
    Point,
    Reasoning,
    Segmentation,
    TextDelta,
)
from vlm_server.engine.core.step_layout import O_COORD, O_HEIGHT, O_WIDTH, RowPhase

if TYPE_CHECKING:
    from vlm_server.engine.core.sequence import Sequence

# Plain ints: a step's phases come back as ints (finalize's column), compared fastest with ints.
_TOKEN, _BOUNDARY, _REASON, _COORD, _SIZE = map(
    int, (RowPhase.TOKEN, RowPhase.BOUNDARY, RowPhase.REASON, RowPhase.COORD, RowPhase.SIZE)
)
_COORD_X = StepKind.COORD_X
_STOP = GrammarEnd.STOP

RowValues = list[float]  # one output row (step_layout.py's O_* columns), as the host read it


class Output:
    """One request's answer as its rows commit. This base advances the grammar and counts the
    tokens it feeds back; its answer is the finish reason alone. Subclasses add what their
    grammar's answer is (text, objects, a segmentation)."""

    __slots__ = ("clip", "first_at", "grammar", "output_tokens")

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self.first_at = 0.0  # when the first output committed (time.monotonic; 0: not yet)
        self.output_tokens = 0  # as the API counts them: tokens fed back (subclasses: others)
        self.clip = False  # the request's `clip`: boxes (and polygons) clamped to the picture

    def commit(self, phase: int, token: int, values: RowValues | None, now: float) -> Delta | None:
        """Advance the grammar with one committed row: ``phase`` is what finalize chose for
        it (not IDLE), ``token`` the sampled id, ``values`` the row's outputs (None when no
        row of its step decoded region values). Returns what the row completed to stream
        (text, a segment path's box or command), if any. Commits at ``now``."""
        g = self.grammar
        if phase == _TOKEN:
            g.advance_token(token)
            self.output_tokens += 1
        elif phase in (_BOUNDARY, _REASON):
            g.advance_token(token)
            if not self.first_at:
                self.first_at = now
            if g.next_kind is _COORD_X:  # not eos: the device decoded x at the boundary too
                g.advance_value(values[O_COORD])  # type: ignore[index]
        elif phase == _COORD:
            g.advance_value(values[O_COORD])  # type: ignore[index]
        elif phase == _SIZE:
            g.advance_value((values[O_WIDTH], values[O_HEIGHT]))  # type: ignore[index]
        return None

    # True where `later` builds part of the answer heavy enough (a mask at the picture's
    # size: 4 ms at 800x600, 40 at 12 MP) to leave to a worker rather than the scheduler.
    answers_later = False

    def finish(
        self, seq: Sequence, now: float, defer: bool = False
    ) -> tuple[TextDelta | None, Finished]:
        """The events that end ``seq`` (whose grammar finished) at ``now``: the text still
        held back, if any, then its result. Fills the metrics its outputs decide. With
        ``defer`` the result still lacks what `complete_later` adds (off this thread)."""
        m = seq.metrics
        first = self.first_at
        if first:
            m.time_to_first_token_ms = (first - seq.submitted_at) * 1e3
        m.decode_ms = (now - first) * 1e3 if first else 0.0
        # The task's prompt tokens, as the API states: image positions and BOS not counted.
        m.input_tokens = len(seq.prompt) - (1 if seq.prefix_len == 0 else 0)
        m.output_tokens = self.output_tokens
        stop = self.grammar.finish_reason is _STOP
        result = Finished(FinishReason.EOS if stop else FinishReason.LENGTH, metrics=m)
        tail = self.answer(result, seq.request)
        if not defer:
            self.complete_later(result, seq.request)
        return tail, result

    def complete_later(self, result: Finished, request: GenerationRequest) -> None:
        """Add `later`'s part to ``result``, then clip it as the request asks. Reads only
        the finished grammar, so any thread may run it once `finish` returned."""
        self.later(result, request)
        if self.clip:
            clip_result(result)

    def later(self, result: Finished, request: GenerationRequest) -> None:
        """The heavy part of the answer, where `answers_later` (none here)."""

    def answer(self, result: Finished, request: GenerationRequest) -> TextDelta | None:
        """Complete ``result`` (finish reason and metrics set) with the answer of the
        finished grammar; returns the text still held back, if any."""
        return None


class TextOutput(Output):
    """Caption and query text: streams each token's text as it commits (never half a
    character, see decoding/detokenize.py), and the whole text at the end."""

    __slots__ = ("_ids", "detok", "parts")
    grammar: TextGrammar

    def __init__(self, grammar: TextGrammar, vocab: TokenVocab | None) -> None:
        super().__init__(grammar)
        # Without a vocabulary (a sequence built by hand) the answer is token ids only.
        self.detok = StreamDetokenizer(vocab) if vocab is not None else None
        self.parts: list[str] = []  # the text streamed so far
        self._ids = grammar.token_ids  # the grammar appends to this list, never replaces it

    def commit(
        self, phase: int, token: int, values: RowValues | None, now: float
    ) -> TextDelta | None:
        """A text row is always a TOKEN row (text tokens are fed back: no boundary)."""
        n = len(self._ids)
        self.grammar.advance_token(token)
        return self.emitted(token, n, now)

    def emitted(self, token: int, n: int, now: float) -> TextDelta | None:
        """The text of ``token``, just committed to the grammar (which held ``n`` tokens
        before it)."""
        if len(self._ids) == n:  # eos ends the text and adds none
            return None
        if not self.first_at:
            self.first_at = now
        detok = self.detok
        text = detok.push(token) if detok is not None else ""
        if not text:
            return None
        self.parts.append(text)
        return TextDelta(text)

    def answer(self, result: Finished, request: GenerationRequest) -> TextDelta | None:
        result.metrics.output_tokens = len(self._ids)  # every token the text took
        tail = self.detok.flush() if self.detok is not None else ""
        if tail:
            self.parts.append(tail)
        result.text = "".join(self.parts)
        return TextDelta(tail) if tail else None


class ObjectOutput(Output):
    """Point and detect: the objects the grammar committed, one per boundary and values."""

    __slots__ = ()
    grammar: ObjectGrammar

    def answer(self, result: Finished, request: GenerationRequest) -> TextDelta | None:
        objects = self.grammar.objects
        if result.finish_reason is FinishReason.LENGTH:
            result.finish_reason = FinishReason.MAX_OBJECTS  # the budget counts objects
        result.metrics.output_tokens = len(objects)
        for obj in objects:
            if len(obj) == 2:
                result.points.append(Point(*obj))
            else:
                result.boxes.append(Box(*obj))
        return None


class SegmentOutput(Output):
    """Segment: the box and path the grammar committed, as a segmentation of the request's
    image (its polygons and mask are computed here, once, at the end)."""

    __slots__ = ()
    grammar: SegmentGrammar
    answers_later = True

    def later(self, result: Finished, request: GenerationRequest) -> None:
        image = request.image
        assert image is not None  # the task needs one (requests/tasks.py refuses it without)
        result.segmentation = segmentation(self.grammar.result((image.width, image.height)))


class SvgSegmentOutput(Output):
    """Moondream 3's segment: streams the box when the path begins, then each group of the
    path the grammar completes (box-relative text); the segmentation at the end."""

    __slots__ = ()
    grammar: SvgTokenSegmentGrammar
    answers_later = True

    def commit(self, phase: int, token: int, values: RowValues | None, now: float) -> Delta | None:
        """Box rows as the base commits them; a path token (or eos) as a TOKEN row."""
        if phase != _TOKEN:
            return super().commit(phase, token, values, now)
        g = self.grammar
        started, n = bool(g.path_ids), len(g.chunks)
        g.advance_token(token)
        chunk = g.chunks[-1] if len(g.chunks) > n else ""  # a token completes one group at most
        box = Box(*g.box) if not started and g.path_ids else None
        if box is not None and self.clip:
            box = clip_box(box)
        return PathDelta(chunk, box) if chunk or box is not None else None

    def answer(self, result: Finished, request: GenerationRequest) -> TextDelta | None:
        result.metrics.output_tokens = len(self.grammar.path_ids)  # the path's tokens
        return None

    def later(self, result: Finished, request: GenerationRequest) -> None:
        image = request.image
        assert image is not None  # the task needs one (requests/tasks.py refuses it without)
        seg = self.grammar.result((image.width, image.height))
        result.segmentation = segmentation(seg)
        result.points = [Point(x, y) for x, y in seg.points]


class ReasoningOutput(Output):
    """A query with grounded reasoning: reasoning deltas (marked) as the reasoning commits,
    then answer deltas; the result carries the reasoning text, its grounded spans and the
    answer. Each span's text is detokenized on its own, as the reference decodes its chunks, so
    the offsets of the spans are the reference's."""

    __slots__ = ("_answer", "_span_text", "_spans", "detok", "vocab")
    grammar: ReasoningGrammar

    def __init__(self, grammar: ReasoningGrammar, vocab: TokenVocab | None) -> None:
        super().__init__(grammar)
        self.vocab = vocab
        self.detok = StreamDetokenizer(vocab) if vocab is not None else None
        self._spans: list[str] = []  # text of each closed span
        self._span_text: list[str] = []  # pieces of the open span
        self._answer: TextOutput | None = None

    def commit(
        self, phase: int, token: int, values: RowValues | None, now: float
    ) -> TextDelta | None:
        g = self.grammar
        if self._answer is not None:
            n = len(self._answer.grammar.token_ids)
            g.advance_token(token)  # the answer's grammar, through this one
            return self._answer.emitted(token, n, now)
        if not self.first_at:
            self.first_at = now
        spans = g.span_count
        g.advance_token(token)
        if g.next_kind is _COORD_X:  # the coordinate token: x decoded with it
            g.advance_value(values[O_COORD])  # type: ignore[index]
        if g.answer is not None:  # the answer marker: the reasoning is done
            tail = self._close_span()
            self._answer = TextOutput(g.answer, self.vocab)
            return TextDelta(tail, reasoning=True) if tail else None
        text = ""
        if g.span_count > spans:  # this token opens a span
            text = self._close_span()
        if self.detok is not None:
            piece = self.detok.push(token)
            self._span_text.append(piece)
            text += piece
        return TextDelta(text, reasoning=True) if text else None

    def _close_span(self) -> str:
        tail = self.detok.flush() if self.detok is not None else ""
        self._spans.append("".join(self._span_text) + tail)
        self._span_text = []
        if self.vocab is not None:
            self.detok = StreamDetokenizer(self.vocab)
        return tail

    def answer(self, result: Finished, request: GenerationRequest) -> TextDelta | None:
        g = self.grammar
        tail = None
        if self._answer is None:  # ended before its answer marker (never by a budget)
            text = self._close_span()
            tail = TextDelta(text, reasoning=True) if text else None
            result.text = ""
        else:
            tail = self._answer.answer(result, request)
        texts = self._spans
        grounding, start = [], 0
        for text, span in zip(texts, g.spans(), strict=False):
            coords = span.coords
            if len(coords) > 1:
                points = tuple(
                    Point(coords[i], coords[i + 1]) for i in range(0, len(coords) - 1, 2)
                )
                grounding.append(GroundedSpan(start, start + len(text), points))
            start += len(text)
        result.reasoning = Reasoning("".join(texts), tuple(grounding))
        answer_tokens = len(g.answer.token_ids) if g.answer is not None else 0
        result.metrics.output_tokens = len(g.reasoning_ids) + answer_tokens
        result.metrics.reasoning_tokens = len(g.reasoning_ids)
        return tail


# Makes the `Output` of one grammar: (grammar, vocab) -> Output. ``vocab`` spells text (None:
# a sequence built by hand, whose text requests stream nothing).
OutputMaker = Callable[[Any, "TokenVocab | None"], Output]


class OutputKinds:
    """The `Output` each grammar type answers through. A grammar whose type (or a base of
    it) is not registered gets the base `Output`, which only advances it."""

    def __init__(self) -> None:
        self._makers: dict[type, OutputMaker] = {}

    def register(self, grammar_type: type, make: OutputMaker) -> None:
        """Answer grammars of ``grammar_type`` (and its subclasses, unless they have their
        own) through ``make``; a type registers once."""
        if grammar_type in self._makers:
            raise ValueError(f"grammar type {grammar_type.__qualname__} has an output already")
        self._makers[grammar_type] = make

    def make(self, grammar: Grammar, vocab: TokenVocab | None = None) -> Output:
        """The `Output` of ``grammar``: that of its most derived registered type."""
        for kind in type(grammar).__mro__:
            make = self._makers.get(kind)
            if make is not None:
                return make(grammar, vocab)
        return Output(grammar)


OUTPUTS = OutputKinds()


def register_output(grammar_type: type, make: OutputMaker) -> None:
    """Make grammars of ``grammar_type`` answer through ``make`` (`OutputKinds.register`)."""
    OUTPUTS.register(grammar_type, make)


def output_for(grammar: Grammar, vocab: TokenVocab | None = None) -> Output:
    """The registered `Output` of ``grammar``; ``vocab`` spells text (without it, text
    requests stream nothing)."""
    return OUTPUTS.make(grammar, vocab)


def _regions_only(output: Callable[[Any], Output]) -> OutputMaker:
    """The maker of an output that spells no text."""
    return lambda grammar, _vocab: output(grammar)


register_output(TextGrammar, TextOutput)
register_output(ReasoningGrammar, ReasoningOutput)
register_output(ObjectGrammar, _regions_only(ObjectOutput))
register_output(SegmentGrammar, _regions_only(SegmentOutput))
register_output(SvgTokenSegmentGrammar, _regions_only(SvgSegmentOutput))


def stopped(code: ErrorCode, queued: bool = False) -> EngineError:
    """The event that ends a request stopped before its answer: ``code`` is CANCELLED or
    DEADLINE_EXCEEDED; ``queued`` when it never left the queue."""
    if code == ErrorCode.DEADLINE_EXCEEDED:
        where = " while queued" if queued else ""
        return EngineError(code, f"the request's deadline passed{where}")
    return EngineError(code, "the request was cancelled")


def clip_box(box: Box) -> Box:
    """``box`` clamped to the picture, [0, 1] on both axes."""
    return Box(*(min(max(v, 0.0), 1.0) for v in (box.x_min, box.y_min, box.x_max, box.y_max)))


def _clip_point(p: Point) -> Point:
    return Point(min(max(p.x, 0.0), 1.0), min(max(p.y, 0.0), 1.0))


def clip_result(result: Finished) -> None:
    """A request's `clip`: its boxes, and a segmentation's box and polygon points, clamped
    to the picture. The SVG paths stay as decoded (clamping a curve's control points would
    change its shape); the mask is at the picture's size, cut at its edge either way."""
    result.boxes = [clip_box(b) for b in result.boxes]
    seg = result.segmentation
    if seg is not None:
        polygons = tuple(tuple(_clip_point(p) for p in poly) for poly in seg.polygons)
        result.segmentation = replace(seg, box=clip_box(seg.box), polygons=polygons)


def segmentation(seg: SegmentResult) -> Segmentation:
    """The API's segmentation of a segment grammar's result."""
    polygons = tuple(tuple(Point(x, y) for x, y in poly) for poly in seg.polygons)
    h, w = seg.mask_size
    return Segmentation(
        box=Box(*seg.box),
        svg_path=seg.path,
        polygons=polygons,
        mask_rle=tuple(seg.mask_counts),
        mask_height=h,
        mask_width=w,
        box_path=seg.box_path,
    )

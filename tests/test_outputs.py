"""Results assembled from committed rows (core/outputs.py): grammar advance, streamed text,
points, boxes, segmentation, the metrics of outputs, and the seam another model family uses."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decoding.constraints import ConstraintCompiler
from decoding.detokenize import detokenize
from decoding.grammars import (
    Grammar,
    GrammarEnd,
    ObjectGrammar,
    RegionRows,
    RegionTokens,
    SegmentGrammar,
    StepKind,
    TextGrammar,
    detect_grammar,
    point_grammar,
)
from decoding.mask_table import NO_MASK, MaskTable
from decoding.vocab import TokenVocab
from tests.support.toy_tokenizers import byte_level_bpe
from vlm_server.engine.api import (
    Box,
    EngineError,
    ErrorCode,
    Finished,
    FinishReason,
    GenerationRequest,
    Point,
    Task,
    TextDelta,
)
from vlm_server.engine.core import scheduler as scheduler_module
from vlm_server.engine.core.outputs import (
    ObjectOutput,
    Output,
    OutputKinds,
    SegmentOutput,
    TextOutput,
    output_for,
    register_output,
    segmentation,
    stopped,
)
from vlm_server.engine.core.sequence import Sequence
from vlm_server.engine.core.step_layout import RowPhase

EOS = 0
COORD = 5  # stands in for the 2025-06 coord token
GRID = 100
PROMPT = [1, 2, 3, 4]


@dataclass(frozen=True)
class Image:
    """The size of an image, all a segmentation needs of it."""

    width: int
    height: int


class Setup:
    def __init__(self) -> None:
        self.vocab = TokenVocab.from_tokenizer(byte_level_bpe())
        self.table = MaskTable(self.vocab.size + 16)
        compiler = ConstraintCompiler(self.vocab, self.table, EOS)
        self.gpt2 = RegionRows.register(self.table, RegionTokens(EOS))
        self.starmie = RegionRows.register(self.table, RegionTokens(EOS, COORD))
        self.path = compiler.segment_path(GRID)


@pytest.fixture(scope="module")
def setup() -> Setup:
    return Setup()


def _seq(
    grammar: Grammar,
    vocab: TokenVocab | None = None,
    image: Image | None = None,
    output: Output | None = None,
) -> Sequence:
    """A sequence of ``grammar`` with the output the engine gives it (or ``output``)."""
    task = Task.QUERY if image is None else Task.SEGMENT
    request = GenerationRequest(task, image)  # type: ignore[arg-type]
    prefix_len = 0 if image is None else 730  # BOS in the prompt, or BOS + image patches
    output = output or output_for(grammar, vocab)
    return Sequence(request, list(PROMPT), grammar, prefix_len, output=output)


def _commit(seq: Sequence, token: int, values: tuple[float, ...], now: float) -> TextDelta | None:
    """Commit one row in the phase finalize would give it (`Sequence.phase`)."""
    phase = seq.phase()
    assert phase is not RowPhase.IDLE
    row = [float(token), *values, *[0.0] * (3 - len(values))]
    return seq.output.commit(int(phase), token, row, now)


# ---- text ---------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 999), max_size=40), st.booleans())
def test_text_streams_what_each_token_completes_and_the_whole_text_at_the_end(
    setup: Setup, ids: list[int], eos: bool
) -> None:
    ids = [i % setup.vocab.size or 1 for i in ids]
    seq = _seq(TextGrammar(EOS, len(ids) if not eos else len(ids) + 1), setup.vocab)
    deltas = []
    for i, token in enumerate([*ids, EOS] if eos else ids):
        delta = _commit(seq, token, (), now=10.0 + i)
        if delta is not None:
            assert delta.text  # never an empty delta
            deltas.append(delta.text)
    assert seq.grammar.finished
    tail, result = seq.output.finish(seq, now=100.0)
    streamed = "".join(deltas) + (tail.text if tail is not None else "")
    assert streamed == result.text == detokenize(setup.vocab, ids)
    assert result.finish_reason is (FinishReason.EOS if eos else FinishReason.LENGTH)
    assert result.metrics.output_tokens == len(ids)  # eos is not an output token


def test_text_times_its_first_token_and_its_decode(setup: Setup) -> None:
    seq = _seq(TextGrammar(EOS, 8), setup.vocab)
    seq.submitted_at = 1.0
    for i, token in enumerate([300, 301, EOS]):
        _commit(seq, token, (), now=3.0 + i)
    _, result = seq.output.finish(seq, now=7.0)
    m = result.metrics
    assert m.time_to_first_token_ms == pytest.approx(2000.0)
    assert m.decode_ms == pytest.approx(4000.0)
    assert m.input_tokens == len(PROMPT) - 1  # BOS is in a text-only prompt, not counted
    assert result.metrics is seq.metrics


def test_text_that_ends_with_eos_first_has_no_first_output(setup: Setup) -> None:
    seq = _seq(TextGrammar(EOS, 8), setup.vocab)
    assert _commit(seq, EOS, (), now=5.0) is None
    tail, result = seq.output.finish(seq, now=6.0)
    assert tail is None and result.text == ""
    assert result.metrics.time_to_first_token_ms == 0.0 and result.metrics.decode_ms == 0.0
    assert result.finish_reason is FinishReason.EOS and result.metrics.output_tokens == 0


def test_a_character_split_across_tokens_waits_for_its_last_byte(setup: Setup) -> None:
    pieces = setup.vocab.pieces
    # Tokens of single bytes of "é" (0xC3 0xA9), as a byte-level vocabulary spells them.
    first = next(i for i, p in enumerate(pieces) if p == b"\xc3")
    second = next(i for i, p in enumerate(pieces) if p == b"\xa9")
    seq = _seq(TextGrammar(EOS, 4), setup.vocab)
    assert _commit(seq, first, (), now=1.0) is None  # half a character: nothing yet
    assert _commit(seq, second, (), now=2.0) == TextDelta("é")
    assert seq.output.first_at == 1.0  # the first token counts, not the first text


def test_text_without_a_vocabulary_streams_nothing() -> None:
    seq = _seq(TextGrammar(EOS, 2))
    assert isinstance(seq.output, TextOutput) and seq.output.detok is None
    assert _commit(seq, 300, (), now=1.0) is None
    assert _commit(seq, 301, (), now=2.0) is None
    tail, result = seq.output.finish(seq, now=3.0)
    assert tail is None and result.text == ""
    assert result.finish_reason is FinishReason.LENGTH and result.metrics.output_tokens == 2


def test_a_constraint_met_before_any_step_finishes_with_an_empty_answer(setup: Setup) -> None:
    compiler = ConstraintCompiler(setup.vocab, MaskTable(setup.vocab.size + 16), EOS)
    seq = _seq(TextGrammar(EOS, 8, constraint=compiler.regex("")), setup.vocab)
    assert seq.grammar.finished  # nothing to sample: the scheduler completes it at once
    tail, result = seq.output.finish(seq, now=2.0)
    assert tail is None and result.text == "" and result.finish_reason is FinishReason.EOS
    assert result.metrics.decode_ms == 0.0 and result.metrics.time_to_first_token_ms == 0.0


# ---- points and boxes ---------------------------------------------------------------------


@pytest.mark.parametrize("contract", ["gpt2", "starmie"])
def test_points_come_from_a_boundary_with_its_x_then_a_y(setup: Setup, contract: str) -> None:
    rows = setup.gpt2 if contract == "gpt2" else setup.starmie
    seq = _seq(point_grammar(rows, max_objects=5))
    assert isinstance(seq.output, ObjectOutput)
    for x, y in [(0.25, 0.5), (0.75, 0.125)]:
        assert _commit(seq, COORD, (x,), now=1.0) is None  # boundary: the device decoded x
        assert seq.grammar.next_kind is StepKind.COORD_Y
        assert _commit(seq, 0, (y,), now=2.0) is None
    _commit(seq, EOS, (0.9,), now=3.0)  # eos at a boundary: its x is not an object's
    _, result = seq.output.finish(seq, now=4.0)
    assert result.points == [Point(0.25, 0.5), Point(0.75, 0.125)] and result.boxes == []
    assert result.finish_reason is FinishReason.EOS and result.text is None
    assert result.metrics.output_tokens == 2  # objects, as the API counts them


def test_boxes_come_from_a_center_and_a_size() -> None:
    table = MaskTable(64)
    seq = _seq(detect_grammar(RegionRows.register(table, RegionTokens(EOS, COORD)), 1))
    _commit(seq, COORD, (0.5,), now=1.0)
    _commit(seq, 0, (0.25,), now=2.0)
    assert seq.phase() is RowPhase.SIZE
    _commit(seq, 0, (0.0, 0.5, 0.25), now=3.0)  # [coord, width, height]
    assert seq.grammar.finished  # the one object allowed: no eos step
    _, result = seq.output.finish(seq, now=4.0)
    assert result.boxes == [Box(0.25, 0.125, 0.75, 0.375)] and result.points == []
    assert result.finish_reason is FinishReason.MAX_OBJECTS
    assert result.metrics.output_tokens == 1


def test_a_region_task_outputs_first_at_its_first_boundary_even_an_eos(setup: Setup) -> None:
    seq = _seq(point_grammar(setup.starmie, max_objects=3))
    seq.submitted_at = 1.0
    _commit(seq, EOS, (0.5,), now=4.0)
    _, result = seq.output.finish(seq, now=4.0)
    assert result.points == [] and result.finish_reason is FinishReason.EOS
    assert result.metrics.time_to_first_token_ms == pytest.approx(3000.0)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 6), st.booleans())
def test_objects_equal_what_the_grammar_committed(
    setup: Setup, seed: int, max_objects: int, detect: bool
) -> None:
    rng = np.random.default_rng(seed)
    make = detect_grammar if detect else point_grammar
    seq = _seq(make(setup.starmie, max_objects))
    while not seq.grammar.finished:
        token = EOS if rng.random() < 0.15 else COORD
        _commit(seq, token, tuple(rng.random(3).tolist()), now=1.0)
    _, result = seq.output.finish(seq, now=2.0)
    objects = seq.grammar.objects  # type: ignore[attr-defined]
    found = result.boxes if detect else result.points
    assert [tuple(vars(o).values()) for o in found] == objects
    assert result.metrics.output_tokens == len(objects)
    full = len(objects) == max_objects
    assert result.finish_reason is (FinishReason.MAX_OBJECTS if full else FinishReason.EOS)


# ---- segmentation -------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from(["gpt2", "starmie"]))
def test_segment_answers_with_the_segmentation_of_its_box_and_path(
    setup: Setup, seed: int, contract: str
) -> None:
    rng = np.random.default_rng(seed)
    rows = setup.gpt2 if contract == "gpt2" else setup.starmie
    image = Image(40, 30)
    seq = _seq(SegmentGrammar(rows, setup.path, max_points=6, max_tokens=40), image=image)
    assert isinstance(seq.output, SegmentOutput)
    g: SegmentGrammar = seq.grammar  # type: ignore[assignment]
    _commit(seq, COORD, (0.5,), now=1.0)
    _commit(seq, 0, (0.4,), now=2.0)
    _commit(seq, 0, (0.0, 0.5, 0.25), now=3.0)
    path_tokens = 0
    while not g.finished:
        allowed = np.flatnonzero(setup.table.allowed(g.mask_row))
        _commit(seq, int(rng.choice(allowed)), (), now=4.0)
        path_tokens += 1
    _, result = seq.output.finish(seq, now=5.0)
    assert result.segmentation == segmentation(g.result((image.width, image.height)))
    assert result.segmentation is not None and result.segmentation.mask_width == 40
    assert sum(result.segmentation.mask_rle) == 40 * 30
    assert result.metrics.output_tokens == path_tokens  # path tokens and eos, not the box
    stop = g.finish_reason is GrammarEnd.STOP
    assert result.finish_reason is (FinishReason.EOS if stop else FinishReason.LENGTH)
    assert result.metrics.input_tokens == len(PROMPT)  # image positions are not counted


# ---- the seam -----------------------------------------------------------------------------


def test_each_grammar_gets_the_output_of_its_answer(setup: Setup) -> None:
    assert type(output_for(TextGrammar(EOS, 4), setup.vocab)) is TextOutput
    assert type(output_for(point_grammar(setup.starmie))) is ObjectOutput
    assert type(output_for(detect_grammar(setup.gpt2))) is ObjectOutput
    assert type(output_for(SegmentGrammar(setup.starmie, setup.path))) is SegmentOutput
    assert type(output_for(_Tally())) is Output  # another family's grammar: the base


class _Tally:
    """A grammar of another family: ``n`` tokens, then done (the protocol's minimum)."""

    def __init__(self, n: int = 3) -> None:
        self.next_kind = StepKind.TOKEN
        self.finish_reason: GrammarEnd | None = None
        self.mask_row = NO_MASK
        self.feeds_token = True
        self.max_positions = n
        self.ids: list[int] = []

    @property
    def finished(self) -> bool:
        return self.next_kind is StepKind.DONE

    def advance_token(self, token_id: int) -> None:
        self.ids.append(token_id)
        if len(self.ids) == self.max_positions:
            self.next_kind, self.finish_reason = StepKind.DONE, GrammarEnd.STOP

    def advance_value(self, value: object) -> None:
        raise AssertionError("no values")


class _TallyOutput(Output):
    """Its answer: the ids as text, and a point per id."""

    def answer(self, result: Finished, request: GenerationRequest) -> TextDelta | None:
        ids = self.grammar.ids  # type: ignore[attr-defined]
        result.text = ",".join(map(str, ids))
        result.points.extend(Point(i / 10, 0.0) for i in ids)
        return TextDelta("!")


def test_another_family_answers_through_its_own_output() -> None:
    """Its grammar type registered: every sequence built with such a grammar answers
    through its output, as the project's tasks do."""

    class Counted(_Tally):  # a type of this test's own: the table is the process's
        pass

    register_output(Counted, lambda grammar, _vocab: _TallyOutput(grammar))
    g = Counted()
    seq = _seq(g)  # type: ignore[arg-type]
    assert type(seq.output) is _TallyOutput
    for token in (1, 2, 3):
        assert _commit(seq, token, (), now=float(token)) is None
    tail, result = seq.output.finish(seq, now=5.0)
    assert tail == TextDelta("!") and result.text == "1,2,3"
    assert result.points == [Point(0.1, 0.0), Point(0.2, 0.0), Point(0.3, 0.0)]
    assert result.finish_reason is FinishReason.EOS and result.metrics.output_tokens == 3


def test_the_most_derived_registered_grammar_type_chooses_the_output() -> None:
    kinds = OutputKinds()
    kinds.register(_Tally, lambda grammar, _vocab: _TallyOutput(grammar))

    class Refined(_Tally):
        pass

    class Plain(_Tally):
        pass

    kinds.register(Refined, lambda grammar, _vocab: Output(grammar))
    assert type(kinds.make(Plain())) is _TallyOutput  # a subclass answers as its base
    assert type(kinds.make(Refined())) is Output  # unless it registered its own
    with pytest.raises(ValueError, match="_Tally has an output already"):
        kinds.register(_Tally, lambda grammar, _vocab: Output(grammar))


def _names(module: object) -> set[str]:
    return set(re.findall(r"\b[A-Za-z_]\w*\b", inspect.getsource(module)))  # type: ignore[arg-type]


def test_the_scheduler_knows_no_task() -> None:
    """It hands rows to each sequence's output: no grammar class, detokenizer or result type
    of a task appears in it (another family's tasks need no edit there)."""
    tasks = {"TextGrammar", "ObjectGrammar", "SegmentGrammar", "is_text", "detok", "TextDelta"}
    tasks |= {"Point", "Box", "Segmentation", "FinishReason", "SegmentResult"}
    found = _names(scheduler_module) & tasks
    assert found <= {"is_text"}, found  # is_text: sampling settings of finalize, not results


# ---- stopped requests ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "queued", "message"),
    [
        (ErrorCode.CANCELLED, False, "the request was cancelled"),
        (ErrorCode.CANCELLED, True, "the request was cancelled"),
        (ErrorCode.DEADLINE_EXCEEDED, False, "the request's deadline passed"),
        (ErrorCode.DEADLINE_EXCEEDED, True, "the request's deadline passed while queued"),
    ],
)
def test_a_stopped_request_ends_with_the_error_of_its_code(
    code: ErrorCode, queued: bool, message: str
) -> None:
    err = stopped(code, queued)
    assert isinstance(err, EngineError) and err.code is code and err.message == message


def test_commit_builds_nothing_for_a_row_without_text(setup: Setup) -> None:
    """Region rows and swallowed tokens return None: no event object per row."""
    seq = _seq(detect_grammar(setup.starmie, 2))
    rows = [(COORD, (0.5,)), (0, (0.5,)), (0, (0.0, 0.1, 0.1)), (EOS, (0.0,))]
    assert [_commit(seq, token, values, now=1.0) for token, values in rows] == [None] * 4
    assert seq.grammar.finished and isinstance(seq.grammar, ObjectGrammar)

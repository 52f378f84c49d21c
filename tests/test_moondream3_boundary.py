"""Where point and detect answers stop: Moondream 3 lets only the coordinate token and eos
compete at an object boundary after the first object (its published code's rule), Moondream 2
weighs the whole vocabulary at every boundary (its reference's). Checked on tiny random models
whose ``lm_head`` bias puts a third token on top of the vocabulary: the engine, the reference
and a plain loop written from the rule agree object for object."""

from __future__ import annotations

import pytest
import torch

from decoding.grammars import RegionRows, RegionTokens, detect_grammar, point_grammar
from decoding.mask_table import NO_MASK, MaskTable
from decoding.region_values import coord_from_logits, size_from_logits
from image_pipeline import PreparedImage
from tests.test_engine import _finish_all, images  # noqa: F401  (fixtures)
from vlm_server.engine.api import Finished, FinishReason, GenerationRequest, Task
from vlm_server.models.interface import LoadedModel
from vlm_server.models.registry import preset, random_model
from vlm_server.reference import ReferenceGenerator

EOS, COORD, OTHER = 0, 5, 100  # the tiny vocabulary's eos and coordinate tokens, and a word


def _biased(name: str, eos_over_coord: bool) -> LoadedModel:
    """A tiny random model whose boundary argmax over the whole vocabulary is never eos, and
    where eos beats the coordinate token (or the other way round) by a wide margin."""
    loaded = random_model(preset(name), seed=3, dtype=torch.float32, progress=False)
    with torch.no_grad():
        bias = loaded.model.text.lm_head.bias
        bias[OTHER] += 1e4
        bias[EOS if eos_over_coord else COORD] += 5e3
    return loaded


def _by_rule(ref: ReferenceGenerator, req: GenerationRequest, later_coord_or_eos: bool) -> list:
    """The objects of a greedy point/detect loop written from the rule, not the grammar: the
    first boundary is the argmax over the vocabulary; later ones compare coord and eos only
    (ties to eos, the lower id, as an argmax over the two does) when the rule says so."""
    m, c = ref.model, ref.contract
    built = ref._build(req)
    cache, hidden, pos = ref._prefill(req.image, built.prompt, built.grammar.max_positions, ())
    div, detect = c.coord_divisor, req.task is Task.DETECT
    out: list[tuple[float, ...]] = []
    token = int(m.text.logits(hidden).argmax(-1)[0])
    while token != c.eos_id and len(out) < req.max_objects:
        x = coord_from_logits(m.region.decode_coord(hidden), div)
        hidden = ref._step(cache, m.region.encode_coord(x), pos)
        y = coord_from_logits(m.region.decode_coord(hidden), div)
        hidden = ref._step(cache, m.region.encode_coord(y), pos + 1)
        pos += 2
        if detect:
            wh = size_from_logits(m.region.decode_size(hidden), c.size_scale)
            hidden = ref._step(cache, m.region.encode_size(wh), pos)
            pos += 1
            w, h = float(wh[0, 0]), float(wh[0, 1])
            out.append((float(x) - w / 2, float(y) - h / 2, float(x) + w / 2, float(y) + h / 2))
        else:
            out.append((float(x), float(y)))
        logits = m.text.logits(hidden)[0]
        if later_coord_or_eos:
            token = c.eos_id if logits[c.eos_id] >= logits[c.coord_id] else c.coord_id
        else:
            token = int(logits.argmax())
    return out


def _objects(fin: Finished) -> list[tuple[float, ...]]:
    values = fin.boxes or fin.points
    return [tuple(vars(v).values()) for v in values]


@pytest.mark.parametrize(
    ("name", "eos_over_coord", "want"),
    [
        ("md3-tiny", True, 1),  # the published code's answer: one object, then eos
        ("md3-tiny", False, 4),  # coord beats eos: objects up to max_objects
        ("tiny", True, 4),  # Moondream 2: the word on top starts an object every time
    ],
)
def test_boundary_rule_engine_reference_and_loop_agree(
    images: list[PreparedImage],  # noqa: F811
    name: str,
    eos_over_coord: bool,
    want: int,
) -> None:
    loaded = _biased(name, eos_over_coord)
    reqs = [
        GenerationRequest(Task.DETECT, images[0], object_name="car", max_objects=4),
        GenerationRequest(Task.POINT, images[1], object_name="dog", max_objects=4),
    ]
    done = _finish_all(loaded, reqs, 2, max_batch_size=4)
    ref = ReferenceGenerator(loaded.model, loaded.tokenizer)
    later = loaded.model.config.tokens.object_boundary == "coord_or_eos"
    assert later is name.startswith("md3")
    for req, fin in zip(reqs, done, strict=True):
        built, reason, _ = ref.run(req)
        assert _objects(fin) == list(built.grammar.objects) == _by_rule(ref, req, later)
        assert len(built.grammar.objects) == want
        assert fin.finish_reason == reason
        assert reason == (FinishReason.EOS if want < 4 else FinishReason.MAX_OBJECTS)


def test_later_boundary_row_allows_coord_and_eos_only() -> None:
    table = MaskTable(64)
    md3 = RegionRows.register(table, RegionTokens(EOS, COORD, later_coord_or_eos=True))
    md2 = RegionRows.register(table, RegionTokens(EOS, COORD))
    assert RegionRows.register(table, md3.tokens).later_boundary == md3.later_boundary  # once
    assert md2.later_boundary == NO_MASK and md3.later_boundary != NO_MASK
    assert table.allowed(md3.later_boundary).nonzero()[0].tolist() == [EOS, COORD]
    with pytest.raises(ValueError):
        RegionTokens(EOS, None, later_coord_or_eos=True)


@pytest.mark.parametrize("detect", [False, True])
def test_object_grammar_rows_first_boundary_values_then_later(detect: bool) -> None:
    table = MaskTable(64)
    rows = RegionRows.register(table, RegionTokens(EOS, COORD, later_coord_or_eos=True))
    g = (detect_grammar if detect else point_grammar)(rows, max_objects=2)
    assert g.mask_row == NO_MASK  # the first boundary weighs the whole vocabulary
    g.advance_token(OTHER)  # any token but eos starts the first object
    seen = []
    for value in [0.5, 0.5, (0.1, 0.1)][: 3 if detect else 2]:
        seen.append(g.mask_row)
        g.advance_value(value)
    assert seen == [NO_MASK] * len(seen)  # value steps sample no token
    assert g.mask_row == rows.later_boundary
    g.advance_token(COORD)
    assert g.mask_row == NO_MASK
    for value in [0.5, 0.5, (0.1, 0.1)][: 3 if detect else 2]:
        g.advance_value(value)
    assert g.finished and g.mask_row == NO_MASK and len(g.objects) == 2


def test_moondream2_rows_stay_unmasked() -> None:
    table = MaskTable(64)
    g = point_grammar(RegionRows.register(table, RegionTokens(EOS, COORD)), max_objects=3)
    rows = []
    while not g.finished:
        rows.append(g.mask_row)
        if g.next_kind.name == "TOKEN":
            g.advance_token(OTHER)
        else:
            g.advance_value(0.5)
    assert rows == [NO_MASK] * len(rows) and len(g.objects) == 3

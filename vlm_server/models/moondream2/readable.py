"""A random checkpoint that reads like text: the built-in default model.

Random weights over a byte-level vocabulary answer with byte soup: lone UTF-8 bytes print as
U+FFFD, low bytes as control characters, and eos, one id among a thousand, almost never wins,
so ``caption --length short`` ran to its 768-token cap. `make_readable` rewrites a checkpoint
that `write_checkpoint` made, keeping every tensor's shape, the architecture and every code path
(vision tower, region heads, grammars, byte-level tokenizer), and changes only what an answer
looks like:

* Words. The tokenizer's merges spell `WORDS` (with a leading space), and the lm_head bias
  holds every other token (bytes, word prefixes, the prompt's special tokens) far down, so free
  text samples whole words. Word logits are flattened, so the default nucleus (top_p 0.3)
  holds dozens of them, and each word reads its own embedding negatively, so it seldom follows
  itself. Byte tokens stay in the vocabulary: any input encodes, and grammars and constraints
  that need them (an SVG path, a regex) still use them.
* Lengths, from two signals in residual dimensions nothing else writes (the first norm treats
  them alike, so that one zero dimension recovers each raw value), both read by eos's row of
  lm_head only. (1) The prompt's kind: caption prompts differ in one token (``<|short|>``,
  ``<|normal|>``, ``<|long|>``), region prompts have ``<|detect|>`` or ``<|point|>``; head 0 of
  the first layer attends to that token from every later position (key and query in the head's
  unrotated dimensions: position does not matter) and copies a one-hot code of it. (2) The
  answer's progress: head 1 attends evenly to the text positions (image ones keyed far down)
  and averages a mark every word token carries, the share of words so far, which grows with
  each word written. eos's logit rises with progress from an offset set by the kind, so
  captions end at lengths shaped like real ones (median, at the default settings: short
  about 15 tokens, normal about 35, long about 90), answers after a couple of dozen words, and
  detect and point after a few objects.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from decoding.vocab import byte_level_alphabet
from vlm_server.models.common.tokenizer_build import build_tokenizer
from vlm_server.models.moondream2.config import ModelConfig
from vlm_server.models.moondream2.layout import NATIVE_PREFIX
from vlm_server.models.moondream2.writer import CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE

WORDS = tuple(
    """
the a an of and to in on with for at by from is are was has two three four five many some
red green blue black white yellow brown orange pink gray dark bright small large tall long
old new round wooden metal glass stone soft quiet busy empty full open closed near far
dog cat car bus truck bike boat train plane bird horse cow sheep fish tree flower grass leaf
house road street bridge river lake sea beach hill mountain sky cloud sun moon rain snow
window door wall roof floor table chair bed lamp clock book cup plate bowl bottle phone
person man woman child girl boy people group family friend crowd player team worker
hand head face eye hair shirt hat coat shoe bag umbrella sign light fence gate path park
city town field garden forest yard kitchen room office shop market station corner edge
standing sitting walking running holding looking playing riding waiting smiling talking
picture photo image scene view front back side top bottom left right middle center behind
under over beside between next there here this that it its which while also very quite
""".split()  # noqa: SIM905
)

# Residual dimensions of the two signals (nothing else writes them): the caption length
# (a one-hot code, copied from its marked prompt token) and the answer's progress (the share
# of words among the text positions so far, which grows with every word written).
_CODE = (60, 61, 62, 54)  # one-hot: short, normal, long; detect or point
_LENGTH_MARK = 63  # on the tokens that carry a code
_WORD_MARK = 59  # on every word token
_IMAGE_MARK = 56  # on every image-prefix position
_PROGRESS = 57
_ZERO = 55  # zero everywhere: its normalized value is what LN adds to every dimension
_SIGNAL = (*_CODE, _LENGTH_MARK, _WORD_MARK, _IMAGE_MARK, _PROGRESS, _ZERO)
_UNROTATED = 8  # the first dimension of a head that rotary leaves alone (tiny: 8..15)
_CODED = (("<|short|>",), ("<|normal|>",), ("<|long|>",), ("<|detect|>", "<|point|>"))
# eos's logit: bias + code weight (short, normal, long, region) + progress weight x progress.
# Tuned on the seed-0 tiny model at the default sampling settings (test_default_model.py).
EOS_BIAS = -9.4
EOS_CODE = (-0.2, -2.8, -3.3, 7.0)
EOS_PROGRESS = 8.0
_HOLD_DOWN = -12.0  # bias of tokens that are not whole words
_REGION_BIAS = -8.0
_VALUE = 0.3  # code strength: about a residual dimension's own scale, so it leaves LN alone


def _word_ids(tokenizer_vocab: dict[str, int], space: str) -> set[int]:
    """Ids of the words, spelled with their leading space (as the tokenizer merges them)."""
    return {tokenizer_vocab[space + w] for w in WORDS if space + w in tokenizer_vocab}


class _Tensors:
    """A checkpoint's tensors by native name (with or without the ``model.`` prefix), read
    as fp32 and written back in their own dtype."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.prefix = NATIVE_PREFIX if any(k.startswith(NATIVE_PREFIX) for k in tensors) else ""

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[self.prefix + key].float()

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        old = self.tensors[self.prefix + key]
        self.tensors[self.prefix + key] = value.to(old.dtype)


def make_readable(
    out_dir: str | Path,
    config: ModelConfig,
    seed: int = 0,
    eos_bias: float | None = None,
    eos_code: tuple[float, float, float, float] | None = None,
    eos_progress: float | None = None,
    repeat_penalty: float = 0.8,
    word_scale: float = 0.35,
) -> Path:
    """Rewrite the checkpoint in ``out_dir`` (written by `write_checkpoint` for ``config``)
    as described in the module docstring; returns ``out_dir``."""
    out = Path(out_dir)
    eos = _EosHead(
        EOS_BIAS if eos_bias is None else eos_bias,
        EOS_CODE if eos_code is None else eos_code,
        EOS_PROGRESS if eos_progress is None else eos_progress,
        repeat_penalty,
        word_scale,
    )
    text = config.text
    if text.dim < 64 or text.head_dim < 16 or text.rotary_dim > _UNROTATED or text.n_heads < 2:
        raise ValueError(f"{config.name}: too small for the length head (needs the tiny shape)")
    tokenizer = build_tokenizer(config, seed=seed, words=WORDS, spaced_only=True)
    tokenizer.save(str(out / TOKENIZER_FILE))
    vocab = tokenizer.get_vocab()
    words = _word_ids(vocab, byte_level_alphabet()[ord(" ")])
    coded = [[vocab[name] for name in names] for names in _CODED]
    path = out / WEIGHTS_FILE
    ts = _Tensors(load_file(str(path)))
    with torch.no_grad():
        wte = _mark_embeddings(ts, words, coded)
        _silence_signal_writers(ts, text.n_layers)
        _length_heads(ts, text.head_dim, text.n_heads, text.n_kv_heads)
        _answer_head(ts, wte, words, config, eos)
    save_file(ts.tensors, str(path), metadata={"format": "pt"})
    meta = json.loads((out / CONFIG_FILE).read_text())
    meta["readable"] = True
    (out / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out


@dataclass(frozen=True)
class _EosHead:
    """How eos's logit reads the signals, and how the word logits are shaped."""

    bias: float
    code: tuple[float, float, float, float]
    progress: float
    repeat_penalty: float
    word_scale: float


def _mark_embeddings(ts: _Tensors, words: set[int], coded: list[list[int]]) -> torch.Tensor:
    """The token embeddings carry the signals' marks (and nothing else in those dims)."""
    wte = ts["text.wte"]
    wte[:, list(_SIGNAL)] = 0.0
    wte[sorted(words), _WORD_MARK] = 1.0
    for j, tokens in enumerate(coded):
        for token in tokens:
            wte[token, _LENGTH_MARK] = 4.0
            wte[token, _CODE[j]] = 4.0
    ts["text.wte"] = wte
    return wte


def _silence_signal_writers(ts: _Tensors, n_layers: int) -> None:
    """Only the image mark and the two heads write the signal dimensions, and the first norm
    treats them alike, so that x[d] / std = LN[d] - LN[_ZERO]."""
    signal = list(_SIGNAL)
    w, b = ts["vision.proj_mlp.fc2.weight"], ts["vision.proj_mlp.fc2.bias"]
    w[signal], b[signal] = 0.0, 0.0
    b[_IMAGE_MARK] = 1.0  # every image position carries the image mark
    ts["vision.proj_mlp.fc2.weight"], ts["vision.proj_mlp.fc2.bias"] = w, b
    for layer in range(n_layers):
        for name in ("attn.proj", "mlp.fc2"):
            key = f"text.blocks.{layer}.{name}"
            w, b = ts[f"{key}.weight"], ts[f"{key}.bias"]
            w[signal], b[signal] = 0.0, 0.0
            ts[f"{key}.weight"], ts[f"{key}.bias"] = w, b
    for name, value in (("weight", 1.0), ("bias", 0.0)):
        ln = ts[f"text.blocks.0.ln.{name}"]
        ln[signal] = value
        ts[f"text.blocks.0.ln.{name}"] = ln


def _length_heads(ts: _Tensors, hd: int, heads: int, kv: int) -> None:
    """Heads 0 and 1 of the first layer become the length signals' readers."""
    qkv_w, qkv_b = ts["text.blocks.0.attn.qkv.weight"], ts["text.blocks.0.attn.qkv.bias"]
    proj = ts["text.blocks.0.attn.proj.weight"]

    def rows(head: int) -> tuple[int, int, int]:
        """First q, k and v rows of ``head`` (its kv head, heads == kv here)."""
        return head * hd, (heads + head) * hd, (heads + kv + head) * hd

    def read(row: int, dim: int, scale: float) -> None:  # scale * x[dim] / std
        qkv_w[row, dim] += scale
        qkv_w[row, _ZERO] -= scale

    for head in (0, 1):
        for start in rows(head):
            qkv_w[start : start + hd], qkv_b[start : start + hd] = 0.0, 0.0
        proj[:, head * hd : (head + 1) * hd] = 0.0
    # Head 0: every position attends to the length token (key on its mark, constant
    # query, both unrotated), and copies its code.
    q, k, v = rows(0)
    qkv_b[q + _UNROTATED] = 4.0
    read(k + _UNROTATED, _LENGTH_MARK, 4.0)
    for j, dim in enumerate(_CODE):
        read(v + j, dim, _VALUE)
        proj[dim, j] = 1.0
    # Head 1: every position attends evenly to the text positions (image ones keyed far
    # down) and takes the mean of the word mark: the share of words so far.
    q, k, v = rows(1)
    qkv_b[q + _UNROTATED] = 4.0
    read(k + _UNROTATED, _IMAGE_MARK, -8.0)
    read(v, _WORD_MARK, 1.0)
    proj[_PROGRESS, hd] = 1.0
    ts["text.blocks.0.attn.qkv.weight"], ts["text.blocks.0.attn.qkv.bias"] = qkv_w, qkv_b
    ts["text.blocks.0.attn.proj.weight"] = proj


def _answer_head(
    ts: _Tensors, wte: torch.Tensor, words: set[int], config: ModelConfig, eos: _EosHead
) -> None:
    """The head: words free, other ordinary tokens held down; only eos reads the signal."""
    contract = config.tokens
    head_w, head_b = ts["text.lm_head.weight"], ts["text.lm_head.bias"]
    # A word reads its own embedding negatively: the residual carries the current
    # token's, so a word is unlikely to follow itself ("sea sea sea").
    ids = sorted(words)
    own = wte[ids] / wte[ids].norm(dim=1, keepdim=True)
    # Flatter word logits: the default nucleus (top_p 0.3) then holds dozens of words
    # rather than the one or two a random head favours, and answers do not loop.
    head_w[ids] = eos.word_scale * head_w[ids] - eos.repeat_penalty * own
    head_w[:, list(_SIGNAL)] = 0.0
    for i in range(head_b.shape[0]):
        if i not in words:
            head_b[i] = _HOLD_DOWN  # bytes, word prefixes and the prompt's own tokens
    # The region tokens: chosen by the grammars' masks where they must be, weighed
    # against eos where an object may start (a few objects per answer, not a hundred).
    for token in (contract.coord_id, contract.size_id):
        head_b[token] = _REGION_BIAS
    head_b[contract.eos_id] = eos.bias
    head_w[contract.eos_id, _PROGRESS] = eos.progress
    for j, dim in enumerate(_CODE):
        head_w[contract.eos_id, dim] = eos.code[j]
    ts["text.lm_head.weight"], ts["text.lm_head.bias"] = head_w, head_b

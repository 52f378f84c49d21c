"""Mask-table build time at the real vocabulary size, and the per-step host cost of masking.

Run from the repository root:  python -m bench.bench_masks [--vocab 51200] [--repeat 3]

Prints (CPU only, no GPU needed):
  * seconds to build the vocabulary tables and the byte trie for a synthetic byte-level
    vocabulary (all 256 bytes + random text-like and raw byte strings);
  * seconds to compile the segment path language and a few sample regexes into token masks
    (cold: no cache), and to load the same masks back from the disk cache;
  * the host cost of one step's mask work for 1/8/32/64 rows: filling the per-row int32 index
    array (the whole upload) and committing one token per row.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from decoding.batch_masks import fill_row_indices
from decoding.constraints import ConstraintCompiler
from decoding.grammars import (
    RegionRows,
    RegionTokens,
    SegmentGrammar,
    TextGrammar,
    detect_grammar,
)
from decoding.mask_table import MaskTable
from decoding.regex_dfa import regex_dfa
from decoding.svg_path import PathLanguage
from decoding.token_masks import MaskCache, compile_masks, vocab_trie
from decoding.vocab import TokenVocab
from tests.support.toy_tokenizers import EOS, random_byte_level

REGEXES = {
    "phone": r"\d{3}-\d{4}",
    "yes/no": r"(yes|no)",
    "email": r"[a-z0-9._]{1,20}@[a-z0-9]{1,12}\.(com|org|net)",
    "sentence<=80": r"[A-Za-z ,.]{1,80}",
    "json-ish": r"\{\"label\": \"[a-z ]{1,30}\", \"count\": \d{1,3}\}",
}


def _timed(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=51200)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    t0 = time.perf_counter()
    tokenizer = random_byte_level(args.vocab)
    print(f"synthetic tokenizer ({args.vocab} ids) built in {time.perf_counter() - t0:.2f} s")
    eos = tokenizer.token_to_id(EOS)
    width = args.vocab

    sec, vocab = _timed(lambda: TokenVocab.from_tokenizer(tokenizer), args.repeat)
    print(f"token byte table: {sec:.3f} s")
    t0 = time.perf_counter()
    trie = vocab_trie(vocab)  # built once per vocabulary, shared by every compile
    print(f"byte trie ({trie.n_nodes} nodes): {time.perf_counter() - t0:.3f} s")

    print("\nmask compile, cold (no cache), best of", args.repeat)
    table = MaskTable(width)
    compiler = ConstraintCompiler(vocab, table, eos)

    def path_cold() -> tuple[PathLanguage, object]:
        language = PathLanguage.for_vocab(100, vocab.text_pieces())
        return language, compile_masks(language.dfa, vocab, eos, width)

    sec, (language, comp) = _timed(path_cold, args.repeat)
    print(
        f"  segment path (grid 100, cap {language.count_cap}): {sec:.3f} s "
        f"({comp.dfa.n_states} states, {comp.rows.shape[0]} distinct rows)"
    )
    path = compiler.segment_path(100)
    for name, pattern in REGEXES.items():
        dfa = regex_dfa(pattern)
        sec, comp = _timed(lambda d=dfa: compile_masks(d, vocab, eos, width), args.repeat)
        print(
            f"  regex {name:<13} {sec:.3f} s "
            f"({dfa.n_states} states, {comp.rows.shape[0]} distinct rows)"
        )

    with tempfile.TemporaryDirectory() as tmp:
        cache = MaskCache(tmp)
        dfa = path.language.dfa
        compile_masks(dfa, vocab, eos, width, cache=cache)
        fresh = MaskCache(tmp)  # empty memory: forces the disk read
        t0 = time.perf_counter()
        compile_masks(dfa, vocab, eos, width, cache=fresh)
        print(f"  segment path from the disk cache: {time.perf_counter() - t0:.3f} s")

    print("\nper-step host cost (mean of many steps)")
    region = RegionRows.register(table, RegionTokens(eos))
    regex = compiler.regex(r"[A-Za-z ,.]+")
    letters = [i for i, p in enumerate(vocab.text_pieces()) if p and p.isalpha()][:50]
    index = np.zeros(64, dtype=np.int32)  # stands in for the engine's pinned buffer
    for batch in (1, 8, 32, 64):
        grammars = []
        for k in range(batch):
            kind = k % 4
            if kind == 0:
                grammars.append(TextGrammar(eos, 10_000))
            elif kind == 1:
                grammars.append(TextGrammar(eos, 10_000, constraint=regex))
            elif kind == 2:
                grammars.append(SegmentGrammar(region, path, 64, 10_000))
            else:
                grammars.append(detect_grammar(region, 10_000))
        n = 2000
        t0 = time.perf_counter()
        for _ in range(n):
            fill_row_indices(grammars, index)
        fill_us = (time.perf_counter() - t0) / n * 1e6
        text_rows = [g for g in grammars if isinstance(g, TextGrammar)]
        t0 = time.perf_counter()
        steps = 0
        for step in range(200):
            for g in text_rows:
                g.advance_token(letters[step % len(letters)])
                steps += 1
        commit_us = (time.perf_counter() - t0) / max(steps, 1) * 1e6
        print(
            f"  {batch:>2} rows: fill index array {fill_us:7.1f} us/step "
            f"(upload {batch * 4} bytes); text commit {commit_us:.2f} us/row"
        )


if __name__ == "__main__":
    main()

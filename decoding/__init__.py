"""Constrained decoding, sampling and detokenization (CUDA-free host logic + device helpers).

Map:
  automaton, regex_dfa, utf8_ranges, svg_path   constraints as byte DFAs
  svg_tokens, svg_token_dfa                      Moondream 3's per-token SVG path: parser, and
                                                 its grammar as a DFA over item kinds
  json_schema                                    JSON Schema (a subset), any JSON object -> regex
  vocab, token_trie, token_masks                 DFA x vocabulary -> token mask rows (cached)
  mask_table, constraints, limits                reference-counted row registry; bounded,
                                                 cached request-time compiling
  compile_pool                                   that compiling in a child process
  grammars (grammar_base, text_grammar, region_grammars, svg_segment_grammar)
                                                 per-request state and protocol
  batch_masks, sampling                          device side: per-row masks, counter-based sampling
  detokenize, segment_output, svg_geometry       streaming text; segment polygons and RLE masks
  region_values                                  coordinate / size bins -> floats
"""

"""The training job, apart from the library: ``python -m twinkle_megatron.job`` (see
:mod:`.job` for its flags).

- :mod:`.job`: the flags, the local launch (one process per rank), the training loop, the
  checkpoint and the greedy sample at the end;
- :mod:`.data`: the embedded data set (procedural tasks, byte-level tokens) and text files;
- :mod:`.configs`: the embedded tiny model configs.

It uses the library as any user script would; nothing in the library imports it.
"""

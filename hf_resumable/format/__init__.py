"""The on-disk format's building blocks, pure or IO at the edge, importing nothing above them: safetensors IO and
hashing, shard planning and index parsing, the state codec, RNG state, the run configuration, and the bounded JSON
and regular-file readers. One line per module: the format/ entry of docs/architecture.md.
"""

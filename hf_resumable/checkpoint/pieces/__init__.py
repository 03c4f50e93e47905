"""Pieces: a rank's part of each tensor, the engine adapters that plan them, and resharding."""

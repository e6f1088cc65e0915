"""Tile IR -> Tile IR passes, one file each. Targets assemble their own pipelines."""

"""The ``sm90`` and ``sm100`` targets: Tile IR lowered to TileLang's CUDA dialect."""

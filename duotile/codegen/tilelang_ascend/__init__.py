"""The ``ascend950`` target: Tile IR -> TileLang Ascend dialect (``tilelang.ascend.language``)
-> Ascend C++ (source only; no bisheng/CANN here). See docs/ascend.md."""

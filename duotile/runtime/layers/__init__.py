"""Building blocks of the reference forward, one module per block (model.md section 2)."""

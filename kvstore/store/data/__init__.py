"""The data path of the root: a save (cut the cache into blocks, write the new ones, commit
its records) and a restore (read the blocks straight into MLX arrays, verified)."""

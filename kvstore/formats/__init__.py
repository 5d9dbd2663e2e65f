"""mlx-bun's files: the v3/v4 monolithic file, the v5 manifest file + blocks, Bun.hash."""

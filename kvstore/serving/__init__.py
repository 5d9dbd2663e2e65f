"""What ``kvstore serve`` does to a request that knows nothing of mlx-lm: the named
prefix-stability rewrites of a chat body (:mod:`kvstore.serving.rules`)."""

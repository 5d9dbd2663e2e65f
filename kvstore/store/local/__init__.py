"""The local tier: a root on this machine's disk (an LMDB catalog and block files)."""

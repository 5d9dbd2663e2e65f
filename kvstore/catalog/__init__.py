"""What an entry is to any tier: its chain keys, its records, and how a tier is searched.

The seam between the store and its tiers (the local root, the remote bucket): nothing
here knows where an entry is kept.
"""

"""Corpus scans: the top activating contexts and the mean of every unit of a hook over a corpus (local or Ray)."""

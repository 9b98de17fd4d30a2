"""Statistics over a corpus: bounded, mergeable, resumable."""
